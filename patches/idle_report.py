"""Seam: when the server goes idle, our coordinator reports every pool's free count.

Upstream target: ``sglang.srt.managers.scheduler.Scheduler.on_idle`` (AFTER). Checked against:
SGLang 0.5.17, where ``on_idle`` runs on every idle loop iteration and skips SGLang's own leak
check when HiSparse is enabled. Once per busy -> idle transition, the coordinator logs
``sglang-hisparse idle: logical_free=a/A device_free=b/B host_free=c/C
leak=no ...`` (an ERROR line with ``leak=yes`` if any count differs from its initial value); the
DeepSeek-V4 coordinator its own pools' (``sglang-hisparse idle (DeepSeek-V4 C4): token_free=...``).
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.decode.c4_coordinator import C4Coordinator
from sglang_hisparse.decode.coordinator import HiSparseCoordinator

TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
CHECKED_AGAINST = "0.5.17"


def report_when_idle(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    coordinator = getattr(scheduler, "hisparse_coordinator", None)
    if isinstance(coordinator, HiSparseCoordinator) and scheduler.is_fully_idle():
        coordinator.stats.idle_report()
    elif isinstance(coordinator, C4Coordinator) and scheduler.is_fully_idle():
        coordinator.idle_report()
    return None


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, report_when_idle, HookType.AFTER)
