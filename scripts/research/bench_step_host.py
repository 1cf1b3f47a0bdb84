#!/usr/bin/env python3
"""Host work of one decode step against batch size, context length and layer count, with real
SGLang objects (the test rig, tests/rig.py), with residency (the default) and hot buffers; on CPU
(the default; CI) or on a GPU (``--device cuda``, the lent H200: real launches and copies).

What is timed is our calls on a decode step's path, in SGLang's order, each apart (``--parts``):
``check`` (``device_rows_short``, the device rows the step lacks: our part of the decode memory
check, ``patches/decode_memory_check.py``), ``alloc`` (``alloc_decode``, the new tokens' logical
ids), ``map`` (``map_last_loc_to_buffer``: write-through bookkeeping, hot-buffer and resident
growth, pressure relief, the mapping) and ``wait`` (``wait_for_pending_backup``): the idle report's
parts. SGLang's own work between them is done but not timed. Not timed: the per-layer resolve
(inside the decode CUDA graph on a GPU). On CPU the write-through's bytes are left out too (a
torch loop over layers there, one kernel launch on a GPU, where it is kept).

On CPU a fake batch is admitted the PD way (logical ids and host rows, no prefill; garbage KV), so
a request of 128k tokens costs no prefill; on a GPU by prefill, staging and collect (garbage KV).
Host work must not grow with the context length or the layer count:
``tests/test_step_host_work.py`` runs :func:`step_host_us` with generous bounds.

    python scripts/research/bench_step_host.py [--out docs/results/step_host.json] [--repeats 3]
    bash scripts/gpu/run.sh step-host --batches 1,64,128 --contexts 1024 --layers 8 --steps 192 --parts --profile 30
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rig import PAGE, Request, Rig  # noqa: E402
from sglang_hisparse.memory.host_pool import HiSparseHostPool  # noqa: E402

BATCHES = (1, 8, 64, 256)
CONTEXTS = (1024, 8192, 131072)
MAX_TOKENS = 1 << 20
"""Cells with more tokens than this (batch x context) are skipped: their pools would not be small."""


def fake_batch(rig: Rig, batch: int, context: int, *, admit: str = "pd") -> list[Request]:
    """``batch`` requests of ``context`` tokens in decode, with garbage KV. ``admit="pd"``: the PD
    way (logical ids and host rows, no prefill), so a request of 128k tokens costs no prefill;
    ``admit="prefill"``: SGLang's order (prefill ids and rows, staging copy, collect), the path the
    GPU sync test covers."""
    reqs = [Request(uid=uid, prompt_len=context) for uid in range(batch)]
    if admit == "pd":
        for req in reqs:
            assert rig.admit_direct(req, write_kv=False), "the fake batch's pools are too small"
    else:
        rig.enter_by_prefill(reqs, write_kv=False)
    return reqs


PARTS = ("check", "alloc", "map", "wait")
"""Our calls of a decode step, in SGLang's order (the idle report's parts, less ``ready``)."""


def time_steps(group, *, batch: int, context: int, layers: int, residency: bool, steps: int = 40,
               device: str = "cpu", admit: str = "pd", profiler=None, flush_every: int = 0) -> dict[str, list[float]]:
    """Host seconds of each of our calls (``PARTS``) and of their sum (``total``), per decode step,
    for ``batch`` requests of ``context`` tokens; the steps cross a page boundary of every request.
    SGLang's own work between our calls (its tensors for the step, the ids written into
    ``req_to_token``) is done but not timed. On CUDA the device is drained after each step,
    untimed, as the step in flight would be in a server. ``profiler`` (a ``cProfile.Profile``) is
    enabled around our calls only. ``flush_every`` (> 0): resident requests' deferred write-through
    every this many steps instead of the default (``ResidentDecode.flush_every``)."""
    tokens = batch * (context + steps + PAGE)
    pages = -(-tokens // PAGE) + 8
    cuda = device == "cuda"
    times: dict[str, list[float]] = {part: [] for part in (*PARTS, "total")}

    def timed(part: str, call, *args):
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        result = call(*args)
        times[part].append(time.perf_counter() - start)
        if profiler is not None:
            profiler.disable()
        return result

    with contextlib.ExitStack() as stack:
        if not cuda:  # see the module docstring
            stack.enter_context(mock.patch.object(HiSparseHostPool, "write_back", lambda *a, **k: None))
            stack.enter_context(mock.patch.object(HiSparseHostPool, "load_rows", lambda *a, **k: None))
        rig = Rig(group, device_rows=PAGE * pages, device_buffer_size=256, top_k=64, max_reqs=batch + 1,
                  max_context=context + steps + 2 * PAGE, residency=residency, residency_watermark=0.0, layers=layers,
                  device=device, debug=False)  # as a server runs: no debug checks (they read pages back)
        if flush_every and residency:
            rig.coord._resident_decode.flush_every = flush_every
        reqs = fake_batch(rig, batch, context - PAGE // 2, admit=admit)
        idx = torch.tensor([r.req_pool_idx for r in reqs])
        idx_d = idx.to(rig.device)
        idx_list = idx.tolist()
        for _ in range(steps):
            committed = [r.seq_len for r in reqs]
            assert timed("check", rig.coord.device_rows_short, idx_list, committed) == 0
            seq_lens = torch.tensor([n + 1 for n in committed])
            seq_lens_d = seq_lens.to(rig.device)  # SGLang's device copy
            last_loc = rig.req_to_token_pool.req_to_token[idx_d, seq_lens_d - 2].to(torch.int64)
            out_loc = timed("alloc", rig.allocator.alloc_decode, seq_lens_d, seq_lens, last_loc)
            rig.req_to_token_pool.write((idx_d, seq_lens_d - 1), out_loc.to(torch.int32))
            timed("map", rig.coord.map_last_loc_to_buffer, seq_lens_d, out_loc, idx_d, seq_lens, idx)
            timed("wait", rig.coord.wait_for_pending_backup)
            times["total"].append(sum(times[part][-1] for part in PARTS))
            if cuda:
                torch.cuda.synchronize()
            for r in reqs:
                r.kv.kv_allocated_len += 1
                r.seq_len += 1
        for r in reqs:
            rig.release(r)
        if cuda:
            torch.cuda.synchronize()
        assert rig.counts() == rig.initial_counts
        rig.close()  # unpins the host pool: the next cell's pool may be mapped at its addresses
    del rig, reqs
    gc.collect()  # the next cell's pools need the memory back
    return times


def step_host_us(group, *, batch: int, context: int, layers: int, residency: bool, steps: int = 40) -> float:
    """Median host time (us) of one decode step's work of ours on CPU (:func:`time_steps`'s total)."""
    times = time_steps(group, batch=batch, context=context, layers=layers, residency=residency, steps=steps)
    return statistics.median(times["total"]) * 1e6


def init_group():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    return dist.group.WORLD


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure_cell(group, args, *, batch: int, context: int, layers: int, residency: bool, profiler=None) -> dict:
    """The run (of ``args.repeats``) with the lowest median total: its median total (us) and, per
    part, the median and the mean (us; the mean carries the rare steps: page starts, the deferred
    write-through every ``DEFERRED_FLUSH_STEPS``)."""
    best = None
    for _ in range(args.repeats):
        times = time_steps(group, batch=batch, context=context, layers=layers, residency=residency, steps=args.steps,
                           device=args.device, admit=args.admit, profiler=profiler, flush_every=args.flush_every)
        if best is None or statistics.median(times["total"]) < statistics.median(best["total"]):
            best = times
    return {"us": round(statistics.median(best["total"]) * 1e6, 1),
            "parts": {part: {"median": round(statistics.median(v) * 1e6, 1), "mean": round(statistics.mean(v) * 1e6, 1)}
                      for part, v in best.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--admit", choices=("pd", "prefill"), default=None,
                   help="how the fake batch enters decode (default: pd on cpu, prefill on cuda; see fake_batch)")
    p.add_argument("--layers", default="2,8")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--steps", type=int, default=40,
                   help="decode steps per run (>= DEFERRED_FLUSH_STEPS, 256, to include a deferred write-through of resident requests)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measure each cell this many times and keep the lowest median (a shared machine's noise only adds)")
    p.add_argument("--flush-every", type=int, default=0, metavar="N",
                   help="resident requests' deferred write-through every N steps (default: the product's)")
    p.add_argument("--parts", action="store_true", help="print each part's median / mean per cell")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile our calls (cProfile) over every cell and print the N functions with the most own time")
    args = p.parse_args()
    if args.admit is None:
        args.admit = "prefill" if args.device == "cuda" else "pd"
    group = init_group()
    torch.set_num_threads(1)
    machine = f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, torch {torch.__version__}"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    print(f"machine: {machine}; device {args.device}, admission {args.admit}, {args.steps} steps per run"
          + (f", deferred write-through every {args.flush_every} steps" if args.flush_every else ""))
    print("layers | batch | context | resident (us/step) | hot buffers (us/step)")
    profiler = cProfile.Profile() if args.profile else None
    rows = []
    for layers in _ints(args.layers):
        for batch in _ints(args.batches):
            for context in _ints(args.contexts):
                if batch * context > MAX_TOKENS:
                    continue
                cell = {"layers": layers, "batch": batch, "context": context}
                for residency in (True, False):
                    measured = measure_cell(group, args, batch=batch, context=context, layers=layers,
                                            residency=residency, profiler=profiler)
                    key = "resident" if residency else "hot"
                    cell[f"{key}_us"], cell[f"{key}_parts"] = measured["us"], measured["parts"]
                rows.append(cell)
                print(f"{layers} | {batch} | {context} | {cell['resident_us']:.0f} | {cell['hot_us']:.0f}", flush=True)
                if args.parts:
                    for key in ("resident", "hot"):
                        print(f"    {key}: " + ", ".join(f"{part} {v['median']:.0f} / {v['mean']:.0f}"
                                                         for part, v in cell[f"{key}_parts"].items()) + " (median / mean us)")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "device": args.device, "admit": args.admit,
                                              "steps": args.steps, "flush_every": args.flush_every or None, "command": " ".join(["python"] + sys.argv),
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
