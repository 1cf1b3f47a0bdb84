"""The performance sweep: decode throughput of no HiSparse, SGLang's HiSparse, ours and ours without
IO (the no-IO oracle) at one HBM budget, per concurrency, per locality of the dummy weights.

Runs on the GPU machine (scripts/gpu/run.sh job ``sweep``), one server per point (impl:locality),
the points one after another; on each server every concurrency level is run ``--repeats`` times
back to back (a full prefill and ``--new-tokens`` greedy tokens each time: no prefix cache with
HiSparse). Rows follow docs/results/perf.json's schema (docs/performance.md), plus the raw runs:

    python scripts/gpu/sweep.py --model ds32-width --points none:realistic,ours:realistic \\
        --concurrency 1,8,32 --repeats 3 --out $OUT/sweep.json

Decode tokens/s and TPOT come from the server's own per-step log lines (scripts/gpu/decode_log.py);
the miss rate and the IO volume from our Prometheus series (``--enable-metrics``, read after the
idle report, which publishes exact totals). ``--timing-context`` adds, on the ``none`` server,
one short-context run per level whose TPOT divided by the model's layer count is the per-layer
decode time docs/performance.md uses to explain the model choice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
from decode_log import decode_stats, parse_batches  # noqa: E402
from profile_summary import load_events, summarize as summarize_profile  # noqa: E402

from sglang_hisparse_testkit.dummy_init import LOCALITY_ENV, LOCALITY_PRESETS, locality_strength  # noqa: E402
from sglang_hisparse.serving.launcher import Server, scrape_metrics, wait_for_idle_report  # noqa: E402

IMPLS = ("none", "upstream", *e2e.OURS)


def parse_points(text: str) -> list[tuple[str, str]]:
    """``impl:locality,...`` -> pairs; raises ValueError naming the allowed values."""
    points = []
    for item in text.split(","):
        impl, _, locality = item.partition(":")
        if impl not in IMPLS:
            raise ValueError(f"--points: impl {impl!r} is not one of {', '.join(IMPLS)}")
        locality_strength(locality or "none")  # raises with the allowed values
        points.append((impl, locality or "none"))
    return points


def layer_count(model: str) -> int:
    return json.loads((e2e.ROOT / "sglang_hisparse/models" / model / "config.json").read_text())["num_hidden_layers"]


def measure(server: Server, impl: str, batch: list[list[int]], new_tokens: int | list[int]) -> dict:
    """One call of ``batch`` with ``new_tokens`` greedy tokens (one count, or one per prompt);
    decode numbers from the log window of this call, miss rate and bytes from our counters (ours
    only)."""
    ours = impl.startswith("ours")
    reports = len(server.idle_reports())
    before = scrape_metrics(server) if ours else {}
    log_start = len(server.log())
    results = server.generate(batch, new_tokens)
    if ours:
        # the report publishes exact totals and our host time per decode step of this call
        host_us = wait_for_idle_report(server, after=reports)["host_us_per_step"]
    else:
        e2e.settled_log(server)  # the last step's log line (ours: its idle report comes after it)
    run = decode_stats(parse_batches(server.log()[log_start:]))
    accept = e2e.accept_length(dict(enumerate(results)))
    if accept is not None:
        run["accept_length"] = accept
    if ours:
        after = scrape_metrics(server)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        selected = delta.get("sglang_hisparse_selected_rows_total", 0.0)
        run["miss_rate"] = delta.get("sglang_hisparse_miss_rows_total", 0.0) / selected if selected else None
        total_new = sum(new_tokens) if isinstance(new_tokens, list) else len(batch) * new_tokens
        decode_s = total_new / run["decode_tok_s"]  # approximate: all decode tokens at the pure-step rate
        run["io_gb_s"] = delta.get("sglang_hisparse_copied_bytes_total", 0.0) / decode_s / 1e9
        run["host_us_per_step"] = host_us
    return run


def summarize(impl: str, locality: str, concurrency: int, runs: list[dict], kv_dtype: str = "bfloat16") -> dict:
    """One perf.json row from repeated runs: medians, the spread of decode tok/s, the raw runs."""
    rates = [r["decode_tok_s"] for r in runs]
    misses = [r["miss_rate"] for r in runs if r.get("miss_rate") is not None]
    io = [r["io_gb_s"] for r in runs if "io_gb_s" in r]
    accepts = [r["accept_length"] for r in runs if "accept_length" in r]
    host = [r["host_us_per_step"] for r in runs if r.get("host_us_per_step")]
    return {"impl": impl, "locality": locality, "kv_dtype": kv_dtype,
            **({"accept_length": statistics.median(accepts)} if accepts else {}),
            "miss_rate": statistics.median(misses) if misses else None,
            "concurrency": concurrency, "held": max(r["max_running"] for r in runs), "repeats": len(runs),
            "decode_tok_s": statistics.median(rates), "decode_tok_s_spread": [min(rates), max(rates)],
            "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
            "io_gb_s": statistics.median(io) if io else None,
            **({"host_us_per_step": statistics.median(host)} if host else {}), "runs": runs}


def no_pressure_lengths(concurrency: int, buffer: int, seed: int) -> list[int]:
    """Prompt lengths of the no-pressure point: uniform in [B/8, 3B/8], so that prompt + new tokens
    stay below B (every request on the fast path) and 128 of them fit a 262,144-token pool."""
    rng = random.Random(seed)
    return [rng.randrange(buffer // 8, 3 * buffer // 8) for _ in range(concurrency)]


def mixed_shapes(concurrency: int, context: int, new_tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """Prompt lengths and new-token counts of the mixed point: prompts uniform in
    [context/4, context], new tokens uniform in [new_tokens/4, new_tokens], independent, so that
    requests finish at different steps and give their device rows back while longer ones still
    decode (the chance promotion needs; a uniform point frees rows only when all finish)."""
    rng = random.Random(seed)
    lengths = [rng.randint(context // 4, context) for _ in range(concurrency)]
    counts = [rng.randint(max(1, new_tokens // 4), new_tokens) for _ in range(concurrency)]
    return lengths, counts


def level_batch(args, concurrency: int, seed: int) -> tuple[list[list[int]], int | list[int]]:
    """The prompts and new-token counts of one run at ``concurrency``: ``--context`` tokens each
    and ``--new-tokens``, the no-pressure mix, or the mixed point (``--mixed``)."""
    if args.no_pressure:
        return e2e.prompts(no_pressure_lengths(concurrency, args.buffer, seed), seed=seed), args.new_tokens
    if args.mixed:
        lengths, counts = mixed_shapes(concurrency, args.context, args.new_tokens, seed)
        return e2e.prompts(lengths, seed=seed), counts
    return e2e.prompts([args.context] * concurrency, seed=seed), args.new_tokens


def start_profile(server: Server, out_dir: Path, steps: int, timeout: float = 300) -> None:
    """SGLang's torch profiler over the next ``steps`` forward steps (CPU and GPU activities, Python
    stacks, no shapes); returns once the trace is written under ``out_dir``."""
    body = {"output_dir": str(out_dir), "num_steps": steps, "activities": ["CPU", "GPU"], "with_stack": True,
            "record_shapes": False, "profile_by_stage": False}
    request = urllib.request.Request(f"{server.url}/start_profile", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


def profile_level(server: Server, args, impl: str, concurrency: int, held: int, out_dir: Path) -> dict:
    """One more run at ``concurrency``, profiled for ``--profile-steps`` decode steps once ``held``
    requests decode together (steady state); the trace reduced by scripts/gpu/profile_summary.py."""
    batch, new_tokens = level_batch(args, concurrency, seed=10 + concurrency)
    log_start = len(server.log())
    worker = threading.Thread(target=server.generate, args=(batch, new_tokens), daemon=True)
    worker.start()
    deadline = time.time() + 300
    while time.time() < deadline:
        running = [b.running for b in parse_batches(server.log()[log_start:]) if b.decode]
        if running and running[-1] >= held:
            break
        time.sleep(0.02)
    out_dir.mkdir(parents=True, exist_ok=True)
    start_profile(server, out_dir, args.profile_steps)
    worker.join()
    traces = sorted(out_dir.glob("*.trace.json*"))
    if not traces:
        raise RuntimeError(f"no trace under {out_dir}")
    summary = summarize_profile(load_events(traces[-1]), skip=2)
    return {"impl": impl, "concurrency": concurrency, "held": held, "steps": args.profile_steps, **summary}


def layer_timing(server: Server, args, layers: int) -> list[dict]:
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        run = measure(server, "none", e2e.prompts([args.timing_context] * c, seed=20 + c), args.timing_new_tokens)
        rows.append({"concurrency": c, "context": args.timing_context, "tpot_ms": run["tpot_ms"],
                     "per_layer_ms": run["tpot_ms"] / layers, "held": run["max_running"]})
        print(json.dumps({"layer_timing": rows[-1]}), flush=True)
    return rows


def spec_server_flags(steps: int) -> tuple[str, ...]:
    """Every server of a speculative sweep: linear MTP (e2e.spec_flags) without the overlap
    scheduler (sglang-hisparse refuses speculation with it; the others run the same way)."""
    return (*e2e.spec_flags(steps), "--disable-overlap-schedule") if steps else ()


def sweep(args) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    layers = layer_count(args.model)
    profile_levels = {int(c) for c in args.profile_levels.split(",") if c}
    profile_impls = set(args.profile_impls.split(",")) if args.profile_impls else set(IMPLS)
    result: dict = {"model": args.model, "layers": layers, "kv_dtype": args.kv_dtype,
                    "speculative": e2e.speculative_label(args.spec_steps),
                    "context": (f"{args.buffer // 8}-{3 * args.buffer // 8}" if args.no_pressure
                                else f"{args.context // 4}-{args.context}" if args.mixed else args.context),
                    "pressure": not args.no_pressure, "mixed": args.mixed,
                    "new_tokens": (f"{max(1, args.new_tokens // 4)}-{args.new_tokens}" if args.mixed
                                   else args.new_tokens),
                    "max_total_tokens": args.max_total_tokens, "B": args.buffer, "ratio": args.ratio,
                    "locality_presets": LOCALITY_PRESETS, "rows": [], "layer_timing": [], "profiles": [], "skipped": []}
    t_start = time.time()

    def left() -> float:
        return args.budget_s - (time.time() - t_start)

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    def start(impl: str, locality: str) -> Server | None:
        if left() < args.start_margin_s:
            result["skipped"].append(f"{impl}:{locality} (time budget)")
            return None
        os.environ[LOCALITY_ENV] = locality
        t = time.time()
        try:
            server = e2e.launch(impl, buffer=args.buffer, ratio=args.ratio, graph=True,
                                max_total_tokens=args.max_total_tokens, max_running=max(levels) + 1,
                                log_dir=e2e.LOG_DIR, tag=f"{args.model}_{locality}_{args.kv_dtype}", model=args.model,
                                more_flags=("--enable-metrics", *spec_server_flags(args.spec_steps),
                                            "--decode-log-interval", str(args.decode_log_interval),
                                            *(("--mem-fraction-static", str(args.mem_fraction)) if args.mem_fraction
                                              else ())),
                                kv_dtype=args.kv_dtype)
        except Exception as e:  # noqa: BLE001 - recorded, the next point runs
            result["skipped"].append(f"{impl}:{locality} failed to start: {repr(e)[-1500:]}")
            save()
            return None
        finally:
            os.environ.pop(LOCALITY_ENV, None)
        print(f"[sweep] {impl}:{locality} up in {time.time() - t:.0f}s", flush=True)
        if impl == "none" and args.timing_context and not result["layer_timing"]:
            result["layer_timing"] = layer_timing(server, args, layers)
        return server

    def run_once(server: Server, impl: str, locality: str, c: int, repeat: int) -> dict | None:
        if left() < args.level_margin_s:
            result["skipped"].append(f"{impl}:{locality} c={c} repeat {repeat} (time budget)")
            return None
        return measure(server, impl, *level_batch(args, c, seed=10 + c))

    def finish_level(server: Server, impl: str, locality: str, c: int, runs: list[dict]) -> None:
        if not runs:
            return
        result["rows"].append(summarize(impl, locality, c, runs, args.kv_dtype))
        print(json.dumps({k: v for k, v in result["rows"][-1].items() if k != "runs"}), flush=True)
        if c in profile_levels and impl in profile_impls and left() >= args.level_margin_s:
            try:
                profile = profile_level(server, args, impl, c, result["rows"][-1]["held"],
                                        Path(args.profile_dir) / f"{impl}_{locality}_c{c}")
                result["profiles"].append(profile)
                print(json.dumps({"profile": profile}), flush=True)
            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                result["skipped"].append(f"{impl}:{locality} c={c} profile failed: {repr(e)[-800:]}")
        save()

    points = parse_points(args.points)
    if args.interleave:
        # every point's server up at once; each repeat of a level runs every server in turn, so
        # that drift of the host (the step is host-bound at small sizes) hits them alike
        servers = [(impl, locality, start(impl, locality)) for impl, locality in points]
        live = [(i, l, srv) for i, l, srv in servers if srv is not None]
        try:
            for c in levels:
                runs: dict[str, list[dict]] = {f"{i}:{l}": [] for i, l, _ in live}
                for r in range(args.repeats):
                    for impl, locality, server in live:
                        try:
                            run = run_once(server, impl, locality, c, r)
                        except Exception as e:  # noqa: BLE001 - recorded, the others go on
                            result["skipped"].append(f"{impl}:{locality} c={c} failed: {repr(e)[-800:]}")
                            run = None
                        if run is not None:
                            runs[f"{impl}:{locality}"].append(run)
                for impl, locality, server in live:
                    finish_level(server, impl, locality, c, runs[f"{impl}:{locality}"])
        finally:
            for _, _, server in live:
                server.stop()
        save()
        return result
    for impl, locality in points:
        server = start(impl, locality)
        if server is None:
            continue
        try:
            for c in levels:
                runs = []
                for r in range(args.repeats):
                    run = run_once(server, impl, locality, c, r)
                    if run is None:
                        break
                    runs.append(run)
                finish_level(server, impl, locality, c, runs)
        except Exception as e:  # noqa: BLE001 - recorded, the next point runs
            result["skipped"].append(f"{impl}:{locality} failed: {repr(e)[-1500:]}")
        finally:
            server.stop()
        save()
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-dsa", help="a directory under sglang_hisparse/models")
    p.add_argument("--points", default="none:realistic,upstream:realistic,ours:realistic,ours_noio:realistic",
                   help=f"impl:locality,... (impl: {', '.join(IMPLS)}; locality: a preset or a strength)")
    p.add_argument("--kv-dtype", default="bfloat16", choices=sorted(e2e.KV_DTYPES),
                   help="KV cache dtype of every server; fp8_e4m3 (656-byte rows) runs FlashMLA KV")
    p.add_argument("--spec-steps", type=int, default=0,
                   help="linear MTP speculation with this many draft tokens on every server (needs a model with an "
                        "MTP layer, e.g. ds32-width-mtp; runs without the overlap scheduler)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--no-pressure", action="store_true",
                   help="the no-pressure point: prompts uniform in [B/8, 3B/8] instead of --context (shorter than B "
                        "with their new tokens; 128 of them fit the default pool)")
    p.add_argument("--mixed", action="store_true",
                   help="the mixed point: prompts uniform in [context/4, context] and new tokens in "
                        "[new-tokens/4, new-tokens], so requests finish at different steps (promotion's chance)")
    p.add_argument("--interleave", action="store_true",
                   help="start every point's server at once and run each repeat of a level on each server in turn "
                        "(paired runs: host drift hits every server alike; set --mem-fraction so they fit together)")
    p.add_argument("--mem-fraction", type=float, default=0.0,
                   help="--mem-fraction-static of every server (0: e2e.py's 0.4)")
    p.add_argument("--decode-log-interval", type=int, default=1,
                   help="SGLang's decode log interval on every server (the decode numbers come from these lines; "
                        "1 logs every step, which costs host time per step: use 40, SGLang's default, where the "
                        "step is host-bound)")
    p.add_argument("--profile-levels", default="",
                   help="concurrency levels to profile after measuring them (one more run, SGLang's torch profiler)")
    p.add_argument("--profile-steps", type=int, default=24)
    p.add_argument("--profile-impls", default="", help="profile only these impls (default: every point's)")
    p.add_argument("--profile-dir", default="/tmp/profiles")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--buffer", type=int, default=4096)
    p.add_argument("--ratio", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=262144)
    p.add_argument("--timing-context", type=int, default=0, help="per-layer timing on the none server (0: off)")
    p.add_argument("--timing-new-tokens", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--level-margin-s", type=float, default=45, help="a run starts only with this much budget left")
    p.add_argument("--start-margin-s", type=float, default=150,
                   help="a server starts only with this much budget left (a start plus one level must fit)")
    p.add_argument("--out", required=True)
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.mixed and args.no_pressure:
        raise SystemExit("--mixed and --no-pressure choose different prompt shapes: pass one of them")
    result = sweep(args)
    result["command"] = " ".join(["python", "scripts/gpu/sweep.py"] + sys.argv[1:])
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
