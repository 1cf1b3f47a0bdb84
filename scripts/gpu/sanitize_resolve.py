#!/usr/bin/env python3
"""A small representative set of resolve / replay launches, for compute-sanitizer.

Run as ``compute-sanitizer --tool memcheck python scripts/gpu/sanitize_resolve.py`` (or
racecheck). Cases and the oracle are computed on the CPU and only copied to the GPU, so the
sanitizer instruments almost nothing but our kernels. Covers block sizes 32 .. 1024, both item
sizes and DeepSeek-V4's paged C4 rows, plan recording and replay, skip-IO, fast-path and padded rows, resident requests mixed with
hot-buffer ones (uint8 and bool flags), copier CTAs automatic, none (planners copy) and few, and
spilling planners (a verify union of 3 and 4 rows of 2048: top-k-sized arrays in global memory).
Every launch is also compared with the oracle. Exit status 1 on a mismatch. The JIT modules must already be built (scripts/gpu/jit_warmup.py, or ``--build-only``
first, outside the sanitizer: it builds this script's modules and exits).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HISPARSE_RESOLVE_SPIN_TIMEOUT_S", "60")  # instrumented kernels are slow

import torch  # noqa: E402

from sglang_hisparse.resolver import cuda as rcuda  # noqa: E402
from sglang_hisparse.resolver import jit  # noqa: E402
from sglang_hisparse.resolver.batched import replay_plan_batched, resolve_batched  # noqa: E402
from sglang_hisparse_testkit.resolver_cases import (  # noqa: E402
    CaseSpec,
    HostPool,
    compress_ratio_of,
    describe_difference,
    differences,
    make_case,
    row_args,
)
from sglang_hisparse.resolver.reference import MissPlan  # noqa: E402

# (item, B, top_k, batch, num_real, block, copiers, plan, skip_io, hit_mode, resident)
# resident: None = no residency tables; else (share of resident request rows, flag dtype)
CASES = [
    (1152, 128, 64, 4, 4, 32, 0, True, False, "uniform", None),
    (656, 128, 64, 5, 3, 96, 0, False, False, "zero", None),
    (1152, 1024, 512, 3, 3, 256, 0, True, False, "uniform", None),
    (656, 512, 512, 2, 2, 1024, 0, True, True, "one", None),
    (1152, 4096, 2048, 2, 2, 960, 0, True, False, "fixed", None),
    (1152, 8192, 6144, 2, 2, 960, 0, True, False, "fixed", None),  # spills
    (656, 256, 64, 6, 6, 640, 0, False, False, "uniform", None),
    (1152, 1024, 512, 6, 5, 352, 0, True, False, "uniform", (0.5, torch.uint8)),
    (656, 128, 64, 4, 4, 1024, 0, False, True, "fixed", (1.0, torch.bool)),
    # DeepSeek-V4's paged C4 rows (584 B, 37440-byte pages, entries of 4 tokens)
    (584, 1024, 512, 3, 3, 256, 0, True, False, "uniform", None),
    (584, 2048, 512, 2, 2, 960, 0, True, False, "fixed", (0.5, torch.uint8)),
    # copier mode last (its CTAs wait on the planners')
    (1152, 128, 64, 4, 4, 64, None, True, False, "uniform", None),
    (656, 1024, 512, 3, 2, 512, 3, False, False, "zero", None),
    (1152, 4096, 2048, 2, 2, 960, None, True, False, "fixed", None),
    (1152, 4096, 2048, 3, 3, 960, None, True, False, "fixed", (0.5, torch.bool)),
    (656, 10240, 8192, 3, 2, 1024, None, True, False, "uniform", None),  # spills
    (584, 1024, 1024, 3, 3, 512, None, True, False, "uniform", (0.3, torch.bool)),
]


def to_gpu(case, dev):
    """GPU copies of the kernel-side tensors of a CPU case (host KV stays pinned on the CPU)."""
    k = case.kernel
    tok = case.slot_tokens_all["kernel"].to(dev)
    lru = case.lru_all["kernel"].to(dev)
    plan = None
    if k["plan"] is not None:
        plan = MissPlan(k["plan"].host_rows.to(dev), k["plan"].device_rows.to(dev), k["plan"].counts.to(dev))
    inputs = {name: (v.to(dev) if isinstance(v, torch.Tensor) else v) for name, v in case.inputs.items()}
    if case.spec.topk_row_pad == 0:
        inputs["top_k_positions"] = inputs["top_k_positions"].contiguous()
    return dict(
        inputs,
        slot_tokens=tok[case.spec.layer], lru=lru[case.spec.layer], out=k["out"].to(dev),
        num_real_reqs=k["num_real_reqs"].to(dev), plan=plan,
        counters=None if k["counters"] is None else k["counters"].to(dev),
        host_kv=row_args(case.host_kv, case.spec.item_bytes),
        device_kv=row_args(case.kernel_kv.to(dev), case.spec.item_bytes), **ratio_kwargs(case.spec.item_bytes),
    ), tok, lru


def ratio_kwargs(item: int) -> dict:
    """``compress_ratio`` for DeepSeek-V4's C4 rows, nothing otherwise."""
    ratio = compress_ratio_of(item)
    return {"compress_ratio": ratio} if ratio != 1 else {}


