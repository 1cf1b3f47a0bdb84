"""Merge the GPU end-to-end fragments into docs/results/e2e_gpu.json and plot the throughput.

Fragments are the JSON files scripts/gpu/e2e.py wrote on the H200 (kept under
docs/results/gpu_run*/ with the run.log of each call). Runs on the development machine:

    python scripts/gpu/collect.py            # writes docs/results/e2e_gpu.json and e2e_gpu_throughput.png
"""

from __future__ import annotations

import io
import json
import re
import statistics
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_log import decode_stats, decode_trace, parse_batches, split_throughput_run  # noqa: E402
from e2e import speculative_label  # noqa: E402
from v4_probe import first_diff  # noqa: E402

# (fragment, workload description, how the call was made)
FRAGMENTS = [
    ("gpu_run2/exact1.json", "two waves: wave 2 (6 requests, 2 aborted) raced wave 1 (12 requests) at arrival"),
    ("gpu_run3/exact2.json", "two waves: wave 2 (6 requests, 2 aborted) arrives after wave 1 (12 requests) decodes"),
    ("gpu_run5/lockstep.json", "lockstep: wave 1 only (12 requests, 2k-60k contexts) in one batched call"),
    ("gpu_run9/exact3.json", None),  # rows carry their workload and graph_bs
    ("gpu_run10/exact4.json", None),
    ("gpu_run11/exact5.json", None),
    ("gpu_run12/tput.json", None),  # decode numbers recomputed from the server logs (decode_log.py)
    ("gpu_run13/exact6.json", None),
    ("gpu_run14/exact7.json", None),
    ("gpu_run15/exact8.json", None),  # rows carry model, overlap_schedule, wait_for_staging
    ("gpu_run16/exact9.json", None),
    ("gpu_run17/tput2.json", None),  # a repetition of two points on another lent machine
    ("gpu_run18/tput3.json", None),  # ours at concurrency 1 once more (upstream skipped: time budget)
    # the redesigned coordinator (fourth session): the configurations exact before, again
    ("gpu_run19/exact_f18.json", None),
    ("gpu_run20/exact_lockstep.json", None),  # its ours:2048:0 row was skipped (budget set too low)
    ("gpu_run21/exact_f18_2048.json", None),
    ("gpu_run21/exact_lockstep_2048.json", None),
    # seventh session: IndexShare prefetch and FP8 KV (rows carry kv_dtype and speculative)
    ("gpu_run27/is_exact.json", None),  # SGLang's default capture sizes: batches differ, see e2e_gpu.md
    ("gpu_run28/fp8_exact_f18.json", None),
    ("gpu_run29/is_exact_f18.json", None),
    ("gpu_run33/fp8_lockstep.json", None),
    ("gpu_run34/fp8_lockstep_up.json", None),
    ("gpu_run36/is_ds32.json", None),  # IndexShare prefetch on the representative-width variant
    # ninth session: speculative decoding (MTP, one draft step) and FP8 with graphs and aborts
    ("gpu_run37/spec_exact.json", None),  # its F18 config was skipped (budget); run in gpu_run38
    ("gpu_run38/spec_f18.json", None),
    ("gpu_run39/fp8_f18.json", None),
    ("gpu_run39/spec_up.json", None),  # SGLang's own HiSparse with MTP: dies at start-up
    # tenth session: three draft tokens (N = 4, the kernel's spilled planner), forced acceptance, FP8 + MTP
    ("gpu_run42/spec3_exact.json", None),
    ("gpu_run43/spec3_forced.json", None),
    ("gpu_run44/spec3_fp8.json", None),  # the call's second job (spec1_forced.json) was skipped: time budget
    # twelfth session: residency (ours_resident); gpu_run53 on half the pool, two demotions mid-decode
    ("gpu_run52/res.json", None),  # its default-capture-sizes row: batches differ, see e2e_gpu.md
    ("gpu_run53/res_pressure.json", None),
    # thirteenth session: the position -> slot map (ours_map, "slot_map": true)
    ("gpu_run58/map_exact.json", None),
    # fourteenth session: the new default (residency on, rows charged as held, growth from free rows)
    ("gpu_run61/exact_default.json", None),
    # fifteenth session: resident pages mapped inside the forward (quiet decode steps)
    ("gpu_run63/exact_default.json", None),
    ("gpu_run64/exact_default.json", None),  # the page-start-only resident step (reverted: slower)
    # sixteenth session: the resident step, deferred resident write-through, the decode kernels
    ("gpu_run65/exact_default.json", None),  # 15 / 16: one request's prefill chunk differed (run.md)
    ("gpu_run67/exact_default.json", None),
]
# Left out: gpu_run4/tput.json (first session's kernel; client-side timing only and no server logs
# to recompute it from; the raw file stays).
# Runs whose server logs have one file per server, so decode traces can be read back for each row.
TRACED_RUNS = {"gpu_run13"}
WORKLOADS = {
    "arrival": "two waves: wave 2 (6 requests, 2 aborted) arrives while wave 1 (12 requests) decodes",
    # 12 requests (wave 1) until the third session, both waves' 18 since; the count is the row's
    "lockstep": "lockstep: {sequences} requests (1k-61k contexts, none aborted) in one batched call",
}
DEVICE_CALLS = {
    "gpu_run65": "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh e2e exactness --configs ours:4096:F18:arrival "
                 "--max-total-tokens 262144 --budget-s 240 --out $OUT/exact_default.json + sweep ... (the no-pressure "
                 "point: docs/results/gpu_run65/run.md)",
    "gpu_run67": "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh pytest tests/gpu/test_decode_kernel.py + e2e exactness "
                 "--configs ours:4096:F18:arrival --max-total-tokens 262144 --budget-s 240 --out $OUT/exact_default.json "
                 "+ sweep ... (docs/results/gpu_run67/run.md)",
    "gpu_run63": "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh e2e exactness --configs ours:4096:F18:arrival "
                 "--max-total-tokens 262144 --budget-s 300 --out $OUT/exact_default.json + sweep ... (the no-pressure "
                 "point: docs/results/gpu_run63/run.md)",
    "gpu_run64": "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh e2e exactness --configs ours:4096:F18:arrival "
                 "--max-total-tokens 262144 --budget-s 240 --out $OUT/exact_default.json + sweep ... "
                 "(docs/results/gpu_run64/run.md)",
    "gpu_run61": "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh e2e exactness --configs ours:4096:F18:arrival "
                 "--max-total-tokens 262144 --budget-s 330 --out $OUT/exact_default.json + sweep ... (the no-pressure "
                 "point: docs/results/gpu_run61/run.md)",
    "gpu_run58": "bash scripts/gpu/run.sh e2e exactness --configs ours_map:4096:F18:arrival --budget-s 500 "
                 "--out $OUT/map_exact.json",
    "gpu_run52": "bash scripts/gpu/run.sh e2e exactness --configs ours_resident:4096:1,ours_resident:4096:F18:arrival "
                 "--budget-s 530 --out $OUT/res.json",
    "gpu_run53": "bash scripts/gpu/run.sh e2e exactness --configs ours_resident:4096:F18:arrival --max-total-tokens 262144 "
                 "--budget-s 480 --out $OUT/res_pressure.json   (262,144-row pool: 2 demotions mid-decode)",
    "gpu_run2": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:1,ours:2048:1 --budget-s 520 --out $OUT/exact1.json",
    "gpu_run3": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:1,upstream:4096:1 --budget-s 520 --out $OUT/exact2.json",
    "gpu_run4": "bash scripts/gpu/run.sh e2e throughput --impls none,ours,upstream --concurrency 1,8,32,64 --context 32768 "
                "--new-tokens 256 --ratio 8 --max-total-tokens 262144 --budget-s 500 --out $OUT/tput.json",
    "gpu_run5": "bash scripts/gpu/run.sh e2e exactness --lockstep --configs ours:4096:1 --budget-s 230 --out $OUT/lockstep.json",
    "gpu_run9": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:F18:arrival,upstream:4096:F18:arrival,"
                "ours:2048:F18:arrival,ours:4096:0:lockstep,ours:2048:0:lockstep,upstream:2048:F18:arrival,"
                "upstream:2048:0:lockstep --budget-s 540 --out $OUT/exact3.json",
    "gpu_run10": "bash scripts/gpu/run.sh e2e exactness --configs upstream:2048:F18:arrival --budget-s 240 --out $OUT/exact4.json",
    "gpu_run11": "bash scripts/gpu/run.sh e2e exactness --configs upstream:4096:0:lockstep,upstream:2048:0:lockstep,"
                 "none:4096:0:arrival,ours:4096:0:arrival,ours:2048:0:arrival,upstream:4096:0:arrival --budget-s 545 "
                 "--out $OUT/exact5.json",
    "gpu_run12": "bash scripts/gpu/run.sh e2e throughput --impls none,ours,upstream --concurrency 1,8,32,64 --context 32768 "
                 "--new-tokens 256 --ratio 8 --max-total-tokens 262144 --budget-s 540 --out $OUT/tput.json",
    "gpu_run13": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:0:lockstep,upstream:4096:0:lockstep,"
                 "ours:2048:0:lockstep,upstream:2048:0:lockstep --budget-s 470 --out $OUT/exact6.json",
    "gpu_run14": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:0:lockstep,upstream:4096:0:lockstep,"
                 "ours:2048:0:lockstep,upstream:2048:0:lockstep --budget-s 540 --out $OUT/exact7.json",
    "gpu_run15": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:0:lockstep,ours:2048:0:lockstep,"
                 "upstream:4096:0:lockstep,upstream:2048:0:lockstep --no-overlap --wait-for-staging --budget-s 520 "
                 "--out $OUT/exact8.json",
    "gpu_run16": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-indexshare --configs "
                 "ours:4096:0:lockstep,ours:2048:F18:lockstep --no-overlap --wait-for-staging --budget-s 420 "
                 "--out $OUT/exact9.json",
    "gpu_run17": "bash scripts/gpu/run.sh e2e throughput --impls upstream,ours --concurrency 1,32 --budget-s 400 "
                 "--out $OUT/tput2.json",
    "gpu_run18": "bash scripts/gpu/run.sh e2e throughput --impls ours,upstream --concurrency 1 --budget-s 170 "
                 "--out $OUT/tput3.json",
    "gpu_run19": "bash scripts/gpu/run.sh demo + e2e exactness --configs ours:4096:F18 --budget-s 300 "
                 "--out $OUT/exact_f18.json",
    "gpu_run20": "bash scripts/gpu/run.sh e2e exactness --configs ours:2048:F18 --budget-s 200 --out "
                 "$OUT/exact_f18_2048.json + e2e exactness --configs ours:4096:0:lockstep,ours:2048:0:lockstep "
                 "--no-overlap --wait-for-staging --budget-s 240 --out $OUT/exact_lockstep.json + e2e throughput "
                 "--impls ours --concurrency 1 --context 12000 --buffer 15936 --budget-s 150 --out $OUT/fastpath.json",
    "gpu_run27": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-indexshare --configs ours:4096:1 --budget-s 380 "
                 "--out $OUT/is_exact.json + e2e exactness --kv-dtype fp8_e4m3 --configs ours:4096:1 --budget-s 175 "
                 "--out $OUT/fp8_exact.json",
    "gpu_run28": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-indexshare --configs ours:4096:F18 --budget-s 200 "
                 "--out $OUT/is_exact_f18.json + e2e exactness --kv-dtype fp8_e4m3 --configs "
                 "ours:4096:F18,upstream:4096:F18 --budget-s 330 --out $OUT/fp8_exact_f18.json",
    "gpu_run29": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-indexshare --configs ours:4096:F18 --budget-s 230 "
                 "--out $OUT/is_exact_f18.json + sweep --model ds32-width-indexshare --points "
                 "ours_noprefetch:realistic,ours:realistic --concurrency 32 --repeats 1 --budget-s 350 "
                 "--level-margin-s 60 --out $OUT/sweep_is.json",
    "gpu_run33": "bash scripts/gpu/run.sh sweep --model ds32-width --points ours:realistic,ours_reuse:realistic "
                 "--concurrency 32 --repeats 1 --budget-s 290 --level-margin-s 60 --out $OUT/sweep_reuse.json + e2e "
                 "exactness --kv-dtype fp8_e4m3 --configs ours:4096:0:lockstep,upstream:4096:0:lockstep --no-overlap "
                 "--wait-for-staging --budget-s 240 --out $OUT/fp8_lockstep.json   (HISPARSE_PACK_JIT=0)",
    "gpu_run34": "bash scripts/gpu/run.sh sweep --model ds32-width --points ours_reuse:realistic --concurrency 32 "
                 "--repeats 1 --budget-s 230 --level-margin-s 30 --out $OUT/sweep_reuse2.json + e2e exactness "
                 "--kv-dtype fp8_e4m3 --configs upstream:4096:0:lockstep --no-overlap --wait-for-staging --budget-s 260 "
                 "--out $OUT/fp8_lockstep_up.json   (HISPARSE_PACK_JIT=0; same machine as gpu_run33, still warm)",
    "gpu_run36": "bash scripts/gpu/run.sh e2e exactness --model ds32-width-indexshare --configs ours:4096:F18 "
                 "--budget-s 540 --out $OUT/is_ds32.json   (HISPARSE_PACK_JIT=0)",
    "gpu_run37": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-mtp --spec-steps 1 --no-overlap "
                 "--wait-for-staging --configs ours:6144:0:lockstep,ours:6144:F18:arrival --budget-s 545 "
                 "--out $OUT/spec_exact.json   (HISPARSE_PACK_JIT=0)",
    "gpu_run38": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-mtp --spec-steps 1 --no-overlap "
                 "--wait-for-staging --configs ours:6144:F18:arrival --budget-s 560 --out $OUT/spec_f18.json",
    "gpu_run39": "bash scripts/gpu/run.sh e2e exactness --kv-dtype fp8_e4m3 --no-overlap --wait-for-staging --configs "
                 "ours:4096:F18:arrival --budget-s 290 --out $OUT/fp8_f18.json + e2e exactness --model tiny-dsa-mtp "
                 "--spec-steps 1 --no-overlap --configs upstream:6144:F18:arrival --budget-s 230 --out $OUT/spec_up.json",
    "gpu_run42": "HISPARSE_VERIFY_SUITE_LIMIT_S=400 bash scripts/gpu/run.sh bg verify + e2e exactness --model "
                 "tiny-dsa-mtp --spec-steps 3 --no-overlap --wait-for-staging --configs ours:10240:F18:arrival "
                 "--budget-s 520 --out $OUT/spec3_exact.json   (HISPARSE_PACK_JIT=0)",
    "gpu_run43": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-mtp --spec-steps 3 --no-overlap "
                 "--wait-for-staging --accept-all --configs ours:10240:F18:arrival --budget-s 470 "
                 "--out $OUT/spec3_forced.json   (HISPARSE_PACK_JIT=0; same machine as gpu_run42, warm)",
    "gpu_run44": "bash scripts/gpu/run.sh e2e exactness --model tiny-dsa-mtp --kv-dtype fp8_e4m3 --spec-steps 3 "
                 "--no-overlap --wait-for-staging --configs ours:10240:F18:arrival --budget-s 230 "
                 "--out $OUT/spec3_fp8.json + e2e exactness --model tiny-dsa-mtp --spec-steps 1 --no-overlap "
                 "--wait-for-staging --accept-all --configs ours:6144:F18:arrival --budget-s 220 "
                 "--out $OUT/spec1_forced.json   (HISPARSE_PACK_JIT=0; same machine, warm)",
    "gpu_run21": "bash scripts/gpu/run.sh e2e exactness --configs ours:2048:F18 --budget-s 400 --out "
                 "$OUT/exact_f18_2048.json + e2e exactness --configs ours:2048:0:lockstep --no-overlap "
                 "--wait-for-staging --budget-s 400 --out $OUT/exact_lockstep_2048.json + e2e throughput --impls ours "
                 "--concurrency 1 --context 12000 --buffer 15936 --budget-s 400 --out $OUT/fastpath.json",
}
CLIENT_SIDE = ("client_decode_tok_s", "client_tpot_ms")
"""Client-side throughput (full call minus a 1-token call): known to be wrong (e.g. 228k tok/s for
one request in gpu_run12), so left out of e2e_gpu.json; the raw fragments keep them."""
# The main throughput sweep; other throughput runs are repetitions of some of its points.
MAIN_SWEEP = "gpu_run12"


