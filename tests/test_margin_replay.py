"""scripts/research/margin_replay.py (issue 44, prefetch by score margin) on tiny synthetic traces
whose counts are known by construction: the no-prefetch replay is the simulator's kernel LRU, a
margin that holds exactly the next step's misses pre-empts all of them, junk in the margin costs
unused copies, and a prefetch that evicts a position needed later is counted as harm."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from research_scripts import ROOT, load_script

mr = load_script("scripts/research/margin_replay.py")


def _next_misses_in_margin(steps: int, k: int = 16, core: int = 6, rank: int = 32) -> np.ndarray:
    """One cache: ``core`` positions selected every step plus ``k - core`` new ones; the new ones of
    step t+1 are exactly ranks k..k+(k-core)-1 of step t; the remaining ranks are fresh junk that is
    never selected. Every position is >= 100, so none is in the initial buffer (0..B-1, B < 100)."""
    new = k - core
    ranked = np.empty((1, steps, rank), dtype=np.int64)
    for s in range(steps):
        junk = [1000 + 100 * s + j for j in range(rank - k - new)]
        ranked[0, s] = ([100 + j for j in range(core)] + [200 + new * s + j for j in range(new)]
                        + [200 + new * (s + 1) + j for j in range(new)] + junk)
    return ranked


@pytest.mark.parametrize("placement", mr.PLACEMENTS)
def test_margin_holding_the_next_misses_preempts_them_all(placement):
    steps, k, B = 12, 16, 40
    ranked = _next_misses_in_margin(steps)
    base = mr.replay(ranked, k, B, coverage_margins=(4, 10, 16))
    assert base.misses[0].tolist() == [16] + [10] * (steps - 1)
    assert base.coverage == {4: 4 * (steps - 1), 10: 10 * (steps - 1), 16: 10 * (steps - 1)}
    for m, used, junk in ((4, 4, 0), (10, 10, 0), (16, 10, 6)):
        run = mr.replay(ranked, k, B, m, placement, reference=base)
        assert (run.preempted, run.avoided, run.caused) == (used * (steps - 1),) * 2 + (0,)
        assert run.misses[0].tolist() == [16] + [10 - used] * (steps - 1)
        assert run.prefetches == (used + junk) * (steps - 1)  # none after the last step
        assert (run.used_next, run.used_later, run.harm, run.dropped) == (used * (steps - 1), 0, 0, 0)
        row = mr.summarize(base, run, m, k)
        assert row["ideal_coverage"] == row["preempted_share"] == used / 10
        assert row["prefetch_copies_per_step"] == used + junk
        assert row["unused_next_per_step"] == row["never_used_per_step"] == junk
        assert row["misses_per_step"] == (16 + (10 - used) * (steps - 1)) / steps
        assert row["net_miss_reduction"] == pytest.approx(used * (steps - 1) / (16 + 10 * (steps - 1)))
        assert row["extra_copies_per_step"] == pytest.approx(junk * (steps - 1) / steps)
        assert row["harm_misses_per_step"] == 0


def test_placement_decides_which_slot_a_prefetch_loses_and_harm_is_counted():
    """k=2, B=4, margin 1. Step 0 selects {0,1} and prefetches 10 (evicting 2); step 1 selects
    {20,21} (two misses) and prefetches 30; step 2 selects {10,0}.
    mru: step 1's misses evict 3 and 0 (the prefetched 10 is most recent), the prefetch of 30
    evicts 1; step 2 hits 10 (prefetched two steps earlier) and misses 0, evicted by demand.
    low: step 1's misses evict 3 and the prefetched 10, the prefetch of 30 evicts 0; step 2 misses
    both, 0 being a miss the previous step's prefetch caused (harm)."""
    ranked = np.array([[[0, 1, 10], [20, 21, 30], [10, 0, 40]]])
    base = mr.replay(ranked, 2, 4)
    assert base.misses[0].tolist() == [0, 2, 1] and base.prefetches == 0
    mru = mr.replay(ranked, 2, 4, 1, "mru")
    assert mru.misses[0].tolist() == [0, 2, 1]
    assert (mru.prefetches, mru.used_next, mru.used_later, mru.harm, mru.harm_next) == (2, 0, 1, 0, 0)
    low = mr.replay(ranked, 2, 4, 1, "low")
    assert low.misses[0].tolist() == [0, 2, 2]
    assert (low.prefetches, low.used_next, low.used_later, low.harm, low.harm_next) == (2, 0, 0, 1, 1)
    low = mr.replay(ranked, 2, 4, 1, "low", reference=base)
    assert (low.avoided, low.caused) == (0, 1)  # 0 at step 2: hit without prefetch
    row = mr.summarize(base, low, 1, 2)
    assert row["caused_misses_per_step"] == pytest.approx(1 / 3)
    assert row["net_miss_reduction"] == pytest.approx(1 - 4 / 3)
    assert row["harm_next_misses_per_step"] == pytest.approx(1 / 3)


