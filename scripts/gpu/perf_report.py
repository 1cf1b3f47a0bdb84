"""Merge the sweep fragments (scripts/gpu/sweep.py on the H200) into docs/results/perf.json and
plot docs/results/perf.png. Runs on the development machine:

    python scripts/gpu/perf_report.py

perf.json: ``{"machine", "commands", "model", "rows": [...]}`` as docs/performance.md describes;
each row also names its ``model`` and the ``run`` (docs/results/gpu_run*/) it came from, and the
per-layer decode timings are under ``layer_timing``. The raw repeats stay in the fragments.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
HEADLINE_MODEL = "ds32-width"
MACHINE = "one lent NVIDIA H200 (141 GB HBM3e, PCIe Gen5 host link), 16 CPU cores, 128 GiB RAM; SGLang 0.5.17, torch 2.11, CUDA 13"

# (fragment under docs/results, the device call that produced it)
FRAGMENTS: list[tuple[str, str]] = []


def merge(fragments: list[tuple[str, str]], results: Path = RESULTS) -> dict:
    """perf.json's content from the fragments (pure apart from reading them)."""
    rows, timing = [], []
    for path, command in fragments:
        data = json.loads((results / path).read_text())
        run = path.split("/")[0]
        for row in data["rows"]:
            rows.append({k: v for k, v in row.items() if k != "runs"} | {"model": data["model"], "run": run,
                                                                          "context": data["context"]})
        for t in data.get("layer_timing", []):
            timing.append(t | {"model": data["model"], "layers": data["layers"], "run": run})
    return {"machine": MACHINE, "commands": [c for _, c in fragments], "model": HEADLINE_MODEL, "rows": rows,
            "layer_timing": timing}


def plot(perf: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in perf["rows"]}, key=lambda m: m != HEADLINE_MODEL)
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        series: dict[tuple[str, str], list[dict]] = {}
        for r in perf["rows"]:
            if r["model"] == model:
                series.setdefault((r["impl"], r["locality"]), []).append(r)
        for (impl, locality), rs in sorted(series.items()):
            rs.sort(key=lambda r: r["concurrency"])
            x = [r["concurrency"] for r in rs]
            y = [r["decode_tok_s"] for r in rs]
            err = [[r["decode_tok_s"] - r["decode_tok_s_spread"][0] for r in rs],
                   [r["decode_tok_s_spread"][1] - r["decode_tok_s"] for r in rs]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{impl} ({locality})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (32k-token requests)")
        ax.set_ylabel("decode tokens/s (median, min-max)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    perf = merge(FRAGMENTS)
    (RESULTS / "perf.json").write_text(json.dumps(perf, indent=1) + "\n")
    if perf["rows"]:
        plot(perf, RESULTS / "perf.png")
    print(f"{len(perf['rows'])} rows -> docs/results/perf.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
