"""End to end on the H200: one configuration per call, results as JSON fragments.

Runs on the GPU machine from the repository root after scripts/gpu/run.sh prepared
/tmp/site (SGLang 0.5.17 + our wheel). Each subcommand starts real servers with the tiny DSA
model (sglang_hisparse/models/tiny-dsa), drives them with token-id requests, stops them
by PID and writes a JSON fragment; scripts/gpu/collect.py merges fragments into
docs/results/e2e_gpu.json.

    python scripts/gpu/e2e.py exactness --configs ours:4096:1,ours:2048:1 --out $OUT/x.json
    python scripts/gpu/e2e.py throughput --impls none,ours --concurrency 1,8,32 --out $OUT/t.json

Implementations: ``none`` (no HiSparse), ``ours`` (this plugin), ``upstream`` (SGLang's own
HiSparse: SGLANG_PLUGINS selects only our test-only dummy-init plugin, so weights are the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_hisparse.serving.launcher import Server, start_server, wait_for_idle_report  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_log import decode_stats, decode_trace, parse_batches  # noqa: E402

VOCAB = 32768
EXACTNESS_MODELS = ["tiny-dsa", "tiny-dsa-indexshare", "ds32-width", "ds32-width-indexshare", "tiny-dsa-mtp"]
"""Models the exactness workloads run on: index_topk = TOP_K and vocab_size = VOCAB (tested)."""
LOG_DIR = Path(os.environ.get("E2E_LOG_DIR", "/tmp/e2e_logs"))  # packed by scripts/gpu/run.sh
TOP_K = 2048  # the tiny model's index_topk


def parse_graph(mode: str) -> tuple[bool, int | None]:
    """Graph mode of a config: "0" off, "1" on (SGLang's capture sizes), "F<n>": on with the single
    capture size n, so every decode step up to n requests runs padded to n rows (the same GEMM shapes
    whatever the batch: decode numerics do not depend on when requests join)."""
    if mode in ("0", "1"):
        return mode == "1", None
    if mode.startswith("F") and mode[1:].isdigit() and int(mode[1:]) >= 1:
        return True, int(mode[1:])
    raise ValueError(f"graph mode must be 0, 1 or F<n> (fixed capture size), got {mode!r}")


KV_DTYPES = {"bfloat16": "flashmla_sparse", "fp8_e4m3": "flashmla_kv"}
"""KV cache dtypes of the suite and the DSA prefill/decode backend each runs with (SGLang 0.5.17's
HiSparse and ours accept fp8_e4m3 KV with FlashMLA KV only: sglang_hisparse/serving/server_checks.py)."""


def flags(graph: bool, max_total_tokens: int, max_running: int, graph_bs: int | None = None,
          overlap: bool = True, kv_dtype: str = "bfloat16") -> list[str]:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    backend = KV_DTYPES[kv_dtype]
    args = [
        "--trust-remote-code", "--kv-cache-dtype", kv_dtype, "--mem-fraction-static", "0.4",
        "--dsa-prefill-backend", backend, "--dsa-decode-backend", backend,
        "--dsa-topk-backend", "torch", "--context-length", "65536", "--grammar-backend", "none",
        "--max-running-requests", str(max_running), "--decode-log-interval", "1",
    ]
    if not overlap:
        args += ["--disable-overlap-schedule"]
    if graph and graph_bs is not None:
        args += ["--cuda-graph-bs", str(graph_bs), "--cuda-graph-max-bs", str(graph_bs),
                 "--cuda-graph-backend-prefill", "disabled"]
    elif graph:
        args += ["--cuda-graph-max-bs", str(min(max(max_running, 8), 128)), "--cuda-graph-backend-prefill", "disabled"]
    else:
        args += ["--disable-cuda-graph"]
    return args


def accept_all_env(steps: int) -> dict[str, str]:
    """SGLang's simulated acceptance: every verify step accepts all ``steps`` draft tokens (the
    draft's own tokens, then the target's bonus token), so every window position is committed."""
    return {"SGLANG_SIMULATE_ACC_LEN": str(steps + 1), "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}


def speculative_label(steps: int) -> str | None:
    """The ``speculative`` field of a result row: ``NEXTN:<draft tokens>``, None without speculation."""
    return f"NEXTN:{steps}" if steps else None


def spec_flags(steps: int) -> list[str]:
    """Linear MTP speculation with ``steps`` draft tokens per step (NEXTN, top-k 1; the verify
    window is steps + 1 tokens); no flags for 0."""
    if steps <= 0:
        return []
    return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(steps + 1)]


ENV = {"SGLANG_DSA_FUSE_TOPK": "0", "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}


def server_name(impl: str, buffer: int, graph: bool, graph_bs: int | None = None, tag: str = "") -> str:
    """A server's name, which is also its log's file name: ``<impl>_B<buffer>_g<graph>[bs<n>][_<tag>]``."""
    return f"{impl}_B{buffer}_g{int(graph)}{f'bs{graph_bs}' if graph_bs else ''}{f'_{tag}' if tag else ''}"


OURS = ("ours", "ours_hot", "ours_noio", "ours_resident", "ours_nopromo", "ours_elastic", "ours_noprefetch", "ours_reuse",
        "ours_map")
"""Our implementations: the plugin with its defaults (residency on), the plugin with hot buffers
only (residency off), the no-IO oracle of the hot buffers, the plugin with residency set
explicitly, the defaults without promotion back from hot buffers (``promotion_interval`` 0: the
A/B point of issue 44's promotion), the defaults with elastic hot buffers up to twice the size
(``max_device_buffer_size`` 2B: issue 44's A/B point against ``ours``), and three A/B variants of the hot-buffer path (residency off, so that every request
resolves through the kernel): IndexShare prefetch off (every layer resolves), the reuse-table
replacement policy instead of LRU, planning with the position -> slot map."""
HOT_BUFFER_VARIANTS = {"ours_noprefetch": {"indexshare_prefetch": False}, "ours_reuse": {"replacement": "reuse"},
                       "ours_map": {"slot_map": True}}
RESIDENCY_WATERMARK = 0.05


def hisparse_config(impl: str, buffer: int, ratio: int, stats_interval: int = 0,
                    wait_for_staging: bool = False) -> str | None:
    """The ``--hisparse-config`` of an implementation (None: no HiSparse). ``wait_for_staging`` is
    ours only: SGLang's own HiSparse has no such key."""
    if impl in OURS:
        config = {"device_buffer_size": buffer, "host_to_device_ratio": ratio, "stats_log_interval": stats_interval}
        if wait_for_staging:
            config["wait_for_staging"] = True
        if impl == "ours_hot":  # every decoding request in a hot buffer (residency off)
            config["residency"] = False
        if impl == "ours_noio":  # the no-IO oracle of ours_hot: the same planning, no host->device copy
            config.update(skip_io=True, residency=False)
        if impl == "ours_resident":  # pressure-driven residency (docs/design.md, "Residency")
            config.update(residency=True, residency_watermark=RESIDENCY_WATERMARK)
        if impl == "ours_nopromo":  # residency without promotion: demoted requests stay in hot buffers
            config["promotion_interval"] = 0
        if impl == "ours_elastic":  # long hot buffers grow into spare rows, up to 2B
            config["max_device_buffer_size"] = 2 * buffer
        if impl in HOT_BUFFER_VARIANTS:
            config.update(residency=False, **HOT_BUFFER_VARIANTS[impl])
        return json.dumps(config)
    if impl == "upstream":
        return json.dumps({"top_k": TOP_K, "device_buffer_size": buffer, "host_to_device_ratio": ratio})
    return None


def launch(impl: str, *, buffer: int, ratio: int, graph: bool, max_total_tokens: int, max_running: int,
           log_dir: Path, stats_interval: int = 0, graph_bs: int | None = None, tag: str = "",
           overlap: bool = True, wait_for_staging: bool = False, model: str = "tiny-dsa",
           more_flags: tuple[str, ...] = (), kv_dtype: str = "bfloat16", more_env: dict | None = None) -> Server:
    """Start one server of ``model`` (a directory under sglang_hisparse/models); its log is
    ``<log_dir>/<server_name(...)>.log``."""
    env = {**ENV, **(more_env or {})}
    if impl == "upstream":
        env["SGLANG_PLUGINS"] = "hisparse_dummy_init"
    return start_server(
        model=model, hisparse_config=hisparse_config(impl, buffer, ratio, stats_interval, wait_for_staging),
        extra_args=flags(graph, max_total_tokens, max_running, graph_bs, overlap, kv_dtype) + list(more_flags),
        env=env, log_dir=log_dir, cpu=False, name=server_name(impl, buffer, graph, graph_bs, tag),
        max_total_tokens=max_total_tokens, ready_timeout=420,
    )


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


# --- exactness ---------------------------------------------------------------------------------
FIRST_WAVE = [2048 - 64, 16384, 32768, 61440, 2000, 16000, 32000, 60000, 8192, 24576, 4096, 12000]
SECOND_WAVE = [16384, 32768, 3000, 20000, 45000, 1000]  # arrives while the first wave decodes
ABORTED = (1, 4)  # indices in the second wave, aborted mid-decode


def lockstep_workload(server: Server, new_tokens: int) -> dict:
    """Both waves' prompts (18 requests, none aborted) in one batched call: both servers run
    identical batches. Named ``ls-<i>`` so that every one of them is compared."""
    outs = server.generate(prompts(FIRST_WAVE, seed=1) + prompts(SECOND_WAVE, seed=2), new_tokens)
    return {f"ls-{i}": o for i, o in enumerate(outs)}


def exactness_workload(server: Server, new_tokens: int) -> dict:
    """Wave 1 in one batched call; wave 2 arrives while wave 1 decodes (separate calls, two of
    them aborted mid-decode). Returns output ids by request name."""
    results: dict[str, object] = {}
    wave2 = prompts(SECOND_WAVE, seed=2)
    rids = [f"w2-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(wave2))]

    def second_wave(i: int) -> None:
        try:
            out = server.generate(wave2[i], new_tokens if i not in ABORTED else 16 * new_tokens, rid=rids[i])
            results[f"w2-{i}"] = out
        except Exception as e:  # noqa: BLE001 - recorded
            results[f"w2-{i}"] = {"error": repr(e)}

    def first_wave() -> None:
        outs = server.generate(prompts(FIRST_WAVE, seed=1), new_tokens)
        for i, o in enumerate(outs):
            results[f"w1-{i}"] = o

    decodes_before = server.log().count("Decode batch")  # warm-up requests decode too

    def decodes() -> int:
        return server.log().count("Decode batch") - decodes_before

    t1 = threading.Thread(target=first_wave)
    t1.start()
    deadline = time.time() + 300
    while decodes() < 1 and time.time() < deadline:  # logged every step
        time.sleep(0.05)
    threads = [threading.Thread(target=second_wave, args=(i,)) for i in range(len(wave2))]
    for t in threads:
        t.start()
    # abort once the aborted requests decode (their output would otherwise run 16x longer)
    deadline = time.time() + 120
    while decodes() < 40 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    for i in ABORTED:
        server.abort(rids[i])
    t1.join()
    for t in threads:
        t.join()
    return results


def compare(base: dict, test: dict) -> tuple[list, list]:
    """(names compared, first differing token index per name: None = identical, -1 = missing)."""
    names = sorted(k for k in base if not (k.startswith("w2-") and int(k.split("-")[1]) in ABORTED))
    first_diff = []
    for k in names:
        a, b = base[k].get("output_ids"), test.get(k, {}).get("output_ids")
        if a is None or b is None:
            first_diff.append(-1)
        elif a == b:
            first_diff.append(None)
        else:
            first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return names, first_diff


def digests(outputs: dict) -> dict[str, str | None]:
    """First 12 hex digits of sha1 over each sequence's output ids (None when it has none): rows of
    different implementations can then be compared with each other, not only with the baseline."""
    return {k: hashlib.sha1(json.dumps(v["output_ids"]).encode()).hexdigest()[:12]
            if isinstance(v, dict) and "output_ids" in v else None for k, v in sorted(outputs.items())}


def settled_log(server) -> str:
    """The server's log once every step of the requests answered so far is in it. SGLang streams a
    decode step's outputs before it logs that step's "Decode batch" line (``process_batch_result_decode``:
    ``stream_output`` then ``report_decode_stats``), so a client can hold its last token while the
    last line is not yet written. A one-token request runs its prefill (and no decode step) in a
    later scheduler iteration than any step already answered, so once it is answered those lines
    are in the log; it adds a prefill line and no decode line."""
    server.generate(prompts([4], seed=0)[0], 1)
    return server.log()


def run_workload(impl: str, buffer: int, graph_mode: str, workload: str, args, log_suffix: str = ""
                 ) -> tuple[dict, object, str]:
    """Run one workload on a fresh server: (outputs by name, our idle report or None, decode trace:
    the run-length batch sizes of its decode steps, e.g. "1x8 17x128 1x128", warm-up included).
    ``log_suffix`` keeps a second server of the same kind from overwriting the first one's log."""
    graph, graph_bs = parse_graph(graph_mode)
    t = time.time()
    server = launch(impl, buffer=buffer, ratio=args.ratio, graph=graph, max_total_tokens=args.max_total_tokens,
                    max_running=args.max_running, log_dir=LOG_DIR, graph_bs=graph_bs,
                    tag=workload + log_suffix, overlap=not args.no_overlap,
                    wait_for_staging=args.wait_for_staging and impl in OURS, model=args.model,
                    kv_dtype=args.kv_dtype, more_flags=(*spec_flags(args.spec_steps), *parallel_flags(args)),
                    more_env=run_env(args))
    tag = f"{impl} B={buffer} graph={graph_mode} {workload} {args.kv_dtype}"
    print(f"[e2e] {tag}: up in {time.time() - t:.0f}s", flush=True)
    try:
        before = len(server.idle_reports())
        t = time.time()
        outputs = (lockstep_workload if workload == "lockstep" else exactness_workload)(server, args.new_tokens)
        print(f"[e2e] {tag}: workload {time.time() - t:.0f}s", flush=True)
        report = wait_for_idle_report(server, after=before) if impl in OURS else None
        return outputs, report, decode_trace(parse_batches(settled_log(server)))
    finally:
        server.stop()


def run_env(args) -> dict[str, str]:
    """Environment every server of an exactness run gets (the baseline too): simulated acceptance
    (``--accept-all``) and SGLang's test retraction (``--retract``: a running decode request is
    retracted every third scheduler step)."""
    env = accept_all_env(args.spec_steps) if args.accept_all else {}
    if getattr(args, "retract", False):
        env["SGLANG_TEST_RETRACT"] = "1"
    return env


def parallel_flags(args) -> tuple[str, ...]:
    """The layout flags of every server of an exactness run (the baseline too: dummy weights are
    seeded per shard, so only servers of the same layout compare): ``--tp``, and ``--dp`` with DP
    attention. Nothing for one GPU."""
    flags: tuple[str, ...] = ()
    if getattr(args, "tp", 1) > 1:
        flags += ("--tp-size", str(args.tp))
    if getattr(args, "dp", 1) > 1:
        flags += ("--dp-size", str(args.dp), "--enable-dp-attention")
    return flags


def parse_config(text: str, default_workload: str) -> tuple[str, int, str, str]:
    """``impl:B:graph[:workload]``: impl none, upstream or one of ``OURS``, graph 0|1|F<n>, workload
    arrival|lockstep."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in ("none", "upstream") + OURS or not parts[1].isdigit():
        raise ValueError(f"config must be impl:B:graph[:workload] (impl none|upstream|{'|'.join(OURS)}), got {text!r}")
    parse_graph(parts[2])
    workload = parts[3] if len(parts) == 4 else default_workload
    if workload not in ("arrival", "lockstep"):
        raise ValueError(f"workload must be arrival or lockstep, got {workload!r} in {text!r}")
    return parts[0], int(parts[1]), parts[2], workload


def accept_length(outputs: dict) -> float | None:
    """Mean of the sequences' ``spec_accept_length`` (tokens per verify step; None when absent)."""
    values = [v["meta_info"].get("spec_accept_length") for v in outputs.values()
              if isinstance(v, dict) and "meta_info" in v]
    values = [float(x) for x in values if x is not None]
    return round(sum(values) / len(values), 4) if values else None


def exactness(args) -> dict:
    """Configs ``impl:B:graph[:workload]`` (e.g. ours:4096:1, ours:2048:F24:arrival,
    upstream:4096:0:lockstep); one baseline run per (graph mode, workload), then each config
    compared with it. Stops starting servers when the budget would be exceeded and writes the rows
    it has after every config."""
    t0 = time.time()
    if args.spec_steps and not args.no_overlap:
        raise SystemExit("--spec-steps needs --no-overlap (sglang-hisparse refuses speculation with the overlap scheduler)")
    if args.accept_all and not args.spec_steps:
        raise SystemExit("--accept-all needs --spec-steps")
    default_workload = "lockstep" if args.lockstep else "arrival"
    configs = [parse_config(c, default_workload) for c in args.configs.split(",")]
    rows, baselines, traces = [], {}, {}
    for impl, buffer, graph_mode, workload in configs:
        graph, graph_bs = parse_graph(graph_mode)
        head = {"impl": impl, "B": buffer, "cuda_graph": graph, "graph_bs": graph_bs, "workload": workload}
        key = (graph_mode, workload)
        if time.time() - t0 > args.budget_s - (150 if key in baselines else 220):
            rows.append({**head, "skipped": "time budget"})
            continue
        try:
            if key not in baselines:
                baselines[key], _, traces[key] = run_workload("none", buffer, graph_mode, workload, args)
            outputs, report, trace = run_workload(impl, buffer, graph_mode, workload, args, log_suffix=f"_{len(rows)}")
            names, first_diff = compare(baselines[key], outputs)
            row = {**head, "lockstep": workload == "lockstep", "model": args.model, "kv_dtype": args.kv_dtype,
                   "speculative": speculative_label(args.spec_steps),
                   "accept_length": accept_length(outputs) if args.spec_steps else None,
                   "forced_acceptance": bool(args.accept_all),
                   "overlap_schedule": not args.no_overlap,
                   "wait_for_staging": args.wait_for_staging and impl in OURS, "tp": args.tp, "dp": args.dp,
                   "retract": args.retract,
                   "sequences": len(names),
                   "identical": sum(d is None for d in first_diff), "first_diff": first_diff,
                   "aborted_finish": [outputs.get(f"w2-{i}", {}).get("meta_info", {}).get("finish_reason") for i in ABORTED],
                   "decode_trace": trace, "baseline_decode_trace": traces[key],
                   "digests": digests(outputs), "baseline_digests": digests(baselines[key]),
                   "idle_report": report}
        except Exception as e:  # noqa: BLE001 - record and go on with the next config
            row = {**head, "error": repr(e)[:2000]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("idle_report", "digests", "baseline_digests")}),
              flush=True)
        Path(args.out).write_text(json.dumps({"exactness": rows}, indent=1))
    return {"exactness": rows}


