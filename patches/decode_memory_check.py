"""Seam: a decode step needs logical ids and host rows, and device rows only for new pages.

Upstream target: ``sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem`` (AROUND).
Checked against: SGLang 0.5.17, where it compares ``allocator.available_size()`` with the tokens
the next decode step needs, and retracts requests (``retract_decode``, which calls it again after
each retraction) when it is short.

With our allocator a decode step takes one logical id (and host row) per request, and free device
rows only where a short hot buffer or a resident request starts a new page; a long hot buffer
reuses its newest slot. For batches on our allocator this hook checks both: the logical space and
host rows (``decode_available_size()``) against SGLang's count of the step's new tokens, and the
device rows against what the coordinator says the step lacks after demoting resident requests
(``HiSparseCoordinator.device_rows_short``). With the radix cache on, cached prefixes are evicted
first when ids or host rows are short (they hold both, no device rows). So SGLang retracts exactly
when the device rows the step needs cannot be found, as it does without HiSparse when its pool is
full. A DeepSeek-V4 batch (our ``C4Allocator``) runs SGLang's check of its token ids, then the C4
rows the step's new entries need (``C4Coordinator.device_rows_short``). Any other batch runs SGLang's original check unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from sglang_hisparse.memory.allocator import HiSparseAllocator
from sglang_hisparse.memory.c4_allocator import C4Allocator
from sglang_hisparse.errors import HiSparsePluginError

TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"
CHECKED_AGAINST = "0.5.17"


def check_decode_mem(original: Callable[..., bool], batch: Any, selected_indices: Optional[list] = None) -> bool:
    allocator = batch.token_to_kv_pool_allocator
    if isinstance(allocator, C4Allocator):
        if not original(batch, selected_indices):
            return False
    elif not isinstance(allocator, HiSparseAllocator):
        return original(batch, selected_indices)
    else:
        needed = batch.new_tokens_required_next_decode(selected_indices)
        short = needed - allocator.decode_available_size()
        tree = getattr(batch, "tree_cache", None)
        if short > 0 and tree is not None and not tree.is_chunk_cache():  # prefix reuse: cached prefixes go first
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            tree.evict(EvictParams(num_tokens=short))
        if allocator.decode_available_size() < needed:
            return False
    coordinator = getattr(batch, "hisparse_coordinator", None)
    if coordinator is None:
        raise HiSparsePluginError("sglang-hisparse: a decode batch on the HiSparse allocator has no coordinator; "
                                  "its device rows cannot be checked")
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    return coordinator.device_rows_short([r.req_pool_idx for r in reqs], [r.kv_committed_len for r in reqs]) == 0


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, check_decode_mem, HookType.AROUND)
