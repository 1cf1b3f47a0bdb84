"""Seam: a decode step needs logical ids and host rows, not device rows.

Upstream target: ``sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem`` (AROUND).
Checked against: SGLang 0.5.17, where it compares ``allocator.available_size()`` with the tokens
the next decode step needs, and retracts requests when it is short.

With our allocator, ``available_size()`` is the admission number: it also keeps device rows for
a new request's prefill and hot buffer, which are fully used in the steady state of a busy
server. Decode steps take no device rows (hot buffers are already held, growth is reserved), so
checking them against that number would retract requests for no reason. For batches on our
allocator this hook compares with ``decode_available_size()`` (logical space and host rows);
any other batch runs SGLang's original check unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from sglang_hisparse.allocator import HiSparseAllocator

TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"
CHECKED_AGAINST = "0.5.17"


def check_decode_mem(original: Callable[..., bool], batch: Any, selected_indices: Optional[list] = None) -> bool:
    allocator = batch.token_to_kv_pool_allocator
    if not isinstance(allocator, HiSparseAllocator):
        return original(batch, selected_indices)
    needed = batch.new_tokens_required_next_decode(selected_indices)
    return allocator.decode_available_size() >= needed


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, check_decode_mem, HookType.AROUND)
