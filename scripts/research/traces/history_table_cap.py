#!/usr/bin/env python3
"""How far can the kernel's history-only reuse table (9 age x 6 count cells) get below LRU?

The kernel orders evictable slots by one level per (age bucket, count bucket) cell, ties by LRU
(docs/kernel.md). Only the 54 levels are free; this script measures what choosing them well can
buy on the traces of ``docs/policies.md`` (simulator, which the kernel replays miss for miss):

1. the fit's target: tables fitted on the tune documents with "selected again within h steps"
   for several h, and with a discounted target ``g ** (d - 1)``; each evaluated on tune and
   held-out documents;
2. a cap: tables fitted on the held-out documents themselves (which no deployable table can be),
   then a greedy coordinate search of the 54 cells on the held-out misses (each cell's value
   scaled by ``--search-factors``; a change is kept when it lowers the misses).

Prints one line per variant and writes ``--out`` (JSON). Cost on the 2-core development machine:
about 20 minutes for the default settings (``--workers 2``).

Usage: python3 scripts/research/traces/history_table_cap.py --traces .traces --out docs/results/history_table_cap.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from report import HELDOUT, load  # noqa: E402
from sglang_hisparse_analysis.policies import LruHitsLast, ReuseTable, fit_reuse_table  # noqa: E402
from sglang_hisparse.resolver.reuse import CELLS, history_table, reuse_levels  # noqa: E402
from sglang_hisparse_analysis.simulator import simulate  # noqa: E402

#: Worker state (fork): the traces of the two splits and the run's k and B.
_STATE: dict[str, Any] = {}


def _total_misses(make_policy, split: str) -> int:
    """Misses of a fresh ``make_policy()`` per document, summed over a split."""
    return sum(int(simulate(make_policy(), r, _STATE["k"], _STATE["B"]).sum()) for r in _STATE[split])


def _misses(table: np.ndarray, split: str) -> int:
    """Total misses of the history-only policy with ``table`` (54 values) over a split."""
    table = np.asarray(table, dtype=np.float64).reshape(9, 6, 1)
    return _total_misses(lambda: ReuseTable(table, use_rank=False), split)


def _fit_job(job: tuple[str, str, dict]) -> tuple[str, list[float], int, int]:
    """Fit on ``split`` with ``kwargs``; return (name, table, tune misses, held-out misses)."""
    name, split, kwargs = job
    table = fit_reuse_table(_STATE[split], _STATE["k"], _STATE["B"], use_rank=False, **kwargs).reshape(CELLS)
    return name, table.tolist(), _misses(table, "tune"), _misses(table, "heldout")


def _search_job(job: tuple[np.ndarray, str]) -> int:
    table, split = job
    return _misses(table, split)


def load_split(paths: list[Path], selector: str, k: int) -> list[np.ndarray]:
    """Each document's selections (the first ``k`` ranks), int64 [layers, steps, k]."""
    return [np.ascontiguousarray(load(path, selector)[:, :, :k]) for path in paths]


def coordinate_search(pool, table: np.ndarray, split: str, factors: tuple[float, ...], log) -> tuple[np.ndarray, int]:
    """One greedy pass over the 54 cells on ``split``: per cell, the best of its value scaled by
    each factor (clipped to [0, 1]; candidates that leave the kernel's levels unchanged are
    skipped) replaces it when it lowers the misses. Returns (table, misses)."""
    best = _misses(table, split)
    for cell in range(CELLS):
        base = reuse_levels(table).numpy()
        candidates = []
        for factor in factors:
            c = table.copy()
            c[cell] = min(1.0, table[cell] * factor)
            if not np.array_equal(reuse_levels(c).numpy(), base):
                candidates.append(c)
        if not candidates:
            continue
        results = pool.map(_search_job, [(c, split) for c in candidates])
        i = int(np.argmin(results))
        if results[i] < best:
            best, table = results[i], candidates[i]
            log(f"  search: cell {cell} -> {best} misses")
    return table, best


