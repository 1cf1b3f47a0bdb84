"""Decode throughput and TPOT from an SGLang server log (the scheduler's own per-step lines).

Why: the client-side measure (time of the full call minus the time of a 1-token call) breaks when
the two prefills differ (a first-call warm-up at a new shape made it near zero: 228k tok/s for one
request in docs/results/gpu_run12/tput.json). With ``--decode-log-interval 1`` SGLang logs every
batch; each "Decode batch" line carries ``#running-req`` and ``gen throughput (token/s)`` (tokens
generated since the previous decode line / seconds since it), so a step's time is running / rate.

A step is counted only when the batch line before it is a decode line too: a decode line that
follows prefill batches also covers their time (prefill is the same work in every mode; it is not
decode throughput). Pure functions; the CLI recomputes a throughput run from its server logs.

    python scripts/gpu/decode_log.py LOG --levels 1,8,32,64 --context 32768 [--impl ours]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

_PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+)")
_DECODE = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)")


@dataclass(frozen=True)
class Batch:
    """One scheduler batch line. ``running`` and ``rate`` are set for decode lines, ``new_tokens``
    for prefill lines."""

    decode: bool
    running: int = 0
    rate: float = 0.0
    new_tokens: int = 0


def parse_batches(text: str) -> list[Batch]:
    """Every prefill and decode batch line of a log, in order (other lines ignored)."""
    out = []
    for line in text.splitlines():
        if m := _DECODE.search(line):
            out.append(Batch(decode=True, running=int(m.group(1)), rate=float(m.group(2))))
        elif m := _PREFILL.search(line):
            out.append(Batch(decode=False, new_tokens=int(m.group(2))))
    return out


def decode_stats(batches: list[Batch]) -> dict:
    """Decode tokens/s (tokens of pure decode steps / their time), TPOT (median pure step time),
    the number of such steps, the most requests decoding at once, and per batch size (requests
    decoding) the pure steps' count and median time in ms (``step_ms_by_running``: two servers
    that ran the same batch sizes compare step for step, whatever their schedules' mix). Raises
    ValueError when the window holds no pure decode step (nothing to measure)."""
    steps = [(b.running, b.running / b.rate) for prev, b in zip(batches, batches[1:])
             if b.decode and prev.decode and b.rate > 0 and b.running > 0]
    if not steps:
        raise ValueError("no decode step follows another decode step in this window")
    tokens = sum(r for r, _ in steps)
    seconds = sum(s for _, s in steps)
    by_running: dict[int, list[float]] = {}
    for running, s in steps:
        by_running.setdefault(running, []).append(1000 * s)
    return {"decode_tok_s": tokens / seconds, "tpot_ms": 1000 * statistics.median(s for _, s in steps),
            "decode_steps": len(steps), "max_running": max(b.running for b in batches if b.decode),
            "step_ms_by_running": {str(r): [len(v), statistics.median(v)] for r, v in sorted(by_running.items())}}


def decode_trace(batches: list[Batch]) -> str:
    """Run-length batch sizes of the decode steps, e.g. "17x128 1x128": two servers whose traces
    differ ran different batch shapes, so their outputs may differ for numerical reasons alone."""
    runs: list[list[int]] = []
    for b in batches:
        if not b.decode:
            continue
        if runs and runs[-1][0] == b.running:
            runs[-1][1] += 1
        else:
            runs.append([b.running, 1])
    return " ".join(f"{r}x{n}" for r, n in runs)


def split_throughput_run(batches: list[Batch], levels: list[int], context: int) -> dict[int, list[Batch]]:
    """The batches of each level's full call in a log written by ``e2e.py throughput`` (per level,
    in order: a 1-token call then the full call, each prefilling exactly level x context tokens, no
    prefix cache). Walks back from the end, so warm-up requests before the first level are skipped.
    Raises ValueError when the prefill tokens do not add up (not such a log)."""
    ends: list[int] = []  # index after the last batch of each call, newest first
    i = len(batches)
    for c in reversed(levels):
        for _ in range(2):  # the full call, then the 1-token probe before it
            ends.append(i)
            need = c * context
            while need > 0:
                i -= 1
                if i < 0:
                    raise ValueError(f"log ends before level {c} prefilled {c * context} tokens")
                need -= batches[i].new_tokens
            if need != 0:
                raise ValueError(f"level {c}: prefill tokens overshoot by {-need}")
    # ends (newest first): [full_64, probe_64, full_32, probe_32, ...]; a full call starts where its probe ended
    starts = ends[1::2]
    return {c: batches[start:end] for c, start, end in zip(reversed(levels), starts, ends[0::2])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--levels", required=True, help="concurrency levels of the run, in order, e.g. 1,8,32,64")
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--impl", default=None, help="recorded in each row")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    parts = split_throughput_run(parse_batches(args.log.read_text(errors="replace")), levels, args.context)
    rows = [dict({"impl": args.impl, "concurrency": c, "context": args.context}, **decode_stats(parts[c]))
            for c in levels]
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
