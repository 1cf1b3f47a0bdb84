"""Merge the GPU end-to-end fragments into docs/results/e2e_gpu.json and plot the throughput.

Fragments are the JSON files scripts/gpu/e2e.py wrote on the H200 (kept under
docs/results/gpu_run*/ with the run.log of each call). Runs on the development machine:

    python scripts/gpu/collect.py            # writes docs/results/e2e_gpu.json and e2e_gpu_throughput.png
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
# (fragment, workload description, how the call was made)
FRAGMENTS = [
    ("gpu_run2/exact1.json", "two waves: wave 2 (6 requests, 2 aborted) raced wave 1 (12 requests) at arrival"),
    ("gpu_run3/exact2.json", "two waves: wave 2 (6 requests, 2 aborted) arrives after wave 1 (12 requests) decodes"),
    ("gpu_run5/lockstep.json", "lockstep: wave 1 only (12 requests, 2k-60k contexts) in one batched call"),
    ("gpu_run4/tput.json", None),
    ("gpu_run9/exact3.json", None),  # rows carry their workload and graph_bs
    ("gpu_run10/exact4.json", None),
]
WORKLOADS = {
    "arrival": "two waves: wave 2 (6 requests, 2 aborted) arrives while wave 1 (12 requests) decodes",
    "lockstep": "lockstep: wave 1 only (12 requests, 2k-60k contexts) in one batched call",
}
DEVICE_CALLS = {
    "gpu_run2": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:1,ours:2048:1 --budget-s 520 --out $OUT/exact1.json",
    "gpu_run3": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:1,upstream:4096:1 --budget-s 520 --out $OUT/exact2.json",
    "gpu_run4": "bash scripts/gpu/run.sh e2e throughput --impls none,ours,upstream --concurrency 1,8,32,64 --context 32768 "
                "--new-tokens 256 --ratio 8 --max-total-tokens 262144 --budget-s 500 --out $OUT/tput.json",
    "gpu_run5": "bash scripts/gpu/run.sh e2e exactness --lockstep --configs ours:4096:1 --budget-s 230 --out $OUT/lockstep.json",
    "gpu_run9": "bash scripts/gpu/run.sh e2e exactness --configs ours:4096:F18:arrival,upstream:4096:F18:arrival,"
                "ours:2048:F18:arrival,ours:4096:0:lockstep,ours:2048:0:lockstep,upstream:2048:F18:arrival,"
                "upstream:2048:0:lockstep --budget-s 540 --out $OUT/exact3.json",
    "gpu_run10": "bash scripts/gpu/run.sh e2e exactness --configs upstream:2048:F18:arrival --budget-s 240 --out $OUT/exact4.json",
}


def machine() -> str:
    log = (RESULTS / "gpu_run4" / "run.log").read_text()
    gpu = re.search(r"\] (NVIDIA [^;]+); python (Python [\d.]+)", log)
    versions = re.search(r"versions (\S+) (\S+)", log)
    return (f"{gpu.group(1).strip()}, {gpu.group(2)}, torch {versions.group(1)}, SGLang {versions.group(2)} "
            "(lent H200 test machine, 16 vCPU, PCIe Gen5)")


def main() -> int:
    exactness, throughput, commands = [], [], []
    for rel, workload in FRAGMENTS:
        data = json.loads((RESULTS / rel).read_text())
        commands.append(DEVICE_CALLS[rel.split("/")[0]])
        for row in data.get("exactness", []):
            if "identical" not in row:  # skipped for time, or failed: listed in the run's JSON, not here
                continue
            keep = {k: row[k] for k in ("impl", "B", "cuda_graph", "sequences", "identical", "first_diff") if k in row}
            keep["graph_bs"] = row.get("graph_bs")  # one fixed decode-graph capture size, or None
            keep["workload"] = workload or WORKLOADS[row["workload"]]
            keep["run"] = rel.split("/")[0]  # docs/results/<run>/: raw fragment, log and command
            report = row.get("idle_report")
            if report:
                keep["pools_back_to_initial"] = not report["leak"]
                keep["miss_rate"] = report["misses"] / report["selected"] if report["selected"] else None
            exactness.append(keep)
        throughput += [dict(r, run=rel.split("/")[0]) for r in data.get("throughput", []) if "decode_tok_s" in r]
    out = {"machine": machine(), "commands": commands, "exactness": exactness, "throughput": throughput}
    (RESULTS / "e2e_gpu.json").write_text(json.dumps(out, indent=1) + "\n")
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
        pts = sorted((r["concurrency"], r["decode_tok_s"], r["tpot_ms"], r.get("miss_rate")) for r in rows if r["impl"] == impl)
        if not pts:
            continue
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=names[impl])
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], style, label=names[impl])
        if impl == "ours":
            for c, tok, _, miss in pts:
                ax1.annotate(f"miss {miss:.0%}", (c, tok), textcoords="offset points", xytext=(4, -12), fontsize=7)
    for ax, label in ((ax1, "decode tokens/s"), (ax2, "TPOT ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests (32k context, 256 new tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Tiny DSA model on one H200, same HBM budget (--max-total-tokens 262144); HiSparse B=4096, ratio 8")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
