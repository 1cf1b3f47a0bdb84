"""Batched numpy simulator of the per-(request, layer) GPU hot buffer.

Cache model (matches the HiSparse kernel):

* One cache per (request, layer) with ``B`` slots. A batch of ``N`` independent
  caches is simulated at once; every array below has the cache index first.
* A trace is ``ranked[N, S, R]``: for each cache and decode step the positions
  the selector ranked best first. The step's selection is the prefix
  ``ranked[:, s, :k]`` (``R >= k``); positions ``k..R-1`` are the next-best
  candidates, which only score-aware policies look at. The newest position
  (the query token itself) lives in a reserved slot and is never part of a
  trace: the trace generator never lets the selector pick it.
* Initial state: slots hold positions ``0..B-1`` (what prefill staging leaves).
* At each step, the selected positions not resident are misses; every miss is
  inserted, evicting residents that are *not* selected this step (``B >= k``
  guarantees enough of them). After the step every selected position is
  resident and the cache holds exactly ``B`` positions.
* Misses are counted per cache and step; the caller decides the warm-up.

Policies are given as :class:`Policy` objects (see ``policies.py``); each one
decides which residents are evicted first (an eviction key, smallest first)
and how residents' keys change after a step. Per step the work is
``O(N * (k + B))`` numpy element operations plus one ``argpartition`` over the
``B`` slots of each cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

#: Eviction key given to slots that must not be evicted (selected this step).
PINNED_KEY = np.iinfo(np.int64).max
#: Policies' eviction keys must satisfy ``abs(key) < KEY_LIMIT``.
KEY_LIMIT = 1 << 46
#: Largest supported number of slots (keeps ``key * B + slot`` inside int64).
MAX_SLOTS = 1 << 16
#: "Never used again" for next-use distances (Belady).
NEVER = np.iinfo(np.int32).max


@dataclass
class CacheState:
    """Mutable state of ``N`` caches with ``B`` slots each.

    Invariants (checked by :meth:`check`): ``slot_pos[n]`` holds ``B`` distinct
    positions and ``where[n, slot_pos[n, b]] == b``; every other entry of
    ``where[n]`` is ``-1``. ``key`` is the policy's per-slot state (eviction
    priority, smaller is evicted first); ``aux`` is a second per-slot integer
    some policies use.
    """

    slot_pos: np.ndarray  # (N, B) int64
    where: np.ndarray  # (N, P) int64, slot of a position or -1
    key: np.ndarray  # (N, B) int64
    aux: np.ndarray  # (N, B) int64

    @classmethod
    def initial(cls, n_caches: int, n_slots: int, n_positions: int) -> "CacheState":
        """Caches holding positions ``0..B-1`` in slots ``0..B-1``; key and aux zero."""
        if n_positions < n_slots:
            raise ValueError(f"need at least B={n_slots} positions, got {n_positions}")
        slot_pos = np.tile(np.arange(n_slots, dtype=np.int64), (n_caches, 1))
        where = np.full((n_caches, n_positions), -1, dtype=np.int64)
        where[:, :n_slots] = np.arange(n_slots)
        zeros = np.zeros((n_caches, n_slots), dtype=np.int64)
        return cls(slot_pos=slot_pos, where=where, key=zeros, aux=zeros.copy())

    def check(self) -> None:
        """Raise AssertionError if the slot/position maps are inconsistent."""
        n, b = self.slot_pos.shape
        rows = np.arange(n)[:, None]
        assert np.all(self.where[rows, self.slot_pos] == np.arange(b)), "where/slot_pos mismatch"
        assert np.all((self.where >= 0).sum(axis=1) == b), "resident count != B"


@dataclass(frozen=True)
class StepView:
    """What a policy sees at one step (read-only by convention).

    ``sel`` is ``(N, k)`` selected positions best first, ``ranked`` is
    ``(N, R)`` the full ranked list of this step, ``sel_slot`` the slot each
    selected position occupies *before* the step (``-1`` for misses), ``hit``
    the mask ``sel_slot >= 0`` and ``step`` the step index.
    """

    step: int
    sel: np.ndarray
    ranked: np.ndarray
    sel_slot: np.ndarray
    hit: np.ndarray


class Policy(Protocol):
    """A replacement policy for :func:`simulate`.

    ``prepare`` is called once with the whole trace (offline policies such as
    Belady use it; online policies must ignore future steps) and sets the
    initial keys of ``state``. ``eviction_keys`` returns an ``(N, B)`` int64
    array with ``abs(key) < KEY_LIMIT``, smaller evicted first (ties: lower
    slot first); the simulator never evicts slots selected this step. ``after_step`` updates
    ``state.key``/``state.aux`` once misses are inserted; ``new_slot`` is the
    ``(N, k)`` slot of every selected position after the step.
    """

    name: str

    def prepare(self, ranked: np.ndarray, k: int, state: CacheState) -> None: ...

    def eviction_keys(self, view: StepView, state: CacheState) -> np.ndarray: ...

    def after_step(self, view: StepView, state: CacheState, new_slot: np.ndarray) -> None: ...


def _victim_slots(ekey: np.ndarray, pinned: np.ndarray, n_miss: np.ndarray) -> np.ndarray:
    """Slots to evict, ``(N, M)`` with ``M = max(n_miss)``, smallest key first.

    ``ekey`` holds int64 keys with ``|key| < KEY_LIMIT``; ``pinned`` marks the
    slots that must not be evicted. Ties are broken by slot index (lower first),
    so the choice is deterministic. Row ``n`` only uses its first ``n_miss[n]``
    entries, all of which are unpinned (``B >= k`` guarantees it).
    """
    n, b = ekey.shape
    m = int(n_miss.max())
    if m == 0:
        return np.zeros((n, 0), dtype=np.int64)
    composite = ekey * b + np.arange(b, dtype=np.int64)
    composite[pinned] = PINNED_KEY
    if m < b:
        part = np.argpartition(composite, m - 1, axis=1)[:, :m]
    else:
        part = np.broadcast_to(np.arange(b, dtype=np.int64), (n, b))
    order = np.argsort(np.take_along_axis(composite, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1)


def simulate(policy: Policy, ranked: np.ndarray, k: int, n_slots: int, *, check: bool = False) -> np.ndarray:
    """Replay ``ranked`` through ``N`` caches of ``n_slots`` slots under ``policy``.

    Args:
        ranked: ``(N, S, R)`` integer positions, best first, ``R >= k``; the
            first ``k`` of each step must be distinct.
        k: selection size per step.
        n_slots: ``B``, slots per cache; must satisfy ``B >= k``.
        check: verify the cache invariants after every step (slow; tests).

    Returns:
        ``(N, S)`` int64 number of misses per cache and step (the first step
        included; the initial state is positions ``0..B-1``).

    Side effects: none on the inputs; ``policy`` may keep per-run state.
    """
    ranked = _checked_trace(ranked, k, n_slots)
    n, s_total, _ = ranked.shape
    n_positions = max(int(ranked.max()) + 1, n_slots)
    state = CacheState.initial(n, n_slots, n_positions)
    policy.prepare(ranked, k, state)
    rows = np.arange(n)[:, None]
    misses = np.zeros((n, s_total), dtype=np.int64)
    for step in range(s_total):
        step_ranked = ranked[:, step, :]
        sel = step_ranked[:, :k].astype(np.int64)
        sel_slot = state.where[rows, sel]
        hit = sel_slot >= 0
        n_miss = (~hit).sum(axis=1)
        misses[:, step] = n_miss
        view = StepView(step=step, sel=sel, ranked=step_ranked, sel_slot=sel_slot, hit=hit)
        if n_miss.any():
            _insert_misses(policy, view, state, n_miss, check)
        new_slot = state.where[rows, sel]
        policy.after_step(view, state, new_slot)
        if check:
            state.check()
            assert np.all(new_slot >= 0), "a selected position is not resident"
    return misses


def _checked_trace(ranked: np.ndarray, k: int, n_slots: int) -> np.ndarray:
    """``ranked`` as an array, after checking the shapes :func:`simulate` supports (raises
    ValueError otherwise). No side effects."""
    ranked = np.asarray(ranked)
    if ranked.ndim != 3:
        raise ValueError("ranked must be (N, S, R)")
    r = ranked.shape[2]
    if r < k:
        raise ValueError(f"trace holds {r} ranks per step, need k={k}")
    if n_slots < k:
        raise ValueError(f"B={n_slots} must be >= k={k}")
    if n_slots > MAX_SLOTS:
        raise ValueError(f"B={n_slots} exceeds {MAX_SLOTS}")
    return ranked


def _insert_misses(policy: Policy, view: StepView, state: CacheState, n_miss: np.ndarray, check: bool) -> None:
    """One step's eviction and insertion: the policy's eviction keys choose, per cache, a victim
    slot for every miss (never a slot hit this step; the j-th miss in selection order takes the
    j-th victim), and each miss takes its victim's slot. Updates ``state.slot_pos`` and
    ``state.where`` in place; with ``check``, asserts the choice and the keys are valid."""
    sel, sel_slot, hit = view.sel, view.sel_slot, view.hit
    miss = ~hit
    ekey = np.asarray(policy.eviction_keys(view, state), dtype=np.int64)
    pinned = np.zeros(ekey.shape, dtype=bool)
    hit_rows, hit_cols = np.nonzero(hit)
    pinned[hit_rows, sel_slot[hit_rows, hit_cols]] = True
    victims = _victim_slots(ekey, pinned, n_miss)
    miss_rank = np.cumsum(miss, axis=1) - 1
    m_rows, m_cols = np.nonzero(miss)
    v = victims[m_rows, miss_rank[m_rows, m_cols]]
    if check:
        assert not pinned[m_rows, v].any(), "evicted a selected slot"
        assert np.all(np.abs(ekey) < KEY_LIMIT), "policy key out of range"
    old_pos = state.slot_pos[m_rows, v]
    state.where[m_rows, old_pos] = -1
    new_pos = sel[m_rows, m_cols]
    state.slot_pos[m_rows, v] = new_pos
    state.where[m_rows, new_pos] = v


def keep_only_topk_misses(ranked: np.ndarray, k: int) -> np.ndarray:
    """Misses when the cache holds only the previous step's selection.

    The state before step 0 is positions ``0..k-1`` (the first ``k`` staged
    positions). Returns ``(N, S)`` int64 misses. Equivalent to any policy of
    :func:`simulate` with ``B = k``.
    """
    ranked = np.asarray(ranked)
    n, s_total, _ = ranked.shape
    n_positions = max(int(ranked.max()) + 1, k)
    rows = np.arange(n)[:, None]
    mark = np.zeros((n, n_positions), dtype=bool)
    prev = np.tile(np.arange(k, dtype=np.int64), (n, 1))
    misses = np.zeros((n, s_total), dtype=np.int64)
    for step in range(s_total):
        sel = ranked[:, step, :k]
        mark[rows, prev] = True
        misses[:, step] = k - mark[rows, sel].sum(axis=1)
        mark[rows, prev] = False
        prev = sel
    return misses


def step_overlap(ranked: np.ndarray, k: int) -> np.ndarray:
    """Fraction of step ``s``'s selection also selected at step ``s-1``.

    ``ranked`` is ``(N, S, R)``; returns ``(N, S-1)`` float64 in ``[0, 1]``.
    """
    return 1.0 - keep_only_topk_misses(ranked, k)[:, 1:] / k


def pair_overlap(sel_a: np.ndarray, sel_b: np.ndarray) -> np.ndarray:
    """Per-row overlap ``|a ∩ b| / k`` of two ``(M, k)`` selections of distinct positions."""
    a = np.sort(np.asarray(sel_a), axis=1)
    b = np.sort(np.asarray(sel_b), axis=1)
    k = a.shape[1]
    both = np.concatenate([a, b], axis=1)
    both.sort(axis=1)
    dup = (both[:, 1:] == both[:, :-1]).sum(axis=1)
    return dup / k
