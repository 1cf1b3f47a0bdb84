"""scripts/research/cross_layer_replay.py (issue 44, cross-layer prefetch) on tiny synthetic traces
whose counts are known by construction: without prefetch every layer is the simulator's kernel LRU;
when layer l+1 selects exactly what layer l selected at the same step, the prefetch turns every
miss of layers 1..L-1 into a hit; a cap limits the copies; unrelated layers gain nothing and pay
copies."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hisparse_analysis.policies import LruHitsLast
from sglang_hisparse_analysis.simulator import simulate

from research_scripts import load_script

cl = load_script("scripts/research/cross_layer_replay.py")


def _shared_selection(layers: int, steps: int, k: int = 8, core: int = 3, rank: int = 16) -> np.ndarray:
    """One document: every layer selects the same positions at a step: ``core`` positions every
    step plus ``k - core`` new ones (never selected before), all >= 100 (outside the initial
    buffer); ranks beyond k are junk never selected."""
    new = k - core
    ranked = np.empty((1, layers, steps, rank), dtype=np.int64)
    for s in range(steps):
        row = [100 + j for j in range(core)] + [200 + new * s + j for j in range(new)]
        row += [5000 + 100 * s + j for j in range(rank - k)]
        ranked[0, :, s] = row
    return ranked


@pytest.mark.parametrize("placement", cl.PLACEMENTS)
def test_identical_layers_lose_every_miss_after_the_first_layer(placement):
    layers, steps, k, B = 3, 10, 8, 24
    ranked = _shared_selection(layers, steps)
    base = cl.replay(ranked, k, B, ideal_depths=(k,))
    # layer alone: all k new at step 0, then k - core new per step
    assert base.misses[0, 0].tolist() == [k] + [k - 3] * (steps - 1)
    assert (base.misses[0] == base.misses[0, 0]).all()
    run = cl.replay(ranked, k, B, depth=k, cap=k, placement=placement)
    assert run.misses[0, 0].tolist() == base.misses[0, 0].tolist()  # layer 0 has no earlier layer
    assert run.misses[0, 1:].sum() == 0
    assert run.copies == int(base.misses[0, 1:].sum())  # exactly the misses, copied one layer early
    assert run.used == run.copies
    assert base.ideal_share(k) == 1.0


def test_the_cap_limits_copies_and_what_they_catch():
    layers, steps, k, B = 2, 6, 8, 24
    ranked = _shared_selection(layers, steps)
    base = cl.replay(ranked, k, B)
    run = cl.replay(ranked, k, B, depth=k, cap=2, placement="low")
    # layer 1's misses: k at step 0, k - 3 later; the prefetch copies at most 2 of them per step
    expected = [max(0, int(m) - 2) for m in base.misses[0, 1]]
    assert run.misses[0, 1].tolist() == expected
    assert run.copies == 2 * steps


def test_unrelated_layers_gain_nothing_and_pay_copies():
    layers, steps, k, B = 2, 6, 8, 24
    ranked = _shared_selection(layers, steps)
    ranked[0, 1] += 10_000  # layer 1 selects other positions (same structure, shifted)
    base = cl.replay(ranked, k, B, ideal_depths=(k,))
    run = cl.replay(ranked, k, B, depth=k, cap=k, placement="low")
    assert run.misses[0, 1].sum() >= base.misses[0, 1].sum()
    assert run.used == 0 and run.copies > 0
    assert base.ideal_share(k) == 0.0


def test_no_prefetch_equals_the_kernel_lru_simulator_on_random_traces():
    rng = np.random.default_rng(0)
    docs, layers, steps, k, B, rank = 2, 3, 12, 16, 40, 24
    ranked = np.stack([[[rng.permutation(200)[:rank] for _ in range(steps)] for _ in range(layers)]
                       for _ in range(docs)])
    base = cl.replay(ranked, k, B)
    flat = ranked.reshape(docs * layers, steps, rank)
    assert np.array_equal(base.misses.reshape(docs * layers, steps), simulate(LruHitsLast(), flat, k, B))


def test_bad_placement_names_the_allowed_values():
    with pytest.raises(ValueError, match="mru"):
        cl.replay(_shared_selection(2, 2), 8, 24, depth=8, cap=8, placement="top")


def test_a_depth_beyond_the_buffer_is_refused():
    with pytest.raises(ValueError, match="depth 32 > B=24"):
        cl.replay(_shared_selection(2, 2, rank=32), 8, 24, depth=32, cap=8)
