#!/usr/bin/env python3
"""Cross-layer prefetch (issue 44): a replay of the recorded selection traces.

The question. Without IndexShare a layer's misses are known only once its own indexer has run, so
they are copied on the critical path. But layer ``l``'s selection at step ``t`` is known a whole
layer before layer ``l+1`` selects at the same step (its attention, MLP and layer ``l+1``'s
projections run in between). If layer ``l+1`` tends to select what layer ``l`` selected, copying
layer ``l``'s selection into layer ``l+1``'s hot buffer off the critical path turns some of layer
``l+1``'s misses into hits, without changing what attention reads (the demand resolve still
copies whatever is missing). This script measures how many, and at what copy volume, before any
of it is built.

Model. One LRU hot buffer of ``B`` slots per (document, layer), the kernel's order
(``LruHitsLast`` in ``sglang_hisparse_analysis/policies.py``: misses evict the least recent slots
not selected this step; afterwards the order is unselected residents, this step's misses in top-k
order, then its hits in their old order). Steps in order; within a step, layers in order: layer
``l`` resolves its selection (demand misses counted), then, for ``l + 1 < L``, the prefetch
copies the first ``depth`` ranks of layer ``l``'s selection that layer ``l+1``'s buffer does not
hold, best rank first, at most ``cap`` per (document, layer, step), each evicting the least
recent slot that holds no other candidate. A prefetched position's recency (``placement``):

* ``mru``: most recent (what running the resolve kernel itself on layer ``l+1``'s buffer with layer
  ``l``'s selection would do);
* ``low``: least recent, so that the next demand misses evict unused prefetches first.

Reported per configuration (selector, k, B, depth, cap, placement), over every (document, layer,
step) resolve: demand misses per resolve with and without prefetch (the no-prefetch run must
equal ``simulate(LruHitsLast())``: checked), the share of the no-prefetch run's misses in layers
``1..L-1`` that the prefetch could have caught (they lie in layer ``l``'s top ``depth`` at the
same step: *ideal*), the net demand-miss reduction over all layers, prefetch copies per resolve
and how many of them were selected before being evicted (*used*). Copies are scaled to
DeepSeek-V3.2 as ``margin_replay.py`` does.

Traces: ``.traces/<doc>.npz`` from ``scripts/research/traces/generate.py`` (``(layers, steps,
rank)`` uint16, best first). Pure numpy, CPU only.

Usage:
    python3 scripts/research/cross_layer_replay.py --traces .traces \\
        --docs topics_06,pydoc_socket --k 256 --B 512,1024 --depths 64,256 --caps 64,256 \\
        --out docs/results/cross_layer_replay.json
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import margin_replay  # noqa: E402
# the same LRU victim choice, DSV3.2 scaling and run record as the margin study
from margin_replay import _victims, dsv32_bytes, record_run  # noqa: E402

PLACEMENTS = ("mru", "low")


class LruBank:
    """``n`` LRU hot buffers of ``B`` slots, initially holding positions ``0..B-1`` (recency in
    position order), as the simulator's. Owns its slot tables and recency stamps; stamps are unique
    per row (a rising clock for demand and ``mru`` prefetches, a falling one for ``low``)."""

    def __init__(self, n: int, B: int, n_pos: int):
        self.n, self.B = n, B
        self.rows = np.arange(n)[:, None]
        self.slot_pos = np.tile(np.arange(B, dtype=np.int64), (n, 1))
        self.where = np.full((n, n_pos), -1, dtype=np.int64)
        self.where[:, :B] = np.arange(B)
        self.stamp = np.tile(np.arange(B, dtype=np.int64), (n, 1))
        self.prefetched = np.zeros((n, B), dtype=bool)
        """Slots filled by a prefetch and not selected since."""
        self._up, self._down = B, -1

    def resolve(self, sel: np.ndarray) -> tuple[np.ndarray, int]:
        """Resolve ``sel`` ``(n, k)`` (distinct per row, best first). Returns the misses per row and
        how many selections hit a prefetched slot. Side effects: the tables and stamps."""
        rows, k = self.rows, sel.shape[1]
        sel_slot = self.where[rows, sel]
        hit = sel_slot >= 0
        miss = ~hit
        n_miss = miss.sum(axis=1)
        hr, hc = np.nonzero(hit)
        hs = sel_slot[hr, hc]
        used = int(self.prefetched[hr, hs].sum())
        self.prefetched[hr, hs] = False
        old_stamp = self.stamp.copy()
        if n_miss.any():
            pinned = np.zeros((self.n, self.B), dtype=bool)
            pinned[hr, hs] = True
            victims = _victims(self.stamp, pinned, n_miss)
            mr, mc = np.nonzero(miss)
            v = victims[mr, np.cumsum(miss, axis=1)[mr, mc] - 1]
            self.where[mr, self.slot_pos[mr, v]] = -1
            pos = sel[mr, mc]
            self.slot_pos[mr, v] = pos
            self.where[mr, pos] = v
            self.prefetched[mr, v] = False
        new_slot = self.where[rows, sel]
        big = np.where(hit, old_stamp[rows, new_slot], np.iinfo(np.int64).max)
        order = np.argsort(big, axis=1, kind="stable")
        hit_rank = np.empty_like(order)
        np.put_along_axis(hit_rank, order, np.broadcast_to(np.arange(k), order.shape).copy(), axis=1)
        self.stamp[rows, new_slot] = np.where(hit, self._up + k + hit_rank, self._up + np.arange(k))
        self._up += 2 * k
        return n_miss, used

    def prefetch(self, cand: np.ndarray, cap: int, placement: str) -> int:
        """Copy the candidates ``cand`` ``(n, d)`` (best first) not held, at most ``cap`` per row, each
        into the least recent slot holding no candidate. Returns the copies."""
        rows = self.rows
        cand_slot = self.where[rows, cand]
        held = cand_slot >= 0
        todo = (~held) & (np.cumsum(~held, axis=1) <= cap)
        count = todo.sum(axis=1)
        if not count.any():
            return 0
        pinned = np.zeros((self.n, self.B), dtype=bool)
        hr, hc = np.nonzero(held)
        pinned[hr, cand_slot[hr, hc]] = True
        victims = _victims(self.stamp, pinned, count)
        pr, pc = np.nonzero(todo)
        v = victims[pr, np.cumsum(todo, axis=1)[pr, pc] - 1]
        pos = cand[pr, pc]
        self.where[pr, self.slot_pos[pr, v]] = -1
        self.slot_pos[pr, v] = pos
        self.where[pr, pos] = v
        self.prefetched[pr, v] = True
        d = cand.shape[1]
        if placement == "mru":  # best rank most recent
            self.stamp[pr, v] = self._up + (d - pc)
            self._up += d + 1
        else:  # below everything, best rank the most recent of them
            self.stamp[pr, v] = self._down - pc
            self._down -= d + 1
        return len(pr)


@dataclass
class Run:
    misses: np.ndarray  # (docs, layers, steps) demand misses
    copies: int = 0
    used: int = 0
    caught: dict[int, int] = field(default_factory=dict)
    """depth -> demand misses of layers 1..L-1 lying in the previous layer's top ``depth`` at the same step."""

    def ideal_share(self, depth: int) -> float:
        """Share of layers 1..L-1's misses a free prefetch of ``depth`` ranks that evicted nothing
        useful would catch (meaningful for the run without prefetch, which counted ``depth``)."""
        total = int(self.misses[:, 1:].sum())
        return self.caught[depth] / total if total else 0.0


