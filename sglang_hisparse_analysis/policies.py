"""Replacement policies for :func:`sglang_hisparse_analysis.simulator.simulate`.

Every policy keeps an int64 key per slot; the simulator evicts the unselected
slots with the smallest eviction keys (ties: lower slot first). Recency keys are
"stamps": the initial residents ``0..B-1`` get stamps ``0..B-1`` (position 0
is the least recent); at step ``s`` the stamp base is ``B + s * stride`` with
``stride = 2k + 2``, so every stamp given at a step is more recent than every
earlier one. Stamps are non-negative and stay below ``RECENCY_SPAN`` for runs
of up to ``(2**32 - B) / (2k + 2)`` steps.

Online policies only look at the current step (``StepView``) and their own
state; :class:`Belady` reads the whole trace in ``prepare`` (offline).
"""

from __future__ import annotations

import numpy as np

from sglang_hisparse.resolver.reuse import AGE_EDGES, COUNT_EDGES, PRIORITY_LEVELS

from .simulator import KEY_LIMIT, NEVER, CacheState, StepView


#: Recency stamps are below this; composite keys put a priority above it.
RECENCY_SPAN = 1 << 32


def _stride(k: int) -> int:
    return 2 * k + 2


def _initial_stamps(state: CacheState) -> None:
    n, b = state.key.shape
    state.key[:] = np.arange(b, dtype=np.int64)


def _stamp_base(step: int, n_slots: int, stride: int) -> int:
    return n_slots + step * stride


