"""Seam: a PD decode instance counts what our radix tree can give back in its admission budget.

Upstream target: ``sglang.srt.disaggregation.decode.DecodePreallocQueue._allocatable_token_budgets``
(AROUND). Checked against: SGLang 0.5.17, where the budget of a HiSparse decode instance is the
free logical ids (``logical_attn_allocator.available_size()``) less the decode reserve, while the
same function adds ``tree_cache.evictable_size()`` for SGLang's own decode radix cache: cached
prefixes would hold ids no admission could ever take back (no request would be admitted while the
tree held them, nothing would evict them).

Ours: with our coordinator and our tree, the original's budget plus what evicting the tree's
unlocked prefixes gives back to it (ids and host rows: ``prefix/pd_prefix.py``,
:func:`ids_from_eviction`); ``_pre_alloc`` evicts before it allocates (SGLang's code and
:func:`preallocate_with_prefix`). Otherwise the original's budget, unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.decode.coordinator import HiSparseCoordinator
from sglang_hisparse.prefix.host_tree import HostPrefixCache

TARGET = "sglang.srt.disaggregation.decode.DecodePreallocQueue._allocatable_token_budgets"
CHECKED_AGAINST = "0.5.17"


def allocatable_token_budgets(original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any) -> Any:
    budget = original(queue, *args, **kwargs)
    tree = getattr(queue, "tree_cache", None)
    if isinstance(tree, HostPrefixCache) and isinstance(getattr(queue.scheduler, "hisparse_coordinator", None),
                                                         HiSparseCoordinator):
        from sglang_hisparse.prefix.pd_prefix import ids_from_eviction

        budget += ids_from_eviction(tree)
    return budget


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, allocatable_token_budgets, HookType.AROUND)
