#!/usr/bin/env python3
"""Host-side (Python) cost of one ``resolve_cuda`` call and of one call of the per-layer bound form
the coordinator uses (``bind_resolve_cuda``), without a GPU: the compiled kernel
module is replaced by a no-op, so what is timed is argument checking and dispatch, the part a
decode step pays per layer when CUDA graphs are off. (On the H200 the benchmark's ``host_us``
column adds the FFI call and the launch: docs/results/kernel_bench.md.)

    python scripts/research/bench_host_overhead.py            # prints us per call for batch 1, 16 and 64
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from sglang_hisparse.resolver import cuda as rcuda  # noqa: E402
from sglang_hisparse.resolver import jit  # noqa: E402


class _NoOpModule:
    def bind(self, *args) -> None:
        pass

    bind_skip_io = launch = launch_skip_io = bind


def per_call_us(batch: int, bound: bool, calls: int = 3000, B: int = 4096, K: int = 2048, table_rows: int = 64) -> float:
    """Mean host time of one call: ``resolve_cuda`` with every keyword, or (``bound``)
    the per-layer form the coordinator binds at start-up."""
    ws = rcuda.make_workspace(table_rows, "cpu", top_k=K)
    kw = dict(
        top_k_positions=torch.zeros(batch, K, dtype=torch.int32), seq_lens=torch.zeros(batch, dtype=torch.int64),
        req_pool_indices=torch.zeros(batch, dtype=torch.int64), hot_locs=torch.zeros(table_rows, B + 1, dtype=torch.int32),
        slot_tokens=torch.zeros(table_rows, B, dtype=torch.int32), lru=torch.zeros(table_rows, B, dtype=torch.int16),
        host_locs=torch.zeros(table_rows, 1024, dtype=torch.int64), host_kv=torch.zeros(64, 576, dtype=torch.bfloat16),
        device_kv=torch.zeros(64, 576, dtype=torch.bfloat16), out=torch.zeros(batch, K, dtype=torch.int32),
        num_real_reqs=torch.tensor([batch], dtype=torch.int32), device_buffer_size=B, workspace=ws,
        skip_io=True,  # CPU tensors are not pinned; the IO checks run once per buffer either way
        counters=torch.zeros(2, dtype=torch.int64),
    )
    call = lambda: rcuda.resolve_cuda(**kw)  # noqa: E731
    if bound:
        batch_keys = ("top_k_positions", "seq_lens", "req_pool_indices", "out")
        fixed = {k: v for k, v in kw.items() if k not in batch_keys + ("workspace",)}
        resolve = rcuda.bind_resolve_cuda(workspace=ws, top_k=K, **fixed)
        args = [kw[k] for k in batch_keys]
        call = lambda: resolve(*args)  # noqa: E731
    for _ in range(200):
        call()
    t = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    jit.resolve_module = lambda *a, **k: _NoOpModule()  # this process only
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}, "
          f"torch {torch.__version__}")
    for batch in (1, 16, 64):
        print(f"batch {batch}: {per_call_us(batch, False):.1f} us per resolve_cuda call, "
              f"{per_call_us(batch, True):.1f} us per bound call (Python side)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