def _rank_in_row(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Rank (0 = smallest) of each masked entry among the masked entries of its row.

    Unmasked entries get ranks after all masked ones (meaningless). Stable:
    equal values keep their column order.
    """
    big = np.where(mask, values, np.iinfo(np.int64).max)
    order = np.argsort(big, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(values.shape[1])[None, :].repeat(values.shape[0], 0), axis=1)
    return rank


class Fifo:
    """First in, first out: evict the resident inserted longest ago.

    Hits do not refresh; this step's misses are inserted in top-k order.
    Per-slot state: the insertion stamp.
    """

    name = "fifo"

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        self.stride = _stride(k)
        _initial_stamps(state)

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        return state.key

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        base = _stamp_base(view.step, state.key.shape[1], self.stride)
        r, c = np.nonzero(~view.hit)
        state.key[r, new_slot[r, c]] = base + c


class Lru:
    """Plain LRU: every selected position is touched this step.

    Tie order inside a step: positions are touched in top-k order, so the
    best-ranked selected position is the least recent of the step's group and
    the k-th ranked is the most recent. Hits and misses are not distinguished.
    """

    name = "lru"

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        self.stride = _stride(k)
        _initial_stamps(state)

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        return state.key

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        base = _stamp_base(view.step, state.key.shape[1], self.stride)
        k = new_slot.shape[1]
        state.key[np.arange(new_slot.shape[0])[:, None], new_slot] = base + np.arange(k)


class LruHitsLast:
    """LRU with this step's hits ordered after (more recent than) its misses.

    The kernel's order: after a step the recency list (oldest first) is the
    unselected residents in their previous order, then this step's misses in
    top-k order, then this step's hits in their previous relative order.
    """

    name = "lru_hits_last"

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        self.stride = _stride(k)
        _initial_stamps(state)

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        return state.key

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        base = _stamp_base(view.step, state.key.shape[1], self.stride)
        rows = np.arange(new_slot.shape[0])[:, None]
        k = new_slot.shape[1]
        old_key = state.key[rows, new_slot]  # stale (victim's) for misses; masked below
        hit_rank = _rank_in_row(old_key, view.hit)
        new_key = np.where(view.hit, base + k + hit_rank, base + np.arange(k))
        state.key[rows, new_slot] = new_key


class RandomEviction:
    """Evict uniformly random unselected residents (seeded, reproducible)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        self.rng = np.random.default_rng(self.seed)

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        return self.rng.integers(0, KEY_LIMIT, size=state.key.shape, dtype=np.int64)

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        return None


def next_use(ranked: np.ndarray, k: int, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-use step of every selection, for Belady.

    Returns ``(nxt, first)``: ``nxt[n, s, j]`` is the first step after ``s`` at
    which ``ranked[n, s, j]`` is selected again (``NEVER`` if never), and
    ``first[n, p]`` the first step at which position ``p`` is selected.
    """
    n, s_total, _ = ranked.shape
    rows = np.arange(n)[:, None]
    seen = np.full((n, n_positions), NEVER, dtype=np.int64)
    nxt = np.empty((n, s_total, k), dtype=np.int64)
    for step in range(s_total - 1, -1, -1):
        sel = ranked[:, step, :k]
        nxt[:, step, :] = seen[rows, sel]
        seen[rows, sel] = step
    return nxt, seen


class Belady:
    """Offline optimum: evict the unselected resident whose next use is farthest.

    Never-used-again residents count as infinitely far (ties: lower slot first).
    Per-slot state: ``-next_use`` of the resident.
    """

    name = "belady"

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        n_positions = state.where.shape[1]
        self.nxt, first = next_use(ranked, k, n_positions)
        rows = np.arange(state.key.shape[0])[:, None]
        state.key[:] = -first[rows, state.slot_pos]

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        return state.key

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        rows = np.arange(new_slot.shape[0])[:, None]
        state.key[rows, new_slot] = -self.nxt[:, view.step, :]


class ScoreRank:
    """Score-aware eviction (ECHO-like): evict the residents the indexer ranks worst now.

    The selector already scores every candidate position at each step; the
    trace keeps its best ``R`` positions in order. A resident's current rank is
    its index in that list (``window`` caps how many ranks are used, default:
    the whole stored list; a resident outside the window has rank ``window``). Eviction order: worst current rank
    first; among equal ranks (in practice: all residents outside the window),
    least recent first, recency kept as in :class:`LruHitsLast`.

    Per-slot state: the recency stamp. Per step: one scatter of the ranked list
    into a position->rank map and one gather of the B residents' ranks.
    """

    name = "score_rank"

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self._recency = LruHitsLast()

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        self._recency.prepare(ranked, k, state)
        n = state.key.shape[0]
        self.n_positions = state.where.shape[1]
        self.rank_map = np.full((n, self.n_positions), np.iinfo(np.int32).max, dtype=np.int64)

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        n, b = state.key.shape
        window = min(self.window or view.ranked.shape[1], view.ranked.shape[1])
        rows = np.arange(n)[:, None]
        listed = view.ranked[:, :window].astype(np.int64)
        self.rank_map[rows, listed] = np.arange(window)
        rank = np.minimum(self.rank_map[rows, state.slot_pos], window)
        self.rank_map[rows, listed] = np.iinfo(np.int32).max
        return (window - rank) * RECENCY_SPAN + state.key

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        self._recency.after_step(view, state, new_slot)


#: Upper edges (exclusive) of the rank buckets, in multiples of k: rank in the current step's list.
RANK_EDGES_IN_K = (1.5, 2.0, 3.0, 4.0)


class ReuseTable:
    """Evict the residents least likely to be selected again soon.

    Each resident is put in a cell of a small 3-D table by three per-slot
    features, all available online on the GPU:

    * age: steps since it was last selected (log2 buckets, :data:`AGE_EDGES`);
    * count: how often it was selected since it was inserted (log2 buckets,
      :data:`COUNT_EDGES`);
    * rank: its rank in the selector's current scores (buckets at
      ``rank_edges_in_k`` times ``k``; beyond the stored list = last bucket).
      Set ``use_rank=False`` for a history-only variant (one rank bucket).

    ``table[age, count, rank]`` is the probability that a resident in that cell
    is selected again within ``horizon`` steps, fitted offline on tune
    documents (:func:`fit_reuse_table`). Eviction: lowest probability first;
    ties broken by the kernel's recency order (:class:`LruHitsLast`).

    Per-slot state: recency stamp, last-selected step, saturating selection
    count. With ``record_horizon`` set, the policy also reads the future of the
    trace (like Belady, for fitting only) and accumulates, over every resident
    not selected at a step, its cell in ``self.seen`` and whether its next use
    is within ``record_horizon`` steps in ``self.reused``. With ``record_discount``
    (in (0, 1)) it accumulates ``record_discount ** (d - 1)`` instead, ``d`` the
    steps to the next use (weight 0 when never used again): a smooth version of
    the same target.
    """

    def __init__(self, table: np.ndarray | None = None, *, use_rank: bool = True,
                 rank_edges_in_k: tuple[float, ...] = RANK_EDGES_IN_K, record_horizon: int | None = None,
                 record_discount: float | None = None, name: str | None = None) -> None:
        self.rank_edges_in_k = tuple(rank_edges_in_k) if use_rank else ()
        shape = self.shape
        self.table = np.full(shape, 0.5) if table is None else np.asarray(table, dtype=np.float64)
        if self.table.shape != shape:
            raise ValueError(f"table must have shape {shape}, got {self.table.shape}")
        self.use_rank = use_rank
        if record_discount is not None and not 0.0 < record_discount < 1.0:
            raise ValueError(f"record_discount must be in (0, 1), got {record_discount}")
        if record_discount is not None and record_horizon is None:
            raise ValueError("record_discount needs record_horizon (the trace's future is read only when recording)")
        self.record_horizon = record_horizon
        self.record_discount = record_discount
        self.name = name or ("reuse_table" if use_rank else "reuse_table_norank")
        self.seen = np.zeros(shape, dtype=np.int64)
        self.reused = np.zeros(shape, dtype=np.float64)
        self._recency = LruHitsLast()

    @property
    def shape(self) -> tuple[int, int, int]:
        """Table shape ``(age buckets, count buckets, rank buckets)``."""
        return len(AGE_EDGES) + 1, len(COUNT_EDGES) + 1, len(self.rank_edges_in_k) + 1

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        self._recency.prepare(ranked, k, state)
        n, b = state.key.shape
        self.k = k
        self.last = np.full((n, b), -1, dtype=np.int64)  # initial residents: as if selected before step 0
        self.count = np.zeros((n, b), dtype=np.int64)
        self.rank_edges = np.array([int(e * k) for e in self.rank_edges_in_k], dtype=np.int64)
        # Bucket lookup tables: index = clipped feature value.
        self.age_lut = np.searchsorted(AGE_EDGES, np.arange(AGE_EDGES[-1] + 2), side="left")
        self.count_lut = np.searchsorted(COUNT_EDGES, np.arange(COUNT_EDGES[-1] + 2), side="left")
        self.rank_lut = np.searchsorted(self.rank_edges, np.arange(ranked.shape[2]), side="right")
        self.rank_map = np.zeros((n, state.where.shape[1]), dtype=np.int64)
        self.quantized = np.round(self.table * (PRIORITY_LEVELS - 1)).astype(np.int64)
        if self.record_horizon is not None:
            self.nxt, self.next_use_of = next_use(ranked, k, state.where.shape[1])

    def cells(self, view: StepView, state: CacheState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-slot ``(age, count, rank)`` bucket indices at this step, each ``(N, B)``."""
        age_b = self.age_lut[np.minimum(view.step - self.last, len(self.age_lut) - 1)]
        count_b = self.count_lut[np.minimum(self.count, len(self.count_lut) - 1)]
        if not self.use_rank:
            return age_b, count_b, np.zeros_like(age_b)
        rows = np.arange(state.key.shape[0])[:, None]
        listed = view.ranked
        n_listed = listed.shape[1]
        # rank_map holds rank bucket + 1 for listed positions, 0 elsewhere ("beyond the list").
        self.rank_map[rows, listed] = self.rank_lut[:n_listed] + 1
        rank_b = self.rank_map[rows, state.slot_pos] - 1
        self.rank_map[rows, listed] = 0
        return age_b, count_b, np.where(rank_b < 0, len(self.rank_edges), rank_b)

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        a, c, r = self.cells(view, state)
        return self.quantized[a, c, r] * RECENCY_SPAN + state.key

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        rows = np.arange(new_slot.shape[0])[:, None]
        if self.record_horizon is not None:
            # Unselected residents' last/count are unchanged since eviction saw them.
            candidate = np.ones(state.key.shape, dtype=bool)
            candidate[rows, new_slot] = False
            cells = self.cells(view, state)
            self.next_use_of[rows, view.sel] = self.nxt[:, view.step, :]
            distance = self.next_use_of[rows, state.slot_pos] - view.step
            if self.record_discount is None:
                outcome = (distance <= self.record_horizon).astype(np.float64)
            else:  # NEVER is far beyond any trace: its weight underflows to 0
                outcome = self.record_discount ** (np.minimum(distance, 1 << 16) - 1.0)
            np.add.at(self.seen, tuple(cell[candidate] for cell in cells), 1)
            np.add.at(self.reused, tuple(cell[candidate] for cell in cells), outcome[candidate])
        self._recency.after_step(view, state, new_slot)
        miss_rows, miss_cols = np.nonzero(~view.hit)
        self.count[miss_rows, new_slot[miss_rows, miss_cols]] = 0
        self.count[rows, new_slot] += 1
        self.last[rows, new_slot] = view.step


def fit_reuse_table(traces: list[np.ndarray], k: int, n_slots: int, *, horizon: int = 1, use_rank: bool = True,
                    rank_edges_in_k: tuple[float, ...] = RANK_EDGES_IN_K, iterations: int = 2,
                    prior_weight: float = 20.0, discount: float | None = None) -> np.ndarray:
    """Fit :class:`ReuseTable`'s probabilities on tune traces.

    Runs the policy (starting from an all-equal table, i.e. plain
    :class:`LruHitsLast`) over every trace, records for each unselected
    resident its cell and whether it is selected again within ``horizon``
    steps, sets each cell to the smoothed empirical rate (``prior_weight``
    pseudo-counts of the overall rate), and repeats ``iterations`` times so the
    statistics come from the policy's own cache contents. With ``discount`` the
    outcome is ``discount ** (d - 1)`` (``d``: steps to the next use) instead of
    "within ``horizon``". Returns the table.
    """
    from .simulator import simulate

    policy = ReuseTable(use_rank=use_rank, rank_edges_in_k=rank_edges_in_k)
    table = policy.table
    for _ in range(iterations):
        seen = np.zeros(table.shape, dtype=np.int64)
        reused = np.zeros(table.shape, dtype=np.float64)
        for ranked in traces:
            policy = ReuseTable(table, use_rank=use_rank, rank_edges_in_k=rank_edges_in_k, record_horizon=horizon,
                                record_discount=discount)
            simulate(policy, ranked, k, n_slots)
            seen += policy.seen
            reused += policy.reused
        overall = reused.sum() / max(seen.sum(), 1)
        table = (reused + prior_weight * overall) / (seen + prior_weight)
    return table


class LookaheadOracle:
    """Analysis aid (offline): knows the selections of the next ``horizon`` steps only.

    Residents not selected within the next ``horizon`` steps are evicted first,
    least recent first (kernel recency order, :class:`LruHitsLast`); if more
    victims are needed, those used within the horizon go farthest-next-use
    first. With a horizon covering the whole trace it makes Belady's choices.
    It bounds what an online predictor of the near future could achieve.
    """

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon
        self.name = f"lookahead_{horizon}"
        self._recency = LruHitsLast()

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None:
        self._recency.prepare(ranked, k, state)
        self.nxt, first = next_use(ranked, k, state.where.shape[1])
        rows = np.arange(state.key.shape[0])[:, None]
        self.slot_next = first[rows, state.slot_pos]

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray:
        far = self.slot_next - view.step > self.horizon
        return np.where(far, state.key, RECENCY_SPAN + (NEVER - np.minimum(self.slot_next, NEVER)))

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None:
        self._recency.after_step(view, state, new_slot)
        rows = np.arange(new_slot.shape[0])[:, None]
        self.slot_next[rows, new_slot] = self.nxt[:, view.step, :]
