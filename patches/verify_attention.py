"""Seam (CUDA DSA backend): a speculative verify batch reads the rows our coordinator resolves.

Upstream targets (SGLang 0.5.17), both AROUND, both acting only for a TARGET_VERIFY batch of a
backend that holds our coordinator (every other call runs the original unchanged):

* ``sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.get_indexer_metadata``:
  the indexer's top-k stays unfused (positions, not page-table entries), as upstream forces for
  decode with HiSparse: our resolver takes positions.
* ``...DeepseekSparseAttnBackend.forward_extend``: a verify batch is an extend mode, whose path
  translates a page table of logical ids through the mapping; a decoding request's earlier
  positions are not mapped (they live in its hot buffer and host rows). The batch runs the
  backend's own decode path instead (``forward_decode``: writes the window's KV through the
  mapping, then sparse MLA over per-token page tables with the verify metadata SGLang built, one
  query row per token), whose page table comes from our ``resolve_verify`` (the backend sees a
  view of the coordinator whose ``swap_in_selected_pages`` resolves the verify rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sglang_hisparse.decode.coordinator import HiSparseCoordinator

BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
METADATA_TARGET = f"{BACKEND}.get_indexer_metadata"
EXTEND_TARGET = f"{BACKEND}.forward_extend"
CHECKED_AGAINST = "0.5.17"


def _ours_in_verify(backend: Any, forward_batch: Any) -> bool:
    return isinstance(backend.hisparse_coordinator, HiSparseCoordinator) and forward_batch.forward_mode.is_target_verify()


def indexer_metadata(original: Callable[..., Any], backend: Any, layer_id: int, forward_batch: Any) -> Any:
    metadata = original(backend, layer_id, forward_batch)
    if _ours_in_verify(backend, forward_batch) and not metadata.force_unfused_topk:
        metadata = dataclasses.replace(metadata, force_unfused_topk=True)
    return metadata


class _VerifyRows:
    """The coordinator as the backend's decode path sees it during a verify batch: its
    ``swap_in_selected_pages`` resolves the N verify rows of each request."""

    def __init__(self, coordinator: HiSparseCoordinator):
        self._coordinator = coordinator

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id: int):
        return self._coordinator.resolve_verify(req_pool_indices, seq_lens, top_k_result, layer_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coordinator, name)


def forward_extend(original: Callable[..., Any], backend: Any, q, k, v, layer, forward_batch, *args: Any,
                   **kwargs: Any) -> Any:
    if not _ours_in_verify(backend, forward_batch):
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    coordinator = backend.hisparse_coordinator
    backend.hisparse_coordinator = _VerifyRows(coordinator)
    try:
        return backend.forward_decode(q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        backend.hisparse_coordinator = coordinator


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(METADATA_TARGET, indexer_metadata, HookType.AROUND)
    registry.register(EXTEND_TARGET, forward_extend, HookType.AROUND)