def server_log(run: str, name: str) -> str:
    """One server's log from docs/results/<run>/logs.tar.xz (e2e_logs/<name>.log)."""
    with tarfile.open(RESULTS / run / "logs.tar.xz") as t:
        return io.TextIOWrapper(t.extractfile(f"e2e_logs/{name}.log"), errors="replace").read()


def server_side_throughput(run: str, rows: list[dict]) -> list[dict]:
    """Rows of a throughput fragment written before e2e.py read the server log: decode_tok_s,
    tpot_ms, decode_steps and max_running recomputed from each server's log; the client-side
    numbers are kept as client_*."""
    command = DEVICE_CALLS[run]
    levels = [int(c) for c in re.search(r"--concurrency ([\d,]+)", command).group(1).split(",")]
    context = int(re.search(r"--context (\d+)", command).group(1))
    out = []
    for impl in sorted({r["impl"] for r in rows}):
        parts = split_throughput_run(parse_batches(server_log(run, f"{impl}_B4096_g1")), levels, context)
        for r in rows:
            if r["impl"] == impl:
                out.append({"impl": impl, "concurrency": r["concurrency"], "context": r["context"],
                            **decode_stats(parts[r["concurrency"]]), "client_decode_tok_s": r["decode_tok_s"],
                            "client_tpot_ms": r["tpot_ms"], "miss_rate": r["miss_rate"]})
    return out


