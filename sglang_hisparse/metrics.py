"""Prometheus series of a HiSparse scheduler (exported with SGLang's ``--enable-metrics``).

| series | kind | what |
|---|---|---|
| `sglang_hisparse_selected_rows_total` | counter | selected positions resolved past the fast path (newest excluded), all layers |
| `sglang_hisparse_miss_rows_total` | counter | those copied from host |
| `sglang_hisparse_copied_bytes_total` | counter | bytes copied host -> device by the resolver (0 with `skip_io`) |
| `sglang_hisparse_decode_steps_total` | counter | decode steps |
| `sglang_hisparse_staging_requests` | gauge | prefilled requests whose copy to host is queued or running |
| `sglang_hisparse_host_rows_used` / `_host_rows_capacity` | gauge | host rows in use, and all of them |
| `sglang_hisparse_hot_buffers_in_use` | gauge | requests holding a hot buffer |
| `sglang_hisparse_resident_requests` | gauge | decoding requests whose whole KV is on the device (residency) |
| `sglang_hisparse_demotions_total` | counter | resident requests moved into a hot buffer under memory pressure |

Labels: ``model_name``, ``tp_rank`` (and ``dp_rank`` under DP attention), as SGLang's own scheduler
series. The counters come from the resolver's device counters without stalling the host: each
export point starts a copy of them into host memory and publishes the previous copy, so they lag
one export interval while decoding; every idle report publishes exact values. SGLang sets up
Prometheus' multiprocess directory before the scheduler starts, which is where these series live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PREFIX = "sglang_hisparse_"


@dataclass(frozen=True)
class Gauges:
    staging_requests: int
    host_rows_used: int
    host_rows_capacity: int
    hot_buffers_in_use: int
    resident_requests: int = 0
    demotions_total: int = 0


class CounterReader:
    """The device counters as host ints, without a host stall (see the module docstring)."""

    def __init__(self, counters: torch.Tensor):
        self._counters = counters
        self._host = torch.zeros_like(counters, device="cpu", pin_memory=counters.is_cuda)
        self._event = None

    def latest(self) -> Optional[list[int]]:
        """The newest completed copy, or None when none completed since the last call. Starts the
        next copy whenever the last one is done."""
        if not self._counters.is_cuda:
            return self._counters.tolist()
        done = self._event is None or self._event.query()
        values = self._host.tolist() if self._event is not None and done else None
        if done:
            self._host.copy_(self._counters, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return values


class PrometheusExport:
    """The series above for one scheduler; ``publish`` brings them to the given totals."""

    def __init__(self, labels: dict[str, str], row_bytes: int):
        from prometheus_client import Counter, Gauge

        names = list(labels)
        self._labels = labels
        self._row_bytes = row_bytes

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, labelnames=names).labels(**labels)

        def gauge(name: str, doc: str):
            return Gauge(PREFIX + name, doc, labelnames=names, multiprocess_mode="mostrecent").labels(**labels)

        self.selected = counter("selected_rows_total", "Selected positions resolved past the fast path, all layers")
        self.misses = counter("miss_rows_total", "Selected positions copied from host, all layers")
        self.copied = counter("copied_bytes_total", "Bytes copied host to device by the resolver")
        self.steps = counter("decode_steps_total", "Decode steps")
        self.demotions = counter("demotions_total", "Resident requests moved into a hot buffer under memory pressure")
        self.gauges = {field: gauge(field, doc) for field, doc in (
            ("staging_requests", "Prefilled requests whose copy to host is queued or running"),
            ("host_rows_used", "Host rows in use"),
            ("host_rows_capacity", "Host rows"),
            ("hot_buffers_in_use", "Requests holding a hot buffer"),
            ("resident_requests", "Decoding requests whose whole KV is on the device"),
        )}
        self._published = (0, 0, 0)
        self._demotions = 0

    def publish(self, selected: int, misses: int, steps: int, gauges: Gauges) -> None:
        """Counters advance to the given totals (never backwards); gauges are set."""
        last_selected, last_misses, last_steps = self._published
        if selected > last_selected:
            self.selected.inc(selected - last_selected)
        if misses > last_misses:
            self.misses.inc(misses - last_misses)
            self.copied.inc((misses - last_misses) * self._row_bytes)
        if steps > last_steps:
            self.steps.inc(steps - last_steps)
        self._published = (max(selected, last_selected), max(misses, last_misses), max(steps, last_steps))
        if gauges.demotions_total > self._demotions:
            self.demotions.inc(gauges.demotions_total - self._demotions)
            self._demotions = gauges.demotions_total
        for field, gauge in self.gauges.items():
            gauge.set(getattr(gauges, field))
