"""Tests of the hot-buffer replacement simulator (numpy only, tiny sizes).

Every policy is pinned by hand-written cases and compared, on random traces,
with an independent naive model: a plain Python list-based cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tier import examples

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_hisparse_analysis.policies import (  # noqa: E402
    Belady,
    Fifo,
    LookaheadOracle,
    Lru,
    LruHitsLast,
    RandomEviction,
    ReuseTable,
    ScoreRank,
    fit_reuse_table,
)
from sglang_hisparse_analysis.simulator import (  # noqa: E402
    KEY_LIMIT,
    CacheState,
    keep_only_topk_misses,
    pair_overlap,
    simulate,
    step_overlap,
)


def trace(*steps: list[int]) -> np.ndarray:
    """One cache's trace ``(1, S, k)`` from per-step selections (best first)."""
    return np.array([list(steps)], dtype=np.int64)


def misses_of(policy, steps: np.ndarray, k: int, b: int) -> list[int]:
    return simulate(policy, steps, k, b, check=True)[0].tolist()


# ---------------------------------------------------------------- naive models


def naive_recency(steps: list[list[int]], b: int, order: str) -> list[int]:
    """List cache, oldest first; ``order`` in {"fifo", "lru", "hits_last"}."""
    cache = list(range(b))
    out = []
    for sel in steps:
        selected = set(sel)
        misses = [p for p in sel if p not in cache]
        hits_in_old_order = [p for p in cache if p in selected]
        out.append(len(misses))
        unselected = [p for p in cache if p not in selected]
        survivors = unselected[len(misses):]  # the oldest unselected are evicted
        if order == "fifo":
            cache = [p for p in cache if p not in set(unselected[:len(misses)])] + misses
        elif order == "lru":
            cache = survivors + list(sel)
        elif order == "hits_last":
            cache = survivors + misses + hits_in_old_order
        else:
            raise ValueError(order)
        assert len(cache) == b and selected <= set(cache)
    return out


def naive_belady(steps: list[list[int]], b: int) -> list[int]:
    """Set cache; evict the unselected resident whose next use is farthest."""
    cache = set(range(b))
    out = []
    for s, sel in enumerate(steps):
        misses = [p for p in sel if p not in cache]
        out.append(len(misses))

        def next_use(p: int) -> float:
            for later in range(s + 1, len(steps)):
                if p in steps[later]:
                    return later
            return float("inf")

        candidates = sorted((p for p in cache if p not in sel), key=next_use, reverse=True)
        for victim in candidates[:len(misses)]:
            cache.remove(victim)
        cache.update(misses)
        assert len(cache) == b
    return out


def naive_random(steps: list[list[int]], b: int, seed: int) -> list[int]:
    """Slot list; the same random key stream as :class:`RandomEviction` (one draw of B keys per step with misses)."""
    rng = np.random.default_rng(seed)
    slots = list(range(b))
    out = []
    for sel in steps:
        misses = [p for p in sel if p not in slots]
        out.append(len(misses))
        if not misses:
            continue
        keys = rng.integers(0, KEY_LIMIT, size=(1, b), dtype=np.int64)[0].tolist()
        free = sorted((keys[i], i) for i in range(b) if slots[i] not in sel)
        for p, (_, i) in zip(misses, free):
            slots[i] = p
    return out


# ---------------------------------------------------------------- hand cases


def test_hits_last_differs_from_plain_lru_exactly_as_specified() -> None:
    # B=3, k=2. Step 0 selects [1, 3]: 1 hits, 3 misses and evicts 0 (the oldest).
    # Plain LRU (touch in top-k order) -> recency [2, 1, 3]; kernel order -> [2, 3, 1].
    # Step 1 selects [4, 5]: plain evicts 2, 1; kernel evicts 2, 3.
    # Step 2 selects [1, 4]: plain misses 1, the kernel order hits both.
    steps = trace([1, 3], [4, 5], [1, 4])
    assert misses_of(Lru(), steps, 2, 3) == [1, 2, 1]
    assert misses_of(LruHitsLast(), steps, 2, 3) == [1, 2, 0]


