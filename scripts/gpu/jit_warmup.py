#!/usr/bin/env python3
"""Build every JIT module the GPU suite needs, and time it.

1. A server's start-up build, cold: ``warmup_build(1152, 4096, 2048, 960)`` (resolve + replay
   modules, concurrently) then the same call again (cache hit).
2. Every other module of the kernel tests and the benchmark, and upstream SGLang's swap-in kernel
   for the benchmark, concurrently.

Writes ``jit_warmup.json`` into ``$HISPARSE_RESULTS_DIR`` (merged into kernel_tests.json by
scripts/gpu/finalize_results.py) and prints a summary. Exit status 1 if one of our builds fails.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_hisparse.resolver import cuda as rcuda  # noqa: E402
from sglang_hisparse.resolver import jit  # noqa: E402
from sglang_hisparse.resolver.report import results_dir, write_json  # noqa: E402

TEST_CONFIGS = [(k, k * m) for k in (64, 512, 2048) for m in (1, 2, 4)]
ITEMS = (1152, 656)
BENCH_BS = (2048, 4096)


def main() -> int:
    report: dict = {"kernel_source": str(jit.kernel_source())}
    print(f"[jit] kernel source {report['kernel_source']}", flush=True)
    t0 = time.time()
    rcuda.warmup_build(1152, 4096, 2048, 960)
    report["server_warmup_cold_s"] = round(time.time() - t0, 1)
    t1 = time.time()
    rcuda.warmup_build(1152, 4096, 2048, 960)
    report["server_warmup_cached_s"] = round(time.time() - t1, 2)
    print(f"[jit] server warmup_build: cold {report['server_warmup_cold_s']}s, cached {report['server_warmup_cached_s']}s",
          flush=True)

    timings: dict[str, float] = {}

    def timed(name, fn):
        def job():
            s = time.time()
            fn()
            timings[name] = round(time.time() - s, 1)
        return job

    jobs = [timed(f"resolve{'_reuse' if r else ''}_{i}_{b}_{k}",
                  lambda i=i, k=k, b=b, r=r: jit.resolve_module(i, b, k, reuse=r))
            for i in ITEMS for k, b in TEST_CONFIGS for r in (False, True)]
    jobs += [timed(f"replay_{i}", lambda i=i: jit.replay_module(i)) for i in ITEMS]
    upstream_error = None
    try:
        from sglang.kernels.ops.kvcache.hisparse import _jit_sparse_module

        jobs += [timed(f"upstream_{i}_{b}", lambda i=i, b=b: _jit_sparse_module(i, 960, 2048, b, is_mla=True,
                                                                                is_dsv4_layout=False))
                 for i in ITEMS for b in BENCH_BS]
    except Exception as e:
        upstream_error = f"{type(e).__name__}: {e}"
        print(f"[jit] upstream kernel unavailable: {upstream_error}", flush=True)
    t2 = time.time()
    status = 0
    try:
        jit.build_all(jobs)
    except Exception:
        traceback.print_exc()
        status = 1
    report["all_modules_s"] = round(time.time() - t2, 1)
    report["modules"] = timings
    report["upstream_error"] = upstream_error
    print(f"[jit] {len(timings)} more modules in {report['all_modules_s']}s (slowest "
          f"{max(timings.values()) if timings else 0}s)", flush=True)
    out = results_dir()
    if out is not None:
        write_json(out / "jit_warmup.json", report)
    return status


if __name__ == "__main__":
    sys.exit(main())
