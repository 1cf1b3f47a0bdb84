"""PD disaggregation with a real KV transfer on one machine: exactness and throughput.

Runs on the GPU machine (scripts/gpu/run.sh job ``pd``, with .site/pd.tar.xz carried) or, for a
test at tiny scale, on CPU. One prefill instance without HiSparse (mooncake over TCP on
127.0.0.1, sglang_hisparse_testkit.pd) serves several decode instances side by side on the same
device, each behind its own router; every server starts at once.

    python scripts/gpu/pd.py exactness --decodes ours:4096,ours:2048,ours:4096:retract,upstream:4096,none:4096 \\
        --out $OUT/pd_exact.json
    python scripts/gpu/pd.py throughput --decodes none,ours,upstream --points 32x24576,64x1024 --repeats 2 \\
        --out $OUT/pd_tput.json

``exactness``: the arrival workload of scripts/gpu/e2e.py (18 requests of 1k-61k tokens, the
second wave arriving while the first decodes, two of them aborted on both instances mid-decode)
through every pair at once and through a colocated server without HiSparse; outputs compared
token for token. Every server runs one prefill request per batch (``--prefill-max-requests 1``) and
decode graphs of one size (``--cuda-graph-bs 18``), so a request's numbers do not depend on what
it shares a batch with: a difference is a wrong KV row. ``:retract`` adds ``SGLANG_TEST_RETRACT=1``
(a retraction every third step) to that decode instance. Rows carry the decode instance's idle
report (pools back to initial) and the transfer backend.

``throughput``: per point ``<requests>x<prompt tokens>``, per repeat, the decode implementations in
turn through the same prefill instance: TTFT per request (streamed through the router: time to
the first token, i.e. prefill + transfer + admission), the decode instance's tokens/s (its own
per-step log lines) and the requests it held at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
from decode_log import decode_stats, decode_trace, parse_batches  # noqa: E402

from sglang_hisparse_testkit.pd import PD_ENV, TRANSFER_BACKEND, RoutedPair, decode_args, prefill_args  # noqa: E402
from sglang_hisparse.serving.launcher import Server, free_port, start_server, wait_for_idle_report  # noqa: E402

DECODE_IMPLS = ("none", "upstream", "ours", "ours_hot")
ONE_PREFILL_PER_BATCH = ["--prefill-max-requests", "1"]


def parse_decode(text: str) -> tuple[str, int, bool]:
    """``impl[:B][:retract]`` -> (impl, B, retract); B defaults to 4096."""
    parts = text.split(":")
    impl, rest = parts[0], parts[1:]
    retract = "retract" in rest
    rest = [p for p in rest if p != "retract"]
    if impl not in DECODE_IMPLS or len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise ValueError(f"decode must be impl[:B][:retract] with impl one of {', '.join(DECODE_IMPLS)}, got {text!r}")
    return impl, int(rest[0]) if rest else 4096, retract


def decode_name(impl: str, buffer: int, retract: bool) -> str:
    return f"decode_{impl}_B{buffer}{'_retract' if retract else ''}"


def server_flags(args, *, graph_bs: int | None, max_running: int) -> list[str]:
    if args.device == "cpu":
        return ["--mem-fraction-static", str(args.mem_fraction), "--disable-overlap-schedule",
                "--max-running-requests", str(max_running), "--chunked-prefill-size", "16384"]
    flags = e2e.flags(graph_bs is not None or args.graphs, args.max_total_tokens, max_running, graph_bs)
    flags[flags.index("--mem-fraction-static") + 1] = str(args.mem_fraction)
    return flags


def start_servers(args, decodes: list[tuple[str, int, bool]], *, colocated_baseline: bool, graph_bs: int | None,
                  max_running: int) -> tuple[Server | None, Server, dict[str, Server], int]:
    """Start the colocated baseline (optional), the prefill instance and every decode instance at
    once; returns them and the prefill instance's bootstrap port. Raises if any fails (the others
    are stopped)."""
    bootstrap_port = free_port()
    cpu = args.device == "cpu"
    model = model_name(args)
    base_env = {**e2e.ENV} if not cpu else {}
    common = server_flags(args, graph_bs=graph_bs, max_running=max_running) + ONE_PREFILL_PER_BATCH
    specs: dict[str, dict] = {}
    if colocated_baseline:
        specs["colocated_none"] = dict(extra_args=common, env=base_env, max_total_tokens=args.baseline_max_total_tokens)
    specs["prefill"] = dict(extra_args=common + prefill_args(bootstrap_port), env={**base_env, **PD_ENV},
                            max_total_tokens=args.baseline_max_total_tokens)
    for impl, buffer, retract in decodes:
        env = {**base_env, **PD_ENV, **({"SGLANG_TEST_RETRACT": "1"} if retract else {})}
        if impl == "upstream":
            env["SGLANG_PLUGINS"] = "hisparse_dummy_init"
        specs[decode_name(impl, buffer, retract)] = dict(
            extra_args=common + decode_args(), env=env, max_total_tokens=args.max_total_tokens,
            hisparse_config=e2e.hisparse_config(impl, buffer, args.ratio) if impl != "none" else None)
    started: dict[str, Server] = {}
    errors: list[str] = []

    def start(name: str, spec: dict) -> None:
        try:
            started[name] = start_server(model=model, log_dir=e2e.LOG_DIR, cpu=cpu, name=name, ready_timeout=540, **spec)
        except Exception as e:  # noqa: BLE001 - reported below, after the others
            errors.append(f"{name}: {e!r}"[:3000])

    t = time.time()
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        list(pool.map(lambda item: start(*item), specs.items()))
    if errors:
        for server in started.values():
            server.stop()
        raise RuntimeError("; ".join(errors))
    print(f"[pd] {len(started)} servers up in {time.time() - t:.0f}s: {', '.join(started)}", flush=True)
    decode_servers = {name: started[name] for name in specs if name.startswith("decode_")}
    return started.get("colocated_none"), started["prefill"], decode_servers, bootstrap_port


def stop_all(*servers: Server | None) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda s: s.stop(), [s for s in servers if s is not None]))


# --- exactness ---------------------------------------------------------------------------------
def model_name(args) -> str:
    return args.model if args.device != "cpu" else "tiny-dsa-cpu"


def use_model_vocabulary(args) -> None:
    """Prompts draw token ids below the served model's vocabulary size (e2e.prompts)."""
    config = json.loads((e2e.ROOT / "sglang_hisparse/models" / model_name(args) / "config.json").read_text())
    e2e.VOCAB = config["vocab_size"]