def test_hits_last_keeps_hits_previous_relative_order() -> None:
    # B=4, k=2, initial recency [0, 1, 2, 3]. Step 0 selects [3, 0], both hits:
    # kernel order -> [1, 2, 0, 3] (hits keep their old relative order: 0 before 3);
    # plain LRU touches in top-k order -> [1, 2, 3, 0].
    # Step 1 selects [5, 6]: both evict 1, 2. Step 2 selects [7, 5]: one eviction,
    # the kernel evicts 0, plain LRU evicts 3. Step 3 selects [3, 5].
    steps = trace([3, 0], [5, 6], [7, 5], [3, 5])
    assert misses_of(LruHitsLast(), steps, 2, 4) == [0, 2, 1, 0]
    assert misses_of(Lru(), steps, 2, 4) == [0, 2, 1, 1]


def test_belady_evicts_farthest_next_use() -> None:
    # B=3, k=1: step 0 needs a slot; 0, 1, 2 are next used at steps 1, 2, 3 -> evict 2.
    steps = trace([3], [0], [1], [2])
    assert misses_of(Belady(), steps, 1, 3) == [1, 0, 0, 1]
    assert misses_of(LruHitsLast(), steps, 1, 3) == [1, 1, 1, 1]


def test_belady_prefers_never_used_again() -> None:
    # 1 is never used again, 0 is used at the last step: evict 1, not the older-used 0.
    steps = trace([2], [3], [0])
    assert misses_of(Belady(), steps, 1, 2) == [1, 1, 0]


def test_fifo_hits_do_not_refresh() -> None:
    steps = trace([0], [2], [0])
    assert misses_of(Fifo(), steps, 1, 2) == [0, 1, 1]
    assert misses_of(Lru(), steps, 1, 2) == [0, 1, 0]


def test_keep_only_topk_counts_changes_against_previous_selection() -> None:
    steps = trace([0, 1], [1, 5], [5, 6], [7, 8])
    assert keep_only_topk_misses(steps, 2)[0].tolist() == [0, 1, 1, 2]


def test_selected_slots_are_never_victims_even_if_oldest() -> None:
    # B=2, k=2: 0 is the oldest but selected, so 1 must go.
    steps = trace([0, 2], [0, 1])
    for policy in (Fifo(), Lru(), LruHitsLast(), Belady(), RandomEviction(3)):
        assert misses_of(policy, steps, 2, 2) == [1, 1]


def test_score_rank_evicts_worst_current_rank() -> None:
    # B=3, k=1, ranked lists of 3. Step 0 ranks [3, 2, 0]: 3 misses; residents 0, 1, 2
    # have ranks 2, none, 1 -> evict 1. Step 1 selects 1: miss.
    steps = np.array([[[3, 2, 0], [1, 0, 2]]])
    assert misses_of(ScoreRank(), steps, 1, 3) == [1, 1]
    assert misses_of(LruHitsLast(), steps, 1, 3) == [1, 0]


def test_reuse_table_uses_its_table() -> None:
    # B=3, k=1, one rank edge at 2k=2: bucket 0 = rank < 2, bucket 1 = the rest.
    # The table keeps bucket 0 (value 1) and evicts bucket 1 (value 0).
    # Step 0 ranks [3, 0, 1]: resident 0 has rank 1 (kept), 1 has rank 2 and 2 is
    # unranked (both bucket 1; recency breaks the tie: 1 is older) -> evict 1.
    # Kernel LRU evicts 0 instead. Step 1 selects 0.
    edges = (2.0,)
    table = np.zeros(ReuseTable(rank_edges_in_k=edges).shape)
    table[:, :, 0] = 1.0
    steps = np.array([[[3, 0, 1], [0, 4, 1]]])
    assert misses_of(ReuseTable(table, rank_edges_in_k=edges), steps, 1, 3) == [1, 0]
    assert misses_of(LruHitsLast(), steps, 1, 3) == [1, 1]


