"""Seam: with ``--enable-metrics``, a HiSparse scheduler exports our series through SGLang's
Prometheus endpoint (``sglang_hisparse.metrics``).

Upstream target: ``sglang.srt.managers.scheduler.Scheduler.init_metrics_reporter`` (AFTER).
Checked against: SGLang 0.5.17, where the scheduler builds its metrics reporter after the HiSparse
coordinator, and ``metrics_reporter.enable_metrics`` says whether this rank exports (attention-TP
rank 0, or every rank with ``--enable-metrics-for-all-schedulers``). Nothing happens without
HiSparse, without metrics, or on a rank that does not export. Both coordinators export (DSA and
DeepSeek-V4, whose rows are C4 entries of 584 bytes).
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.decode.c4_coordinator import C4Coordinator
from sglang_hisparse.decode.coordinator import HiSparseCoordinator
from sglang_hisparse.metrics import Gauges, PrometheusExport
from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_metrics_reporter"
CHECKED_AGAINST = "0.5.17"


def gauges_of(coordinator: HiSparseCoordinator) -> Gauges:
    host, residency = coordinator.mem_pool_host, coordinator.residency
    return Gauges(
        staging_requests=coordinator.mirror.staged_count(),
        host_rows_used=host.capacity_tokens - host.available_size(),
        host_rows_capacity=host.capacity_tokens,
        hot_buffers_in_use=sum(1 for held in coordinator.hot.capacity if held),
        resident_requests=residency.count() if residency is not None else 0,
        demotions_total=residency.demotions_total if residency is not None else 0,
    )


def export_metrics(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    ranks = dict(zip(("tp_rank", "pp_rank", "dp_rank"), args), **kwargs)
    tp_rank, dp_rank = ranks.get("tp_rank"), ranks.get("dp_rank")
    coordinator = getattr(scheduler, "hisparse_coordinator", None)
    reporter = getattr(scheduler, "metrics_reporter", None)
    ours = isinstance(coordinator, (HiSparseCoordinator, C4Coordinator))
    if not ours or not getattr(reporter, "enable_metrics", False):
        return None
    labels = {"model_name": str(scheduler.server_args.served_model_name), "tp_rank": str(tp_rank)}
    if dp_rank is not None:
        labels["dp_rank"] = str(dp_rank)
    if isinstance(coordinator, C4Coordinator):  # DeepSeek-V4: rows are C4 entries
        coordinator.export_to(PrometheusExport(labels, 0 if coordinator.config.skip_io else C4_ITEM_BYTES))
        return None
    moved_row_bytes = 0 if coordinator.config.skip_io else coordinator.device_pool.row_bytes  # skip_io copies nothing
    export = PrometheusExport(labels, moved_row_bytes)
    coordinator.stats.export_to(export, lambda: gauges_of(coordinator))
    return None


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, export_metrics, HookType.AFTER)
