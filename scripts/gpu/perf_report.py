"""Merge the sweep fragments (scripts/gpu/sweep.py on the H200) into docs/results/perf.json and
plot docs/results/perf.png. Runs on the development machine:

    python scripts/gpu/perf_report.py

perf.json: ``{"machine", "commands", "model", "rows": [...]}`` as docs/performance.md describes;
each row also names its ``model`` and the calls (docs/results/gpu_run*/) its runs came from (``runs_from``), and the
per-layer decode timings are under ``layer_timing``. The raw repeats stay in the fragments.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
HEADLINE_MODEL = "ds32-width"
MACHINE = "one lent NVIDIA H200 (141 GB HBM3e, PCIe Gen5 host link), 16 CPU cores, 128 GiB RAM; SGLang 0.5.17, torch 2.11, CUDA 13"

# (fragment under docs/results, the device call that produced it)
FRAGMENTS: list[tuple[str, str]] = [
    ("gpu_run23/sweep_a.json", "bash scripts/gpu/run.sh sweep --model ds32-width --points none:realistic,ours:realistic "
                               "--concurrency 1,8,32 --repeats 1 --timing-context 4096 --budget-s 530 --out $OUT/sweep_a.json"),
    ("gpu_run24/sweep_b.json", "bash scripts/gpu/run.sh sweep --model ds32-width --points ours:realistic,ours_noio:realistic "
                               "--concurrency 1,8,32 --repeats 1 --budget-s 370 --out $OUT/sweep_b.json + demo"),
    ("gpu_run25/sweep_c.json", "bash scripts/gpu/run.sh sweep --model ds32-width --points upstream:realistic,ours:none,"
                               "none:realistic --concurrency 1,8,32 --repeats 1 --budget-s 470 --out $OUT/sweep_c.json"),
    ("gpu_run26/sweep_d.json", "bash scripts/gpu/run.sh sweep --model ds32-width --points upstream:realistic,ours:realistic "
                               "--concurrency 32 --repeats 1 --budget-s 250 --level-margin-s 60 --out $OUT/sweep_d.json"),
    ("gpu_run29/sweep_is.json", "bash scripts/gpu/run.sh sweep --model ds32-width-indexshare --points "
                                "ours_noprefetch:realistic,ours:realistic --concurrency 32 --repeats 1 --budget-s 350 "
                                "--level-margin-s 60 --out $OUT/sweep_is.json"),
    ("gpu_run33/sweep_reuse.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width --points "
                                   "ours:realistic,ours_reuse:realistic --concurrency 32 --repeats 1 --budget-s 290 "
                                   "--level-margin-s 60 --out $OUT/sweep_reuse.json (ours_reuse did not fit the budget)"),
    ("gpu_run34/sweep_reuse2.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width --points "
                                    "ours_reuse:realistic --concurrency 32 --repeats 1 --budget-s 230 --level-margin-s 30 "
                                    "--out $OUT/sweep_reuse2.json (same machine as gpu_run33, next call)"),
    ("gpu_run41/sweep_mtp.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width-mtp --spec-steps 1 "
                                 "--points none:realistic,ours:realistic --concurrency 32 --repeats 1 --budget-s 555 "
                                 "--level-margin-s 60 --out $OUT/sweep_mtp.json"),
    ("gpu_run46/sweep_fp8_a.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width --kv-dtype fp8_e4m3 "
                                   "--points none:realistic,ours:realistic --concurrency 32 --repeats 1 --budget-s 555 "
                                   "--level-margin-s 60 --out $OUT/sweep_fp8_a.json"),
    ("gpu_run47/sweep_fp8_b.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width --kv-dtype fp8_e4m3 "
                                   "--points upstream:realistic,ours:realistic --concurrency 32 --repeats 1 --budget-s 555 "
                                   "--level-margin-s 60 --out $OUT/sweep_fp8_b.json (the next call on the same H200)"),
    ("gpu_run54/sweep_res_c1.json", "bash scripts/gpu/run.sh sweep --model ds32-width --points none:realistic,"
                                    "ours_resident:realistic --concurrency 1 --repeats 1 --budget-s 420 "
                                    "--level-margin-s 60 --out $OUT/sweep_res_c1.json"),
    ("gpu_run55/sweep_res_c32.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width --points "
                                     "ours_resident:realistic,ours:realistic --concurrency 32 --repeats 1 --budget-s 290 "
                                     "--level-margin-s 60 --out $OUT/sweep_res_c32.json (ours did not fit the budget)"),
    ("gpu_run71/np_tiny.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model tiny-dsa --no-pressure "
                               "--interleave --mem-fraction 0.3 --points none:realistic,ours:realistic --concurrency "
                               "1,16,64,128 --repeats 2 --decode-log-interval 40 --profile-levels 64 --profile-impls ours,none "
                               "--profile-steps 16 --budget-s 300 --start-margin-s 60 --level-margin-s 10 --out $OUT/np_tiny.json"),
    ("gpu_run72/np_ds32.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width --no-pressure "
                               "--interleave --mem-fraction 0.3 --points none:realistic,ours:realistic --concurrency "
                               "1,16,64,128 --repeats 2 --decode-log-interval 40 --budget-s 330 --start-margin-s 60 "
                               "--level-margin-s 10 --out $OUT/np_ds32.json"),
    ("gpu_run75/np_tiny.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model tiny-dsa --no-pressure "
                               "--interleave --mem-fraction 0.3 --points none:realistic,ours:realistic --concurrency "
                               "64,128 --repeats 3 --decode-log-interval 40 --budget-s 270 --start-margin-s 40 "
                               "--level-margin-s 5 --out $OUT/np_tiny.json"),
    ("gpu_run76/pressure.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width --interleave "
                                "--mem-fraction 0.5 --points ours:realistic,none:realistic --concurrency 32 --repeats 2 "
                                "--budget-s 555 --start-margin-s 120 --level-margin-s 60 --out $OUT/pressure.json"),
    ("gpu_run77/pressure_upstream.json", "HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh sweep --model ds32-width "
                                         "--interleave --mem-fraction 0.5 --points upstream:realistic,ours:realistic "
                                         "--concurrency 32 --repeats 1 --budget-s 320 --start-margin-s 100 "
                                         "--level-margin-s 40 --out $OUT/pressure_upstream.json (the next call on the "
                                         "machine of gpu_run76)"),
]
# The no-pressure point of earlier code stays in its folders, not pooled with the code measured now:
# gpu_run59-60 (before the host-work changes were complete, one server after another, a log line
# every step), gpu_run61 (before quiet steps), gpu_run62 (quiet steps mapped on the host),
# gpu_run63 (resident ids mapped inside the forward, the full path at page starts) and gpu_run64 (a
# page-start-only resident step, measured slower and reverted): their run.md files. gpu_run65 (the
# resident step), gpu_run66 (ds32-width, that code), gpu_run67 (the decode kernels, one repeat) and
# gpu_run68 (the finishing change, before the sync fixes) are in their run.md files: the no-pressure
# panels carry gpu_run71 (tiny-dsa) and gpu_run72 (ds32-width), the code without host syncs.
# gpu_run73 (tiny-dsa at 64 and 128 on another machine, the same code) is in its run.md, not pooled:
# tiny-dsa's host-bound tok/s differ by up to 40% between lent machines, so runs pair only within a call.
# The final code (deferred write-through every 256 steps, nineteenth session) was measured at tiny-dsa's
# 64 and 128 (gpu_run75) and at the pressure point (gpu_run76, gpu_run77): those levels come from
# those calls alone; gpu_run71's 64 and 128 and gpu_run69 (the pressure point, earlier code) are in
# their run.md files. Levels the final code was not measured at come from the latest call that did.
LEVELS_TAKEN: dict[str, tuple[int, ...]] = {"gpu_run71/np_tiny.json": (1, 16)}
"""Fragments of which only these concurrency levels enter perf.json (the others were measured again
on later code, see above)."""
FIRST_RESIDENCY_DEFAULT_RUN = 59
"""From gpu_run59 on, ``ours`` is the plugin's default with residency on; before it, residency was
off by default and those calls' ``ours`` rows are hot buffers only: perf.json labels them ``ours_hot``."""
# Run 23 used the first version of the dial (strength 8, residual writers not damped), which gave
# ds32-width 78% misses, not ~13%: its rows are labelled so. Its "none" rows are speed-equivalent
# (no HiSparse: the weights' values do not change the work), but they are kept apart too.
LOCALITY_LABELS = {"gpu_run23": {"realistic": "first-dial-s8"}}