def run(traces_dir: Path, *, selector: str, k: int, B: int, horizons: list[int], discounts: list[float],
        search_factors: tuple[float, ...], workers: int, log=print) -> dict[str, Any]:
    start = time.time()
    paths = sorted(traces_dir.glob("*.npz"))
    split = {"tune": [p for p in paths if p.stem not in HELDOUT], "heldout": [p for p in paths if p.stem in HELDOUT]}
    if not split["tune"] or not split["heldout"]:
        raise SystemExit(f"{traces_dir}: need tune and held-out traces (bash scripts/research/policy_report.sh generates them)")
    _STATE.update(k=k, B=B, **{s: load_split(ps, selector, k) for s, ps in split.items()})
    selected = {s: sum(t.size for t in _STATE[s]) for s in split}
    lru = {s: _total_misses(LruHitsLast, s) for s in split}

    def row(name: str, table, tune: int, held: int) -> dict[str, Any]:
        r = {"name": name, "table": list(table) if table is not None else None,
             "tune_miss_rate": tune / selected["tune"], "heldout_miss_rate": held / selected["heldout"],
             "tune_reduction_vs_lru": 1 - tune / lru["tune"], "heldout_reduction_vs_lru": 1 - held / lru["heldout"]}
        log(f"{name:34s} tune {100 * r['tune_miss_rate']:.2f}% (-{100 * r['tune_reduction_vs_lru']:.2f}%)  "
            f"held-out {100 * r['heldout_miss_rate']:.2f}% (-{100 * r['heldout_reduction_vs_lru']:.2f}%)")
        return r

    log(f"{selector}, k={k}, B={B}: tune {len(split['tune'])} documents, held-out {len(split['heldout'])}")
    rows = [row("LRU (kernel)", None, lru["tune"], lru["heldout"])]
    packaged = history_table().table.reshape(CELLS)
    rows.append(row("packaged table (within 4, tune)", packaged, _misses(packaged, "tune"), _misses(packaged, "heldout")))
    jobs = [(f"fit on tune, within {h}", "tune", {"horizon": h}) for h in horizons]
    jobs += [(f"fit on tune, discount {g}", "tune", {"horizon": 1, "discount": g}) for g in discounts]
    jobs += [(f"fit ON HELD-OUT, within {h}", "heldout", {"horizon": h}) for h in horizons[:3]]
    with mp.get_context("fork").Pool(workers) as pool:
        fitted = {name: (table, tune, held) for name, table, tune, held in pool.imap(_fit_job, jobs)}
        for name, _, _ in jobs:
            rows.append(row(name, *fitted[name]))
        cap_start = min((n for n, _, _ in jobs if n.startswith("fit ON HELD-OUT")), key=lambda n: fitted[n][2])
        log(f"coordinate search on the held-out documents from '{cap_start}'")
        table, held = coordinate_search(pool, np.asarray(fitted[cap_start][0]), "heldout", search_factors, log)
    rows.append(row("searched ON HELD-OUT (cap)", table.tolist(), _misses(table, "tune"), held))
    return {
        "selector": selector, "k": k, "B": B, "tune_documents": [p.stem for p in split["tune"]],
        "heldout_documents": [p.stem for p in split["heldout"]], "selected": selected, "rows": rows,
        "command": " ".join(shlex.quote(a) for a in sys.argv), "wall_seconds": round(time.time() - start, 1),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=ROOT / ".traces")
    parser.add_argument("--selector", default="attention", choices=("attention", "quest"))
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--B", type=int, default=512)
    parser.add_argument("--horizons", default="1,2,4,8,16,32", help="comma-separated; the first 3 also fit the cap")
    parser.add_argument("--discounts", default="0.5,0.8,0.9")
    parser.add_argument("--search-factors", default="0.3,0.6,1.5,3.0")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args.traces, selector=args.selector, k=args.k, B=args.B,
                 horizons=[int(h) for h in args.horizons.split(",")],
                 discounts=[float(g) for g in args.discounts.split(",") if g],
                 search_factors=tuple(float(f) for f in args.search_factors.split(",")),
                 workers=args.workers, log=lambda s: print(s, flush=True))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    print(f"wall {result['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