def raw(kv) -> torch.Tensor:
    """The buffer behind a row view (``C4PagedRows``) or the tensor itself."""
    return getattr(kv, "pages", kv)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build_modules(cases: list) -> None:
    """JIT-build (or load) every module the cases launch, concurrently."""
    configs = sorted({(item, B, K) for item, B, K, *_ in cases})
    t0 = time.time()
    jit.build_all([lambda c=c: jit.resolve_module(*c) for c in configs]
                  + [lambda i=i: jit.replay_module(i) for i in sorted({c[0] for c in configs})])
    print(f"[build] {len(configs)} resolve modules and their replay modules in {time.time() - t0:.0f}s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", default="sanitizer", help="label for the log")
    parser.add_argument("--device", default="cuda", help="device of the kernel launches")
    parser.add_argument("--build-only", action="store_true", help="build the modules the cases need and exit")
    parser.add_argument("--items", type=int, nargs="+", default=None,
                        help="only the cases of these row sizes (e.g. 584: DeepSeek-V4's C4 rows)")
    args = parser.parse_args()
    cases = [c for c in CASES if args.items is None or c[0] in args.items]
    if args.build_only:
        build_modules(cases)
        return 0
    dev = torch.device(args.device)
    cpu = torch.device("cpu")
    pool = HostPool(64 << 20, cpu, pin=dev.type == "cuda", seed=5)
    kbuf = torch.empty(4 * 10241 * 1152, dtype=torch.uint8)
    rbuf = torch.empty_like(kbuf)
    ws = rcuda.make_workspace(8, dev, top_k=8192, spill=True)
    rng = random.Random(3)
    failures = 0
    for n, (item, B, K, batch, real, block, copiers, plan, skip, hit_mode, resident) in enumerate(cases):
        t0 = time.time()
        residency = {} if resident is None else dict(residency=True, resident_prob=resident[0],
                                                      resident_dtype=resident[1], rtt_row_pad=5)
        spec = CaseSpec(item_bytes=item, B=B, top_k=K, num_reqs=batch, num_real=real, max_reqs=batch + 1, seed=n,
                        hit_mode=hit_mode, hit_rate=0.87, short_frac=0.2, plan=plan, skip_io=skip, counters=True,
                        block_size=block, num_copiers=copiers, seq_dtype=rng.choice([torch.int32, torch.int64]),
                        rpi_dtype=rng.choice([torch.int32, torch.int64]), **residency)
        case = make_case(spec, pool, kbuf, rbuf, cpu)
        kw, tok, lru = to_gpu(case, dev)
        rcuda.resolve_cuda(**kw, workspace=ws, block_size=block, num_copiers=copiers)
        sync(dev)
        # results back into the CPU case, then the oracle on the CPU
        case.kernel["out"].copy_(kw["out"].cpu())
        case.slot_tokens_all["kernel"].copy_(tok.cpu())
        case.lru_all["kernel"].copy_(lru.cpu())
        case.kernel_kv.copy_(raw(kw["device_kv"]).cpu())
        if kw["plan"] is not None:
            for a, b in ((case.kernel["plan"].host_rows, kw["plan"].host_rows),
                         (case.kernel["plan"].device_rows, kw["plan"].device_rows),
                         (case.kernel["plan"].counts, kw["plan"].counts)):
                a.copy_(b.cpu())
        if kw["counters"] is not None:
            case.kernel["counters"].copy_(kw["counters"].cpu())
        resolve_batched(**case.ref_kwargs())
        bad = differences(case)
        if kw["plan"] is not None:
            kv2 = torch.zeros_like(raw(kw["device_kv"]))
            rcuda.replay_plan_cuda(plan=kw["plan"], num_real_reqs=kw["num_real_reqs"], host_kv=kw["host_kv"],
                                   device_kv=row_args(kv2, item), workspace=ws, block_size=rng.choice([32, 128, 512]),
                                   num_ctas=3, **ratio_kwargs(item))
            sync(dev)
            ref2 = torch.zeros_like(case.ref_kv)
            replay_plan_batched(plan=case.ref["plan"], num_real_reqs=real, host_kv=row_args(case.host_mirror, item),
                                device_kv=row_args(ref2, item))
            if not torch.equal(kv2.cpu().reshape(-1).view(torch.uint8), ref2.reshape(-1).view(torch.uint8)):
                bad.append("replay device_kv")
        state = ws.state[[0, 32, 64, 96]].tolist()
        if state != [0, 0, 0, 0]:
            bad.append(f"workspace state {state}")
        status = "ok" if not bad else f"MISMATCH {bad}"
        print(f"[{args.tool}] case {n}: item {item} B {B} top_k {K} batch {batch}/{real} block {block} "
              f"copiers {copiers} plan {plan} skip_io {skip} resident {resident}: {status} ({time.time() - t0:.1f}s)",
              flush=True)
        if bad:
            failures += 1
            for x in bad:
                if " " not in x:
                    print(describe_difference(case, x), flush=True)
    print(f"[{args.tool}] {len(cases)} cases, {failures} mismatches", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