def aborted_outcome(output: dict) -> object:
    """What an aborted request returned: its finish reason, or the error the client got (through a
    router an aborted request may end in an HTTP error rather than a finish reason)."""
    return output.get("meta_info", {}).get("finish_reason") or output.get("error")


def exactness(args) -> dict:
    decodes = [parse_decode(d) for d in args.decodes.split(",")]
    use_model_vocabulary(args)
    if args.workload_scale != 1.0:  # a CPU rehearsal of the script: the same workload, shorter prompts
        e2e.FIRST_WAVE = [max(16, int(n * args.workload_scale)) for n in e2e.FIRST_WAVE]
        e2e.SECOND_WAVE = [max(16, int(n * args.workload_scale)) for n in e2e.SECOND_WAVE]
    base, prefill, decode_servers, bootstrap_port = start_servers(
        args, decodes, colocated_baseline=True, graph_bs=args.graph_bs, max_running=args.max_running)
    pairs = {name: RoutedPair(prefill, server, bootstrap_port) for name, server in decode_servers.items()}
    rows: list[dict] = []
    try:
        before = {name: len(server.idle_reports()) for name, server in decode_servers.items()}
        results: dict[str, dict] = {}
        errors: dict[str, str] = {}

        def run(name: str, client) -> None:
            t = time.time()
            try:
                results[name] = e2e.exactness_workload(client, args.new_tokens)
                print(f"[pd] {name}: workload {time.time() - t:.0f}s", flush=True)
            except Exception as e:  # noqa: BLE001 - recorded in the row
                errors[name] = repr(e)[:2000]

        clients = {"colocated_none": base}
        clients.update({name: SimpleNamespace(generate=pair.generate, abort=pair.abort, log=pair.decode.log)
                        for name, pair in pairs.items()})
        threads = [threading.Thread(target=run, args=item) for item in clients.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if "colocated_none" not in results:
            raise RuntimeError(f"the colocated baseline failed: {errors.get('colocated_none')}")
        baseline = results["colocated_none"]
        base_trace = decode_trace(parse_batches(e2e.settled_log(base)))
        for (impl, buffer, retract), (name, server) in zip(decodes, decode_servers.items()):
            row: dict = {"impl": impl, "B": buffer, "pd": True, "transfer_backend": TRANSFER_BACKEND,
                         "retract": retract, "model": model_name(args),
                         "device": args.device, "graph_bs": args.graph_bs, "max_total_tokens": args.max_total_tokens,
                         "ratio": args.ratio, "prefill_max_requests": 1}
            if name in errors:
                rows.append({**row, "error": errors[name]})
                continue
            outputs = results[name]
            names, first_diff = e2e.compare(baseline, outputs)
            report = wait_for_idle_report(server, after=before[name]) if impl.startswith("ours") else None
            log = e2e.settled_log(clients[name])  # through the router: a decode instance takes no unpaired request
            row.update(sequences=len(names), identical=sum(d is None for d in first_diff), first_diff=first_diff,
                       aborted_finish=[aborted_outcome(outputs.get(f"w2-{i}", {})) for i in e2e.ABORTED],
                       retractions=log.count("Testing retraction"),
                       decode_trace=decode_trace(parse_batches(log)), baseline_decode_trace=base_trace,
                       digests=e2e.digests(outputs), baseline_digests=e2e.digests(baseline),
                       leak=None if report is None else report["leak"],
                       demotions=None if report is None else report["demotions"], idle_report=report)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items()
                              if k not in ("idle_report", "digests", "baseline_digests", "decode_trace",
                                           "baseline_decode_trace")}), flush=True)
            Path(args.out).write_text(json.dumps({"pd_exactness": rows}, indent=1))
    finally:
        for pair in pairs.values():
            pair.close()
        stop_all(base, prefill, *decode_servers.values())
    return {"pd_exactness": rows}