# --- throughput --------------------------------------------------------------------------------
def throughput(args) -> dict:
    """Per implementation one server; per level a 1-token call (prefill time) then the full call.
    decode_tok_s / tpot_ms / decode_steps / max_running come from the server's own per-step log
    lines of the full call (scripts/gpu/decode_log.py); client_* are full call minus 1-token call
    (kept for comparison, unreliable when the two prefills differ)."""
    log_dir = LOG_DIR
    rows = []
    levels = [int(c) for c in args.concurrency.split(",")]
    t_start = time.time()
    for impl in args.impls.split(","):
        if time.time() - t_start > args.budget_s - 150:
            rows.append({"impl": impl, "skipped": "time budget"})
            continue
        t = time.time()
        server = launch(impl, buffer=args.buffer, ratio=args.ratio, graph=True, max_total_tokens=args.max_total_tokens,
                        max_running=max(levels) + 1, log_dir=log_dir)  # + 1: tests/test_sglang_admission.py
        print(f"[e2e] {impl}: up in {time.time() - t:.0f}s", flush=True)
        try:
            for c in levels:
                if time.time() - t_start > args.budget_s - 30:
                    rows.append({"impl": impl, "concurrency": c, "skipped": "time budget"})
                    continue
                batch = prompts([args.context] * c, seed=10 + c)
                before = len(server.idle_reports())
                t0 = time.time()
                server.generate(batch, 1)
                t1 = time.time()
                log_before = len(server.log())  # the full call's batch lines are the log's text after this
                server.generate(batch, args.new_tokens)
                t2 = time.time()
                decode_s = max((t2 - t1) - (t1 - t0), 1e-6)
                miss_rate = None
                if impl in OURS:  # every plugin impl logs an idle report (miss rate None when nothing was selected)
                    rep = wait_for_idle_report(server, after=before)
                    miss_rate = rep["misses"] / rep["selected"] if rep["selected"] else None
                else:
                    settled_log(server)  # the last step's log line (ours: its idle report comes after it)
                row = {"impl": impl, "concurrency": c, "context": args.context,
                       **decode_stats(parse_batches(server.log()[log_before:])),
                       "client_decode_tok_s": c * (args.new_tokens - 1) / decode_s,
                       "client_tpot_ms": 1000 * decode_s / (args.new_tokens - 1), "miss_rate": miss_rate}
                rows.append(row)
                print(json.dumps(row), flush=True)
                Path(args.out).write_text(json.dumps({"throughput": rows}, indent=1))
        except Exception as e:  # noqa: BLE001 - record and go on with the next implementation
            rows.append({"impl": impl, "error": repr(e)[:2000]})
        finally:
            server.stop()
    return {"throughput": rows}


