"""SGLang 0.5.17's DeepSeek-V4 on the GPU machine with the tiny V4 model: the upstream baseline.

Runs on the GPU machine from the repository root after scripts/gpu/run.sh prepared /tmp/site
(the site, our wheel and the V4 bundle: TileLang for the mHC kernels; scripts/gpu/build_v4_bundle.sh).
For each implementation it starts one server of ``sglang_hisparse/models/tiny-dsv4`` (dummy weights
from the test-only dummy-init plugin, token-id requests), sends the same greedy requests one at a
time (batch size 1 throughout, so no batch-shape numerics; the servers run side by side on the one
GPU unless --sequential), stops the server by PID and records:
output ids, server start time, exit status, the pool / HiSparse lines of its log. Then it compares
every implementation with the first one token by token and writes ``$OUT/v4probe.json`` (after
every server, so a call cut short still brings back what ran).

    python scripts/gpu/v4_probe.py --impls none,upstream --out $OUT/v4probe.json

Implementations (as scripts/gpu/e2e.py names them):
  none      SGLang without HiSparse; every plugin of ours loaded (--enable-hisparse off)
  upstream  SGLang's own HiSparse; SGLANG_PLUGINS names only our test-only dummy-init plugin
  ours      this plugin's HiSparse (docs/design.md, "DeepSeek-V4"), the same --hisparse-config

docs/deepseek_v4/gpu-probe.md records what ran and what came out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_hisparse.serving.launcher import MODELS_DIR, start_server  # noqa: E402

LOG_DIR = Path(os.environ.get("E2E_LOG_DIR", "/tmp/e2e_logs")) / "v4probe"  # packed by scripts/gpu/run.sh
IMPLS = ("none", "upstream", "ours")
DEFAULT_LENGTHS = "1024,2500,3900,4300,5500,7000,9500,12000"
"""Prompt lengths: four at or below device_buffer_size * 4 = 4096 (the kernel's fast path with the
default buffer of 1024), four above; index_topk 512 makes the C4 attention sparse above 2048."""
DEFAULT_HISPARSE = '{"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 2}'
ENV = {
    # the tiny model is unquantized: the fp8 wo_a GEMM asserts an fp8 quantization_config
    "SGLANG_OPT_FP8_WO_A_GEMM": "0",
    # SGLang switches the prefill indexer to its non-paged path (bs 1, >= 8192 query rows) only
    # without a HiSparse coordinator (dsv4/indexer.py _can_use_nonpaged_indexer): both
    # implementations take the paged path so that their numerics can be compared
    "SGLANG_OPT_DSV4_NONPAGED_INDEXER": "0",
    # V4's default fused top-k is not run-to-run deterministic (near ties): two runs of the same
    # server differed after a few tokens on the H100 (docs/results/gpu_v4probe1b vs gpu_v4probe2);
    # the torch top-k makes the baseline repeatable, so a difference is the implementation's
    "SGLANG_TOPK_TRANSFORM_512_TORCH": "1",
}
POOL_LINE = re.compile(r"(DSV4 pool|pool siz|HiSparse|hisparse|KV Cache is allocated|max_total_num_tokens|"
                       r"Load weight end|Capture cuda graph|TileLang|tilelang|mhc|MHC|Using .*Backend|"
                       r"chunked_prefill_size|context_len)", re.IGNORECASE)
ERROR_LINE = re.compile(r"(Traceback|Error|error:|Exception|assert|CUDA|killed)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS))
    p.add_argument("--model", default="tiny-dsv4", help="a directory under sglang_hisparse/models (or a path)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in tokens, comma list")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    p.add_argument("--hisparse-config", default=DEFAULT_HISPARSE, help="--hisparse-config of upstream and ours")
    p.add_argument("--max-total-tokens", type=int, default=131072)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--graph", action="store_true", help="decode CUDA graphs (off by default: --disable-cuda-graph)")
    p.add_argument("--extra-env", action="append", default=[], metavar="K=V", help="more server environment")
    p.add_argument("--extra-arg", action="append", default=[], metavar="FLAG", help="more server flags (repeat)")
    p.add_argument("--sequential", action="store_true",
                   help="one server after the other (default: all at once on the one GPU, sharing the JIT "
                        "caches, whose builds are file-locked; each server still serves one request at a time)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="seconds for the whole probe: a server is given what is left (less a margin)")
    p.add_argument("--ready-timeout", type=float, default=330.0, help="most seconds one server may take to start")
    p.add_argument("--request-timeout", type=float, default=240.0)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "v4probe.json"))
    args = p.parse_args(argv)
    args.impl_list = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in args.impl_list if i not in IMPLS]
    if bad or not args.impl_list:
        p.error(f"--impls: unknown {bad or 'empty'}; allowed: {', '.join(IMPLS)}")
    try:
        args.length_list = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be integers, got {args.lengths!r}")
    if not args.length_list or min(args.length_list) < 1:
        p.error("--lengths must be positive")
    json.loads(args.hisparse_config)  # fail here, not on the GPU machine's server
    for kv in args.extra_env:
        if "=" not in kv:
            p.error(f"--extra-env wants K=V, got {kv!r}")
    return args


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--grammar-backend", "none", "--max-running-requests", str(args.max_running),
             "--mem-fraction-static", "0.35", "--decode-log-interval", "8",
             # SGLang sizes the SWA pool at 10% of the full pool by default (13056 tokens with
             # --max-total-tokens 131072): a longer prompt waited for SWA room forever, with and without
             # HiSparse (docs/results/gpu_v4probe4); 0.2 leaves room for tiny-dsv4's 16384-token context
             "--swa-full-tokens-ratio", "0.2"]
    if not args.graph:
        flags.append("--disable-cuda-graph")
    return flags + list(args.extra_arg)


def server_env(impl: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(ENV)
    env.update(kv.split("=", 1) for kv in args.extra_env)
    if impl == "upstream":
        env["SGLANG_PLUGINS"] = "hisparse_dummy_init"  # SGLang's own HiSparse, our dummy weights only
    return env


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def first_diff(a: list[int] | None, b: list[int] | None) -> int | None:
    """None: identical; -1: one side missing; else the first index where they differ."""
    if a is None or b is None:
        return -1
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(results: dict, lengths: list[int]) -> dict:
    """Every implementation against the first one that served all requests."""
    impls = [i for i, r in results.items() if r.get("requests")]
    if len(impls) < 2:
        return {"baseline": impls[0] if impls else None, "against": {}, "identical": None}
    base = impls[0]
    against = {}
    for impl in impls[1:]:
        rows = []
        for k, n in enumerate(lengths):
            a = results[base]["requests"][k].get("output_ids") if k < len(results[base]["requests"]) else None
            b = results[impl]["requests"][k].get("output_ids") if k < len(results[impl]["requests"]) else None
            rows.append({"prompt_len": n, "first_diff": first_diff(a, b)})
        against[impl] = {"identical": all(r["first_diff"] is None for r in rows), "per_request": rows}
    return {"baseline": base, "against": against,
            "identical": all(v["identical"] for v in against.values())}


def interesting_lines(log: str, pattern: re.Pattern = POOL_LINE, limit: int = 60, width: int = 400) -> list[str]:
    """Matching log lines, cut to ``width`` characters; the one-line ``server_args=`` dump is left
    out (it names every option, HiSparse's included)."""
    lines = [ln[:width] for ln in log.splitlines() if pattern.search(ln) and "server_args=" not in ln]
    return lines[:limit]


def run_impl(impl: str, args: argparse.Namespace, inputs: list[list[int]], deadline: float) -> dict:
    row: dict = {"impl": impl, "env": server_env(impl, args), "started": False}
    hisparse = args.hisparse_config if impl in ("upstream", "ours") else None
    row["hisparse_config"] = hisparse
    ready_timeout = max(30.0, min(args.ready_timeout, deadline - time.time() - 45))
    t0 = time.time()
    server = None
    try:
        server = start_server(model=args.model, hisparse_config=hisparse, extra_args=server_flags(args),
                              env=row["env"], log_dir=LOG_DIR, cpu=False, name=f"v4_{impl}",
                              max_total_tokens=args.max_total_tokens, ready_timeout=ready_timeout)
        row["started"] = True
        row["start_s"] = round(time.time() - t0, 1)
        row["command"] = server.args
        print(f"[v4probe] {impl}: server up in {row['start_s']} s", flush=True)
        row["requests"] = []
        for n, ids in zip(args.length_list, inputs):
            if time.time() > deadline - 20:
                row["requests"].append({"prompt_len": n, "error": "skipped: probe budget spent"})
                continue
            t1 = time.time()
            try:
                out = server.generate(ids, args.new_tokens, timeout=min(args.request_timeout, deadline - time.time()))
                req = {"prompt_len": n, "output_ids": out.get("output_ids"), "latency_s": round(time.time() - t1, 2),
                       "finish_reason": (out.get("meta_info") or {}).get("finish_reason")}
            except Exception as e:  # noqa: BLE001 - recorded
                req = {"prompt_len": n, "error": repr(e), "latency_s": round(time.time() - t1, 2)}
            print(f"[v4probe] {impl}: {n} tokens -> {req.get('output_ids', req.get('error'))!s:.160}", flush=True)
            row["requests"].append(req)
    except Exception as e:  # noqa: BLE001 - a server that does not start is a result
        row["error"] = f"{type(e).__name__}: {e}"
        row["start_s"] = round(time.time() - t0, 1)
        print(f"[v4probe] {impl}: FAILED after {row['start_s']} s: {str(e)[:4000]}", flush=True)
        if not isinstance(e, (RuntimeError, TimeoutError)):
            row["traceback"] = traceback.format_exc()
    finally:
        if server is not None:
            alive_before_stop = server.process.poll() is None
            server.stop()
            row["exit_code"] = server.process.returncode
            row["alive_at_stop"] = alive_before_stop
        log_path = LOG_DIR / f"v4_{impl}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        row["log_lines"] = len(log.splitlines())
        row["pool_lines"] = interesting_lines(log)
        row["error_lines"] = interesting_lines(log, ERROR_LINE, limit=40)
        row["log_tail"] = [ln[:400] for ln in log.splitlines()[-60:]]
    return row


def device_info() -> dict:
    info: dict = {}
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = repr(e)
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001
        info["torch"] = repr(e)
    for mod in ("sglang", "tilelang"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            info[mod] = repr(e)
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.budget_s
    model_dir = Path(args.model) if os.path.isdir(args.model) else MODELS_DIR / args.model
    config = json.loads((model_dir / "config.json").read_text())
    inputs = prompts(args.length_list, int(config["vocab_size"]), args.seed)
    report: dict = {
        "argv": sys.argv[1:] if argv is None else argv,
        "model": str(model_dir.relative_to(ROOT)) if model_dir.is_relative_to(ROOT) else str(model_dir),
        "model_config": config, "lengths": args.length_list, "new_tokens": args.new_tokens, "seed": args.seed,
        "server_flags": server_flags(args), "max_total_tokens": args.max_total_tokens,
        "device": device_info(), "impls": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        report["compare"] = compare(report["impls"], args.length_list)
        report["wall_s"] = round(time.time() - t_start, 1)
        out.write_text(json.dumps(report, indent=1))

    lock = threading.Lock()

    def one(impl: str) -> None:
        if time.time() > deadline - 60:
            row = {"impl": impl, "started": False, "error": "skipped: probe budget spent"}
        else:
            try:
                row = run_impl(impl, args, inputs, deadline)
            except Exception as e:  # noqa: BLE001 - recorded
                row = {"impl": impl, "started": False, "error": repr(e), "traceback": traceback.format_exc()}
        with lock:
            report["impls"][impl] = row
            write()

    report["parallel"] = not args.sequential
    if args.sequential:
        for impl in args.impl_list:
            one(impl)
    else:
        threads = [threading.Thread(target=one, args=(impl,)) for impl in args.impl_list]
        for t in threads:
            t.start()
            time.sleep(2)  # distinct ports and process start order
        for t in threads:
            t.join()
    report["impls"] = {impl: report["impls"][impl] for impl in args.impl_list}
    write()
    cmp = report["compare"]
    print(f"[v4probe] compare: {json.dumps(cmp)[:2000]}", flush=True)
    served = all(r.get("requests") and all("output_ids" in q for q in r["requests"])
                 for r in report["impls"].values())
    return 0 if served else 1


if __name__ == "__main__":
    sys.exit(main())
