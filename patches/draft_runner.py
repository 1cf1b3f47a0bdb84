"""Seam: the draft (MTP / EAGLE) model of a speculative server runs without HiSparse.

Upstream targets (SGLang 0.5.17), both AROUND:

* ``sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator``: the
  draft runner builds a coordinator too (no ``is_draft_worker`` gate), sharing the target's
  allocator. For a draft runner we build none: one coordinator per server owns the hot buffers.
* ``sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool``: the
  draft's DSA pool is a HiSparse pool too. For a draft worker it is built inside
  ``device_pool.resident_pools()``: rows for every logical id, no mapping. The draft layer keeps
  its whole KV on the device (1 layer of 62 in DeepSeek-V3.2: ``ratio / layers`` of the device
  KV bytes) and its backend takes SGLang's non-HiSparse path (no coordinator). SGLang's memory
  profile sized that pool for the device rows only; the seam logs what the resident pool holds
  and how much more than planned it is (:func:`resident_draft_pool_line`).

Target runners and servers without ``--enable-hisparse`` run the originals unchanged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from sglang_hisparse.memory.device_pool import resident_pools

logger = logging.getLogger(__name__)

COORDINATOR_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator"
POOL_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool"
CHECKED_AGAINST = "0.5.17"


def init_coordinator(original: Callable[..., Any], runner: Any) -> Any:
    if getattr(runner, "is_draft_worker", False):
        return None
    return original(runner)


def build_dsa_pool(original: Callable[..., Any], configurator: Any, *args: Any, **kwargs: Any) -> Any:
    if not (configurator.is_draft_worker and configurator.server_args.enable_hisparse):
        return original(configurator, *args, **kwargs)
    with resident_pools():
        pool = original(configurator, *args, **kwargs)
    logger.info(resident_draft_pool_line(pool, kwargs.get("max_total_num_tokens")))
    return pool


def resident_draft_pool_line(pool: Any, planned_rows: Optional[int]) -> str:
    """The start-up line of a resident draft pool: its rows (one per logical id), layers and bytes
    (``get_kv_size_bytes``: KV and indexer keys), and the bytes beyond what SGLang's memory profile
    planned for ``planned_rows`` rows (the device rows it passed), which no other line of SGLang or
    ours counts."""
    kv_bytes = pool.get_kv_size_bytes()
    gib = 1 << 30
    line = (f"sglang-hisparse: the draft model's KV pool is resident (a row per logical id, no hot buffers): "
            f"{pool.size} rows x {pool.layer_num} layer(s), {kv_bytes / gib:.2f} GiB (KV and indexer keys)")
    if planned_rows:
        extra = kv_bytes - kv_bytes * planned_rows // max(pool.size, 1)
        line += (f"; SGLang's memory profile planned {planned_rows} rows, so {extra / gib:.2f} GiB more are in use "
                 "than it counted (lower --mem-fraction-static if the GPU runs short)")
    return line


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(COORDINATOR_TARGET, init_coordinator, HookType.AROUND)
    registry.register(POOL_TARGET, build_dsa_pool, HookType.AROUND)
