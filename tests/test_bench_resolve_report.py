"""scripts/research/bench_resolve.py's report on CPU (the benchmark itself needs the GPU): the reuse-policy
section pairs ours_reuse with ours on the same cell, the target lines read the LRU rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "research"))

import bench_resolve  # noqa: E402


def _row(impl: str, us: float, batch: int = 16, miss: float = 0.0, skip: bool = False) -> dict:
    return {"impl": impl, "B": 4096, "batch": batch, "miss_frac": miss, "item_bytes": 1152, "skip_io": skip,
            "timing": "graph", "median_us": us, "p10_us": us, "p90_us": us}


def test_report_pairs_the_reuse_kernel_with_lru_on_each_cell():
    result = {"rows": [_row("ours", 10.0), _row("ours", 8.0, skip=True), _row("ours_reuse", 12.5)],
              "checks": [{"cell": "c", "ours_matches_oracle": True, "upstream_agrees_with_ours": None}],
              "skipped": [], "upstream": "n/a", "timing": ["graph"], "sweep": [], "stage_clock": []}
    text = bench_resolve.report_markdown(result, "machine", "command")
    assert "| 4096 | 1152 | 16 | 0 | 10.0 | 12.5 | 1.25x |" in text
    assert "- 0 misses, batch 16 <= 8 us: 10.0 us, MISSED" in text
    assert "all match" in text
