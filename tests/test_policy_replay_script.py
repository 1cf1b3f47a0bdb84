"""scripts/research/bench_policy_replay.py on the CPU: a tiny synthetic trace file in the packed format
(scripts/research/traces/pack_gpu.py) goes through resolve_batched with both policies, and the resolver's
miss counts equal the simulator's."""

from __future__ import annotations

import json

import numpy as np

from research_scripts import load_script


def _load_script():
    return load_script("scripts/research/bench_policy_replay.py")


def _doc(rng: np.random.Generator, layers: int, steps: int, k: int, first_query: int) -> np.ndarray:
    """[layers, steps, k] selections with locality: half of the last step's positions stay, the
    rest mostly from a hot set, at times anywhere before the query."""
    ranked = np.empty((layers, steps, k), dtype=np.uint16)
    for layer in range(layers):
        hot = rng.choice(first_query, size=3 * k, replace=False)
        prev: list[int] = []
        for s in range(steps):
            chosen = [p for p in prev if rng.random() < 0.5]
            while len(chosen) < k:
                p = int(rng.choice(hot)) if rng.random() < 0.7 else int(rng.integers(first_query + s))
                if p not in chosen:
                    chosen.append(p)
            ranked[layer, s] = chosen
            prev = chosen
    return ranked


def test_cpu_replay_equals_the_simulator_for_both_policies(tmp_path):
    rng = np.random.default_rng(7)
    layers, steps, k, first_query = 3, 40, 8, 64
    arrays = {}
    for doc in ("doc_a", "doc_b"):
        arrays[f"{doc}/ranked"] = _doc(rng, layers, steps, k, first_query)
        arrays[f"{doc}/query_pos"] = np.arange(first_query, first_query + steps, dtype=np.int32)
    traces = tmp_path / "tiny.npz"
    np.savez_compressed(traces, **arrays)
    out = tmp_path / "replay.json"
    rc = _load_script().main(["--traces", str(traces), "--device", "cpu", "--B", "8,16,24", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["resolver_equals_simulator"], result["mismatches"]
    assert result["documents"] == ["doc_a", "doc_b"] and result["layers"] == layers and result["k"] == k
    assert len(result["rows"]) == 6
    for row in result["rows"]:
        assert row["identical_to_simulator"] and row["miss_rate"] == row["simulator_miss_rate"]
        assert row["selected"] == 2 * layers * steps * k and len(row["per_layer"]) == layers
    rates = {(r["policy"], r["B"]): r["miss_rate"] for r in result["rows"]}
    assert rates[("lru", 8)] == rates[("reuse", 8)]  # B = k: no choice
    assert rates[("lru", 16)] > 0 and rates[("lru", 16)] != rates[("reuse", 16)], "the trace must tell them apart"
    assert set(result["relative_reduction_reuse_vs_lru"]) == {"8", "16", "24"}
