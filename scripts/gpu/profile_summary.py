"""Per-step breakdown of a decode profile: a torch-profiler trace of SGLang's scheduler (``/start_profile``
with ``with_stack``) reduced to what a HiSparse step costs on the host and on the GPU.

The trace is cut into *iterations* at each start of the scheduler's ``run_batch`` (one scheduler
loop each; with the overlap scheduler the host prepares step n + 1 while the GPU runs step n, so an
iteration's wall time is the step time whenever the host is the bottleneck). Per iteration:

* ``wall_us``: from one ``run_batch`` start to the next;
* ``ours_us``: host time inside this plugin's functions (outermost ``sglang_hisparse`` Python frames
  on the scheduler thread), and per function (``ours_by_function``, mean per iteration);
* ``launches`` / ``graph_launches``: kernel launches issued outside / CUDA graph replays, and how
  many of the launches came from our functions (``ours_launches``);
* ``syncs``: host waits on the device (stream, event, device synchronize, blocking copies), with the
  ones issued inside our functions counted apart (``ours_syncs``);
* ``gpu_busy_us`` / ``gpu_outside_graph_us``: device time of kernels and copies launched in the
  iteration, and of those not replayed from a graph, with the top names (``outside_graph_kernels``);
* ``replay_us`` / ``gpu_gap_us``: the span of one decode graph replay on the device, and the idle
  time from the end of one replay to the start of the next (a gap near the step time minus the
  replay means the device waits for the host);
* ``sglang_by_function``: host time of the scheduler loop's direct callees (what SGLang itself
  does per iteration), ``ours_detail``: inclusive host time of every function of this plugin
  (nested ones too), and ``tree``: inclusive host time per call path below the loop (depth 4,
  paths of at least 20 us per iteration; decorator frames skipped), and ``forward_tree``: the same
  below ``forward_raw`` (the model runner's forward: graph replay and what prepares it) to depth
  10, paths of at least 5 us, all as means per iteration.

Python-level tracing slows the host code it traces, so ``ours_us`` is an upper bound; the step times
to compare implementations come from runs without the profiler (scripts/gpu/sweep.py).

    python scripts/gpu/profile_summary.py TRACE.json.gz [--skip 2]    # prints the summary as JSON
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

OURS = re.compile(r"(^|/)sglang_hisparse/")
RUN_BATCH = re.compile(r"scheduler\.py\(\d+\): run_batch$")
EVENT_LOOP = re.compile(r"scheduler\.py\(\d+\): event_loop_\w+$")
TRANSPARENT = re.compile(r": (wrapper|inner|decorate_context|_fn)$")
LAUNCH = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|cudaLaunchCooperativeKernel)")
GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")
SYNC = re.compile(r"^(cudaStreamSynchronize|cudaEventSynchronize|cudaDeviceSynchronize|cudaMemcpy$|cudaMemcpy2D$"
                  r"|cuStreamSynchronize|cuEventSynchronize|cuCtxSynchronize)")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _outermost(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Spans (start, end, name) not contained in an earlier one, in start order."""
    out: list[tuple[float, float, str]] = []
    for start, end, name in sorted(spans):
        if out and start < out[-1][1]:
            continue
        out.append((start, end, name))
    return out


def _inside(t: float, spans: list[tuple[float, float, str]], starts: list[float]) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def _function(name: str) -> str:
    """``.../sglang_hisparse/coordinator.py(199): map_last_loc_to_buffer`` -> ``coordinator.map_last_loc_to_buffer``."""
    m = re.search(r"sglang_hisparse/(.*?)\.py\(\d+\): (.*)$", name)
    return f"{m.group(1).replace('/', '.')}.{m.group(2)}" if m else name


