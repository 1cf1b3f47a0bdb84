"""The demo: HiSparse serving a tiny DSA model next to the same server without it.

Starts two real SGLang servers on this machine (SGLang's CPU engine when there is no GPU), sends
a few long requests in one batch to each, prints what the resolver did per decode step (hit
rate, miss rows, bytes copied), the pools' free counts when the server is idle again, and
whether the greedy outputs of the two servers are identical. Stops both servers by PID.

    python -m sglang_hisparse.tools.demo [--contexts 1500,2500,3000,3500] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from sglang_hisparse.serving.launcher import has_cuda, start_server, wait_for_idle_report

STEP_LINE = re.compile(r"sglang-hisparse step \d+: .*")


PAGE_SIZE = 64
"""The DSA models' KV page size; SGLang requires the chunked-prefill size to be a multiple of it."""


def one_prefill_chunk(contexts: list[int]) -> int:
    """A chunked-prefill size that holds every prompt in one prefill batch (so both servers run
    identical batches), a multiple of the page size, at least 16384."""
    return max(16384, -(-sum(contexts) // PAGE_SIZE) * PAGE_SIZE)


def server_flags(contexts: list[int], *, cpu: bool) -> tuple[list[str], dict[str, str]]:
    """Flags and environment both servers share: one prefill batch for every prompt, no overlap
    schedule; on GPU the deterministic configuration of docs/e2e_gpu.md."""
    flags = ["--mem-fraction-static", "0.5" if cpu else "0.4", "--disable-overlap-schedule", "--chunked-prefill-size",
             str(one_prefill_chunk(contexts)), "--max-running-requests", str(len(contexts))]
    env = {"SGLANG_HISPARSE_DUMMY_LOCALITY": "realistic"}  # selections overlap as a trained model's do
    if cpu:
        return flags, env
    flags += ["--kv-cache-dtype", "bfloat16", "--dsa-prefill-backend", "flashmla_sparse",
              "--dsa-decode-backend", "flashmla_sparse", "--dsa-topk-backend", "torch",
              "--context-length", "65536", "--grammar-backend", "none"]
    return flags, {**env, "SGLANG_DSA_FUSE_TOPK": "0", "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default=None,
                        help="prompt lengths, comma separated (default: 1500,2500,3000,3500 on CPU; 8000..30000 on GPU)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--device-buffer-size", type=int, default=None,
                        help="B (default: 128 on CPU, whose model has top_k 64; 4096 on GPU, top_k 2048)")
    parser.add_argument("--log-dir", default=None, help="keep server logs here (default: a temp dir)")
    args = parser.parse_args(argv)

    cpu = not has_cuda()
    contexts = [int(c) for c in (args.contexts or ("1500,2500,3000,3500" if cpu else "8000,16000,24000,30000")).split(",")]
    buffer_size = args.device_buffer_size or (128 if cpu else 4096)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hisparse-demo-"))
    common, env = server_flags(contexts, cpu=cpu)
    # wait_for_staging: requests join decode in the step they would without HiSparse (same batches);
    # residency off: these requests fit the pool, so by default they would keep their whole KV on the
    # device and copy nothing; the demo shows the hot buffers at work instead
    config = f'{{"device_buffer_size": {buffer_size}, "stats_log_interval": 1, "wait_for_staging": true, "residency": false}}'
    model = "tiny-dsa-cpu" if cpu else "tiny-dsa"
    print(f"[demo] {'CPU (SGLang CPU engine, torch DSA path)' if cpu else 'GPU'}; model {model}; logs in {log_dir}")
    print(f"[demo] --hisparse-config {config}")

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 2000) for _ in range(n)] for n in contexts]  # < both models' vocab
    servers = []
    try:
        t0 = time.time()
        tokens = 32768 if cpu else 262144
        base = start_server(model=model, extra_args=common, env=env, log_dir=log_dir, name="baseline", cpu=cpu, max_total_tokens=tokens)
        servers.append(base)
        ours = start_server(model=model, hisparse_config=config, extra_args=common, env=env, log_dir=log_dir, name="hisparse", cpu=cpu, max_total_tokens=tokens)
        servers.append(ours)
        print(f"[demo] both servers up in {time.time() - t0:.0f}s; sending {len(prompts)} requests, contexts {contexts}")
        reports_before = len(ours.idle_reports())
        steps_before = len(STEP_LINE.findall(ours.log()))
        outputs = {}
        for name, server in (("without HiSparse", base), ("with HiSparse", ours)):
            t = time.time()
            outputs[name] = [o["output_ids"] for o in server.generate(prompts, args.new_tokens)]
            print(f"[demo] {name}: {len(prompts)} x {args.new_tokens} tokens in {time.time() - t:.1f}s")
        report = wait_for_idle_report(ours, after=reports_before)
        print("[demo] resolver, per decode step (all layers):")
        for line in STEP_LINE.findall(ours.log())[steps_before:]:
            print("    " + line)
        counts = ", ".join(f"{k} {now}/{initial}" for k, (now, initial) in report["counts"].items())
        print(f"[demo] pools when idle again (free/initial): {counts}; leak: {'yes' if report['leak'] else 'no'}")
        if report["selected"]:
            print(f"[demo] server lifetime: {report['selected']} selected rows, {report['misses']} misses "
                  f"(miss rate {report['misses'] / report['selected']:.1%})")
    finally:
        for server in servers:
            server.stop()
        print("[demo] servers stopped")
    same = [a == b for a, b in zip(outputs["without HiSparse"], outputs["with HiSparse"])]
    if all(same):
        print(f"[demo] outputs identical: {len(same)}/{len(same)} requests, {args.new_tokens} greedy tokens each")
        return 0
    print(f"[demo] outputs DIFFER for {same.count(False)}/{len(same)} requests")
    return 1


if __name__ == "__main__":
    sys.exit(main())
