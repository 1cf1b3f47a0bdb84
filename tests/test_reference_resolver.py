"""The reference resolver's rules, pinned by hand-written cases and checked against an
independent naive cache model on random inputs (with step-to-step overlap, like real selections)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tier import examples
from sglang_hisparse.resolver.reference import MissPlan, replay_plan_reference, resolve_reference

ROW = 4  # elements per KV row (tiny)


class Case:
    """One request (row 0 of the tables) with B slots; device row of slot s is 100 + s."""

    def __init__(self, B: int, tokens: list[int], lru: list[int], context: int = 64, top_k: int = 4):
        self.B = B
        self.hot_locs = torch.tensor([[100 + s for s in range(B + 1)]], dtype=torch.int32)
        self.slot_tokens = torch.tensor([tokens], dtype=torch.int32)
        self.lru = torch.tensor([lru], dtype=torch.int16)
        # host row of position p is 1000 + p; host KV row h holds value h
        self.host_locs = torch.tensor([[1000 + p for p in range(context)]], dtype=torch.int64)
        self.host_kv = torch.arange(2000, dtype=torch.float32).repeat_interleave(ROW).view(2000, ROW)
        self.device_kv = torch.full((200, ROW), -7.0)
        self.out = torch.full((2, top_k), -99, dtype=torch.int32)

    def resolve(self, positions: list[int], seq_len: int, **kw):
        return resolve_reference(
            top_k_positions=torch.tensor([positions], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len]),
            req_pool_indices=torch.tensor([0]),
            hot_locs=self.hot_locs, slot_tokens=self.slot_tokens, lru=self.lru,
            host_locs=self.host_locs, host_kv=self.host_kv, device_kv=self.device_kv,
            out=self.out, num_real_reqs=1, device_buffer_size=self.B, **kw,
        )


def test_seed_example_hits_before_misses():
    """The seed's worked example (section 3.5): B=8, slots s0..s7 hold t10..t17, LRU s0..s7,
    selection {t12, t16, t25, t30} with t30 newest -> t25 takes s0; new LRU
    s1 s3 s4 s5 s7 | s0 | s2 s6."""
    c = Case(8, tokens=[10, 11, 12, 13, 14, 15, 16, 17], lru=list(range(8)))
    stats = c.resolve([12, 16, 25, 30], seq_len=31)
    assert c.out[0].tolist() == [102, 106, 100, 108]
    assert c.lru[0].tolist() == [1, 3, 4, 5, 7, 0, 2, 6]
    assert c.slot_tokens[0].tolist() == [25, 11, 12, 13, 14, 15, 16, 17]
    assert c.device_kv[100].tolist() == [1025.0] * ROW  # host row of position 25
    assert (stats.selected, stats.misses, stats.copied_bytes) == (3, 1, ROW * 4)
    assert c.out[1].tolist() == [-99] * 4  # beyond num_real_reqs: untouched


def test_fast_path_short_sequence_reads_slot_p_and_changes_nothing():
    c = Case(8, tokens=list(range(8)), lru=[7, 6, 5, 4, 3, 2, 1, 0])
    stats = c.resolve([0, 5, -1, 7], seq_len=8)
    assert c.out[0].tolist() == [100, 105, -1, 107]
    assert c.lru[0].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    assert (c.device_kv == -7.0).all()
    assert stats.misses == 0 and stats.selected == 0


def test_padding_and_newest_are_not_cached():
    c = Case(4, tokens=[0, 1, 2, 3], lru=[0, 1, 2, 3])
    c.resolve([9, -1, 2, -1], seq_len=10)
    assert c.out[0].tolist() == [104, -1, 102, -1]
    assert c.lru[0].tolist() == [0, 1, 3, 2]
    assert c.slot_tokens[0].tolist() == [0, 1, 2, 3]


def test_misses_take_oldest_unselected_slots_in_topk_order():
    c = Case(4, tokens=[5, 6, 7, 8], lru=[3, 1, 0, 2])  # oldest: slot 3 (t8), then 1 (t6)
    c.resolve([20, 7, 21, 30], seq_len=31)  # t7 (slot 2) hits; misses 20, 21
    assert c.out[0].tolist() == [103, 102, 101, 104]
    assert c.slot_tokens[0].tolist() == [5, 21, 7, 20]
    assert c.lru[0].tolist() == [0, 3, 1, 2]  # remaining evictable, misses, hits


def test_a_smaller_buffer_size_hides_the_slots_beyond_it():
    """Size 3 of B = 4: slot 3 is neither a hit (its token t7 misses) nor a victim, and stays
    among the kept slots of the LRU; the misses take the oldest of slots 0-2."""
    c = Case(4, tokens=[5, 6, 8, 7], lru=[3, 0, 1, 2])
    stats = c.resolve([7, 6, 20, 30], seq_len=31, buffer_sizes=torch.tensor([3], dtype=torch.int32))
    assert c.out[0].tolist() == [100, 101, 102, 104]  # t7 -> slot 0, t6 hit in slot 1, t20 -> slot 2
    assert c.slot_tokens[0].tolist() == [7, 6, 20, 7]  # slot 3 untouched (its stale t7 stays)
    assert c.lru[0].tolist() == [0, 2, 3, 1]  # victims, then kept slots (3, hit 1) in old order
    assert (stats.selected, stats.misses) == (3, 2)


def test_the_fast_path_ends_at_the_request_s_buffer_size():
    """With size 3, a 4-token request (fast path at B = 4) takes the long path: position 3 is the
    newest (slot B), positions 0-2 are hits in their fast-path slots."""
    sizes = torch.tensor([3], dtype=torch.int32)
    c = Case(4, tokens=[0, 1, 2, 3], lru=[0, 1, 2, 3])
    c.resolve([0, 2, 3, -1], seq_len=3, buffer_sizes=sizes)  # L = 3 <= 3: fast path, nothing changes
    assert c.out[0].tolist() == [100, 102, 103, -1] and c.lru[0].tolist() == [0, 1, 2, 3]
    c.resolve([0, 2, 3, -1], seq_len=4, buffer_sizes=sizes)
    assert c.out[0].tolist() == [100, 102, 104, -1]
    assert c.lru[0].tolist() == [1, 0, 2, 3]


@pytest.mark.parametrize("size", [-1, 5])
def test_a_buffer_size_outside_zero_to_b_is_refused(size):
    c = Case(4, tokens=[0, 1, 2, 3], lru=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="buffer_sizes"):
        c.resolve([0, -1, -1, -1], seq_len=9, buffer_sizes=torch.tensor([size], dtype=torch.int32))


def test_skip_io_updates_tables_but_copies_nothing_and_plan_replays():
    c = Case(4, tokens=[5, 6, 7, 8], lru=[0, 1, 2, 3])
    plan = MissPlan(
        host_rows=torch.zeros((2, 4), dtype=torch.int64),
        device_rows=torch.zeros((2, 4), dtype=torch.int32),
        counts=torch.full((2,), 9, dtype=torch.int32),
    )
    stats = c.resolve([40, 41, 6, 50], seq_len=51, skip_io=True, plan=plan)
    assert stats.copied_bytes == 0 and (c.device_kv == -7.0).all()
    assert c.slot_tokens[0].tolist() == [40, 6, 41, 8]  # t6 (slot 1) hits
    assert plan.counts.tolist() == [2, 9]  # row 1 is beyond num_real_reqs
    assert plan.host_rows[0, :2].tolist() == [1040, 1041]
    assert plan.device_rows[0, :2].tolist() == [100, 102]
    copied = replay_plan_reference(plan=plan, num_real_reqs=1, host_kv=c.host_kv, device_kv=c.device_kv)
    assert copied == 2 * ROW * 4
    assert c.device_kv[100].tolist() == [1040.0] * ROW and c.device_kv[102].tolist() == [1041.0] * ROW


def _residency(flag: torch.Tensor, context: int = 64) -> dict[str, torch.Tensor]:
    """Request row 0's position p has logical id 500 + 2p (a view with a wider row stride, as a
    slice of SGLang's table may be) and logical id 500 + 2p lives at device row 9000 - p; every
    other logical id maps to -5."""
    wide = torch.arange(500, 500 + 2 * (context + 16), 2, dtype=torch.int32).view(1, context + 16)
    logical_to_device = torch.full((700,), -5, dtype=torch.int64)
    logical_to_device[500 + 2 * torch.arange(context)] = 9000 - torch.arange(context)
    return dict(resident=flag, req_to_token=wide[:, :context], logical_to_device=logical_to_device)


def _poisoned_plan() -> MissPlan:
    return MissPlan(host_rows=torch.full((2, 4), -3, dtype=torch.int64),
                    device_rows=torch.full((2, 4), -4, dtype=torch.int32),
                    counts=torch.full((2,), 9, dtype=torch.int32))


def test_resident_request_reads_its_own_rows_and_changes_nothing():
    """A long request (seq_len 31 > B = 4) marked resident: every selected position, the newest
    included, resolves to logical_to_device[req_to_token[r, p]]; no copy, no table or LRU change,
    not counted, plan count 0 and no plan rows written."""
    c = Case(4, tokens=[5, 6, 7, 8], lru=[2, 0, 3, 1])
    plan, counters = _poisoned_plan(), torch.tensor([11, 22], dtype=torch.int64)
    stats = c.resolve([12, -1, 30, 6], seq_len=31, plan=plan, counters=counters,
                      **_residency(torch.tensor([3], dtype=torch.uint8)))  # any nonzero flag
    assert c.out[0].tolist() == [8988, -1, 8970, 8994]
    assert c.out[1].tolist() == [-99] * 4
    assert c.slot_tokens[0].tolist() == [5, 6, 7, 8] and c.lru[0].tolist() == [2, 0, 3, 1]
    assert (c.device_kv == -7.0).all()
    assert (stats.selected, stats.misses, stats.copied_bytes) == (0, 0, 0)
    assert counters.tolist() == [11, 22]
    assert plan.counts.tolist() == [0, 9]
    assert (plan.host_rows == -3).all() and (plan.device_rows == -4).all()


def test_residency_comes_before_the_fast_path():
    c = Case(8, tokens=list(range(8)), lru=list(range(8)))
    c.resolve([0, 5, -1, 7], seq_len=8, **_residency(torch.tensor([True])))
    assert c.out[0].tolist() == [9000, 8995, -1, 8993]  # not hot_locs (100 + p)


def test_a_non_resident_request_ignores_the_residency_tables():
    c = Case(4, tokens=[5, 6, 7, 8], lru=[0, 1, 2, 3])
    stats = c.resolve([12, -1, 30, 6], seq_len=31, **_residency(torch.tensor([0], dtype=torch.uint8)))
    assert c.out[0].tolist() == [100, -1, 104, 101]  # the long path: t6 hits slot 1, t12 misses into slot 0
    assert c.slot_tokens[0].tolist() == [12, 6, 7, 8]
    assert (stats.selected, stats.misses) == (2, 1)


@pytest.mark.parametrize("missing", ["resident", "req_to_token", "logical_to_device"])
def test_residency_tables_come_together_or_not_at_all(missing):
    c = Case(4, tokens=[5, 6, 7, 8], lru=[0, 1, 2, 3])
    tables = _residency(torch.tensor([1], dtype=torch.uint8))
    del tables[missing]
    with pytest.raises(ValueError, match="together"):
        c.resolve([12, -1, 30, 6], seq_len=31, **tables)
    assert c.out[0].tolist() == [-99] * 4 and c.slot_tokens[0].tolist() == [5, 6, 7, 8]


class NaiveCache:
    """An independent model: a dict position -> slot and a recency list, no tensors."""

    def __init__(self, B: int, initial_positions: list[int]):
        self.B = B
        self.slot_of = {p: s for s, p in enumerate(initial_positions)}
        self.recency = list(range(B))  # oldest first

    def step(self, selected: list[int], newest: int) -> dict[int, int]:
        wanted = [p for p in selected if p != newest]
        hits = [self.slot_of[p] for p in wanted if p in self.slot_of]
        misses = [p for p in wanted if p not in self.slot_of]
        free = [s for s in self.recency if s not in hits]
        result = {newest: self.B}
        victims = free[: len(misses)]
        position_of = {s: p for p, s in self.slot_of.items()}
        for p, s in zip(misses, victims):
            old = position_of.get(s)
            if old is not None:
                del self.slot_of[old]
            self.slot_of[p] = s
        for p in wanted:
            result[p] = self.slot_of[p]
        self.recency = free[len(misses):] + victims + [s for s in self.recency if s in hits]
        return result


@settings(max_examples=examples(60), deadline=None)
@given(
    B=st.integers(2, 24),
    extra=st.integers(0, 6),
    steps=st.integers(1, 25),
    overlap=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_matches_naive_model_on_random_decode_sequences(B, extra, steps, overlap, seed):
    rng = random.Random(seed)
    top_k = rng.randint(1, B)
    seq_len = B + 1 + extra
    c = Case(B, tokens=list(range(B)), lru=list(range(B)), context=seq_len + steps + 1, top_k=top_k)
    model = NaiveCache(B, list(range(B)))
    previous: list[int] = []
    for _ in range(steps):
        newest = seq_len - 1
        candidates = list(range(seq_len - 1))
        keep = [p for p in previous if p < newest and rng.random() < overlap]
        fresh = rng.sample(candidates, k=min(len(candidates), top_k - 1))
        chosen = list(dict.fromkeys(keep + fresh))[: top_k - 1] + [newest]
        rng.shuffle(chosen)
        positions = chosen + [-1] * (top_k - len(chosen))
        c.resolve(positions, seq_len=seq_len)
        expected = model.step(chosen, newest)
        for j, p in enumerate(positions):
            want = -1 if p < 0 else 100 + expected[p]
            assert int(c.out[0, j]) == want
            if p >= 0 and p != newest:
                assert c.device_kv[want].tolist() == [1000.0 + p] * ROW or int(c.slot_tokens[0, want - 100]) == p
        assert c.lru[0].tolist() == model.recency
        previous = chosen
        seq_len += 1
