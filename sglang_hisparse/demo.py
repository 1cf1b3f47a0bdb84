"""The demo: HiSparse serving a tiny DSA model next to the same server without it.

Starts two real SGLang servers on this machine (SGLang's CPU engine when there is no GPU), sends
a few long requests in one batch to each, prints what the resolver did per decode step (hit
rate, miss rows, bytes copied), the pools' free counts when the server is idle again, and
whether the greedy outputs of the two servers are identical. Stops both servers by PID.

    python -m sglang_hisparse.demo [--contexts 1500,2500,3000,3500] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from sglang_hisparse.testing.server import has_cuda, start_server, wait_for_idle_report

STEP_LINE = re.compile(r"sglang-hisparse step \d+: .*")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1500,2500,3000,3500", help="prompt lengths, comma separated")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--device-buffer-size", type=int, default=128, help="B (the CPU model's top_k is 64)")
    parser.add_argument("--log-dir", default=None, help="keep server logs here (default: a temp dir)")
    args = parser.parse_args(argv)

    cpu = not has_cuda()
    contexts = [int(c) for c in args.contexts.split(",")]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hisparse-demo-"))
    common = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size",
              str(max(16384, sum(contexts))), "--max-running-requests", str(len(contexts))]
    config = f'{{"device_buffer_size": {args.device_buffer_size}, "stats_log_interval": 1}}'
    model = "tiny-dsa-cpu" if cpu else "tiny-dsa"
    print(f"[demo] {'CPU (SGLang CPU engine, torch DSA path)' if cpu else 'GPU'}; model {model}; logs in {log_dir}")
    print(f"[demo] --hisparse-config {config}")

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 2000) for _ in range(n)] for n in contexts]
    servers = []
    try:
        t0 = time.time()
        base = start_server(model=model, extra_args=common, log_dir=log_dir, name="baseline", cpu=cpu, max_total_tokens=32768)
        servers.append(base)
        ours = start_server(model=model, hisparse_config=config, extra_args=common, log_dir=log_dir, name="hisparse", cpu=cpu, max_total_tokens=32768)
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