def machine() -> str:
    log = (RESULTS / "gpu_run12" / "run.log").read_text()
    gpu = re.search(r"\] (NVIDIA [^;]+); python (Python [\d.]+)", log)
    versions = re.search(r"versions (\S+) (\S+)", log)
    return (f"{gpu.group(1).strip()}, {gpu.group(2)}, torch {versions.group(1)}, SGLang {versions.group(2)} "
            "(lent H200 test machine, 16 vCPU, PCIe Gen5)")


def job_words(run: str, fragment: str) -> list[str]:
    """The words of the job (``+``-separated part of the run's recorded command) that wrote ``fragment``."""
    name = fragment.split("/")[-1]
    return next(part.split() for part in DEVICE_CALLS[run].split(" + ") if name in part)


# DeepSeek-V4 (tiny-dsv4) through scripts/gpu/v4_probe.py: one server per implementation side by side,
# one request at a time; each run's COMMAND file holds the device call (docs/deepseek_v4/gpu-probe.md)
V4_PROBES = ["gpu_v4probe3", "gpu_v4probe4"]
IDLE_LINE = re.compile(r"leak=(yes|no) selected=(\d+) misses=(\d+)")


def v4_probe_rows(run: str) -> list[dict]:
    """One exactness row per HiSparse implementation of a V4 probe, against its ``none`` server:
    the completed prompts only (``not_completed`` lists the others, with why)."""
    data = json.loads((RESULTS / run / "v4probe.json").read_text())
    base = {r["prompt_len"]: r.get("output_ids") for r in data["impls"]["none"]["requests"]}
    rows = []
    for impl, info in data["impls"].items():
        if impl == "none":
            continue
        done, first_diff, missing = [], [], []
        for req in info["requests"]:
            ids, ref = req.get("output_ids"), base.get(req["prompt_len"])
            if not ids or not ref:
                missing.append({"prompt_len": req["prompt_len"], "why": req.get("error", "baseline missing")})
                continue
            done.append(req["prompt_len"])
            first_diff.append(next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b),
                                   None if len(ids) == len(ref) else min(len(ids), len(ref))))
        idle = [IDLE_LINE.search(line) for line in info.get("pool_lines", [])]
        idle = [m for m in idle if m]
        config = json.loads(info["hisparse_config"])
        row = {"impl": impl, "model": data["model"].rsplit("/", 1)[-1], "B": config["device_buffer_size"],
               "top_k": config["top_k"], "cuda_graph": "--disable-cuda-graph" not in data["server_flags"],
               "sequences": len(done), "identical": first_diff.count(None), "first_diff": first_diff,
               "prompt_lens": done, "new_tokens": data["new_tokens"],
               "workload": "one request at a time, greedy, torch top-k (SGLANG_TOPK_TRANSFORM_512_TORCH=1)",
               "device": data["device"]["nvidia_smi"], "run": run}
        if missing:
            row["not_completed"] = missing
        if idle:
            leak, selected, misses = idle[-1].groups()
            row["pools_back_to_initial"] = leak == "no"
            row["miss_rate"] = int(misses) / int(selected) if int(selected) else None
        rows.append(row)
    return rows


