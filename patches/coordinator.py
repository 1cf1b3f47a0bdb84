"""Seam: SGLang builds our coordinator wherever it builds its HiSparse coordinator.

Upstream target: ``sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator`` (REPLACE,
class; the registry also rebinds ``from ... import HiSparseCoordinator`` copies, e.g. in the
scheduler). Checked against: SGLang 0.5.17 (``ModelRunner.maybe_init_hisparse_coordinator``
constructs it with keyword arguments; the scheduler, batch processor, schedule batch, DSA
backend, CUDA-graph runner and PD decode path call its 0.5.17 protocol).
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.decode.c4_coordinator import C4Coordinator
from sglang_hisparse.decode.coordinator import HiSparseCoordinator

TARGET = "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator"
CHECKED_AGAINST = "0.5.17"
ROLE = "coordinator"
IMPLEMENTATION = HiSparseCoordinator
ALSO_BUILDS = (C4Coordinator,)
"""What ``HiSparseCoordinator(...)`` returns for a DeepSeek-V4 allocator (the self-check accepts it)."""


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, IMPLEMENTATION, HookType.REPLACE)
