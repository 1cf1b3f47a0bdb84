"""Seam: a speculative decode step starts our verify window (linear speculation, N tokens).

Upstream target: ``sglang.srt.speculative.eagle_utils.eagle_prepare_for_decode`` (AROUND).
Checked against: SGLang 0.5.17, where a decode batch of a speculative server is prepared by
``spec_prepare_for_decode -> eagle_prepare_for_decode`` (imported at call time) instead of the
code that calls ``map_last_loc_to_buffer``. It grows each request's ids to
``round_up(kv_committed_len + 2 * N, page)`` with ``alloc_for_spec_decode`` and leaves
``batch.seq_lens`` at the committed lengths; the verify forward then writes positions
``seq_lens .. seq_lens + N - 1``.

With our coordinator on the batch: the allocation runs inside ``allocator.logical_only()`` (a
decoding request never takes device rows outside its hot buffer), then
``begin_verify_step`` writes the committed positions through to host and maps the window's ids
to hot-buffer slots. Without it, the original runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.decode.coordinator import HiSparseCoordinator

TARGET = "sglang.srt.speculative.eagle_utils.eagle_prepare_for_decode"
CHECKED_AGAINST = "0.5.17"


def prepare_verify_step(original: Callable[..., Any], batch: Any) -> Any:
    coordinator = getattr(batch, "hisparse_coordinator", None)
    if not isinstance(coordinator, HiSparseCoordinator):
        return original(batch)
    with batch.token_to_kv_pool_allocator.logical_only():
        result = original(batch)
    lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
    idxs = batch.req_pool_indices_cpu if batch.req_pool_indices_cpu is not None else batch.req_pool_indices.cpu()
    coordinator.begin_verify_step(batch.req_pool_indices, idxs.tolist(), lens.tolist())
    return result


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, prepare_verify_step, HookType.AROUND)