V4_CONCURRENT = ["gpu_v4probe6", "gpu_v4probe7"]


def v4_concurrent_rows(run: str) -> list[dict]:
    """One exactness row per HiSparse implementation of a V4 probe's concurrent phase (requests
    in one batch, some aborted mid-decode), against its ``none`` server and, for ours at another
    B, against ours at the first B (``identical_to``): the requests not aborted."""
    data = json.loads((RESULTS / run / "v4probe.json").read_text())
    phase, impls = data["concurrent"], data["impls"]
    aborted = set(phase["abort_indices"])

    def outputs(impl: str) -> list:
        return [r.get("output_ids") for r in impls[impl]["concurrent"]["requests"]]

    def first_diffs(ids_list: list, ref_list: list) -> list:
        return [first_diff(ids, ref) for n, (ids, ref) in enumerate(zip(ids_list, ref_list)) if n not in aborted]

    base, rows = outputs("none"), []
    first_ours = next(impl for impl in impls if impl.startswith("ours"))
    for impl, info in impls.items():
        if impl == "none":
            continue
        config = json.loads(info["hisparse_config"])
        conc = info["concurrent"]
        diffs = first_diffs(outputs(impl), base)
        row = {"impl": impl.split("@")[0], "model": data["model"].rsplit("/", 1)[-1],
               "B": config["device_buffer_size"], "top_k": config["top_k"], "cuda_graph": True,
               "graph_bs": phase["n"], "sequences": len(diffs), "identical": diffs.count(None),
               "first_diff": diffs, "new_tokens": data["new_tokens"],
               "workload": (f"{phase['n']} requests in one batch ({min(phase['lengths'])}-{max(phase['lengths'])} "
                            f"tokens), " + (f"{len(aborted)} aborted after {phase['abort_after']} tokens, greedy, "
                                            "torch top-k; decode batches not held equal around the aborts"
                                            if aborted else "none aborted, greedy, torch top-k")),
               "decode_trace": conc.get("decode_trace"),
               "baseline_decode_trace": impls["none"]["concurrent"].get("decode_trace"),
               "retracted": conc.get("retracted"), "device": data["device"]["nvidia_smi"], "run": run}
        if impl != first_ours and impl.startswith("ours"):
            same = first_diffs(outputs(impl), outputs(first_ours))
            row["identical_to"] = {"impl": first_ours, "identical": same.count(None), "sequences": len(same)}
        report = conc.get("idle_report")
        if report:
            row["pools_back_to_initial"] = not report["leak"]
            row["miss_rate"] = report["misses"] / report["selected"] if report["selected"] else None
        rows.append(row)
    return rows