# --- the launch scripts at tiny scale (colocated; PD decode with the fake transfer backend) ------
SCRIPTS = ROOT / "scripts" / "launch"


def script_env(model: str, port: int, extra_args: str, **values: str) -> dict[str, str]:
    """The launch scripts' variables for the tiny model on this machine's GPU (one rank), plus the
    deterministic DSA configuration of the exactness runs."""
    env = {**os.environ, **ENV, "PYTHON": sys.executable, "MODEL": str(ROOT / "sglang_hisparse/models" / model),
           "TP": "1", "DP": "1", "DP_ATTENTION": "0", "HOST": "127.0.0.1", "PORT": str(port),
           "MEM_FRACTION_STATIC": "0.4", "EXTRA_ARGS": extra_args, **values}
    return env


def fake_transfer_body(prompts: list[list[int]], new_tokens: int) -> dict:
    """A request as a PD router sends it to a decode instance, with SGLang's fake bootstrap host."""
    return {"input_ids": prompts, "bootstrap_host": ["2.2.2.2"] * len(prompts),
            "bootstrap_room": list(range(100, 100 + len(prompts))),
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}


def launch_scripts(args) -> dict:
    """scripts/launch/colocated.sh and pd_decode.sh (fake transfer backend, a retraction every third
    step via SGLANG_TEST_RETRACT) serving the tiny model: every request completes, the idle report
    shows every pool at its initial count, and the decode instance did retract."""
    from sglang_hisparse.serving.launcher import free_port, post_json, run_server

    extra = (f"--load-format dummy --skip-tokenizer-init --random-seed 0 --max-total-tokens {args.max_total_tokens} "
             f"{args.server_args}")
    hisparse = {"DEVICE_BUFFER_SIZE": str(args.buffer), "HOST_TO_DEVICE_RATIO": str(args.ratio)}
    lengths = [int(n) for n in args.contexts.split(",")]
    rows = []
    for script, values, retract in (("colocated.sh", {}, False),
                                    ("pd_decode.sh", {"TRANSFER_BACKEND": "fake", "SGLANG_TEST_RETRACT": "1"}, True)):
        port = free_port()
        env = script_env(args.model, port, extra, DEVICE=args.device, **hisparse, **values)
        t = time.time()
        row: dict = {"script": script, "B": args.buffer, "contexts": lengths}
        try:
            server = run_server(["bash", str(SCRIPTS / script)], port=port, env=env, log_dir=LOG_DIR,
                                name=script.removesuffix(".sh"), ready_timeout=420)
        except Exception as e:  # noqa: BLE001 - recorded
            rows.append({**row, "error": repr(e)[-2000:]})
            continue
        print(f"[e2e] {script}: up in {time.time() - t:.0f}s", flush=True)
        try:
            before = len(server.idle_reports())
            batch = prompts(lengths, seed=5)
            body = fake_transfer_body(batch, args.new_tokens) if retract else {
                "input_ids": batch, "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}}
            outs = post_json(f"{server.url}/generate", body, 900)
            report = wait_for_idle_report(server, after=before)
            row.update(completed=sum(len(o["output_ids"]) == args.new_tokens for o in outs), requests=len(outs),
                       pools_back_to_initial=not report["leak"], miss_rate=report["misses"] / report["selected"]
                       if report["selected"] else None,
                       retractions=sum(int(n) for n in re.findall(r"Testing retraction\. #retracted_reqs: (\d+)",
                                                                  server.log())))
        except Exception as e:  # noqa: BLE001 - recorded
            row["error"] = repr(e)[-2000:]
        finally:
            server.stop()
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps({"launch_scripts": rows}, indent=1))
    return {"launch_scripts": rows}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("exactness")
    e.add_argument("--configs", default="ours:4096:1",
                   help="impl:B:graph[:workload], comma separated; graph 0|1|F<n>, workload arrival|lockstep")
    e.add_argument("--ratio", type=int, default=4)
    e.add_argument("--budget-s", type=float, default=540)
    e.add_argument("--lockstep", action="store_true",
                   help="default workload lockstep: both waves in one batched call (identical batches in both servers)")
    e.add_argument("--new-tokens", type=int, default=128)
    e.add_argument("--max-total-tokens", type=int, default=524288)
    e.add_argument("--model", default="tiny-dsa", choices=EXACTNESS_MODELS,
                   help="tiny-dsa-indexshare: index_topk_freq 2 (every second layer reuses the previous top-k); "
                        "ds32-width(-indexshare): the representative-width models of the sweep (same top_k and "
                        "vocabulary, 8 layers of DeepSeek-V3.2's widths)")
    e.add_argument("--kv-dtype", default="bfloat16", choices=sorted(KV_DTYPES),
                   help="KV cache dtype of every server (the baseline too); fp8_e4m3 runs FlashMLA KV")
    e.add_argument("--no-overlap", action="store_true",
                   help="every server (the baseline too) with --disable-overlap-schedule")
    e.add_argument("--spec-steps", type=int, default=0,
                   help="every server (the baseline too) with linear MTP speculation of this many draft tokens "
                        "(NEXTN, --speculative-eagle-topk 1; needs --model tiny-dsa-mtp and --no-overlap)")
    e.add_argument("--accept-all", action="store_true",
                   help="with --spec-steps: every server accepts every draft token (SGLang's simulated acceptance "
                        "with the real draft tokens), so every verify window is committed")
    e.add_argument("--wait-for-staging", action="store_true",
                   help='ours with "wait_for_staging": true (prefilled requests join decode in the same step '
                        "as without HiSparse; with --no-overlap the decode batches are the baseline's)")
    e.add_argument("--retract", action="store_true",
                   help="every server (the baseline too) with SGLANG_TEST_RETRACT=1: a decode request retracted "
                        "every third scheduler step (colocated, a retracted request is prefilled again on resume)")
    e.add_argument("--tp", type=int, default=1, help="--tp-size of every server (the baseline too)")
    e.add_argument("--dp", type=int, default=1,
                   help="--dp-size with --enable-dp-attention on every server (the baseline too); needs --tp >= dp")
    e.add_argument("--max-running", type=int, default=len(FIRST_WAVE) + len(SECOND_WAVE) + 1,
                   help="--max-running-requests of every server; default 19: SGLang 0.5.17 without HiSparse "
                        "decodes at most max-running-requests - 1 requests together "
                        "(tests/test_sglang_admission.py), and all 18 must fit")
    e.add_argument("--out", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--impls", default="none,upstream,ours")
    t.add_argument("--concurrency", default="1,8,32,64")
    t.add_argument("--context", type=int, default=32768)
    t.add_argument("--new-tokens", type=int, default=256)
    t.add_argument("--buffer", type=int, default=4096)
    t.add_argument("--ratio", type=int, default=8)
    t.add_argument("--max-total-tokens", type=int, default=262144)
    t.add_argument("--budget-s", type=float, default=540)
    t.add_argument("--out", required=True)
    ls = sub.add_parser("launch-scripts")
    ls.add_argument("--model", default="tiny-dsa")
    ls.add_argument("--device", default="cuda")
    ls.add_argument("--contexts", default="2000,16000,32000,60000")
    ls.add_argument("--new-tokens", type=int, default=64)
    ls.add_argument("--buffer", type=int, default=4096)
    ls.add_argument("--ratio", type=int, default=4)
    ls.add_argument("--max-total-tokens", type=int, default=262144)
    ls.add_argument("--server-args", default="--context-length 65536 --grammar-backend none --dsa-topk-backend torch "
                    "--cuda-graph-max-bs 8 --cuda-graph-backend-prefill disabled",
                    help="more flags for both servers (EXTRA_ARGS of the scripts)")
    ls.add_argument("--out", required=True)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    result = {"exactness": exactness, "throughput": throughput, "launch-scripts": launch_scripts}[args.cmd](args)
    result["command"] = " ".join(["python", "scripts/gpu/e2e.py"] + sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