def summarize(events: Iterable[dict], skip: int = 1) -> dict:
    """The per-iteration breakdown (module docstring): medians over iterations, the first ``skip``
    dropped (the profiler starts inside one)."""
    events = [e for e in events if e.get("ph") == "X"]
    py = [e for e in events if e.get("cat") == "python_function"]
    marks = sorted((e for e in py if RUN_BATCH.search(e["name"])), key=lambda e: float(e["ts"]))
    if len(marks) < skip + 2:
        raise ValueError(f"the trace has {len(marks)} run_batch calls; need at least {skip + 2}")
    thread = Counter(e["tid"] for e in marks).most_common(1)[0][0]
    starts = sorted(float(e["ts"]) for e in marks if e["tid"] == thread)
    bounds = list(zip(starts[skip:-1], starts[skip + 1:]))

    ours = _outermost([(float(e["ts"]), float(e["ts"]) + float(e["dur"]), _function(e["name"]))
                       for e in py if e["tid"] == thread and OURS.search(e["name"])])
    ours_starts = [s for s, _, _ in ours]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    launch_ts: dict[int, float] = {}
    graph_ids: set[int] = set()
    for e in runtime:
        corr = e.get("args", {}).get("correlation")
        if corr is not None and (LAUNCH.search(e["name"]) or GRAPH_LAUNCH.search(e["name"])):
            launch_ts[corr] = float(e["ts"])
            if GRAPH_LAUNCH.search(e["name"]):
                graph_ids.add(corr)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]

    rows = []
    outside_names: dict[str, float] = defaultdict(float)
    by_function: dict[str, float] = defaultdict(float)
    for lo, hi in bounds:
        row = {"wall_us": hi - lo, "ours_us": 0.0, "launches": 0, "ours_launches": 0, "graph_launches": 0,
               "syncs": 0, "ours_syncs": 0, "sync_us": 0.0, "gpu_busy_us": 0.0, "gpu_outside_graph_us": 0.0}
        for s, e, name in ours:
            if lo <= s < hi:
                row["ours_us"] += e - s
                by_function[name] += e - s
        for e in runtime:
            t = float(e["ts"])
            if not lo <= t < hi:
                continue
            in_ours = _inside(t, ours, ours_starts)
            if LAUNCH.search(e["name"]):
                row["launches"] += 1
                row["ours_launches"] += in_ours
            elif GRAPH_LAUNCH.search(e["name"]):
                row["graph_launches"] += 1
            elif SYNC.search(e["name"]):
                row["syncs"] += 1
                row["ours_syncs"] += in_ours
                row["sync_us"] += float(e["dur"])
        for e in device:
            corr = e.get("args", {}).get("correlation")
            t = launch_ts.get(corr)
            if t is None or not lo <= t < hi:
                continue
            row["gpu_busy_us"] += float(e["dur"])
            if corr not in graph_ids:
                row["gpu_outside_graph_us"] += float(e["dur"])
                outside_names[e["name"][:80]] += float(e["dur"])
        rows.append(row)
    n = len(rows)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary["iterations"] = n
    summary.update(_replays(device, graph_ids, launch_ts, starts[skip], starts[-1]))
    summary["ours_by_function"] = _top(by_function, n)
    summary["ours_detail"] = _top(_inclusive(py, thread, starts[skip], starts[-1], OURS), n, 16)
    summary["sglang_by_function"] = _top(_loop_callees(py, thread, starts[skip], starts[-1]), n)
    summary["tree"] = {k: v for k, v in _top(_call_tree(py, thread, starts[skip], starts[-1]), n, 60).items() if v >= 20}
    deep = _call_tree(py, thread, starts[skip], starts[-1], depth=10)
    summary["forward_tree"] = {k.split("forward_raw/", 1)[1]: v for k, v in _top(
        {k: v for k, v in deep.items() if "forward_raw/" in k}, n, 80).items() if v >= 5}
    summary["outside_graph_kernels"] = _top(outside_names, n)
    return summary


def _top(totals: dict[str, float], n: int, count: int = 12) -> dict[str, float]:
    return {k: round(v / n, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:count]}


def _inclusive(py: list[dict], thread, lo: float, hi: float, pattern: re.Pattern) -> dict[str, float]:
    """Inclusive time per function name of the Python events matching ``pattern`` in [lo, hi)."""
    totals: dict[str, float] = defaultdict(float)
    for e in py:
        if e["tid"] == thread and pattern.search(e["name"]) and lo <= float(e["ts"]) < hi:
            totals[_function(e["name"])] += float(e["dur"])
    return totals


def _loop_callees(py: list[dict], thread, lo: float, hi: float) -> dict[str, float]:
    """Time of the scheduler loop's direct callees in [lo, hi), per callee (empty when the trace
    has no event-loop frame)."""
    events = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in py if e["tid"] == thread),
                    key=lambda t: (t[0], -t[1]))
    loops = [ev for ev in events if EVENT_LOOP.search(ev[2])]
    if not loops:
        return {}
    loop_start, loop_end, _ = loops[0]
    totals: dict[str, float] = defaultdict(float)
    covered = -1.0
    for start, end, name in events:
        if not loop_start < start < loop_end or start < covered or name == loops[0][2]:
            continue
        if TRANSPARENT.search(name):
            continue  # a decorator's frame: its callee is the function that counts
        covered = end  # the first event after the last callee ends is the next direct callee
        if lo <= start < hi:
            totals[name.split(": ")[-1]] += end - start
    return totals


def _call_tree(py: list[dict], thread, lo: float, hi: float, depth: int = 4) -> dict[str, float]:
    """Inclusive time per call path (``a/b/c``) of the Python events below the scheduler loop
    that start in [lo, hi), to ``depth`` levels (empty when the trace has no event-loop frame)."""
    events = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in py if e["tid"] == thread),
                    key=lambda t: (t[0], -t[1]))
    totals: dict[str, float] = defaultdict(float)
    stack: list[tuple[float, str]] = []  # (end, path) of the open frames below the loop
    inside = None
    for start, end, name in events:
        if EVENT_LOOP.search(name):
            inside, stack = end, []
            continue
        if inside is None or start >= inside:
            continue
        while stack and stack[-1][0] <= start:
            stack.pop()
        if TRANSPARENT.search(name):
            continue
        path = (stack[-1][1] + "/" if stack else "") + name.split(": ")[-1]
        stack.append((end, path))
        if path.count("/") < depth and lo <= start < hi:
            totals[path] += end - start
    return totals


def _replays(device: list[dict], graph_ids: set[int], launch_ts: dict[int, float], lo: float, hi: float) -> dict:
    """Median span of a graph replay on the device and median idle gap between consecutive replays."""
    spans: dict[int, list[float]] = {}
    for e in device:
        corr = e.get("args", {}).get("correlation")
        if corr in graph_ids and lo <= launch_ts[corr] < hi:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            span = spans.setdefault(corr, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
    ordered = sorted(spans.values())
    gaps = [b[0] - a[1] for a, b in zip(ordered, ordered[1:])]
    return {"replay_us": statistics.median(e - s for s, e in ordered) if ordered else 0.0,
            "gpu_gap_us": statistics.median(gaps) if gaps else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--skip", type=int, default=1)
    args = p.parse_args()
    print(json.dumps(summarize(load_events(args.trace), args.skip), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