V4_THROUGHPUT = ["gpu_v4probe8", "gpu_v4probe9", "gpu_v4probe10"]
V4_PD = ["gpu_v4pd1"]
V4_RESIDENCY_ON_AS_OURS = {"gpu_v4probe8", "gpu_v4probe9", "gpu_v4pd1"}
"""Calls made while C4 residency was V4's default: their ``ours`` had it on (labelled ``ours_resident``
here) and their ``ours_hot`` had it off, which is V4's default since (labelled ``ours``)."""


def v4_impl_label(run: str, impl: str) -> str:
    """The implementation name a V4 call's server has in e2e_gpu.json (see V4_RESIDENCY_ON_AS_OURS)."""
    if run in V4_RESIDENCY_ON_AS_OURS:
        return {"ours": "ours_resident", "ours_hot": "ours", "decode_ours": "ours_resident",
                "decode_ours_hot": "ours"}.get(impl, impl.removeprefix("decode_"))
    return impl.removeprefix("decode_")


def v4_throughput_rows(run: str) -> list[dict]:
    """One row per server of a V4 probe's throughput phase: the median decode tok/s of its rounds
    (paired: every server once per round, the others idle), the spread, TPOT, requests held,
    ours' miss rate and pools, and every round's tok/s. A server that measured no round (it
    crashed) gets a row with ``decode_tok_s`` None and its first error line."""
    data = json.loads((RESULTS / run / "v4probe.json").read_text())
    argv = data.get("argv", [])
    new_tokens = argv[argv.index("--throughput-new-tokens") + 1] if "--throughput-new-tokens" in argv else "128"
    workload = f"24 prompts of 12,000 tokens in one call, {new_tokens} greedy tokens, under pressure"
    by_round = {impl: {r["round"]: r["decode_tok_s"] for r in info["throughput"]["runs"]
                       if not r.get("warmup") and r.get("decode_tok_s")} for impl, info in data["impls"].items()}

    def paired(a: str, b: str) -> float:
        """Median over the rounds both measured of a's tok/s over b's (drift between rounds cancels)."""
        return statistics.median(by_round[a][k] / by_round[b][k] for k in set(by_round[a]) & set(by_round[b]))

    rows = []
    for impl, info in data["impls"].items():
        if not info["throughput"]["summary"].get("measured", 1):
            lines = [e for e in info.get("error_lines", []) if e.startswith(("torch.", "RuntimeError", "CUDA error"))
                     and "Error" in e]  # the exception's own line (not start-up notices naming an error)
            client = [r["error"] for r in info["throughput"]["runs"] if r.get("error")]
            rows.append({"impl": v4_impl_label(run, impl), "impl_in_run": impl, "decode_tok_s": None,
                         "error": (lines or client or [None])[0], "workload": workload,
                         "device": data["device"]["nvidia_smi"], "run": run})
            continue
        summary, runs = info["throughput"]["summary"], info["throughput"]["runs"]
        config = json.loads(info["hisparse_config"]) if info.get("hisparse_config") else None
        rows.append({"impl": v4_impl_label(run, impl), "impl_in_run": impl, "model": data["model"].rsplit("/", 1)[-1],
                     "B": config["device_buffer_size"] if config else None,
                     "residency": config.get("residency", True) if config else None,
                     "max_total_tokens": info["max_total_tokens"],
                     "workload": workload,
                     "decode_tok_s": summary["decode_tok_s"], "decode_tok_s_spread": summary["decode_tok_s_spread"],
                     "tpot_ms": summary["tpot_ms"], "held": summary["held"], "miss_rate": summary["miss_rate"],
                     "pools_back_to_initial": summary["pools_back_to_initial"],
                     "rounds_tok_s": [r.get("decode_tok_s") for r in runs],
                     "paired_ratio_vs": {v4_impl_label(run, other): paired(impl, other) for other in by_round
                                         if other != impl and by_round[other]},
                     "device": data["device"]["nvidia_smi"], "run": run})
    return rows


