#!/usr/bin/env python3
"""Host-side cost of the coordinator's per-step call (``map_last_loc_to_buffer``) against the
batch size, on CPU with real SGLang objects (the test rig, tests/rig.py), hot buffers versus
resident requests. What is timed is the Python and small-tensor work a decode step pays once per
step (write-through bookkeeping, hot-buffer growth, residency growth, the mapping), not GPU time.

    python scripts/bench_step_host.py            # prints us per step for batch 1 .. 128
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rig import PAGE, Request, Rig  # noqa: E402


def per_step_us(group, batch: int, residency: bool, steps: int = 60, prompt: int = 1000) -> float:
    """Median host time of one ``map_last_loc_to_buffer`` over ``steps`` steps of ``batch``
    requests of ``prompt`` tokens."""
    pages = batch * (-(-(prompt + steps + 1) // PAGE) + 1) + 8
    rig = Rig(group, device_rows=PAGE * pages, device_buffer_size=256, top_k=64, max_reqs=batch + 1,
              max_context=prompt + steps + 2 * PAGE, residency=residency, residency_watermark=0.0, layers=2)
    reqs = [Request(uid=i, prompt_len=prompt) for i in range(batch)]
    for r in reqs:
        assert rig.prefill(r)
        rig.stage(r)
    assert len(rig.collect()) == batch
    idx = torch.tensor([r.req_pool_idx for r in reqs])
    times = []
    for _ in range(steps):
        seq_lens = torch.tensor([r.seq_len + 1 for r in reqs])
        last_loc = rig.req_to_token_pool.req_to_token[idx, seq_lens - 2].to(torch.int64)
        out_loc = rig.allocator.alloc_decode(seq_lens, seq_lens, last_loc)
        rig.req_to_token_pool.write((idx, seq_lens - 1), out_loc.to(torch.int32))
        for r in reqs:
            r.kv.kv_allocated_len += 1
            r.seq_len += 1
        t = time.perf_counter()
        rig.coord.map_last_loc_to_buffer(seq_lens, out_loc, idx, seq_lens, idx)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, torch {torch.__version__}")
    print("batch | hot buffers (us/step) | resident (us/step)")
    for batch in (1, 8, 32, 64, 128):
        hot, resident = per_step_us(dist.group.WORLD, batch, False), per_step_us(dist.group.WORLD, batch, True)
        print(f"{batch} | {hot:.0f} | {resident:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