def test_prefetch_evicts_neither_the_selection_nor_the_other_candidates():
    """k=2, B=5, margin 3. Step 0 selects {0,1}; candidates 2 (resident, and the least recent
    unselected slot), 7 and 8: room is B - k - 1 = 2, so 7 and 8 go in, evicting 3 and 4, not 2.
    Step 1 selects {2,7}: two hits (7 used the step after its prefetch); its candidates 50..52 fill
    the three unselected slots (0, 1 and 8). Step 2 selects {8,2}: 8 misses, evicted by the
    previous step's prefetch (harm)."""
    ranked = np.array([[[0, 1, 2, 7, 8], [2, 7, 50, 51, 52], [8, 2, 60, 61, 62]]])
    assert mr.replay(ranked, 2, 5).misses[0].tolist() == [0, 1, 1]
    run = mr.replay(ranked, 2, 5, 3, reference=mr.replay(ranked, 2, 5))
    assert run.misses[0].tolist() == [0, 0, 1] and run.preempted == 1  # 7 at step 1
    assert (run.avoided, run.caused) == (1, 0)  # 8 missed at step 2 in both runs
    assert (run.prefetches, run.used_next, run.used_later, run.harm, run.harm_next, run.dropped) == (5, 1, 0, 1, 1, 0)


def test_buffer_without_room_prefetches_nothing():
    ranked = _next_misses_in_margin(6)
    base = mr.replay(ranked, 16, 16)
    run = mr.replay(ranked, 16, 16, 16)
    assert run.prefetches == 0 and run.dropped == 16 * 5
    assert np.array_equal(run.misses, base.misses)


def test_no_prefetch_replay_is_the_simulators_kernel_lru():
    sys.path.insert(0, str(ROOT))
    from sglang_hisparse_analysis.policies import LruHitsLast
    from sglang_hisparse_analysis.simulator import simulate

    rng = np.random.default_rng(3)
    n, steps, k, rank, positions = 6, 30, 8, 24, 80
    ranked = np.empty((n, steps, rank), dtype=np.int64)
    for c in range(n):
        hot = rng.permutation(positions)[:3 * k]
        for s in range(steps):
            weights = np.where(np.isin(np.arange(positions), hot), 8.0, 1.0)
            ranked[c, s] = rng.choice(positions, size=rank, replace=False, p=weights / weights.sum())
    for B in (8, 12, 20):
        base = mr.replay(ranked, k, B)
        assert np.array_equal(base.misses, simulate(LruHitsLast(), ranked, k, B))
        for m in (4, 16):
            for placement in mr.PLACEMENTS:
                run = mr.replay(ranked, k, B, m, placement, reference=base)
                assert base.misses.sum() - run.misses.sum() == run.avoided - run.caused
                assert run.preempted <= min(run.used_next, run.avoided)
                assert run.used_next + run.used_later <= run.prefetches
                assert run.harm_next <= run.harm
                if B == k:
                    assert run.prefetches == 0


def test_cli_writes_the_study(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    one = _next_misses_in_margin(10)[0]
    layered = np.stack([one, one + 3000])  # two layers
    np.savez_compressed(traces / "doc_a.npz", attention=layered.astype(np.uint16), quest=layered.astype(np.uint16))
    out = tmp_path / "margin.json"
    assert mr.main(["--traces", str(traces), "--k", "16", "--B", "40", "--margins", "4,10",
                    "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["documents"] == ["doc_a"] and len(result["configs"]) == 2
    for config in result["configs"]:
        assert config["no_prefetch_equals_simulator"] and config["misses_per_step_no_prefetch"] == (16 + 90) / 10
        assert {(r["placement"], r["m"]): r["preempted_share"] for r in config["rows"]} == {
            ("mru", 4): 0.4, ("mru", 10): 1.0, ("low", 4): 0.4, ("low", 10): 1.0}
    assert "margin_replay.py" in result["command"] and result["machine"]
