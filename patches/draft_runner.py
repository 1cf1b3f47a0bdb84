"""Seam: the draft (MTP / EAGLE) model of a speculative server runs without HiSparse.

Upstream targets (SGLang 0.5.17), both AROUND:

* ``sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator``: the
  draft runner builds a coordinator too (no ``is_draft_worker`` gate), sharing the target's
  allocator. For a draft runner we build none: one coordinator per server owns the hot buffers.
* ``sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool``: the
  draft's DSA pool is a HiSparse pool too. For a draft worker it is built inside
  ``device_pool.resident_pools()``: rows for every logical id, no mapping. The draft layer keeps
  its whole KV on the device (1 layer of 62 in DeepSeek-V3.2: ``ratio / layers`` of the device
  KV bytes) and its backend takes SGLang's non-HiSparse path (no coordinator).

Target runners and servers without ``--enable-hisparse`` run the originals unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.device_pool import resident_pools

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
        return original(configurator, *args, **kwargs)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(COORDINATOR_TARGET, init_coordinator, HookType.AROUND)
    registry.register(POOL_TARGET, build_dsa_pool, HookType.AROUND)