def v4_pd_rows(run: str) -> list[dict]:
    """One exactness row per decode instance of a V4 PD call (scripts/gpu/v4_pd.py): phase 1 (one
    request at a time) against the colocated server without HiSparse; phase 2 (all at once, some
    aborted) recorded with its pools."""
    data = json.loads((RESULTS / run / "v4pd.json").read_text())
    rows = []
    for name, against in data["phase1"]["compare"]["against"].items():
        diffs = [r["first_diff"] for r in against["per_request"]]
        phase2 = data["phase2"].get(name, {})
        rows.append({"impl": v4_impl_label(run, name), "impl_in_run": name, "model": data["model"], "pd": True,
                     "transfer_backend": data["transfer_backend"], "sequences": len(diffs),
                     "identical": diffs.count(None), "first_diff": diffs, "prompt_lens": data["lengths"],
                     "new_tokens": data["new_tokens"],
                     "workload": "one request at a time through a Mooncake PD pair, greedy, torch top-k",
                     "concurrent_first_diff": phase2.get("first_diff_vs_phase1_baseline"),
                     "concurrent_aborted": phase2.get("aborted"),
                     "pools_back_to_initial": phase2.get("pools_back_to_initial"),
                     "device": data["device"]["nvidia_smi"], "run": run})
    return rows