def replay(ranked: np.ndarray, k: int, B: int, depth: int = 0, cap: int = 0, placement: str = "mru",
           ideal_depths: Sequence[int] = ()) -> Run:
    """Replay ``ranked`` ``(D, L, S, R)`` through ``D x L`` buffers, prefetching layer ``l``'s top
    ``depth`` into layer ``l+1`` after each of layer ``l``'s resolves (``depth`` 0: no prefetch).
    ``ideal_depths``: for each, count the misses of layers 1..L-1 that the previous layer's top
    ``depth`` holds at the same step (:attr:`Run.caught`)."""
    d, n_layers, steps, _ = ranked.shape
    if not k <= B:
        raise ValueError(f"need k <= B, got k={k}, B={B}")
    if max([depth, *ideal_depths]) > B:
        raise ValueError(f"depth {max([depth, *ideal_depths])} > B={B}: the candidates would not fit one buffer")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    n_pos = max(int(ranked.max()) + 1, B)
    banks = [LruBank(d, B, n_pos) for _ in range(n_layers)]
    run = Run(misses=np.zeros((d, n_layers, steps), dtype=np.int64), caught={m: 0 for m in ideal_depths})
    rows = np.arange(d)[:, None]
    deepest = max(ideal_depths, default=0)
    for t in range(steps):
        for layer in range(n_layers):
            sel = ranked[:, layer, t, :k]
            if deepest and layer:
                missed = banks[layer].where[rows, sel] < 0
                prev_rank = np.full((d, n_pos), deepest, dtype=np.int64)
                prev_rank[rows, ranked[:, layer - 1, t, :deepest]] = np.arange(deepest)
                rank_of_missed = prev_rank[rows, sel][missed]
                for m in ideal_depths:
                    run.caught[m] += int((rank_of_missed < m).sum())
            run.misses[:, layer, t], used = banks[layer].resolve(sel)
            run.used += used
            if depth and cap and layer + 1 < n_layers:
                run.copies += banks[layer + 1].prefetch(ranked[:, layer, t, :depth], cap, placement)
    return run


