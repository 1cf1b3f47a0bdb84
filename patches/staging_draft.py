"""Seam: a staged request joins decode with its speculative draft state.

With linear speculation a decode step starts from each request's draft state (``EagleDraftInput``
rows: the draft's top-k, hidden state, last token) that the prefill produced. Without HiSparse
the prefill batch itself becomes the decode batch and carries it in ``batch.spec_info``; with
HiSparse the prefill's requests go to staging and SGLang 0.5.17 builds a fresh batch for them
(``Scheduler._build_hisparse_decode_batch``) with no draft state, and re-stashes only their last
token into the future map (which fails with EAGLE: its map also stashes ``topk_p``).

Upstream targets (SGLang 0.5.17), both AROUND and both only under speculation with our coordinator:

* ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.
  process_batch_result_prefill``: after the original ran, each request of the batch that entered
  staging leaves its row of ``batch.spec_info`` with the coordinator (``keep_draft_state``; a shallow
  copy filtered to that row, ``EagleDraftInput.filter_batch``).
* ``sglang.srt.managers.scheduler.Scheduler._build_hisparse_decode_batch``: runs with a future map
  whose ``stash`` of a payload without draft state is skipped (non-overlap: nothing reads it, the
  draft state travels in ``spec_info``; overlap, refused by our launch checks for now: the prefill
  already stashed the whole payload at those indices), then the new batch's ``spec_info`` is the
  requests' kept rows merged in batch order (``EagleDraftInput.merge_batch``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from sglang_hisparse.decode.coordinator import HiSparseCoordinator

PREFILL_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
    "process_batch_result_prefill"
)
BUILD_TARGET = "sglang.srt.managers.scheduler.Scheduler._build_hisparse_decode_batch"
CHECKED_AGAINST = "0.5.17"


def _coordinator_under_speculation(owner: Any, spec_algorithm: Any) -> Any:
    """``owner``'s coordinator when it is ours and the server speculates, else None."""
    coordinator = getattr(owner, "hisparse_coordinator", None)
    if isinstance(coordinator, HiSparseCoordinator) and not spec_algorithm.is_none():
        return coordinator
    return None


def process_prefill_result(original: Callable[..., Any], processor: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    coordinator = _coordinator_under_speculation(processor, batch.spec_algorithm)
    draft = getattr(batch, "spec_info", None)
    result = original(processor, batch, *args, **kwargs)
    if coordinator is None or draft is None:
        return result
    for i, req in enumerate(batch.reqs):
        if coordinator.mirror.is_staged(req):
            row = copy.copy(draft)
            row.filter_batch(torch.tensor([i], dtype=torch.int64, device=batch.device), [i])
            coordinator.keep_draft_state(req.req_pool_idx, row)
    return result


class _KeepDraftState:
    """A future map whose ``stash`` ignores payloads that carry no draft state; everything else
    is the wrapped map's."""

    def __init__(self, future_map: Any):
        self._future_map = future_map

    def stash(self, future_indices: Any, payload: Any) -> None:
        if getattr(payload, "topk_p", None) is None:
            return
        self._future_map.stash(future_indices, payload)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._future_map, name)


def build_decode_batch(original: Callable[..., Any], scheduler: Any, reqs: Any) -> Any:
    coordinator = _coordinator_under_speculation(scheduler, scheduler.spec_algorithm)
    if coordinator is None:
        return original(scheduler, reqs)
    future_map = scheduler.future_map
    scheduler.future_map = _KeepDraftState(future_map)
    try:
        batch = original(scheduler, reqs)
    finally:
        scheduler.future_map = future_map
    rows = [coordinator.take_draft_state(req.req_pool_idx) for req in reqs]
    merged = copy.copy(rows[0])
    for row in rows[1:]:
        merged.merge_batch(row)
    batch.spec_info = merged
    return batch


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(PREFILL_TARGET, process_prefill_result, HookType.AROUND)
    registry.register(BUILD_TARGET, build_decode_batch, HookType.AROUND)
