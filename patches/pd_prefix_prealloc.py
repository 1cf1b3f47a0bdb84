"""Seam: a PD decode request whose prefix our tree holds is preallocated with the tree's host rows.

Upstream target: ``sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc`` (AROUND).
Checked against: SGLang 0.5.17, where ``pop_preallocated`` calls it as
``_pre_alloc(req, prefix_indices, prefix_len, total_prefix_len)`` after the match, and its
HiSparse branch asserts ``prefix_len == 0`` (logical ids and host rows from position 0 through our
allocator and host pool); the caller takes the transfer's destination as the first
``len(origin_input_ids) - prefix_len`` of the returned host rows.

Ours: with our coordinator and a prefix matched (``prefix_len > 0``, only ever from our tree:
``patches/pd_prefix_match.py``), ``prefix/pd_prefix.py`` (:func:`preallocate_with_prefix`) runs the
original as for a request without a prefix, with the tree's host rows of the prefix lent, and
returns the host rows after the prefix. Otherwise the original runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from sglang_hisparse.decode.coordinator import HiSparseCoordinator
from sglang_hisparse.prefix.host_tree import HostPrefixCache

TARGET = "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc"
CHECKED_AGAINST = "0.5.17"


def pre_alloc(original: Callable[..., Any], queue: Any, req: Any, prefix_indices: Any = None,
              prefix_len: Optional[int] = None, total_prefix_len: Optional[int] = None) -> Any:
    coordinator = getattr(queue.scheduler, "hisparse_coordinator", None)
    tree = getattr(queue, "tree_cache", None)
    if not prefix_len or not isinstance(coordinator, HiSparseCoordinator) or not isinstance(tree, HostPrefixCache):
        return original(queue, req, prefix_indices, prefix_len, total_prefix_len)
    if total_prefix_len not in (None, prefix_len):
        raise AssertionError(f"sglang-hisparse: request {req.rid}: a decode prefix of {total_prefix_len} tokens with "
                             f"{prefix_len} held (HiCache's host or storage hits are refused at start-up)")
    from sglang_hisparse.prefix.pd_prefix import preallocate_with_prefix

    return preallocate_with_prefix(original, queue, req, prefix_len, tree, coordinator)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, pre_alloc, HookType.AROUND)
