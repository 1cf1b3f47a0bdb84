#!/usr/bin/env python3
"""Merge the sanitizer counts and JIT timings into kernel_tests.json and print a summary.

Usage: finalize_results.py OUT_DIR SANITIZER_LOG [--memcheck-rc N] [--racecheck-rc N]

Counts come from compute-sanitizer's own summary lines ("ERROR SUMMARY: N errors",
"RACECHECK SUMMARY: N hazards displayed"); a tool that did not run or printed no summary is
recorded as -1 (unknown), never as 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_hisparse.resolver.report import write_json  # noqa: E402


def parse_sanitizer(text: str) -> dict[str, int]:
    """Counts per tool from a log holding both runs, each introduced by '=== TOOL <name>'."""
    result = {"memcheck_errors": -1, "racecheck_hazards": -1}
    sections = re.split(r"^=== TOOL (\w+)", text, flags=re.M)
    for name, body in zip(sections[1::2], sections[2::2]):
        if name == "memcheck":
            m = re.findall(r"ERROR SUMMARY: (\d+) error", body)
            if m:
                result["memcheck_errors"] = int(m[-1])
        elif name == "racecheck":
            m = re.findall(r"RACECHECK SUMMARY: (\d+) hazard", body)
            if m:
                result["racecheck_hazards"] = int(m[-1])
            elif re.search(r"ERROR SUMMARY: 0 errors", body):
                result["racecheck_hazards"] = 0
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("sanitizer_log", type=Path)
    args = parser.parse_args()
    tests_path = args.out / "kernel_tests.json"
    tests = json.loads(tests_path.read_text()) if tests_path.exists() else {
        "machine": "unknown", "command": "not run", "cases": 0, "failures": -1, "block_sizes": [],
        "sanitizer": {}, "details": {"error": "the GPU tests did not write results"}}
    log = args.sanitizer_log.read_text(errors="replace") if args.sanitizer_log.exists() else ""
    tests["sanitizer"] = parse_sanitizer(log)
    mismatches = re.findall(r"\[(memcheck|racecheck)\] \d+ cases, (\d+) mismatches", log)
    tests.setdefault("details", {})["sanitizer_runs"] = {tool: int(n) for tool, n in mismatches}
    jit_path = args.out / "jit_warmup.json"
    if jit_path.exists():
        tests["details"]["jit"] = json.loads(jit_path.read_text())
        jit_path.unlink()  # the device returns at most 8 files; the timings now live here
    write_json(tests_path, tests)
    s = tests["sanitizer"]
    print(f"[summary] kernel tests: {tests['cases']} cases, {tests['failures']} failures; "
          f"memcheck errors {s['memcheck_errors']}, racecheck hazards {s['racecheck_hazards']} (-1 = not run); "
          f"sanitizer-run mismatches {tests['details']['sanitizer_runs'] or 'n/a'}")
    bench = args.out / "kernel_bench.json"
    if bench.exists():
        rows = json.loads(bench.read_text()).get("rows", [])
        print(f"[summary] benchmark: {len(rows)} rows (see kernel_bench.md)")
    else:
        print("[summary] benchmark: no results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
