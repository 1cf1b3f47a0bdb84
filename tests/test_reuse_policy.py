"""The history-only reuse-table policy in the resolvers (``slot_history`` + ``reuse_levels``).

* The packaged table and its levels: levels order the cells as the simulator's quantized table.
* With all levels equal both resolvers are exactly LRU (outputs, tables, copies, plan, counters).
* The loop reference replays random traces with the same misses, per request and step, as
  ``simulate(ReuseTable(table, use_rank=False), ...)``: the resolver's policy is the studied one.
* The batched oracle equals the loop reference with the policy on mixed batches (fast-path,
  resident and padded rows included), history included.
* The history update rules, the victim assignment and the both-or-neither argument rule.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tier import examples
from sglang_hisparse_analysis.policies import AGE_EDGES, COUNT_EDGES, PRIORITY_LEVELS, ReuseTable
from sglang_hisparse.resolver.reuse import (
    CELLS,
    age_bucket,
    count_bucket,
    history_table,
    pack,
    reuse_levels,
    slot_levels,
    unpack,
)
from sglang_hisparse_analysis.replay import ReplayState, bind_python, replay_selections
from sglang_hisparse_analysis.simulator import simulate
from sglang_hisparse.resolver.batched import resolve_batched
from sglang_hisparse_testkit.resolver_cases import differences, make_case, random_history, random_spec
from sglang_hisparse.resolver.reference import resolve_reference

CPU = torch.device("cpu")
ROW = 2  # elements per KV row in the hand-built states


# --- the table and its levels ------------------------------------------------------------------

def test_packaged_table_has_its_provenance_and_54_levels():
    t = history_table()
    assert t.table.shape == (9, 6)
    p = t.provenance
    assert (p["selector"], p["k"], p["B"], p["horizon"], p["fitted_on"]) == ("attention", 256, 512, 4, "tune documents")
    levels = reuse_levels(t.table)
    assert levels.dtype == torch.uint8 and levels.shape == (CELLS,)
    assert t.describe() == "attention k=256 B=512"


def test_packaged_table_is_the_reports_history_table():
    import json
    from pathlib import Path

    detail = Path(__file__).resolve().parents[1] / "docs" / "results" / "policies_detail.json"
    if not detail.exists():
        pytest.skip("docs/results not in this checkout")
    table = np.array(json.loads(detail.read_text())["reuse_table"]["tables"]["attention"]["512/norank"])
    assert np.array_equal(table[..., 0], history_table().table)


@settings(max_examples=examples(50), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), coarse=st.booleans())
def test_levels_order_cells_as_the_quantized_table(seed, coarse):
    table = np.random.default_rng(seed).random((9, 6))
    if coarse:  # many equal cells
        table = np.round(table * 4) / 4
    levels = reuse_levels(table).long().numpy()
    quantized = np.round(table.reshape(-1) * (PRIORITY_LEVELS - 1)).astype(np.int64)
    assert np.array_equal(np.sign(levels[:, None] - levels[None, :]), np.sign(quantized[:, None] - quantized[None, :]))
    assert levels.min() == 0 and levels.max() == len(np.unique(quantized)) - 1  # dense
    assert torch.equal(reuse_levels(table[..., None]), reuse_levels(torch.from_numpy(table)))


def test_buckets_are_the_simulators():
    age = torch.arange(0, 300)
    assert age_bucket(age).tolist() == np.searchsorted(AGE_EDGES, np.minimum(age.numpy(), 129), side="left").tolist()
    count = torch.arange(0, 128)
    assert count_bucket(count).tolist() == np.searchsorted(COUNT_EDGES, np.minimum(count.numpy(), 32),
                                                           side="left").tolist()
    assert age_bucket(torch.tensor([1, 2, 3, 4, 5, 128, 129, 256])).tolist() == [0, 1, 2, 2, 3, 7, 8, 8]
    assert count_bucket(torch.tensor([0, 1, 2, 3, 4, 31, 32, 127])).tolist() == [0, 0, 1, 1, 2, 4, 5, 5]
    levels = torch.arange(CELLS, dtype=torch.uint8)
    # stored age 0 = selected last step (a = 1, bucket 0); stored 128 -> a = 129 (bucket 8)
    h = pack(torch.tensor([0, 1, 127, 128, 255]), torch.tensor([0, 2, 4, 32, 127]))
    assert slot_levels(h, levels).tolist() == [0 * 6 + 0, 1 * 6 + 1, 7 * 6 + 2, 8 * 6 + 5, 8 * 6 + 5]


# --- a hand-built request ----------------------------------------------------------------------

class Req:
    """One long request (row 0) with B slots; device row of slot s is 100 + s, host row of
    position p is 1000 + p."""

    def __init__(self, B: int, tokens: list[int], lru: list[int], history: list[tuple[int, int]], top_k: int = 4):
        self.B = B
        self.hot_locs = torch.tensor([[100 + s for s in range(B + 1)]], dtype=torch.int32)
        self.slot_tokens = torch.tensor([tokens], dtype=torch.int32)
        self.lru = torch.tensor([lru], dtype=torch.int16)
        self.history = pack(torch.tensor([[a for a, _ in history]]), torch.tensor([[c for _, c in history]]))
        self.host_locs = torch.tensor([[1000 + p for p in range(64)]], dtype=torch.int64)
        self.host_kv = torch.arange(2000, dtype=torch.float32).repeat_interleave(ROW).view(2000, ROW)
        self.device_kv = torch.full((200, ROW), -7.0)
        self.out = torch.full((1, top_k), -99, dtype=torch.int32)

    def resolve(self, positions: list[int], seq_len: int, levels: torch.Tensor, resolver=resolve_reference):
        return resolver(
            top_k_positions=torch.tensor([positions], dtype=torch.int32), seq_lens=torch.tensor([seq_len]),
            req_pool_indices=torch.tensor([0]), hot_locs=self.hot_locs, slot_tokens=self.slot_tokens, lru=self.lru,
            host_locs=self.host_locs, host_kv=self.host_kv, device_kv=self.device_kv, out=self.out, num_real_reqs=1,
            device_buffer_size=self.B, slot_history=self.history, reuse_levels=levels)

    def fields(self) -> list[tuple[int, int]]:
        age, count = unpack(self.history[0])
        return list(zip(age.tolist(), count.tolist()))


def _level_by_age(B: int) -> torch.Tensor:
    """Levels that depend on the age bucket only: older = lower (evicted first)."""
    return torch.tensor([8 - cell // 6 for cell in range(CELLS)], dtype=torch.uint8)


@pytest.mark.parametrize("resolver", [resolve_reference, resolve_batched])
def test_victims_by_level_then_lru_and_misses_take_them_in_lru_order(resolver):
    """Slots 0..5 hold positions 10..15, LRU order 0..5. By age, slots 4 (age 200) and 1 (age 40)
    are the lowest levels; slots 2 and 3 share a level (age 10 and 12: bucket 4) with slot 5 (age 9,
    also bucket 4), slot 0 is the youngest. Selection: 12 (hit, slot 2), misses 30, 31, 32.
    Victims: 4, 1 (lowest levels), then 3 (level of bucket 4, older in LRU than 5); the first miss
    takes the victim oldest in LRU (slot 1), then 3, then 4."""
    hist = [(0, 3), (39, 1), (9, 2), (11, 5), (199, 1), (8, 1)]
    c = Req(6, tokens=[10, 11, 12, 13, 14, 15], lru=[0, 1, 2, 3, 4, 5], history=hist)
    c.resolve([30, 12, 31, 32], seq_len=40, levels=_level_by_age(6), resolver=resolver)
    assert c.slot_tokens[0].tolist() == [10, 30, 12, 31, 32, 15]
    assert c.out[0].tolist() == [101, 102, 103, 104]
    assert c.lru[0].tolist() == [0, 5, 1, 3, 4, 2]  # untouched evictables, victims (LRU order), hits
    assert c.device_kv[101].tolist() == [1030.0] * ROW and c.device_kv[104].tolist() == [1032.0] * ROW
    # victims: age 0 count 1; hit: age 0 count 3; the rest one step older
    assert c.fields() == [(1, 3), (0, 1), (0, 3), (0, 1), (0, 1), (9, 1)]


@pytest.mark.parametrize("resolver", [resolve_reference, resolve_batched])
def test_history_saturates_and_short_resident_and_newest_change_nothing(resolver):
    """Idle ages stop at 255, counts at 127; the newest position is not a slot; a fast-path
    request's history is untouched."""
    hist = [(255, 127), (254, 126), (3, 127), (0, 0)]
    c = Req(4, tokens=[10, 11, 12, 13], lru=[0, 1, 2, 3], history=hist)
    levels = torch.zeros(CELLS, dtype=torch.uint8)
    c.resolve([12, 13, 19, -1], seq_len=20, levels=levels, resolver=resolver)  # 19 is the newest
    assert c.fields() == [(255, 127), (255, 126), (0, 127), (0, 1)]
    c.resolve([11, 12, -1, -1], seq_len=20, levels=levels, resolver=resolver)
    assert c.fields() == [(255, 127), (0, 127), (0, 127), (1, 1)]
    before = c.history.clone()
    c.resolve([0, 1, 2, -1], seq_len=4, levels=levels, resolver=resolver)  # fast path (L <= B)
    assert torch.equal(c.history, before)


