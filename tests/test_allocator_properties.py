"""Property tests of the dual-address-space allocator: random interleavings of prefill (with
chunked continuation), decode, hot-buffer allocation, growth from the free rows, finish and abort
never hand out a row twice, keep the mapping consistent, count as admission room exactly the rows
no request holds, and return every counter to its initial value."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rig import DIM, KV_LORA, PAGE, ROPE
from tier import examples
from sglang_hisparse.memory.allocator import HiSparseAllocator
from sglang_hisparse.memory.device_pool import HiSparseDevicePool

DEVICE_ROWS = PAGE * 16
HOT = 3 * PAGE  # hot buffer rows per decoding request (B = 128 + newest page)


def make_allocator() -> HiSparseAllocator:
    pool = HiSparseDevicePool(
        DEVICE_ROWS, page_size=PAGE, kv_lora_rank=KV_LORA, dtype=torch.float32, qk_rope_head_dim=ROPE,
        layer_num=1, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=DIM,
        host_to_device_ratio=2,
    )
    allocator = HiSparseAllocator(DEVICE_ROWS, PAGE, torch.float32, "cpu", pool, False, 2, debug=True)
    allocator.configure(HOT, allocator.logical_size)
    return allocator


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = make_allocator()
        self.initial = self.snapshot()
        self.prefilling: dict[int, list] = {}  # id -> logical ids (positions 0..n-1), rows mapped
        self.decoding: dict[int, dict] = {}  # id -> {"logical": [...], "rows": [...]}
        self.next_id = 0

    def snapshot(self):
        return (self.a.logical.available_pages(), self.a.rows.pages.available_pages())

    # --- prefill ---------------------------------------------------------------------------
    @rule(n=st.integers(1, 5 * PAGE))
    def prefill(self, n):
        if n + PAGE > self.a.available_size():
            return
        ids = self.a.alloc_extend(
            torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n
        )
        assert ids is not None, "available_size promised room"
        self.prefilling[self.next_id] = ids.tolist()
        self.next_id += 1

    @precondition(lambda self: self.prefilling)
    @rule(data=st.data(), n=st.integers(1, 2 * PAGE))
    def prefill_next_chunk(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.prefilling)))
        ids = self.prefilling[rid]
        if n + PAGE > self.a.available_size():
            return
        pre = len(ids)
        more = self.a.alloc_extend(
            torch.tensor([pre]), torch.tensor([pre]), torch.tensor([pre + n]), torch.tensor([pre + n]),
            torch.tensor([ids[-1]]), n,
        )
        assert more is not None
        ids.extend(more.tolist())

    @precondition(lambda self: self.prefilling)
    @rule(data=st.data())
    def take_hot_buffer(self, data):
        rid = data.draw(st.sampled_from(sorted(self.prefilling)))
        ids = self.prefilling[rid]
        keep = min(-(-len(ids) // PAGE) * PAGE, HOT)
        rows = self.a.take_hot_buffer(torch.tensor(ids), keep)
        assert rows is not None, "a hot buffer made of the request's own pages needs no free rows"
        del self.prefilling[rid]
        self.decoding[rid] = {"logical": ids, "rows": rows.tolist()}

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def decode_and_grow(self, data):
        rid = data.draw(st.sampled_from(sorted(self.decoding)))
        state = self.decoding[rid]
        if self.a.decode_available_size() < PAGE:
            return
        seq = len(state["logical"]) + 1
        grows = len(state["rows"]) < min(seq, HOT)  # its newest slot starts a page it has no row for
        free_before = self.a.rows.room()
        if grows and free_before < PAGE:
            assert self.a.grow_hot_buffer(PAGE) is None and self.a.rows.room() == free_before
            return  # the decode check would retract a request first
        new = self.a.alloc_decode(torch.tensor([seq]), torch.tensor([seq]), torch.tensor([state["logical"][-1]]))
        assert new is not None
        state["logical"].append(int(new))
        if grows:
            state["rows"].extend(self.a.grow_hot_buffer(PAGE).tolist())
        slot = min(seq - 1, len(state["rows"]) - 1)
        self.a.map_logical(new, torch.tensor([state["rows"][slot]]))

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.decoding)))
        state = self.decoding.pop(rid)
        self.a.release_hot_buffer(torch.tensor(state["rows"]))
        self.a.unmap_logical(torch.tensor(state["logical"]))
        self.a.free(torch.tensor(state["logical"]))

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def finish_without_unmapping(self, data):
        """SGLang frees logical ids whose mapping still points at a hot-buffer row (the newest
        token): the allocator must not free that row (the hot buffer owns it)."""
        rid = data.draw(st.sampled_from(sorted(self.decoding)))
        state = self.decoding.pop(rid)
        self.a.free(torch.tensor(state["logical"]))
        self.a.release_hot_buffer(torch.tensor(state["rows"]))

    @precondition(lambda self: self.prefilling)
    @rule(data=st.data(), in_staging=st.booleans())
    def abort_prefill(self, data, in_staging):
        rid = data.draw(st.sampled_from(sorted(self.prefilling)))
        ids = torch.tensor(self.prefilling.pop(rid))
        if in_staging:
            self.a.free_prefill_rows(ids)
        self.a.free(ids)

    # --- invariants ------------------------------------------------------------------------
    @invariant()
    def no_row_is_held_twice_and_mapping_is_consistent(self):
        held_rows = []
        for ids in self.prefilling.values():
            rows = self.a.logical_to_device[torch.tensor(ids)]
            assert bool((rows > 0).all()), "a prefilling request lost a mapping"
            held_rows += rows.tolist()
        for state in self.decoding.values():
            held_rows += state["rows"]
            assert bool(self.a.rows.hot_owned[torch.tensor(state["rows"])].all())
        held_pages = {r // PAGE for r in held_rows}
        free_pages = set(self.a.rows.pages.free_pages.tolist())
        assert not held_pages & free_pages, "a held row is also free"
        assert len(set(held_rows)) == len(held_rows), "a row is held twice"
        assert len(free_pages) == self.a.rows.pages.available_pages()
        held_logical = [i for ids in self.prefilling.values() for i in ids]
        held_logical += [i for s in self.decoding.values() for i in s["logical"]]
        assert len(set(held_logical)) == len(held_logical), "a logical id is held twice"
        assert not {i // PAGE for i in held_logical} & set(self.a.logical.free_pages.tolist())
        assert self.a.available_size() == min(self.a.decode_available_size(), self.a.rows.room()), \
            "admission counts exactly the rows that are not held"

    def teardown(self):
        for rid in list(self.decoding):
            state = self.decoding.pop(rid)
            self.a.unmap_logical(torch.tensor(state["logical"]))
            self.a.release_hot_buffer(torch.tensor(state["rows"]))
            self.a.free(torch.tensor(state["logical"]))
        for rid in list(self.prefilling):
            self.a.free(torch.tensor(self.prefilling.pop(rid)))
        assert self.snapshot() == self.initial
        assert not bool(self.a.rows.hot_owned.any())
        assert not bool(self.a.logical_to_device[:-1].any())


AllocatorMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)
TestAllocatorProperties = AllocatorMachine.TestCase


def test_logical_ids_and_device_rows_share_in_page_offsets():
    a = make_allocator()
    ids = a.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([70]), torch.tensor([70]), torch.tensor([-1]), 70)
    more = a.alloc_extend(torch.tensor([70]), torch.tensor([70]), torch.tensor([150]), torch.tensor([150]), ids[-1:], 80)
    ids = torch.cat([ids, more])
    rows = a.device_rows_of(ids)
    positions = torch.arange(150)
    assert torch.equal(ids % PAGE, positions % PAGE) and torch.equal(rows % PAGE, positions % PAGE)
    assert a.logical_to_device[-1] == -1


def test_admission_counts_the_rows_a_request_holds_and_nothing_more():
    """A short request is charged its own page, not a hot buffer it does not use; its growth takes
    a free page when it gets there. Decode needs logical ids only."""
    a = make_allocator()
    assert a.available_size() == DEVICE_ROWS  # nothing set aside for a hot buffer
    ids = a.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([10]), torch.tensor([10]), torch.tensor([-1]), 10)
    rows = a.take_hot_buffer(ids, PAGE)
    assert rows is not None and a.available_size() == DEVICE_ROWS - PAGE
    grown = a.grow_hot_buffer(PAGE)
    assert grown is not None and a.available_size() == DEVICE_ROWS - 2 * PAGE
    assert a.decode_available_size() == a.logical_size - PAGE
    taken = a.rows.pages.alloc_tokens(a.rows.room())
    assert a.grow_hot_buffer(PAGE) is None and a.available_size() == 0, "growth takes free rows or nothing"
    a.rows.pages.free_tokens(taken)


def test_a_free_of_int32_ids_releases_their_rows_mapping_and_resident_marks():
    """SGLang frees ``req_to_token``'s int32 ids: their mapped rows come back, the mapping is
    cleared and their pages are no longer marked resident (a finishing resident request leaves its
    marks to this free), in one free group as SGLang's result processing calls it."""
    a = make_allocator()
    free_rows, free_ids = a.available_size(), a.decode_available_size()
    ids = a.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([150]), torch.tensor([150]),
                         torch.tensor([-1]), 150)
    a.mark_resident_pages(ids[::PAGE], True)
    assert int(a.page_resident.sum()) == 3 and a.available_size() == free_rows - 3 * PAGE
    a.free_group_begin()
    a.free(ids.to(torch.int32))
    assert a.available_size() == free_rows - 3 * PAGE, "a free group frees at its end"
    a.free_group_end()
    assert a.available_size() == free_rows and a.decode_available_size() == free_ids
    assert not bool(a.logical_to_device[ids].any()) and int(a.page_resident.sum()) == 0
