"""Seam: SGLang's KV-cache configurator builds our DSA device pool.

Upstream target: ``sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool``
(REPLACE, class). Checked against: SGLang 0.5.17 (``KVCacheConfigurator._build_dsa_kv_pool``
constructs it with DSA pool arguments plus ``host_to_device_ratio``). Ours subclasses
``DSATokenToKVPool``, which SGLang checks with ``isinstance``.
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.memory.device_pool import HiSparseDevicePool

TARGET = "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool"
CHECKED_AGAINST = "0.5.17"
ROLE = "device_pool"
IMPLEMENTATION = HiSparseDevicePool


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, IMPLEMENTATION, HookType.REPLACE)
