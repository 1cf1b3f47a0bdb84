"""Prefix reuse, the pieces without a server: the room an eviction adds, loads that were not
scheduled, and the loans of cached host rows (docs/prefix_reuse/README.md). The end to end behaviour is in test_e2e_cpu_prefix.py."""

from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hisparse.memory.allocator_room import AllocatorRoom
from sglang_hisparse.memory.device_rows import DeviceRows
from sglang_hisparse.memory.paging import PageAllocator
from sglang_hisparse.prefix.host_tree import PendingLoads, PrefixLoans

P = 4


@settings(max_examples=60, deadline=None)
@given(logical_used=st.integers(0, 48), rows_used=st.integers(0, 24), host_capacity=st.integers(8, 48),
       freed=st.integers(0, 48))
def test_the_room_an_eviction_adds_is_what_available_becomes_after_it(logical_used, rows_used, host_capacity, freed):
    """``available_with_freed(n)`` and ``decode_room_with_freed(n)``: what ``available()`` and
    ``decode_room()`` read once ``n`` cached tokens (ids and host rows, no device rows) are freed;
    checked by freeing them for real."""
    rows_used, freed = rows_used * P, min(freed, logical_used)
    logical = PageAllocator(48, 1, "cpu")  # 48 logical ids, pages of one: exact counts
    rows = DeviceRows(24 * P, P, "cpu")
    room = AllocatorRoom(logical, rows, 48, lambda: "")
    room.host_capacity = host_capacity
    held = logical.alloc_tokens(logical_used) if logical_used else torch.empty(0, dtype=torch.int64)
    if rows_used:
        rows.pages.alloc_tokens(rows_used)
    predicted, predicted_decode = room.available_with_freed(freed), room.decode_room_with_freed(freed)
    if freed:
        logical.free_tokens(held[:freed])
    assert room.available() == predicted
    assert room.decode_room() == predicted_decode  # what a PD decode instance's admission reads
    assert room.available_with_freed(0) == room.available()


class Req:
    """A stand-in request (weak-referenceable, as SGLang's ``Req`` is)."""

    def __init__(self, slot: int = 0):
        self.req_pool_idx = slot


def test_a_load_not_scheduled_is_freed_when_loaded_again_or_when_its_request_is_gone():
    freed: list[list[int]] = []
    pending = PendingLoads(lambda ids: freed.append(ids.tolist()))
    a, b, c = Req(), Req(), Req()
    pending.add(a, torch.tensor([1, 2]))
    pending.add(b, torch.tensor([3, 4]))
    pending.add(c, torch.tensor([5, 6]))
    pending.consumed(c)  # c was prefilled: its ids are freed with it, not here
    pending.free_stale(a)  # a is loaded again: its earlier load goes
    assert freed == [[1, 2]]
    del b
    gc.collect()
    pending.free_stale(Req())  # b was dropped (aborted while waiting): found gone at the next load
    assert freed == [[1, 2], [3, 4]]
    pending.free_stale(c)
    assert freed == [[1, 2], [3, 4]], "a consumed load is never freed here"


def test_a_loan_follows_the_last_load_back_and_ends_with_the_request():
    """Lent at staging only what the request's last load-back offered (a new match withdraws the
    offer: a request prefilled without a load borrows nothing); the loan is recorded by slot until
    the request ends; a reset with a loan open is refused."""
    import pytest

    loans = PrefixLoans()
    a, b = Req(slot=1), Req(slot=2)
    loans.offer(a, torch.arange(8))
    loans.offer(b, torch.arange(8, 12))
    loans.withdraw(b)  # b was matched again and not loaded
    assert loans.lend(b) is None and loans.end(b) == 0
    assert torch.equal(loans.lend(a), torch.arange(8)) and loans.lent_tokens == 8
    with pytest.raises(AssertionError, match="loan of cached host rows open"):
        loans.lend(a)  # staged again before it ended
    with pytest.raises(AssertionError, match="lent to slots \\[1\\]"):
        loans.clear()
    assert loans.end(a) == 8 and loans.end(a) == 0
    assert loans.lend(a) is None, "an offer is lent once"
    loans.offer(a, torch.arange(4))
    assert loans.lend(a).numel() == 4 and loans.end(a) == 4 and loans.end(a) == 0
    c = Req(slot=3)
    loans.offer(c, torch.arange(4))
    del c
    gc.collect()
    loans.offer(a, torch.arange(4))  # offers of requests gone are dropped at the next offer
    assert len(loans._offers) == 1
    loans.clear()
