#!/usr/bin/env python3
"""Pack the selections of a few traces into one small file for the GPU machine.

Per document: ``<doc>/ranked`` = the first ``k`` positions of the selector's ranking per (layer,
step) (uint16 [layers, steps, k], the step's selection, best first) and ``<doc>/query_pos``
(int32 [steps]); np.savez_compressed. Read by ``scripts/research/bench_policy_replay.py``.

Usage: python3 scripts/research/traces/pack_gpu.py .traces/topics_06.npz ... --out .traces_gpu/heldout3_k256.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--selector", default="attention", choices=("attention", "quest"))
    args = parser.parse_args()
    arrays = {}
    for path in args.traces:
        with np.load(path) as data:
            ranked = data[args.selector]
            if ranked.shape[2] < args.k:
                raise SystemExit(f"{path}: {ranked.shape[2]} ranks per step < k={args.k}")
            arrays[f"{path.stem}/ranked"] = np.ascontiguousarray(ranked[:, :, : args.k], dtype=np.uint16)
            arrays[f"{path.stem}/query_pos"] = data["query_pos"].astype(np.int32)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out}: {len(args.traces)} documents, {args.out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