# --- throughput --------------------------------------------------------------------------------
def stream_one(url: str, input_ids: list[int], new_tokens: int, timeout: float = 1800) -> tuple[float, float]:
    """(TTFT, end-to-end seconds) of one streamed greedy request through a router."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    t0 = time.time()
    first = None
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                first = time.time() - t0
    return (first if first is not None else float("nan")), time.time() - t0


def measure_point(pair: RoutedPair, batch: list[list[int]], new_tokens: int, ours: bool) -> dict:
    """One run of ``batch`` through ``pair``, every request streamed at once. With ours, the
    decode instance's idle report after the run: its pools back at their initial counts."""
    log_start = len(pair.decode.log())
    reports = len(pair.decode.idle_reports())
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        timings = list(pool.map(lambda ids: stream_one(pair.url, ids, new_tokens), batch))
    wall = time.time() - t0
    e2e.settled_log(SimpleNamespace(generate=pair.generate, log=pair.decode.log))
    stats = decode_stats(parse_batches(pair.decode.log()[log_start:]))
    ttft = sorted(t for t, _ in timings)
    leak = wait_for_idle_report(pair.decode, after=reports)["leak"] if ours else None
    return {**stats, "leak": leak, "ttft_s_median": statistics.median(ttft), "ttft_s_p90": ttft[int(0.9 * (len(ttft) - 1))],
            "ttft_s_max": ttft[-1], "wall_s": wall, "output_tok_s": len(batch) * new_tokens / wall}