def test_reuse_table_with_flat_table_is_kernel_lru() -> None:
    rng = np.random.default_rng(7)
    steps = random_trace(rng, n=3, s=30, k=4, r=12, n_positions=24)
    flat = ReuseTable(np.full(ReuseTable().shape, 0.3))
    assert np.array_equal(simulate(flat, steps, 4, 8), simulate(LruHitsLast(), steps, 4, 8))


def test_lookahead_with_long_horizon_is_belady() -> None:
    rng = np.random.default_rng(8)
    steps = random_trace(rng, n=2, s=25, k=3, r=3, n_positions=20)
    assert simulate(LookaheadOracle(100), steps, 3, 6).sum() == simulate(Belady(), steps, 3, 6).sum()


def test_rejects_b_smaller_than_k() -> None:
    with pytest.raises(ValueError):
        simulate(Lru(), trace([0, 1]), 2, 1)


def test_overlap_helpers() -> None:
    assert pair_overlap(np.array([[1, 2, 3, 4]]), np.array([[4, 3, 9, 8]])).tolist() == [0.5]
    steps = trace([0, 1], [1, 5], [5, 1])
    assert step_overlap(steps, 2)[0].tolist() == [0.5, 1.0]


# ---------------------------------------------------------------- randomized


def random_trace(rng: np.random.Generator, n: int, s: int, k: int, r: int, n_positions: int) -> np.ndarray:
    """``(n, s, r)`` distinct positions per step, with some locality (a drifting hot set)."""
    out = np.empty((n, s, r), dtype=np.int64)
    for i in range(n):
        hot = rng.choice(n_positions, size=min(n_positions, 2 * r), replace=False)
        for t in range(s):
            if rng.random() < 0.3:
                hot[rng.integers(len(hot))] = rng.integers(n_positions)
            pool = np.unique(hot)
            if len(pool) < r or rng.random() < 0.3:
                pool = np.arange(n_positions)
            out[i, t] = rng.choice(pool, size=r, replace=False)
    return out


sizes = st.tuples(
    st.integers(1, 3),  # caches
    st.integers(1, 14),  # steps
    st.integers(1, 4),  # k
    st.integers(0, 5),  # extra slots
    st.integers(0, 6),  # extra positions beyond B + k
    st.integers(0, 2**31 - 1),  # seed
)


