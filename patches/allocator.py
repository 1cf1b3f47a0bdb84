"""Seam: SGLang's KV-cache configurator builds our dual-address-space allocator.

Upstream target: ``sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator``
(REPLACE, class). Checked against: SGLang 0.5.17 (``KVCacheConfigurator`` constructs it with
``size, page_size, dtype, device, kvcache, need_sort, host_to_device_ratio`` when
``--enable-hisparse``; no SGLang code checks it with ``isinstance``).
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.memory.allocator import HiSparseAllocator

TARGET = "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator"
CHECKED_AGAINST = "0.5.17"
ROLE = "allocator"
IMPLEMENTATION = HiSparseAllocator


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, IMPLEMENTATION, HookType.REPLACE)