def throughput(args) -> dict:
    impls = args.decodes.split(",")
    use_model_vocabulary(args)
    decodes = [(impl, args.buffer, False) for impl in impls]
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    max_running = max(n for n, _ in points) + 1
    t_start = time.time()
    _, prefill, decode_servers, bootstrap_port = start_servers(args, decodes, colocated_baseline=False,
                                                               graph_bs=None, max_running=max_running)
    pairs = dict(zip(impls, (RoutedPair(prefill, s, bootstrap_port) for s in decode_servers.values())))
    runs: list[dict] = []
    try:
        for point_index, (count, context) in enumerate(points):
            for repeat in range(args.repeats):
                batch = e2e.prompts([context] * count, seed=100 + point_index * 10 + repeat)
                for impl in impls:
                    if time.time() - t_start > args.budget_s - args.run_margin_s:
                        runs.append({"impl": impl, "requests": count, "context": context, "repeat": repeat,
                                     "skipped": "time budget"})
                        continue
                    try:
                        row = measure_point(pairs[impl], batch, args.new_tokens, impl.startswith("ours"))
                    except Exception as e:  # noqa: BLE001 - recorded
                        row = {"error": repr(e)[:2000]}
                    runs.append({"impl": impl, "requests": count, "context": context, "repeat": repeat,
                                 "B": args.buffer, "ratio": args.ratio, "max_total_tokens": args.max_total_tokens,
                                 "transfer_backend": TRANSFER_BACKEND, **row})
                    print(json.dumps(runs[-1]), flush=True)
                    Path(args.out).write_text(json.dumps({"pd_throughput_runs": runs}, indent=1))
    finally:
        for pair in pairs.values():
            pair.close()
        stop_all(prefill, *decode_servers.values())
    return {"pd_throughput_runs": runs, "pd_throughput": summarize(runs)}


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (point, impl): medians over the repeats, the spread of decode tok/s."""
    rows = []
    keys = sorted({(r["requests"], r["context"], r["impl"]) for r in runs if "decode_tok_s" in r})
    for count, context, impl in keys:
        mine = [r for r in runs if (r["requests"], r["context"], r["impl"]) == (count, context, impl)
                and "decode_tok_s" in r]
        rates = [r["decode_tok_s"] for r in mine]
        rows.append({"impl": impl, "requests": count, "context": context, "repeats": len(mine),
                     "held": max(r["max_running"] for r in mine), "decode_tok_s": statistics.median(rates),
                     "decode_tok_s_spread": [min(rates), max(rates)],
                     "ttft_s_median": statistics.median(r["ttft_s_median"] for r in mine),
                     "ttft_s_p90": statistics.median(r["ttft_s_p90"] for r in mine),
                     "output_tok_s": statistics.median(r["output_tok_s"] for r in mine),
                     "transfer_backend": TRANSFER_BACKEND})
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("exactness", "throughput"):
        p = sub.add_parser(name)
        p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        p.add_argument("--model", default="tiny-dsa", help="a model under sglang_hisparse/models (GPU)")
        p.add_argument("--ratio", type=int, default=4)
        p.add_argument("--max-total-tokens", type=int, default=262144, help="of each decode instance")
        p.add_argument("--baseline-max-total-tokens", type=int, default=524288,
                       help="of the prefill instance and the colocated baseline")
        p.add_argument("--mem-fraction", type=float, default=0.75,
                       help="--mem-fraction-static of every server. The servers share the device: SGLang needs the free "
                            "memory it sees at start-up above (1 - this) x the device, and the KV pools are capped by "
                            "--max-total-tokens, so a high value lets every server start beside the others")
        p.add_argument("--new-tokens", type=int, default=128 if name == "exactness" else 256)
        p.add_argument("--out", required=True)
    e = sub.choices["exactness"]
    e.add_argument("--decodes", default="ours:4096,ours:2048,ours:4096:retract,upstream:4096,none:4096",
                   help="impl[:B][:retract], comma separated; impl none|upstream|ours|ours_hot")
    e.add_argument("--graph-bs", type=int, default=18, help="the one decode graph size of every server")
    e.add_argument("--workload-scale", type=float, default=1.0,
                   help="prompt lengths of the workload times this (a CPU rehearsal with the tiny CPU model: 0.04)")
    e.add_argument("--max-running", type=int, default=19)
    e.set_defaults(graphs=True)
    t = sub.choices["throughput"]
    t.add_argument("--decodes", default="none,ours,upstream")
    t.add_argument("--points", default="32x24576,64x1024", help="<requests>x<prompt tokens>, comma separated")
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("--buffer", type=int, default=4096)
    t.add_argument("--budget-s", type=float, default=540)
    t.add_argument("--run-margin-s", type=float, default=60, help="a run starts only with this much budget left")
    t.set_defaults(graphs=True)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    result = {"exactness": exactness, "throughput": throughput}[args.cmd](args)
    result["command"] = " ".join(["python", "scripts/gpu/pd.py"] + sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