def draw(params: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
    n, s, k, extra_slots, extra_pos, seed = params
    b = k + extra_slots
    rng = np.random.default_rng(seed)
    steps = random_trace(rng, n, s, k, r=min(4 * k, b + k + extra_pos), n_positions=b + k + extra_pos)
    return steps, k, b


@settings(max_examples=examples(150), deadline=None)
@given(sizes)
def test_recency_policies_match_naive_model(params: tuple[int, ...]) -> None:
    steps, k, b = draw(params)
    for policy, order in ((Fifo(), "fifo"), (Lru(), "lru"), (LruHitsLast(), "hits_last")):
        got = simulate(policy, steps, k, b, check=True)
        for i in range(steps.shape[0]):
            assert got[i].tolist() == naive_recency(steps[i, :, :k].tolist(), b, order), policy.name


@settings(max_examples=examples(100), deadline=None)
@given(sizes)
def test_belady_matches_naive_model(params: tuple[int, ...]) -> None:
    steps, k, b = draw(params)
    got = simulate(Belady(), steps, k, b, check=True)
    for i in range(steps.shape[0]):
        assert got[i].tolist() == naive_belady(steps[i, :, :k].tolist(), b)


@settings(max_examples=examples(100), deadline=None)
@given(sizes)
def test_random_matches_naive_model(params: tuple[int, ...]) -> None:
    steps, k, b = draw(params)
    seed = params[-1] % 1000
    got = simulate(RandomEviction(seed), steps[:1], k, b, check=True)
    assert got[0].tolist() == naive_random(steps[0, :, :k].tolist(), b, seed)


def all_policies(steps: np.ndarray, k: int, b: int) -> list:
    rng = np.random.default_rng(0)
    table = rng.random(ReuseTable().shape)
    return [Fifo(), Lru(), LruHitsLast(), RandomEviction(1), ScoreRank(), ReuseTable(table),
            ReuseTable(table[:, :, :1], use_rank=False), LookaheadOracle(2)]


@settings(max_examples=examples(100), deadline=None)
@given(sizes)
def test_belady_never_loses(params: tuple[int, ...]) -> None:
    steps, k, b = draw(params)
    best = simulate(Belady(), steps, k, b).sum(axis=1)
    for policy in all_policies(steps, k, b):
        assert np.all(best <= simulate(policy, steps, k, b).sum(axis=1)), policy.name


@settings(max_examples=examples(60), deadline=None)
@given(sizes)
def test_every_policy_with_b_equal_k_is_keep_only_topk(params: tuple[int, ...]) -> None:
    steps, k, _ = draw(params)
    expected = keep_only_topk_misses(steps, k)
    for policy in all_policies(steps, k, k) + [Belady()]:
        assert np.array_equal(simulate(policy, steps, k, k), expected), policy.name


class Recorder:
    """Wraps a policy and checks the cache invariants around every step."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.inserted: list[np.ndarray] = []

    def prepare(self, ranked, k, state: CacheState) -> None:
        self.inner.prepare(ranked, k, state)
        self.before = state.slot_pos.copy()

    def eviction_keys(self, view, state):
        return self.inner.eviction_keys(view, state)

    def after_step(self, view, state: CacheState, new_slot) -> None:
        self.inner.after_step(view, state, new_slot)
        rows = np.arange(state.slot_pos.shape[0])
        for n in rows:
            residents = set(state.slot_pos[n].tolist())
            assert len(residents) == state.slot_pos.shape[1]  # exactly B distinct residents
            assert set(view.sel[n].tolist()) <= residents  # everything selected is resident
            evicted = set(self.before[n].tolist()) - residents
            assert not evicted & set(view.sel[n].tolist())  # victims were not selected
        self.inserted.append((state.slot_pos != self.before).sum(axis=1))
        self.before = state.slot_pos.copy()


@settings(max_examples=examples(60), deadline=None)
@given(sizes)
def test_invariants_and_miss_count_equals_insertions(params: tuple[int, ...]) -> None:
    steps, k, b = draw(params)
    for policy in all_policies(steps, k, b) + [Belady()]:
        rec = Recorder(policy)
        misses = simulate(rec, steps, k, b, check=True)
        assert np.array_equal(misses, np.stack(rec.inserted, axis=1)), policy.name


def test_fit_reuse_table_returns_probabilities() -> None:
    rng = np.random.default_rng(3)
    steps = random_trace(rng, n=2, s=20, k=3, r=12, n_positions=30)
    table = fit_reuse_table([steps], 3, 6, horizon=2, iterations=2)
    assert table.shape == ReuseTable().shape
    assert np.all((table >= 0) & (table <= 1))


def test_fit_with_a_vanishing_discount_is_the_one_step_fit() -> None:
    """discount ** (d - 1) with a tiny discount counts only reuse at the next step: horizon 1."""
    rng = np.random.default_rng(5)
    steps = random_trace(rng, n=3, s=24, k=3, r=12, n_positions=30)
    one_step = fit_reuse_table([steps], 3, 6, horizon=1, use_rank=False, iterations=2)
    discounted = fit_reuse_table([steps], 3, 6, horizon=1, use_rank=False, iterations=2, discount=1e-12)
    assert np.allclose(discounted, one_step, atol=1e-9)
    smooth = fit_reuse_table([steps], 3, 6, horizon=1, use_rank=False, iterations=2, discount=0.8)
    assert np.all((smooth >= 0) & (smooth <= 1)) and not np.allclose(smooth, one_step)


def test_reuse_table_refuses_a_bad_discount() -> None:
    with pytest.raises(ValueError, match="record_discount must be in"):
        ReuseTable(use_rank=False, record_horizon=1, record_discount=1.0)
    with pytest.raises(ValueError, match="needs record_horizon"):
        ReuseTable(use_rank=False, record_discount=0.5)
