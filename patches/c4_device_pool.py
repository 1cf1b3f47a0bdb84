"""Seam: SGLang's DeepSeek-V4 KV pool builds our C4 device pool.

Upstream target: ``sglang.srt.mem_cache.deepseek_v4_memory_pool.HiSparseC4DevicePool``
(REPLACE, class). Checked against: SGLang 0.5.17 (``DeepSeekV4TokenToKVPool.__init__`` looks the
module global up when it builds ``c4_kv_pool`` with HiSparse on, and constructs it with
``DeepSeekV4SingleKVPool``'s arguments through ``_make_kv_pool``). Ours subclasses
``DeepSeekV4SingleKVPool``, as SGLang's code treats the C4 pool as one.

Not yet registered by ``serving/plugin.py``: DeepSeek-V4 is refused at start-up until the V4
allocator and coordinator exist.
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.memory.c4_device_pool import C4DevicePool

TARGET = "sglang.srt.mem_cache.deepseek_v4_memory_pool.HiSparseC4DevicePool"
CHECKED_AGAINST = "0.5.17"
ROLE = "device_pool"  # the self-check finds it as the allocator's hisparse_kvcache
IMPLEMENTATION = C4DevicePool


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, IMPLEMENTATION, HookType.REPLACE)
