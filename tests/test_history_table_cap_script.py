"""scripts/research/traces/history_table_cap.py on tiny synthetic traces: every variant is fitted and
evaluated on both splits, the coordinate search never ends above its start, and the reported
miss rates are the simulator's."""

from __future__ import annotations

import json

import numpy as np
from test_policy_replay_script import _doc

from sglang_hisparse_analysis.policies import ReuseTable
from sglang_hisparse_analysis.simulator import simulate

from research_scripts import load_script


def _load_script():
    # registered in sys.modules by load_script: the worker pool pickles its jobs by module name
    return load_script("scripts/research/traces/history_table_cap.py")


def test_cap_script_on_tiny_traces(tmp_path):
    rng = np.random.default_rng(11)
    layers, steps, k, B = 2, 30, 8, 16
    held = {}
    for doc in ("topics_00", "topics_01", "topics_06", "topics_07"):  # tune, tune, held-out, held-out
        ranked = _doc(rng, layers, steps, k, first_query=64)
        np.savez_compressed(tmp_path / f"{doc}.npz", attention=ranked)
        if doc in ("topics_06", "topics_07"):
            held[doc] = ranked.astype(np.int64)
    out = tmp_path / "cap.json"
    rc = _load_script().main(["--traces", str(tmp_path), "--k", str(k), "--B", str(B), "--horizons", "1,2,4",
                              "--discounts", "0.5", "--workers", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["tune_documents"] == ["topics_00", "topics_01"]
    assert result["heldout_documents"] == ["topics_06", "topics_07"]
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["LRU (kernel)"]["heldout_reduction_vs_lru"] == 0.0
    for h in (1, 2, 4):
        assert f"fit on tune, within {h}" in rows and f"fit ON HELD-OUT, within {h}" in rows
    assert "fit on tune, discount 0.5" in rows
    start = min(rows[f"fit ON HELD-OUT, within {h}"]["heldout_miss_rate"] for h in (1, 2, 4))
    cap = rows["searched ON HELD-OUT (cap)"]
    assert cap["heldout_miss_rate"] <= start
    table = np.asarray(cap["table"]).reshape(9, 6, 1)
    misses = sum(int(simulate(ReuseTable(table, use_rank=False), r, k, B).sum()) for r in held.values())
    assert misses / result["selected"]["heldout"] == cap["heldout_miss_rate"]