@pytest.mark.parametrize("resolver", [resolve_reference, resolve_batched])
@pytest.mark.parametrize("given_one", ["slot_history", "reuse_levels"])
def test_policy_tables_are_passed_both_or_neither(resolver, given_one):
    c = Req(4, tokens=[10, 11, 12, 13], lru=[0, 1, 2, 3], history=[(0, 0)] * 4)
    kw = dict(top_k_positions=torch.tensor([[10, -1, -1, -1]], dtype=torch.int32), seq_lens=torch.tensor([20]),
              req_pool_indices=torch.tensor([0]), hot_locs=c.hot_locs, slot_tokens=c.slot_tokens, lru=c.lru,
              host_locs=c.host_locs, host_kv=c.host_kv, device_kv=c.device_kv, out=c.out, num_real_reqs=1,
              device_buffer_size=4)
    kw[given_one] = c.history if given_one == "slot_history" else torch.zeros(CELLS, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot_history and reuse_levels"):
        resolver(**kw)


# --- random batches: flat levels are LRU; batched == reference ---------------------------------

def _specs(seed: int, n: int, residency_share: float = 0.5):
    rng = random.Random(seed)
    for i in range(n):
        K = rng.choice([1, 3, 4, 8, 16])
        B = K * rng.choice([1, 2, 4]) + rng.choice([0, 0, 3])
        spec = random_spec(rng, item_bytes=rng.choice([656, 32]), B=B, top_k=K, block_size=64, max_batch=10,
                           seed=seed * 1000 + i)
        if rng.random() < residency_share:
            spec = dataclasses.replace(spec, residency=True, resident_prob=rng.choice([0.0, 0.3, 0.7]))
        yield dataclasses.replace(spec, reuse=False)  # these tests pass their own policy tables


def _with_policy(case, history: torch.Tensor, levels: torch.Tensor) -> dict:
    kw = case.ref_kwargs()
    kw.update(slot_history=history, reuse_levels=levels)
    return kw


def test_flat_levels_are_exactly_lru(pool, bufs):
    """'kernel' side: LRU; 'ref' side: the reuse policy with every level equal (reference, and
    batched on a second case from the same seed)."""
    for spec in _specs(5, 60):
        gen = torch.Generator().manual_seed(spec.seed)
        flat = torch.full((CELLS,), int(torch.randint(0, 54, (1,), generator=gen)), dtype=torch.uint8)
        for resolver in (resolve_reference, resolve_batched):
            case = make_case(spec, pool, *bufs, CPU)
            history = random_history(gen, (spec.max_reqs, spec.B))
            resolve_reference(**case.kernel_kwargs())
            resolver(**_with_policy(case, history, flat))
            bad = differences(case)
            assert not bad, f"{resolver.__name__}: {bad} differ ({spec.describe()})"


def test_batched_matches_reference_with_the_policy(pool, bufs):
    """Random levels (from random tables, at times with many ties) and random histories, mixed
    batches (fast-path, resident, padded rows): outputs, tables, copies, plan, counters and the
    history are identical; rows the resolver must not touch keep their history."""
    changed = 0
    for spec in _specs(6, 120):
        gen = torch.Generator().manual_seed(spec.seed)
        table = torch.rand(9, 6, generator=gen, dtype=torch.float64)
        if spec.seed % 3 == 0:
            table = torch.round(table * 3) / 3
        levels = reuse_levels(table)
        history = random_history(gen, (spec.max_reqs, spec.B))
        case = make_case(spec, pool, *bufs, CPU)
        ref_history, batched_history = history.clone(), history.clone()
        loop_kw = dict(case.kernel_kwargs(), slot_history=ref_history, reuse_levels=levels)
        resolve_reference(**loop_kw)
        resolve_batched(**_with_policy(case, batched_history, levels))
        bad = differences(case)
        if not torch.equal(ref_history, batched_history):
            bad.append("slot_history")
        assert not bad, f"{bad} differ ({spec.describe()})"
        # only long, non-resident real rows change
        n = spec.num_real
        r = case.inputs["req_pool_indices"][:n].long()
        L = case.inputs["seq_lens"][:n].long()
        touched = torch.zeros(spec.max_reqs, dtype=torch.bool)
        sizes = case.inputs.get("buffer_sizes")  # per-request buffer sizes: long past each size
        long_rows = L > (spec.B if sizes is None else sizes[r].long())
        if "resident" in case.inputs:
            long_rows &= case.inputs["resident"][r] == 0
        touched[r[long_rows]] = True
        assert torch.equal(ref_history[~touched], history[~touched])
        changed += int((ref_history != history).any())
    assert changed > 50


# --- the resolver replays the simulator's policy -----------------------------------------------

def _trace(rng: np.random.Generator, n: int, steps: int, k: int, positions: int) -> np.ndarray:
    """(n, steps, k) selections of distinct positions in [0, positions) with locality: each
    position of the last step stays with probability ``stay``, the rest come from a small hot set
    most of the time, else anywhere."""
    ranked = np.empty((n, steps, k), dtype=np.int64)
    for i in range(n):
        stay = rng.uniform(0.2, 0.9)
        hot = rng.choice(positions, size=min(positions, max(k + 2, positions // 3)), replace=False)
        prev: list[int] = []
        for s in range(steps):
            chosen = [p for p in prev if rng.random() < stay]
            while len(chosen) < k:
                p = int(rng.choice(hot)) if rng.random() < 0.7 else int(rng.integers(positions))
                if p not in chosen:
                    chosen.append(p)
            rng.shuffle(chosen)
            ranked[i, s] = chosen
            prev = chosen
    return ranked


def _replay(ranked: np.ndarray, k: int, B: int, levels: torch.Tensor, resolver) -> np.ndarray:
    """Run the trace through ``resolver`` (``replacement.replay``, with copies): request i holds
    positions 0..B-1 (their KV loaded) in slots 0..B-1, LRU order by slot, history zero; its length
    is past every traced position (the newest is never selected). Returns (n, steps) misses per
    request and step (from the plan counts)."""
    n, steps, _ = ranked.shape
    L = max(int(ranked.max()) + 1, B) + 1

    def reads_own_kv(step: int, state: ReplayState, out: torch.Tensor) -> None:
        want = state.host_locs.gather(1, torch.from_numpy(ranked[:, step])).float()
        assert torch.equal(state.device_kv[out.long(), 0], want)

    result = replay_selections(bind_python(resolver), ranked, np.full(steps, L - 1), B, levels=levels,
                               skip_io=False, on_step=reads_own_kv)
    return result.misses


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), B=st.integers(8, 32), k=st.integers(4, 16), steps=st.integers(10, 40),
       n=st.integers(1, 3), extra=st.integers(1, 40), coarse=st.booleans())
def test_reference_replays_the_simulators_reuse_table(seed, B, k, steps, n, extra, coarse):
    k = min(k, B)
    rng = np.random.default_rng(seed)
    table = rng.random((9, 6, 1))
    if coarse:  # ties between cells: broken by recency on both sides
        table = np.round(table * 3) / 3
    ranked = _trace(rng, n, steps, k, B + extra)
    want = simulate(ReuseTable(table, use_rank=False), ranked, k, B, check=True)
    got = _replay(ranked, k, B, reuse_levels(table), resolve_reference)
    assert np.array_equal(got, want), f"misses per step differ:\nresolver  {got.tolist()}\nsimulator {want.tolist()}"


def test_batched_replays_the_simulators_reuse_table_with_the_packaged_table():
    rng = np.random.default_rng(3)
    B, k = 32, 12
    table = history_table().table
    ranked = _trace(rng, 3, 60, k, 80)
    want = simulate(ReuseTable(table[..., None], use_rank=False), ranked, k, B)
    got = _replay(ranked, k, B, reuse_levels(table), resolve_batched)
    assert np.array_equal(got, want)
    lru = _replay(ranked, k, B, torch.zeros(CELLS, dtype=torch.uint8), resolve_batched)
    assert lru.sum() > 0 and not np.array_equal(lru, got), "the trace must tell the policies apart"
