"""PrometheusExport in-process: counters advance to the published totals and never go back,
bytes follow misses, gauges (residency's included) are set as given."""

from __future__ import annotations

from prometheus_client import REGISTRY

from sglang_hisparse.metrics import Gauges, PrometheusExport


def test_publish_advances_counters_to_totals_and_sets_gauges():
    labels = {"model_name": "unit-test-model", "tp_rank": "0"}
    export = PrometheusExport(labels, row_bytes=100)

    def value(name: str) -> float:
        return REGISTRY.get_sample_value("sglang_hisparse_" + name, labels)

    export.publish(10, 4, 3, Gauges(1, 20, 300, 2, resident_requests=5, demotions_total=1))
    assert (value("selected_rows_total"), value("miss_rows_total"), value("copied_bytes_total")) == (10, 4, 400)
    assert (value("decode_steps_total"), value("demotions_total")) == (3, 1)
    assert (value("resident_requests"), value("hot_buffers_in_use"), value("host_rows_used")) == (5, 2, 20)
    export.publish(8, 6, 3, Gauges(0, 0, 300, 3, resident_requests=4, demotions_total=3))  # selected lags: kept
    assert (value("selected_rows_total"), value("miss_rows_total"), value("copied_bytes_total")) == (10, 6, 600)
    assert (value("demotions_total"), value("resident_requests"), value("staging_requests")) == (3, 4, 0)
