#!/usr/bin/env python3
"""Prefetch by score margin (issue 44, first lever): a replay of the recorded selection traces.

What it measures. At decode step ``t`` the selector's top-k (ranks ``0..k-1``) is resolved into
the B-slot hot buffer exactly as the kernel's LRU does (``LruHitsLast`` in
``sglang_hisparse_analysis/policies.py``: misses evict the least recent slots not selected this
step; afterwards the recency order is unselected residents, then this step's misses in top-k
order, then its hits in their old order). Then, off the critical path, the positions ranked just
below the top-k, ranks ``k..k+m-1`` of the same step, are *prefetched*: each one not resident is
copied in, best rank first, evicting the least recent slot that is neither selected at ``t``
(the current step's top-k) nor holding one of the other margin candidates. At most
``B - k - (resident candidates)`` copies fit; the rest of the margin is dropped. Resident
candidates are left untouched (no recency refresh: only selections touch, as in the kernel).
A prefetched position gets a recency stamp according to ``placement``:

* ``mru``: most recent, after the step's hits (an insertion counts as a use);
* ``low``: below every position selected at ``t``, above every older unselected resident.

No prefetch is issued after the last step (there is no ``t+1`` to use it).

Per configuration (selector, k, B) and margin ``m`` it reports, per (request, layer) cache and
decode step: demand misses without prefetch (must equal ``simulate(LruHitsLast())``; checked),
demand misses with prefetch, the *ideal coverage* (share of the no-prefetch run's misses at
``t+1`` that lie in ranks ``k..k+m-1`` of step ``t``: what a free prefetch would catch), the
share *pre-empted* (hits at ``t+1`` on slots prefetched at ``t`` where the no-prefetch run
missed the same rank at ``t+1``, over the no-prefetch misses of steps ``1..S-1``; at most the ideal
coverage), all hits at ``t+1`` on prefetched slots, the net miss reduction, prefetch copies per step, those not used at ``t+1``
(and those never used before eviction), and *harm* two ways: the selected ranks that the
no-prefetch run hit and this run misses (*caused* misses; the net reduction is exactly avoided
minus caused, step by step against the no-prefetch run), and demand misses on positions whose
last eviction was done by a prefetch (*evicted by a prefetch, later missed*).
For comparison it also runs ``simulate(ScoreRank())`` (the indexer's rank used for eviction,
no extra copies) and scales copies to DeepSeek-V3.2 bytes per request and step (counts times
``2048 / k``, 656-byte rows, 61 layers).

Traces: ``.traces/<doc>.npz`` from ``scripts/research/traces/generate.py`` (arrays ``attention``
and ``quest``, ``(layers, steps, rank)`` uint16, best first). Pure numpy, CPU only.

Usage:
    python3 scripts/research/margin_replay.py --traces .traces \\
        --docs topics_06,pydoc_socket --k 256 --B 512,1024 --margins 64,128,256,512 \\
        --out docs/results/margin_replay.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PLACEMENTS = ("mru", "low")
#: DeepSeek-V3.2's KV row (bytes per position per layer) and layer count, for the PCIe estimate.
DSV32_ROW_BYTES = 656
DSV32_LAYERS = 61
DSV32_K = 2048


@dataclass
class Counts:
    """Totals of one replay over ``n`` caches and ``steps`` decode steps."""

    n: int
    steps: int
    misses: np.ndarray  # (n, steps) demand misses
    prefetches: int = 0  # prefetch copies issued
    used_next: int = 0  # prefetched at t, selected at t+1
    preempted: int = 0  # ... of which the reference (no-prefetch) run missed at t+1
    avoided: int = 0  # selected ranks the reference missed and this run hit (any cause)
    caused: int = 0  # selected ranks the reference hit and this run missed
    used_later: int = 0  # prefetched at t, first selected at t+2 or later while still resident
    harm: int = 0  # demand misses on positions last evicted by a prefetch
    harm_next: int = 0  # ... of which the evicting prefetch was at the previous step
    dropped: int = 0  # non-resident margin candidates that did not fit (B - k too small)
    coverage: dict[int, int] = field(default_factory=dict)  # m -> misses at t+1 in ranks k..k+m-1 of t
    miss_mask: Optional[np.ndarray] = None  # (n, steps, k) bool: which selected ranks missed


def _victims(stamp: np.ndarray, pinned: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``(N, max(count))`` slots with the smallest stamps among unpinned slots, least recent first.

    Row ``n`` uses only its first ``count[n]`` entries; the caller guarantees that many unpinned
    slots exist. Stamps are unique per row, so the choice is deterministic."""
    n, b = stamp.shape
    most = int(count.max()) if count.size else 0
    if most == 0:
        return np.zeros((n, 0), dtype=np.int64)
    key = np.where(pinned, np.iinfo(np.int64).max, stamp)
    part = np.argpartition(key, most - 1, axis=1)[:, :most] if most < b else np.tile(np.arange(b), (n, 1))
    order = np.argsort(np.take_along_axis(key, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1)


def _rank_among(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Rank (0 = smallest) of each masked entry among the masked entries of its row (others: junk)."""
    big = np.where(mask, values, np.iinfo(np.int64).max)
    order = np.argsort(big, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(values.shape[1]), values.shape).copy(), axis=1)
    return rank


def replay(ranked: np.ndarray, k: int, B: int, margin: int = 0, placement: str = "mru",
           coverage_margins: Sequence[int] = (), reference: Optional[Counts] = None) -> Counts:
    """Replay ``ranked`` ``(N, S, R)`` (best first, the selection is the first ``k``) through ``N``
    LRU hot buffers of ``B`` slots, prefetching ranks ``k..k+margin-1`` after every step but the last.

    Initial state as the simulator's: slot ``s`` holds position ``s``, recency ``0..B-1``.
    ``coverage_margins``: for each ``m``, count the demand misses at step ``t+1`` that are ranked
    ``k..k+m-1`` at step ``t`` (meaningful for the no-prefetch run). ``reference``: the
    no-prefetch run of the same trace; a prefetch hit counts as pre-empted only where that run
    missed the same selected rank at the same step. Returns :class:`Counts` (with ``miss_mask``).
    """
    ranked = np.asarray(ranked).astype(np.int64)
    n, steps, r = ranked.shape
    if not k <= B:
        raise ValueError(f"need k <= B, got k={k}, B={B}")
    if k + max([margin, *coverage_margins]) > r:
        raise ValueError(f"trace holds {r} ranks, need k + m = {k + max([margin, *coverage_margins])}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}")
    n_pos = max(int(ranked.max()) + 1, B)
    rows = np.arange(n)[:, None]
    slot_pos = np.tile(np.arange(B, dtype=np.int64), (n, 1))
    where = np.full((n, n_pos), -1, dtype=np.int64)
    where[:, :B] = np.arange(B)
    stamp = np.tile(np.arange(B, dtype=np.int64), (n, 1))
    pf_step = np.full((n, B), -1, dtype=np.int64)  # step of the prefetch that filled the slot, -1: demand
    pf_evicted = np.full((n, n_pos), -1, dtype=np.int64)  # step of the prefetch that last evicted it
    # Per step stamps: [base, base+R) low prefetches, then k misses, k hits, R mru prefetches.
    stride = 2 * k + 2 * r
    counts = Counts(n=n, steps=steps, misses=np.zeros((n, steps), dtype=np.int64),
                    coverage={m: 0 for m in coverage_margins}, miss_mask=np.zeros((n, steps, k), dtype=bool))
    prev_rank: Optional[np.ndarray] = None
    for t in range(steps):
        base = B + t * stride
        sel = ranked[:, t, :k]
        sel_slot = where[rows, sel]
        hit = sel_slot >= 0
        miss = ~hit
        n_miss = miss.sum(axis=1)
        counts.misses[:, t] = n_miss
        counts.miss_mask[:, t] = miss
        if reference is not None and reference.miss_mask is not None:
            counts.avoided += int((hit & reference.miss_mask[:, t]).sum())
            counts.caused += int((miss & ~reference.miss_mask[:, t]).sum())
        # Accounting on this step's selection before it changes the state.
        mr, mc = np.nonzero(miss)
        miss_pos = sel[mr, mc]
        ev = pf_evicted[mr, miss_pos]
        counts.harm += int((ev >= 0).sum())
        counts.harm_next += int(((ev >= 0) & (ev == t - 1)).sum())
        hr, hc = np.nonzero(hit)
        hs = sel_slot[hr, hc]
        fresh = pf_step[hr, hs] >= 0
        just = fresh & (pf_step[hr, hs] == t - 1)
        counts.used_next += int(just.sum())
        if reference is not None and reference.miss_mask is not None:
            counts.preempted += int((just & reference.miss_mask[hr, t, hc]).sum())
        counts.used_later += int((pf_step[hr, hs][fresh] < t - 1).sum())
        pf_step[hr, hs] = -1  # used: from now on an ordinary resident
        if prev_rank is not None and coverage_margins:
            rk = prev_rank[mr, miss_pos]
            for m in coverage_margins:
                counts.coverage[m] += int(((rk >= k) & (rk < k + m)).sum())
        # Demand: every miss evicts the least recent slot not hit this step.
        old_stamp = stamp.copy()
        if n_miss.any():
            pinned = np.zeros((n, B), dtype=bool)
            pinned[hr, hs] = True
            victims = _victims(stamp, pinned, n_miss)
            v = victims[mr, np.cumsum(miss, axis=1)[mr, mc] - 1]
            where[mr, slot_pos[mr, v]] = -1
            pf_evicted[mr, slot_pos[mr, v]] = -1  # evicted by demand: not a prefetch's doing
            slot_pos[mr, v] = miss_pos
            where[mr, miss_pos] = v
            pf_step[mr, v] = -1
            pf_evicted[mr, miss_pos] = -1
        new_slot = where[rows, sel]
        hit_rank = _rank_among(old_stamp[rows, new_slot], hit)
        stamp[rows, new_slot] = np.where(hit, base + r + k + hit_rank, base + r + np.arange(k))
        # Prefetch of ranks k..k+margin-1, best first, into LRU slots outside the selection.
        if margin and t < steps - 1:
            cand = ranked[:, t, k:k + margin]
            cand_slot = where[rows, cand]
            resident = cand_slot >= 0
            room = B - k - resident.sum(axis=1)
            todo = (~resident) & (np.cumsum(~resident, axis=1) <= room[:, None])
            counts.dropped += int((~resident).sum() - todo.sum())
            n_pf = todo.sum(axis=1)
            if n_pf.any():
                pinned = np.zeros((n, B), dtype=bool)
                pinned[rows, new_slot] = True
                rr, rc = np.nonzero(resident)
                pinned[rr, cand_slot[rr, rc]] = True
                victims = _victims(stamp, pinned, n_pf)
                pr, pc = np.nonzero(todo)
                v = victims[pr, np.cumsum(todo, axis=1)[pr, pc] - 1]
                pos = cand[pr, pc]
                old = slot_pos[pr, v]
                where[pr, old] = -1
                pf_evicted[pr, old] = t
                slot_pos[pr, v] = pos
                where[pr, pos] = v
                pf_evicted[pr, pos] = -1
                pf_step[pr, v] = t
                stamp[pr, v] = (base + pc) if placement == "low" else (base + r + 2 * k + pc)
                counts.prefetches += len(pr)
        if coverage_margins:
            prev_rank = np.full((n, n_pos), np.iinfo(np.int64).max, dtype=np.int64)
            prev_rank[rows, ranked[:, t, :]] = np.arange(r)
    return counts


def load_traces(folder: Path, docs: Sequence[str], selector: str) -> np.ndarray:
    """``(docs * layers, steps, rank)`` int64 of ``selector`` from ``folder/<doc>.npz``, document-major."""
    arrays = []
    for doc in docs:
        with np.load(folder / f"{doc}.npz") as data:
            arrays.append(data[selector].astype(np.int64))
    return np.concatenate(arrays)


def dsv32_bytes(k: int) -> float:
    """Bytes per (request, decode step) of one copy per (layer, step) at trace scale ``k``, scaled to
    DeepSeek-V3.2: counts times ``2048 / k`` (same m/k and B/k), 656-byte rows, 61 layers."""
    return DSV32_K / k * DSV32_ROW_BYTES * DSV32_LAYERS


def trace_meta(folder: Path, docs: Sequence[str]) -> dict[str, Any]:
    """Each document's generation record (``meta`` of its ``.npz``: model, settings, seconds)."""
    out: dict[str, Any] = {}
    for doc in docs:
        with np.load(folder / f"{doc}.npz") as data:
            out[doc] = json.loads(str(data["meta"])) if "meta" in data.files else {}
    return out


def summarize(base: Counts, run: Counts, margin: int, k: int) -> dict[str, Any]:
    """Per (request, layer) step figures of one prefetch run against the no-prefetch run."""
    cells = base.n * base.steps
    pf_cells = base.n * (base.steps - 1)  # steps that issue prefetches
    base_next = int(base.misses[:, 1:].sum())  # misses a prefetch at t could have pre-empted
    base_total, run_total = int(base.misses.sum()), int(run.misses.sum())
    unused_next = run.prefetches - run.used_next
    extra = run.prefetches / pf_cells
    return {
        "m": margin,
        "misses_per_step": run_total / cells,
        "ideal_coverage": base.coverage.get(margin, 0) / base_next if base_next else 0.0,
        "preempted_share": run.preempted / base_next if base_next else 0.0,
        "prefetch_hits_next_per_step": run.used_next / pf_cells,
        "net_miss_reduction": 1 - run_total / base_total if base_total else 0.0,
        "prefetch_copies_per_step": extra,
        "unused_next_per_step": unused_next / pf_cells,
        "never_used_per_step": (run.prefetches - run.used_next - run.used_later) / pf_cells,
        "used_next_per_step": run.used_next / pf_cells,
        "used_later_per_step": run.used_later / pf_cells,
        "dropped_per_step": run.dropped / pf_cells,
        "avoided_misses_per_step": run.avoided / cells,
        "caused_misses_per_step": run.caused / cells,
        "harm_misses_per_step": run.harm / cells,
        "harm_next_misses_per_step": run.harm_next / cells,
        "total_copies_per_step": (run_total + run.prefetches) / cells,
        "extra_copies_per_step": (run_total + run.prefetches - base_total) / cells,
        "dsv32_prefetch_bytes_per_step": extra * dsv32_bytes(k),
        "dsv32_extra_bytes_per_step": (run_total + run.prefetches - base_total) / cells * dsv32_bytes(k),
    }


def study(traces: Path, docs: Sequence[str], selectors: Sequence[str], k: int, sizes: Sequence[int],
          margins: Sequence[int], placements: Sequence[str] = PLACEMENTS, check: bool = True,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole study: every (selector, B) configuration, no prefetch and every (margin, placement)."""
    configs = []
    for selector in selectors:
        ranked = load_traces(traces, docs, selector)
        n, steps, r = ranked.shape
        for B in sizes:
            t0 = time.time()
            base = replay(ranked, k, B, coverage_margins=margins)
            score_rank: Optional[float] = None
            if check:
                from sglang_hisparse_analysis.policies import LruHitsLast, ScoreRank
                from sglang_hisparse_analysis.simulator import simulate

                if not np.array_equal(base.misses, simulate(LruHitsLast(), ranked, k, B)):
                    raise SystemExit(f"{selector} B={B}: the no-prefetch replay differs from simulate(LruHitsLast())")
                # Reference without extra copies: the indexer's rank used for eviction instead.
                score_rank = float(simulate(ScoreRank(), ranked, k, B).sum()) / (n * steps)
            rows = []
            for placement in placements:
                for m in margins:
                    row = summarize(base, replay(ranked, k, B, m, placement, reference=base), m, k)
                    row["placement"] = placement
                    rows.append(row)
                    log(f"{selector} B={B} {placement:3s} m={m:3d}: misses/step {row['misses_per_step']:.2f} "
                        f"(no prefetch {base.misses.sum() / (n * steps):.2f}), ideal {100 * row['ideal_coverage']:.1f}%, "
                        f"pre-empted {100 * row['preempted_share']:.1f}%, net {100 * row['net_miss_reduction']:.1f}%, "
                        f"copies/step {row['prefetch_copies_per_step']:.1f} (unused at t+1 "
                        f"{row['unused_next_per_step']:.1f}), caused/step {row['caused_misses_per_step']:.2f}, "
                        f"pf-evicted later missed/step {row['harm_misses_per_step']:.2f}")
            configs.append({
                "selector": selector, "k": k, "B": B, "caches": n, "steps": steps, "rank_stored": r,
                "misses_per_step_no_prefetch": float(base.misses.sum()) / (n * steps),
                "miss_rate_no_prefetch": float(base.misses.sum()) / (n * steps * k),
                "no_prefetch_equals_simulator": check,
                "dsv32_demand_bytes_per_step_no_prefetch": float(base.misses.sum()) / (n * steps) * dsv32_bytes(k),
                "score_rank_eviction_misses_per_step": score_rank,
                "rows": rows, "seconds": round(time.time() - t0, 1),
            })
    return {"traces": str(traces), "documents": list(docs), "trace_meta": trace_meta(traces, docs), "configs": configs}


def machine() -> str:
    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}"


def trace_replay_parser(description: str, placements: Sequence[str] = PLACEMENTS) -> argparse.ArgumentParser:
    """The options every trace replay takes: ``--traces``, ``--docs``, ``--selectors``, ``--k``,
    ``--B``, ``--placements`` (default: all of ``placements``), ``--no-check``, ``--out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=ROOT / ".traces")
    parser.add_argument("--docs", default=None, help="comma-separated documents (default: every .npz in --traces)")
    parser.add_argument("--selectors", default="attention,quest")
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--B", default="512,1024", help="comma-separated buffer sizes")
    parser.add_argument("--placements", default=",".join(placements))
    parser.add_argument("--no-check", action="store_true", help="skip the check against simulate(LruHitsLast())")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    return parser


def trace_docs(args: argparse.Namespace) -> list[str]:
    """``--docs``, or every trace in ``--traces``."""
    return args.docs.split(",") if args.docs else sorted(p.stem for p in args.traces.glob("*.npz") if ".tmp" not in p.name)


def main(argv: Optional[list[str]] = None) -> int:
    parser = trace_replay_parser(__doc__)
    parser.add_argument("--margins", default="64,128,256,512")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    docs = trace_docs(args)
    start = time.time()
    result = study(args.traces, docs, args.selectors.split(","), args.k, [int(b) for b in args.B.split(",")],
                   [int(m) for m in args.margins.split(",")], args.placements.split(","), check=not args.no_check,
                   log=lambda s: print(s, flush=True))
    record_run(result, __file__, argv, start, args.out)
    return 0


def record_run(result: dict[str, Any], script_file: str, argv: Optional[list[str]], start: float,
               out: Optional[Path]) -> None:
    """Add the command line (``argv``, or this process's), the machine and the wall time since
    ``start`` to ``result``; write it as JSON to ``out`` when given (creating its folder)."""
    script = os.path.relpath(Path(script_file).resolve(), Path.cwd())
    given = argv if argv is not None else sys.argv[1:]
    result.update({"command": " ".join(shlex.quote(a) for a in ["python3", script, *given]),
                   "machine": machine(), "wall_seconds": round(time.time() - start, 1)})
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
