#!/usr/bin/env python3
"""Host work of one decode step against batch size, context length and layer count, on CPU with
real SGLang objects (the test rig, tests/rig.py), with residency (the default) and hot buffers.

What is timed is the Python and small-tensor work our code adds to a decode step, in SGLang's
order: the decode memory check (``patches/decode_memory_check.py``: logical and host rows, and the
device rows the step lacks), the logical ids of the new tokens (``alloc_decode``), the coordinator's
``map_last_loc_to_buffer`` (write-through bookkeeping, hot-buffer and resident growth, pressure
relief, the mapping) and ``wait_for_pending_backup``. Not timed: the per-layer resolve (inside the
decode CUDA graph on a GPU) and the bytes of the write-through copy (one kernel launch for all
layers on a GPU; on CPU it would be a torch loop over layers, so it is left out here).

A fake batch is admitted the PD way (logical ids and host rows, no prefill; garbage KV), so a
request of 128k tokens costs no prefill. Host work must not grow with the context length or the
layer count: ``tests/test_step_host_work.py`` runs :func:`step_host_us` with generous bounds.

    python scripts/bench_step_host.py [--out docs/results/step_host.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rig import PAGE, Request, Rig  # noqa: E402
from sglang_hisparse.host_pool import HiSparseHostPool  # noqa: E402

BATCHES = (1, 8, 64, 256)
CONTEXTS = (1024, 8192, 131072)
MAX_TOKENS = 1 << 20
"""Cells with more tokens than this (batch x context) are skipped: their pools would not be small."""


def fake_batch(rig: Rig, batch: int, context: int) -> list[Request]:
    """``batch`` requests of ``context`` tokens admitted the PD way (no prefill, garbage KV)."""
    reqs = []
    for uid in range(batch):
        req = Request(uid=uid, prompt_len=context)
        assert rig.pd_prealloc(req, context), "the fake batch's pools are too small"
        req.seq_len = context
        rig.coord.admit_request_direct(req)
        req.state = "decoding"
        reqs.append(req)
    return reqs


def step_host_us(group, *, batch: int, context: int, layers: int, residency: bool, steps: int = 40) -> float:
    """Median host time (us) of one decode step's work of ours for ``batch`` requests of
    ``context`` tokens (see the module docstring). The steps cross a page boundary of every request."""
    tokens = batch * (context + steps + PAGE)
    pages = -(-tokens // PAGE) + 8
    with mock.patch.object(HiSparseHostPool, "write_back", lambda *a, **k: None), \
            mock.patch.object(HiSparseHostPool, "load_rows", lambda *a, **k: None):
        rig = Rig(group, device_rows=PAGE * pages, device_buffer_size=256, top_k=64, max_reqs=batch + 1,
                  max_context=context + steps + 2 * PAGE, residency=residency, residency_watermark=0.0, layers=layers)
        reqs = fake_batch(rig, batch, context - PAGE // 2)
        idx = torch.tensor([r.req_pool_idx for r in reqs])
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            assert rig.decode_fits(reqs)
            seq_lens = torch.tensor([r.seq_len + 1 for r in reqs])
            last_loc = rig.req_to_token_pool.req_to_token[idx, seq_lens - 2].to(torch.int64)
            out_loc = rig.allocator.alloc_decode(seq_lens, seq_lens, last_loc)
            rig.req_to_token_pool.write((idx, seq_lens - 1), out_loc.to(torch.int32))
            rig.coord.map_last_loc_to_buffer(seq_lens, out_loc, idx, seq_lens, idx)
            rig.coord.wait_for_pending_backup()
            times.append(time.perf_counter() - t)
            for r in reqs:
                r.kv.kv_allocated_len += 1
                r.seq_len += 1
        for r in reqs:
            rig.release(r)
        assert rig.counts() == rig.initial_counts
    del rig, reqs
    gc.collect()  # the next cell's pools need the memory back
    return statistics.median(times) * 1e6


def init_group():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    return dist.group.WORLD


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.add_argument("--layers", default="2,8")
    p.add_argument("--repeats", type=int, default=3,
                   help="measure each cell this many times and keep the lowest median (a shared machine's noise only adds)")
    args = p.parse_args()
    group = init_group()
    torch.set_num_threads(1)
    machine = f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, torch {torch.__version__}"
    print(f"machine: {machine}")
    print("layers | batch | context | resident (us/step) | hot buffers (us/step)")
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        for batch in BATCHES:
            for context in CONTEXTS:
                if batch * context > MAX_TOKENS:
                    continue
                cell = {"layers": layers, "batch": batch, "context": context}
                for residency in (True, False):
                    us = min(step_host_us(group, batch=batch, context=context, layers=layers, residency=residency)
                             for _ in range(args.repeats))
                    cell["resident_us" if residency else "hot_us"] = round(us, 1)
                rows.append(cell)
                print(f"{layers} | {batch} | {context} | {cell['resident_us']:.0f} | {cell['hot_us']:.0f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "command": " ".join(["python"] + sys.argv),
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
