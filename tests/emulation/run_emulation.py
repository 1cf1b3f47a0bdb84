"""Run the device code of kernels/resolve.cuh on CPU threads against the batched oracle.

The CUDA built-ins are emulated (cuda_emulation.h) and the kernel source is compiled unchanged
as a torch CPU extension, so index math, barriers, warp collectives, the planner/copier protocol
and the workspace reset are checked without a GPU. With ``--tsan`` the extension is built with
ThreadSanitizer (run under ``LD_PRELOAD=$(g++ -print-file-name=libtsan.so)``): a data race between
emulated threads (a missing ``__syncthreads``, two threads writing one smem word) is reported.

Not covered here (GPU only): PTX semantics of cp.async / ld.nc / scoped atomics, real warp
scheduling, timing. Usage: ``python tests/emulation/run_emulation.py --cases 200 [--tsan]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BLOCKS = (32, 64, 96, 128, 160, 256, 1024)


def build(tsan: bool = False, build_dir: Optional[Path] = None) -> Any:
    """Compile (or reuse) the emulator extension; ~1 minute the first time."""
    from torch.utils.cpp_extension import load

    name = "hisparse_resolve_emu_tsan" if tsan else "hisparse_resolve_emu"
    build_dir = build_dir or Path(os.environ.get("HISPARSE_EMU_BUILD", Path.home() / ".cache" / "sglang-hisparse")) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O1", "-std=c++20", "-pthread"]
    ldflags = []
    if tsan:
        flags += ["-g", "-fsanitize=thread"]
        ldflags += ["-fsanitize=thread"]
    return load(
        name=name,
        sources=[str(HERE / "emulated_resolve.cpp")],
        extra_cflags=flags,
        extra_ldflags=ldflags,
        extra_include_paths=[str(ROOT / "kernels"), str(HERE)],
        build_directory=str(build_dir),
        verbose=False,
    )


def emulate(emu: Any, case: Any, ws: Any, block: int, concurrent: bool) -> None:
    """One emulated launch of ``case``'s kernel arguments on workspace ``ws`` (its outputs: the
    case's kernel tensors)."""
    e64 = torch.empty(0, dtype=torch.int64)
    e32 = torch.empty(0, dtype=torch.int32)
    e8 = torch.empty(0, dtype=torch.uint8)
    e16 = torch.empty(0, dtype=torch.int16)
    spec = case.spec
    kw = case.kernel_kwargs()
    plan, ctr = kw["plan"], kw["counters"]
    host_kv, device_kv = case.host_kv, case.kernel_kv  # the raw buffers (pages for C4 rows)
    emu.resolve(
        spec.item_bytes, spec.B, spec.top_k, spec.skip_io, kw["top_k_positions"], kw["seq_lens"],
        kw["req_pool_indices"], kw["hot_locs"], kw["slot_tokens"], kw["lru"], kw["host_locs"], host_kv,
        device_kv, kw["out"], kw["num_real_reqs"],
        plan.host_rows if plan else e64, plan.device_rows if plan else e32, plan.counts if plan else e32,
        ctr if ctr is not None else e64,
        kw.get("resident", e8), kw.get("req_to_token", e32), kw.get("logical_to_device", e64),
        kw.get("slot_history", e16), kw.get("reuse_levels", e8), kw.get("slot_map", e16),
        kw.get("buffer_sizes", e32), ws.state,
        ws.flat_host_rows, ws.flat_device_rows, ws.planner_spill,
        block, -1 if spec.num_copiers is None else spec.num_copiers, concurrent,
    )


def run_cases(emu: Any, cases: int, seed: int, log=print, max_block: int = 1024, item_bytes: Optional[int] = None
              ) -> tuple[int, list[str]]:
    """Run ``cases`` random cases (sequential or concurrent CTAs; ``item_bytes``: only the
    configurations of that row size, e.g. 584 for DeepSeek-V4's paged C4 rows); returns
    (failures, reports)."""
    from sglang_hisparse.resolver import cuda as rcuda
    from sglang_hisparse.resolver.batched import replay_plan_batched, resolve_batched
    from sglang_hisparse_testkit.resolver_cases import (
        HostPool,
        describe_difference,
        differences,
        make_case,
        random_spec,
    )

    dev = torch.device("cpu")
    pool = HostPool(8 << 20, dev, pin=False, seed=seed)
    kbuf = torch.empty(16 << 20, dtype=torch.uint8)
    rbuf = torch.empty(16 << 20, dtype=torch.uint8)
    ws = rcuda.make_workspace(24, dev, top_k=64, spill=True)
    configs = [c for c in emu.configs() if item_bytes is None or c[0] == item_bytes]
    assert configs, f"no emulated configuration with {item_bytes}-byte rows"
    rng = random.Random(seed)
    failures = 0
    reports: list[str] = []
    for c in range(cases):
        item, B, K = configs[rng.randrange(len(configs))]
        block = rng.choice([b for b in BLOCKS if b <= max_block])
        spec = random_spec(rng, item_bytes=item, B=B, top_k=K, block_size=block, max_batch=10,
                           seed=rng.randrange(1 << 60))
        case = make_case(spec, pool, kbuf, rbuf, dev)
        plan = case.kernel["plan"]
        concurrent = rng.random() < 0.3
        emulate(emu, case, ws, block, concurrent)
        resolve_batched(**case.ref_kwargs())
        bad = differences(case)
        words = ws.state[[0, 32, 64, 96]].tolist()
        if words != [0, 0, 0, 0]:
            bad.append(f"workspace state {words}")
        if plan is not None and not bad:
            byte = rng.randrange(256)
            case.kernel_kv.view(torch.uint8).fill_(byte)
            case.ref_kv.view(torch.uint8).fill_(byte)
            emu.replay(item, plan.host_rows, plan.device_rows, plan.counts, case.kernel["num_real_reqs"], case.host_kv,
                       case.kernel_kv, ws.state, rng.choice([32, 64, 128]), rng.choice([1, 2, 5]), rng.random() < 0.5)
            ref = case.ref_kwargs()
            replay_plan_batched(plan=case.ref["plan"], num_real_reqs=spec.num_real, host_kv=ref["host_kv"],
                                device_kv=ref["device_kv"])
            if not torch.equal(case.kernel_kv.reshape(-1).view(torch.uint8), case.ref_kv.reshape(-1).view(torch.uint8)):
                bad.append("replay device_kv")
        if bad:
            failures += 1
            detail = "\n".join(describe_difference(case, x) for x in bad if " " not in x)
            report = f"case {c}: {bad} concurrent={concurrent}\n  {spec.describe()}\n{detail}"
            reports.append(report)
            log(report)
            ws.state.zero_()
            if failures >= 5:
                break
    return failures, reports


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tsan", action="store_true")
    parser.add_argument("--item-bytes", type=int, default=None, help="only configurations of this row size")
    parser.add_argument("--max-block", type=int, default=1024, help="largest block size (TSan: 256 keeps memory low)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    t0 = time.time()
    emu = build(tsan=args.tsan)
    t1 = time.time()
    failures, _ = run_cases(emu, args.cases, args.seed, max_block=args.max_block, item_bytes=args.item_bytes)
    print(f"[emulation] build {t1 - t0:.0f}s, {args.cases} cases in {time.time() - t1:.0f}s, {failures} failures"
          + (" (TSan: see any 'WARNING: ThreadSanitizer' above)" if args.tsan else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