def load_traces(folder: Path, docs: Sequence[str], selector: str) -> np.ndarray:
    """``(docs, layers, steps, rank)`` int64 of ``selector`` from ``folder/<doc>.npz``."""
    flat = margin_replay.load_traces(folder, docs, selector)  # document-major (docs * layers, ...)
    return flat.reshape(len(docs), -1, *flat.shape[1:])


def study(traces: Path, docs: Sequence[str], selectors: Sequence[str], k: int, sizes: Sequence[int],
          depths: Sequence[int], caps: Sequence[int], placements: Sequence[str] = PLACEMENTS, check: bool = True,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    configs = []
    for selector in selectors:
        ranked = load_traces(traces, docs, selector)
        d, n_layers, steps, r = ranked.shape
        if max(depths) > r:
            raise SystemExit(f"trace holds {r} ranks, need depth {max(depths)}")
        cells = d * n_layers * steps
        for B in sizes:
            t0 = time.time()
            base = replay(ranked, k, B, ideal_depths=depths)
            if check:
                from sglang_hisparse_analysis.policies import LruHitsLast
                from sglang_hisparse_analysis.simulator import simulate

                flat = ranked.reshape(d * n_layers, steps, r)
                if not np.array_equal(base.misses.reshape(d * n_layers, steps), simulate(LruHitsLast(), flat, k, B)):
                    raise SystemExit(f"{selector} B={B}: the no-prefetch replay differs from simulate(LruHitsLast())")
            base_total = int(base.misses.sum())
            rows = []
            for depth in depths:
                ideal = base.ideal_share(depth)
                for cap in caps:
                    for placement in placements:
                        run = replay(ranked, k, B, depth, cap, placement)
                        total = int(run.misses.sum())
                        row = {
                            "depth": depth, "cap": cap, "placement": placement,
                            "misses_per_resolve": total / cells,
                            "ideal_share_layers_1_on": ideal,
                            "net_miss_reduction": 1 - total / base_total if base_total else 0.0,
                            "copies_per_resolve": run.copies / cells,
                            "used_per_resolve": run.used / cells,
                            "demand_plus_prefetch_per_resolve": (total + run.copies) / cells,
                            "dsv32_demand_bytes_per_step": total / cells * dsv32_bytes(k),
                            "dsv32_prefetch_bytes_per_step": run.copies / cells * dsv32_bytes(k),
                        }
                        rows.append(row)
                        log(f"{selector} B={B} depth={depth} cap={cap} {placement}: misses/resolve "
                            f"{row['misses_per_resolve']:.2f} (none {base_total / cells:.2f}), net "
                            f"{100 * row['net_miss_reduction']:.1f}%, ideal {100 * ideal:.1f}%, copies/resolve "
                            f"{row['copies_per_resolve']:.1f} (used {row['used_per_resolve']:.1f})")
            configs.append({
                "selector": selector, "k": k, "B": B, "documents": d, "layers": n_layers, "steps": steps,
                "misses_per_resolve_no_prefetch": base_total / cells,
                "miss_rate_no_prefetch": base_total / (cells * k),
                "no_prefetch_equals_simulator": check,
                "dsv32_demand_bytes_per_step_no_prefetch": base_total / cells * dsv32_bytes(k),
                "rows": rows, "seconds": round(time.time() - t0, 1),
            })
    return {"traces": str(traces), "documents": list(docs), "configs": configs}


def main(argv: Optional[list[str]] = None) -> int:
    parser = margin_replay.trace_replay_parser(__doc__, PLACEMENTS)
    parser.add_argument("--depths", default="64,256", help="ranks of layer l's selection offered to layer l+1")
    parser.add_argument("--caps", default="32,256", help="most copies per (document, layer, step)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    docs = margin_replay.trace_docs(args)
    start = time.time()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    result = study(args.traces, docs, args.selectors.split(","), args.k, ints(args.B), ints(args.depths),
                   ints(args.caps), args.placements.split(","), check=not args.no_check,
                   log=lambda s: print(s, flush=True))
    record_run(result, __file__, argv, start, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