def option(words: list[str], flag: str, default: str) -> str:
    return words[words.index(flag) + 1] if flag in words else default


def main() -> int:
    exactness, controls, throughput, commands = [], [], [], []
    for rel, workload in FRAGMENTS:
        data = json.loads((RESULTS / rel).read_text())
        run = rel.split("/")[0]
        if DEVICE_CALLS[run] not in commands:
            commands.append(DEVICE_CALLS[run])
        for row in data.get("exactness", []):
            if "error" in row:  # a server that failed: recorded (e.g. SGLang's HiSparse with MTP), no comparison
                job = job_words(run, rel)
                exactness.append({k: row.get(k) for k in ("impl", "B", "cuda_graph", "graph_bs", "workload")}
                                 | {"run": run, "model": option(job, "--model", "tiny-dsa"),
                                    "speculative": speculative_label(int(option(job, "--spec-steps", "0"))),
                                    "failed": row["error"][:300]})
                continue
            if "identical" not in row:  # skipped for time: listed in the run's JSON, not here
                continue
            keep = {k: row[k] for k in ("impl", "B", "cuda_graph", "sequences", "identical", "first_diff") if k in row}
            keep["graph_bs"] = row.get("graph_bs")  # one fixed decode-graph capture size, or None
            keep["workload"] = workload or WORKLOADS[row["workload"]].format(sequences=row["sequences"])
            keep["run"] = run  # docs/results/<run>/: raw fragment, log and command
            # rows written before these keys existed ran tiny-dsa with SGLang's default overlap schedule
            keep["model"] = row.get("model", "tiny-dsa")
            keep["overlap_schedule"] = row.get("overlap_schedule", True)
            keep["wait_for_staging"] = row.get("wait_for_staging", False)
            keep["kv_dtype"] = row.get("kv_dtype", "bfloat16")
            keep["speculative"] = row.get("speculative")
            if row.get("accept_length") is not None:
                keep["accept_length"] = row["accept_length"]  # tokens per verify step, mean over sequences
            if row.get("forced_acceptance"):  # every server committed every draft (e2e.py --accept-all)
                keep["forced_acceptance"] = True
            report = row.get("idle_report")
            if report:
                keep["pools_back_to_initial"] = not report["leak"]
                keep["miss_rate"] = report["misses"] / report["selected"] if report["selected"] else None
            for key in ("decode_trace", "baseline_decode_trace"):
                if key in row:
                    keep[key] = row[key]
            if run in TRACED_RUNS and "decode_trace" not in row:
                keep["decode_trace"] = decode_trace(parse_batches(server_log(run, f"{row['impl']}_B{row['B']}_g0")))
                keep["baseline_decode_trace"] = decode_trace(parse_batches(server_log(run, "none_B4096_g0")))
            # impl "none": the baseline run again against itself, a control of the workload's reproducibility
            (controls if row["impl"] == "none" else exactness).append(keep)
        measured = [r for r in data.get("throughput", []) if "decode_tok_s" in r]
        if measured and "decode_steps" not in measured[0]:
            measured = server_side_throughput(run, measured)
        throughput += [dict({k: v for k, v in r.items() if k not in CLIENT_SIDE}, run=run) for r in measured]
    v4_throughput: list[dict] = []
    for runs, rows_of, into in ((V4_PROBES, v4_probe_rows, exactness), (V4_CONCURRENT, v4_concurrent_rows, exactness),
                                (V4_THROUGHPUT, v4_throughput_rows, v4_throughput), (V4_PD, v4_pd_rows, exactness)):
        for run in runs:  # the V4 calls: each folder's COMMAND and its rows
            commands.append((RESULTS / run / "COMMAND").read_text().splitlines()[0])
            into += rows_of(run)
    out = {"machine": machine(), "commands": commands, "exactness": exactness, "controls": controls,
           "throughput": throughput, "v4_throughput": v4_throughput}
    (RESULTS / "e2e_gpu.json").write_text(json.dumps(out, indent=1) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"wrote {RESULTS / 'e2e_gpu.json'}; e2e_gpu_throughput.png needs matplotlib "
              "(pip install matplotlib), not drawn", file=sys.stderr)
        return 1
    plot(throughput, RESULTS / "e2e_gpu_throughput.png")
    print(f"wrote {RESULTS / 'e2e_gpu.json'} and e2e_gpu_throughput.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = {"none": "no HiSparse", "upstream": "SGLang's HiSparse", "ours": "sglang-hisparse"}
    for impl, style in (("none", "k--"), ("upstream", "b-o"), ("ours", "r-s")):
        for run in sorted({r["run"] for r in rows if r["impl"] == impl}, key=lambda run: run != MAIN_SWEEP):
            pts = sorted((r["concurrency"], r["decode_tok_s"], r["tpot_ms"], r.get("miss_rate"), r.get("max_running"))
                         for r in rows if r["impl"] == impl and r["run"] == run)
            main = run == MAIN_SWEEP
            kw = {"label": names[impl] if main else f"{names[impl]}, repeat ({run})"}
            fmt = style if main else style[0] + style[-1]  # a repetition: hollow markers, no line
            if not main:
                kw.update(fillstyle="none", markersize=9)
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], fmt, **kw)
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], fmt, **kw)
            if main:
                annotate(ax1, impl, pts)
    for ax, label in ((ax1, "decode tokens/s"), (ax2, "TPOT ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests (32k context, 256 new tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Tiny DSA model on one H200, same HBM budget (--max-total-tokens 262144); HiSparse B=4096, ratio 8;\n"
                 "decode steps from the server log", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def annotate(ax, impl: str, pts: list[tuple]) -> None:
    """Miss rate next to our points; requests held at once where HBM held fewer than asked."""
    for c, tok, _, miss, most in pts:
        notes = [f"miss {miss:.0%}"] if impl == "ours" and miss is not None else []
        if impl != "upstream" and most is not None and most < c:
            notes.append(f"{most} at once")
        if notes:
            ax.annotate(", ".join(notes), (c, tok), textcoords="offset points", xytext=(4, -12), fontsize=7)


if __name__ == "__main__":
    raise SystemExit(main())