def merge(fragments: list[tuple[str, str]], results: Path = RESULTS,
          levels_taken: dict[str, tuple[int, ...]] = LEVELS_TAKEN) -> dict:
    """perf.json's content from the fragments (pure apart from reading them). Runs of the same
    (model, impl, locality, concurrency, KV dtype) from several calls are pooled into one row: its repeats,
    median and spread cover them all, and ``runs_from`` names the calls. A fragment named in
    ``levels_taken`` contributes only those concurrency levels."""
    pooled: dict[tuple, dict] = {}
    timing = []
    for path, _ in fragments:
        data = json.loads((results / path).read_text())
        run = path.split("/")[0]
        labels = LOCALITY_LABELS.get(run, {})
        for row in data["rows"]:
            if path in levels_taken and row["concurrency"] not in levels_taken[path]:
                continue
            key = (data["model"], impl_label(run, row["impl"]), labels.get(row["locality"], row["locality"]),
                   row["concurrency"],
                   data.get("kv_dtype", "bfloat16"),  # fragments before the fp8 option are bf16
                   data.get("speculative"),  # and those before speculation ran without it
                   # those before the no-pressure point ran 32k-token requests; a mixed-length point
                   # (sweep --mixed) is its own pressure kind, never pooled with a uniform one
                   "mixed" if data.get("mixed") else data.get("pressure", True))
            entry = pooled.setdefault(key, {"runs": [], "runs_from": [], "context": data["context"]})
            entry["runs"] += row["runs"]
            entry["runs_from"].append(run)
        for t in data.get("layer_timing", []):
            timing.append(t | {"model": data["model"], "layers": data["layers"], "run": run})
    rows = []
    for (model, impl, locality, concurrency, kv_dtype, speculative, pressure), entry in pooled.items():
        row = summarize(impl, locality, concurrency, entry["runs"], kv_dtype)
        del row["runs"]
        rows.append(row | {"model": model, "speculative": speculative, "pressure": pressure,
                           "context": entry["context"], "runs_from": entry["runs_from"]})
    return {"machine": MACHINE, "commands": [c for _, c in fragments], "model": HEADLINE_MODEL, "rows": rows,
            "layer_timing": timing}


