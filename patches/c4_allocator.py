"""Seam: SGLang's KV-cache configurator builds our DeepSeek-V4 allocator.

Upstream target: ``sglang.srt.mem_cache.allocator.hisparse.DeepSeekV4HiSparseTokenToKVPoolAllocator``
(REPLACE, class; the registry also rebinds the ``from ... import`` copies in the configurator,
the schedule policy and the chunk cache). Checked against: SGLang 0.5.17
(``KVCacheConfigurator`` wraps the SWA allocator it built with it when ``--enable-hisparse`` serves a
DeepSeek-V4 model; ``schedule_policy`` and ``chunk_cache`` check it with ``isinstance``, which ours,
a subclass, passes).
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.memory.c4_allocator import C4Allocator

TARGET = "sglang.srt.mem_cache.allocator.hisparse.DeepSeekV4HiSparseTokenToKVPoolAllocator"
CHECKED_AGAINST = "0.5.17"
ROLE = "allocator"
IMPLEMENTATION = C4Allocator


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, IMPLEMENTATION, HookType.REPLACE)
