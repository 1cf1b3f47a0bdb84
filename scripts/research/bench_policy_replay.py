#!/usr/bin/env python3
"""Miss rates of the replacement policies measured through the resolver on real selection traces.

Replays the traces of ``--traces`` (an ``.npz`` from ``scripts/research/traces/pack_gpu.py``: per document
``<doc>/ranked`` uint16 [layers, steps, k] and ``<doc>/query_pos`` int32 [steps]) through the
resolver of ``--device`` (cuda: the fused kernel, ``bind_resolve_cuda`` after ``warmup_build``;
cpu: ``resolve_batched``), once with LRU and once with the reuse-table policy (the packaged
history table's levels), every (document, layer) cache one request row of one batch, one resolver
call per decode step (skip-IO). The simulator (``simulate(LruHitsLast)`` and
``simulate(ReuseTable(table, use_rank=False))``) runs on the same traces on the CPU; any
difference in the miss counts is reported (and makes the exit status 1).

Usage: python3 scripts/research/bench_policy_replay.py --traces .traces_gpu/heldout3_k256.npz --device cuda \
           --B 256,512,1024 --out policy_replay.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sglang_hisparse_analysis.policies import LruHitsLast, ReuseTable  # noqa: E402
from sglang_hisparse_analysis.replay import (  # noqa: E402
    bind_cuda, bind_python, per_layer, replay_selections)
from sglang_hisparse.resolver.reuse import history_table, reuse_levels  # noqa: E402
from sglang_hisparse_analysis.simulator import simulate  # noqa: E402

#: The kernel's KV row size and block size used for the build (skip-IO: no bytes move).
ITEM_BYTES = 1152
BLOCK_SIZE = 960


def load_traces(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(document names, ranked [docs * layers, steps, k] int64 document-major, query_pos [docs * layers, steps])."""
    with np.load(path) as data:
        docs = sorted({key.split("/")[0] for key in data.files})
        ranked = [data[f"{d}/ranked"].astype(np.int64) for d in docs]
        qpos = [data[f"{d}/query_pos"].astype(np.int64) for d in docs]
    shapes = {r.shape for r in ranked}
    if len(shapes) != 1:
        raise ValueError(f"documents differ in shape: {shapes}")
    n_layers = ranked[0].shape[0]
    return docs, np.concatenate(ranked), np.concatenate([np.tile(q, (n_layers, 1)) for q in qpos])


def machine(device: str) -> str:
    text = f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} torch threads"
    if device == "cuda":
        text += f", {torch.cuda.get_device_name()}"
    return text


def run(traces: Path, device: str, sizes: list[int], *, log=print) -> dict[str, Any]:
    start = time.time()
    docs, ranked, qpos = load_traces(traces)
    n, steps, k = ranked.shape
    n_layers = n // len(docs)
    log(f"{len(docs)} documents ({', '.join(docs)}), {n_layers} layers, {steps} steps, k={k}: {n} caches")
    table = history_table().table
    levels = reuse_levels(table)
    policies = {
        "lru": (None, lambda: LruHitsLast()),
        "reuse": (levels, lambda: ReuseTable(table[..., None], use_rank=False)),
    }
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    for B in sizes:
        if device == "cuda":
            from sglang_hisparse.resolver import cuda

            cuda.warmup_build(ITEM_BYTES, B, k, BLOCK_SIZE)
            cuda.warmup_build(ITEM_BYTES, B, k, BLOCK_SIZE, reuse=True)
            bind = bind_cuda(cuda.make_workspace(n, "cuda", k), k, block_size=BLOCK_SIZE)
            item_bytes = ITEM_BYTES
        else:
            from sglang_hisparse.resolver.batched import resolve_batched

            bind, item_bytes = bind_python(resolve_batched), 16
        for name, (lv, make_policy) in policies.items():
            got = replay_selections(bind, ranked, qpos, B, levels=lv, device=device, item_bytes=item_bytes)
            t0 = time.time()
            want = simulate(make_policy(), ranked, k, B)
            sim_seconds = time.time() - t0
            same = bool(np.array_equal(got.misses, want))
            if not same:
                bad = np.argwhere(got.misses != want)
                mismatches.append(f"{name} B={B}: {len(bad)} (cache, step) counts differ, first {bad[:5].tolist()}")
            sim_rate = float(want.sum()) / (n * steps * k)
            rows.append({
                "policy": name, "B": B, "device": device, "miss_rate": got.miss_rate,
                "simulator_miss_rate": sim_rate, "identical_to_simulator": same,
                "misses": int(got.misses.sum()), "selected": got.selected,
                "per_layer": per_layer(got.misses, n_layers, k),
                "simulator_per_layer": per_layer(want, n_layers, k),
                "per_document": [float(m.sum()) / (m.size * k) for m in got.misses.reshape(len(docs), -1, steps)],
                "resolver_seconds": round(got.seconds, 3), "resolver_ms_per_step": round(1e3 * got.seconds / steps, 3),
                "simulator_seconds": round(sim_seconds, 3),
            })
            log(f"B={B} {name:5s}: resolver {100 * got.miss_rate:.2f}% ({got.seconds:.1f} s), simulator "
                f"{100 * sim_rate:.2f}% ({sim_seconds:.1f} s), {'identical' if same else 'DIFFERENT'}")
    reduction = {}
    for B in sizes:
        lru, reuse = (next(r for r in rows if r["B"] == B and r["policy"] == p) for p in ("lru", "reuse"))
        reduction[str(B)] = 1 - reuse["miss_rate"] / lru["miss_rate"] if lru["miss_rate"] else 0.0
        log(f"B={B}: reuse vs LRU: {100 * reduction[str(B)]:.1f}% fewer misses")
    return {
        "traces": str(traces), "documents": docs, "layers": n_layers, "steps": steps, "k": k,
        "table": history_table().describe(), "rows": rows, "relative_reduction_reuse_vs_lru": reduction,
        "resolver_equals_simulator": not mismatches, "mismatches": mismatches,
        "machine": machine(device), "command": " ".join(shlex.quote(a) for a in sys.argv),
        "wall_seconds": round(time.time() - start, 1),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--B", default="512", help="comma-separated buffer sizes (>= k)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    result = run(args.traces, args.device, [int(b) for b in args.B.split(",")], log=lambda s: print(s, flush=True))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    for m in result["mismatches"]:
        print(f"MISMATCH {m}")
    print(f"wall {result['wall_seconds']} s")
    return 0 if result["resolver_equals_simulator"] else 1


if __name__ == "__main__":
    sys.exit(main())