def impl_label(run: str, impl: str) -> str:
    """The implementation name a fragment's row has in perf.json (see FIRST_RESIDENCY_DEFAULT_RUN)."""
    suffix = run.removeprefix("gpu_run")
    before = suffix.isdigit() and int(suffix) < FIRST_RESIDENCY_DEFAULT_RUN
    return "ours_hot" if impl == "ours" and before else impl


def panels(rows: list[dict]) -> dict[tuple, dict[tuple[str, str], list[dict]]]:
    """The plot's panels: one per (model, KV dtype, pressure), the headline model's bf16 panel
    first; in each, one series per (impl, locality) with its rows by concurrency (so that an FP8
    point never joins a bf16 line, nor a no-pressure point a 32k-token one)."""
    out: dict[tuple, dict[tuple[str, str], list[dict]]] = {}
    order = sorted({(r["model"], r["kv_dtype"], r.get("pressure", True)) for r in rows},
                   key=lambda k: (k[0] != HEADLINE_MODEL, k[0], k[1] != "bfloat16", k[1], not k[2], str(k[2])))
    for key in order:
        series: dict[tuple[str, str], list[dict]] = {}
        for r in rows:
            if (r["model"], r["kv_dtype"], r.get("pressure", True)) == key:
                series.setdefault((r["impl"], r["locality"]), []).append(r)
        out[key] = {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in sorted(series.items())}
    return out


def plot(perf: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = panels(perf["rows"])
    fig, axes = plt.subplots(1, len(grouped), figsize=(6.5 * len(grouped), 4.5), squeeze=False)
    for ax, ((model, kv_dtype, pressure), series) in zip(axes[0], grouped.items()):
        for (impl, locality), rs in series.items():
            x = [r["concurrency"] for r in rs]
            y = [r["decode_tok_s"] for r in rs]
            err = [[r["decode_tok_s"] - r["decode_tok_s_spread"][0] for r in rs],
                   [r["decode_tok_s_spread"][1] - r["decode_tok_s"] for r in rs]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{impl} ({locality})")
        ax.set_xscale("log", base=2)
        context = next(iter(series.values()))[0]["context"]
        ax.set_xlabel(f"concurrency ({context}-token requests)")
        ax.set_ylabel("decode tokens/s (median, min-max)")
        title = model if kv_dtype == "bfloat16" else f"{model}, {kv_dtype} KV"
        ax.set_title(f"{title}, mixed lengths" if pressure == "mixed"
                     else title if pressure else f"{title}, no memory pressure")
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
