"""Prefix reuse on the GPU (issue 43): HiSparse with SGLang's radix cache on, against the same
workloads without it, SGLang's own HiSparse and no HiSparse with the radix cache.

Runs on the GPU machine (scripts/gpu/run.sh job ``prefix``), one call of at most ~9 minutes:

    # here: bash scripts/gpu/build_site.sh && pip wheel --no-deps -w .site .   (docs/e2e_gpu.md)
    # on the GPU machine (device tool, carry [".site/site.tar.xz", ".site/sglang_hisparse-0.1.0-py3-none-any.whl", ".jit"]):
    HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh prefix --out $OUT/prefix.json

(without ``HISPARSE_PACK_JIT=0`` the call also brings back the JIT caches for ``.jit/``, which costs
minutes of the call). ``$OUT/prefix.json`` then goes to docs/results/prefix.json and
docs/performance.md.

Servers (``--servers``, in this order by default), up side by side on the one GPU: the first is
started and warmed up alone to measure what a server takes of the GPU, then as many more as the
free memory holds start in parallel (``--together`` sets the group size instead); servers that do
not fit form a later group, which runs the whole workloads after the first group has stopped:

  ours_radix  this plugin, radix cache on (prefix reuse, docs/prefix_reuse/README.md)
  ours        this plugin, ``--disable-radix-cache``
  upstream    SGLang's own HiSparse, ``--disable-radix-cache`` (it requires it); SGLANG_PLUGINS names
              only our test-only dummy-init plugin, as e2e.py does, so the weights are the same
  none_radix  no HiSparse, radix cache on

Workloads, the same token ids on every server (seeded), greedy, ``--new-tokens`` per request:

* multi-turn (``mt``): ``--conversations`` C x ``--turns`` T; turn t sends every conversation's
  whole history (its earlier prompts and this server's own replies) plus a new user message, all C
  in one batched streamed ``/generate``; each turn adds about ``--max-context`` / T tokens, so a
  conversation grows to about ``--max-context`` L. Turn t runs on every server before turn t + 1.
* shared prefix (``sp``): ``--shared-requests`` N prompts of one ``--shared-prefix`` system prefix
  plus a unique suffix of ``--suffix-tokens`` / 2 to ``--suffix-tokens`` tokens; the first alone, then
  the other N - 1 in one batched streamed call (each phase on every server before the next).

Default (sized for one call with four ds32-width servers on the H200, ~27 GB of weights each):
C=16, T=4, L=16384, 64 new tokens, N=16 sharing 16384 tokens: about 2.4M prefilled tokens over the
four servers, ~150 s at ds32-width's ~16k prefill tokens/s, after ~200 s of starts. Larger, the
issue's setting (32 conversations x 6 turns growing to 32k): about 3.7M prefilled tokens for each
server without the radix cache and 1M with it, too much for four servers in one call; run it as
one pair per call, each paired in itself, e.g.

    HISPARSE_PACK_JIT=0 bash scripts/gpu/run.sh prefix --conversations 32 --turns 6 --max-context 32768 \
        --ratio 8 --workloads mt --budget-s 520 --servers ours_radix,ours --out $OUT/prefix_mt32_ours.json

then ``--servers ours_radix,upstream`` and ``--servers ours_radix,none_radix``. ``--ratio 8`` gives
ours 2M logical ids and host rows, enough to keep 32 x 32k tokens cached; none_radix caches in its
262,144-token device pool and evicts there, so its later turns find less cached (and are left out
of the exactness rows, which the default run gives). A call that runs short of its budget skips
the last turns on both servers alike (``skipped``).

Measured per server and workload, from the stream (the client's clock): TTFT per request (first
streamed token minus the call's send time), output tok/s (output tokens over the calls' wall time,
prefill included), each request's decode rate (tokens after the first over the time from the first
to the last), SGLang's ``cached_tokens`` per request (meta_info); from the server log
(scripts/gpu/decode_log.py): prefilled tokens, decode tok/s and the decode trace. Pools: after each
workload ours' idle line (``leak=``, ``cached=``), then ``/flush_cache`` and the next idle line:
``pools_back`` when nothing is cached and every pool is at its initial count.

Exactness rows (ours_radix against none_radix, token by token, per workload). Held equal, as in
e2e.py's exactness runs: the weights (dummy init seeded per tensor name, one ``--locality``), the
deterministic DSA configuration (e2e.flags/ENV: torch top-k, no fused top-k, FlashMLA sparse
prefill and decode, dense-attention threshold 0, bf16 KV), one CUDA-graph capture size
(``--cuda-graph-bs F``, F = the largest batch: every decode step padded to F rows, so a request's
decode numerics do not depend on which others decode beside it), one batched call per turn or
phase (one scheduler message, the same queue order), sent when the server is idle, both caches
flushed before each workload (so with nothing evicted both cache the same page-aligned tokens and
each request prefills the same suffix). Compared are the requests whose prompt (the history, which
holds the server's own replies) and ``cached_tokens`` are equal on both servers; the others are
listed with the reason. Not held equal: the overlap scheduler (on; ``--strict`` turns it off on
every server and sets ours' ``wait_for_staging``, e2e.py's ``--no-overlap --wait-for-staging``), the
prefill chunks when the servers admit differently under memory pressure, and eviction (none_radix
caches in its device pool, ours_radix in host rows). ``ours`` and ``upstream`` are not compared
(no radix cache: every request prefills in full); every request's output digest is recorded.

Summary: per workload and other server, ``ttft_speedup`` = other's median TTFT / ours_radix's
(also over the later turns / the shared requests after the first alone: ``ttft_later_speedup``)
and ``tok_s_ratio`` = ours_radix's output tok/s / other's: above 1, ours_radix is faster. A short
markdown summary is printed at the end. CPU tests: tests/test_gpu_scripts.py (no servers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (flags, ENV, hisparse_config, prompts, VOCAB, LOG_DIR)
import v4_probe  # noqa: E402  (sse_payloads, BatchTracker, batch_body, request_ids, device_info, first_diff)
from decode_log import decode_stats, decode_trace, parse_batches  # noqa: E402

from sglang_hisparse.serving.launcher import Server, start_server, wait_for_idle_report  # noqa: E402
from sglang_hisparse_testkit.dummy_init import LOCALITY_ENV, locality_strength  # noqa: E402

SERVERS = {"ours_radix": ("ours", True), "none_radix": ("none", True), "ours": ("ours", False),
           "upstream": ("upstream", False)}
"""Server name -> (implementation as e2e.py names it, radix cache on); the default start order (the
exactness pair first, so that it shares a group where the GPU holds only two)."""
ANCHOR, BASELINE = "ours_radix", "none_radix"
CONTEXT_LENGTH = 65536  # e2e.flags' --context-length
WORKLOADS = ("mt", "sp")
START_STAGGER_S = 2.0  # between the parallel starts of a group


# --- arguments -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma list, start order: {', '.join(SERVERS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="mt (multi-turn), sp (shared prefix)")
    p.add_argument("--model", default="ds32-width", choices=e2e.EXACTNESS_MODELS)
    p.add_argument("--conversations", type=int, default=16, help="C: multi-turn conversations, one batch per turn")
    p.add_argument("--turns", type=int, default=4, help="T: turns per conversation")
    p.add_argument("--max-context", type=int, default=16384, help="L: tokens a conversation grows to")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request (every workload)")
    p.add_argument("--shared-requests", type=int, default=16, help="N: requests sharing the system prefix")
    p.add_argument("--shared-prefix", type=int, default=16384, help="tokens of the shared system prefix")
    p.add_argument("--suffix-tokens", type=int, default=256, help="a unique suffix has S/2 to S tokens")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--buffer", type=int, default=4096, help="HiSparse device_buffer_size (ours and upstream)")
    p.add_argument("--ratio", type=int, default=4, help="host_to_device_ratio (ours and upstream)")
    p.add_argument("--max-total-tokens", type=int, default=262144, help="every server's KV pool (one HBM budget)")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="--mem-fraction-static: SGLang 0.5.17 keeps (1 - f) of the memory free at each server's "
                        "start for activations; the pool is capped by --max-total-tokens, so later servers fit")
    p.add_argument("--locality", default="realistic", help="dummy-weight locality (a preset or a strength)")
    p.add_argument("--kv-dtype", default="bfloat16", choices=sorted(e2e.KV_DTYPES))
    p.add_argument("--graph-bs", type=int, default=0, help="the one CUDA-graph capture size (0: the largest batch)")
    p.add_argument("--together", type=int, default=0,
                   help="servers up at once (0: as many as the GPU's free memory holds after the first one started)")
    p.add_argument("--growth-mib", type=int, default=6144,
                   help="what each server takes beyond its warm-up during the workloads (16 x 16k multi-turn "
                        "on ds32-width grew each of four servers by ~4.7 GiB, and the fourth ran out of memory)")
    p.add_argument("--strict", action="store_true",
                   help="every server --disable-overlap-schedule, ours with wait_for_staging (batches held equal)")
    p.add_argument("--decode-log-interval", type=int, default=1, help="SGLang's decode log interval (traces need 1)")
    p.add_argument("--budget-s", type=float, default=480, help="the script's own time limit (the call's is 600 s)")
    p.add_argument("--start-margin-s", type=float, default=120, help="a server starts only with this much left")
    p.add_argument("--round-margin-s", type=float, default=15, help="a turn or phase starts only with the last "
                   "one's time plus this much left")
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp/out")) / "prefix.json"))
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments; ``server_list`` and ``workload_list`` are set. Errors exit 2
    (argparse) naming the option."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.server_list = [s for s in args.servers.split(",") if s]
    args.workload_list = [w for w in args.workloads.split(",") if w]
    bad = [s for s in args.server_list if s not in SERVERS]
    if bad or not args.server_list or len(set(args.server_list)) != len(args.server_list):
        parser.error(f"--servers: distinct names of {', '.join(SERVERS)}, got {args.servers!r}")
    if not args.workload_list or any(w not in WORKLOADS for w in args.workload_list):
        parser.error(f"--workloads: mt and/or sp, got {args.workloads!r}")
    if min(args.conversations, args.turns, args.new_tokens, args.shared_requests, args.suffix_tokens) < 1:
        parser.error("--conversations, --turns, --new-tokens, --shared-requests, --suffix-tokens must be >= 1")
    if args.max_context // args.turns - args.new_tokens < 8:
        parser.error(f"--max-context / --turns must exceed --new-tokens by 8 or more (each turn's message), "
                     f"got {args.max_context} / {args.turns} and {args.new_tokens}")
    longest = max(args.max_context, args.shared_prefix + args.suffix_tokens + args.new_tokens)
    if longest > CONTEXT_LENGTH:
        parser.error(f"a request would reach {longest} tokens, above the servers' context length {CONTEXT_LENGTH}")
    if args.together < 0:
        parser.error("--together must be >= 0")
    if not 0 < args.mem_fraction < 1:
        parser.error("--mem-fraction must be in (0, 1)")
    locality_strength(args.locality)  # raises ValueError naming the allowed values
    return args


def graph_size(args: argparse.Namespace) -> int:
    """The one capture size: --graph-bs, or the largest batch a call sends."""
    return args.graph_bs or max(args.conversations, args.shared_requests - 1, 1)


# --- workloads (pure) ------------------------------------------------------------------------------
def turn_messages(conversations: int, turns: int, max_context: int, new_tokens: int, seed: int
                  ) -> list[list[list[int]]]:
    """``[c][t]``: the user message conversation c sends at turn t. Each turn adds ``max_context //
    turns`` tokens at most (its message, up to an eighth shorter, then ``new_tokens`` of reply), so
    a conversation ends at most ``max_context`` tokens long."""
    rng = random.Random(seed)
    base = max_context // turns - new_tokens
    return [[[rng.randrange(2, e2e.VOCAB) for _ in range(base - rng.randrange(0, base // 8 + 1))]
             for _ in range(turns)] for _ in range(conversations)]


def next_prompt(history: list[int], message: list[int]) -> list[int]:
    """A turn's prompt: the whole history (earlier prompts and replies) plus the new message."""
    return history + message


def shared_prefix_prompts(requests: int, prefix_tokens: int, suffix_tokens: int, seed: int) -> list[list[int]]:
    """``requests`` prompts: one system prefix of ``prefix_tokens`` plus a unique suffix of
    ``suffix_tokens // 2`` to ``suffix_tokens`` tokens each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, e2e.VOCAB) for _ in range(prefix_tokens)]
    lengths = [rng.randint(max(1, suffix_tokens // 2), suffix_tokens) for _ in range(requests)]
    return [prefix + [rng.randrange(2, e2e.VOCAB) for _ in range(n)] for n in lengths]


def digest(ids: list[int] | None) -> str | None:
    """First 12 hex digits of sha1 over the ids (as e2e.digests)."""
    return None if ids is None else hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


# --- one streamed call and its arithmetic ----------------------------------------------------------
def request_metrics(t0: float, events: list[tuple[float, dict]], names: list[str], rids: list[str]) -> list[dict]:
    """Per request of one batched streamed call, from its chunks ``(client time, payload)``: output
    ids (v4_probe.BatchTracker: cumulative or delta chunks), TTFT (first chunk holding a token minus
    ``t0``), the time of its last token, decode tok/s (tokens after the first over first -> last),
    SGLang's prompt_tokens and cached_tokens (the last meta_info that has them), finish reason."""
    tracker = v4_probe.BatchTracker(rids, [], 0)
    first: list[float | None] = [None] * len(rids)
    last: list[float | None] = [None] * len(rids)
    meta: list[dict] = [{} for _ in rids]
    for t, chunk in events:
        info = chunk.get("meta_info") or {}
        i = chunk.get("index")
        if i is None:  # as BatchTracker finds it
            i = tracker.index_of.get(info.get("id"), 0 if len(rids) == 1 else None)
        if i is None or not 0 <= i < len(rids):
            tracker.update(chunk)  # recorded among its errors
            continue
        before = len(tracker.ids[i])
        tracker.update(chunk)
        meta[i].update({k: info[k] for k in ("prompt_tokens", "cached_tokens") if k in info})
        if len(tracker.ids[i]) > before:
            first[i] = t if first[i] is None else first[i]
            last[i] = t
    rows = []
    for i, name in enumerate(names):
        n = len(tracker.ids[i])
        span = last[i] - first[i] if first[i] is not None and last[i] is not None else 0.0
        rows.append({"name": name, "output_ids": tracker.ids[i], "output_tokens": n,
                     "ttft_s": None if first[i] is None else first[i] - t0,
                     "last_token_s": None if last[i] is None else last[i] - t0,
                     "decode_tok_s": (n - 1) / span if n > 1 and span > 0 else None,
                     "prompt_tokens": meta[i].get("prompt_tokens"), "cached_tokens": meta[i].get("cached_tokens"),
                     "finish_reason": tracker.finish[i]})
    return rows


def stream_call(server: Server, prompts: list[list[int]], new_tokens: int, rids: list[str], timeout: float
                ) -> tuple[float, float, list[tuple[float, dict]], str | None]:
    """One batched streamed /generate (greedy): (send time, end time, timed chunks, error or None)."""
    body = json.dumps(v4_probe.batch_body(prompts, [new_tokens] * len(prompts), rids)).encode()
    request = urllib.request.Request(f"{server.url}/generate", data=body, headers={"Content-Type": "application/json"})
    events: list[tuple[float, dict]] = []
    error = None
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for chunk in v4_probe.sse_payloads(response):
                events.append((time.perf_counter(), chunk))
    except Exception as e:  # noqa: BLE001 - recorded with what came back
        error = repr(e)[:1000]
    return t0, time.perf_counter(), events, error


# --- servers ---------------------------------------------------------------------------------------
@dataclass
class Live:
    """A started server and what the workloads need of it."""

    name: str
    impl: str
    radix: bool
    server: Server
    idle_mark: int = 0  # ours: idle reports before the last call
    up_s: float = 0.0  # start and warm-up
    history: dict = field(default_factory=dict)


def hisparse_config(impl: str, args: argparse.Namespace) -> str | None:
    return e2e.hisparse_config(impl, args.buffer, args.ratio, wait_for_staging=args.strict and impl == "ours")


def server_flags(args: argparse.Namespace) -> list[str]:
    """Every server's flags: e2e.py's deterministic set with one capture size, then ours."""
    bs = graph_size(args)
    flags = e2e.flags(True, args.max_total_tokens, max(args.conversations, args.shared_requests) + 1, bs,
                      overlap=not args.strict, kv_dtype=args.kv_dtype)
    return flags + ["--mem-fraction-static", str(args.mem_fraction), "--decode-log-interval",
                    str(args.decode_log_interval)]


def server_env(impl: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**e2e.ENV, LOCALITY_ENV: args.locality}
    if impl == "upstream":
        env["SGLANG_PLUGINS"] = "hisparse_dummy_init"  # SGLang's own HiSparse: ours excluded (e2e.launch)
    return env


def launch(name: str, args: argparse.Namespace) -> Live:
    impl, radix = SERVERS[name]
    server = start_server(model=args.model, hisparse_config=hisparse_config(impl, args), extra_args=server_flags(args),
                          env=server_env(impl, args), log_dir=e2e.LOG_DIR, cpu=False, name=f"prefix_{name}",
                          max_total_tokens=args.max_total_tokens, ready_timeout=420, radix_cache=radix)
    return Live(name, impl, radix, server)


def gpu_free_mib() -> int | None:
    """Free GPU memory (nvidia-smi, first GPU), None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except Exception:  # noqa: BLE001
        return None


def how_many_fit(free_mib: int | None, used_mib: int | None, margin: float = 1.05, reserve_mib: int = 2048,
                 growth_mib: int = 0) -> int:
    """How many more servers like the one measured (``used_mib`` taken by it, warm-up included) fit
    in ``free_mib``, each with a margin and ``growth_mib`` more for what the workloads' prefills
    take beyond the warm-up (the measured one grows too), plus a reserve. Unknown readings: 1 (one
    more at a time)."""
    if free_mib is None or used_mib is None or used_mib <= 0:
        return 1
    return max(0, int((free_mib - reserve_mib - growth_mib) // (margin * used_mib + growth_mib)))


def flush(server: Server, tries: int = 5) -> bool:
    """/flush_cache (SGLang answers 400 while requests run or wait: retried)."""
    for _ in range(tries):
        try:
            with urllib.request.urlopen(f"{server.url}/flush_cache", timeout=60) as response:
                response.read()
            return True
        except urllib.error.HTTPError:
            time.sleep(2)
    return False


def pools_back(report: dict | None) -> bool | None:
    """After a flush: nothing cached, no leak, every pool at its initial count (None: no report)."""
    if report is None:
        return None
    return (not report["leak"] and report.get("cached", 0) == 0
            and all(now == initial for now, initial in report["counts"].values()))


def brief(report: dict | None) -> dict | None:
    keys = ("leak", "cached", "loaded", "lent", "evicted", "counts", "resident", "demotions")
    return None if report is None else {k: report.get(k) for k in keys}


def pools_after_workload(live: Live) -> dict:
    """Ours: the idle line of the workload's end, then /flush_cache and (radix cache on) the next idle
    line; ``pools_back`` from the last of them. Others: the flush only (none_radix's cache emptied
    for the next workload)."""
    if live.impl != "ours":
        return {"flushed": flush(live.server)}
    idle = idle_report(live.server, live.idle_mark)
    mark = settled_reports(live.server)
    out: dict = {"idle": brief(idle), "flushed": flush(live.server)}
    if live.radix:  # the flush counts as activity: one idle line follows (tests/test_e2e_cpu_prefix.py)
        idle = idle_report(live.server, mark, timeout=30)
        out["after_flush"] = brief(idle)
    out["pools_back"] = pools_back(idle)
    return out


def idle_report(server: Server, after: int, timeout: float = 60) -> dict | None:
    """Ours' idle report after the first ``after`` ones (None when none comes in ``timeout``)."""
    try:
        return wait_for_idle_report(server, timeout=timeout, after=after)
    except TimeoutError:
        return None


def settled_reports(server: Server) -> int:
    """``Server.settle`` (two /server_info round trips: every idle line due is logged), then the
    number of idle reports."""
    server.settle(timeout=60)
    return len(server.idle_reports())


def warm_up(live: Live, args: argparse.Namespace) -> None:
    """One batch at the capture size (short prompts) so that first-use costs fall outside the
    workloads, then an empty cache."""
    live.server.generate(e2e.prompts([1024] * graph_size(args), seed=99), 8)
    flush(live.server)


def warm_up_or_stop(live: Live, args: argparse.Namespace) -> None:
    """warm_up; a server that fails it is stopped and the error raised."""
    try:
        warm_up(live, args)
    except BaseException:
        live.server.stop()
        raise


# --- the workloads on a group of servers -----------------------------------------------------------
class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.time(), budget_s

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)


def timed_round(group: list[Live], prompts_of, names: list[str], args: argparse.Namespace, clock: Clock,
                rows: dict, workload: str, round_index: int) -> bool:
    """One turn or phase on every server of the group in turn; records each call's requests into
    ``rows[(server, workload)]``. ``prompts_of(live)`` gives that server's prompts. False when a
    server failed (it is dropped from the group)."""
    ok = True
    for live in list(group):
        prompts = prompts_of(live)
        live.idle_mark = settled_reports(live.server) if live.impl == "ours" else 0  # the last call's line logged
        rids = v4_probe.request_ids(len(prompts), uuid.uuid4().hex[:6])
        t0, t1, events, error = stream_call(live.server, prompts, args.new_tokens, rids, max(30.0, clock.left()))
        requests = request_metrics(t0, events, names, rids)
        for r, p in zip(requests, prompts):
            r.update(prompt_len=len(p), prompt_digest=digest(p), round=round_index, later=round_index > 0,
                     output_digest=digest(r["output_ids"]))
        row = rows.setdefault((live.name, workload), {"calls": [], "requests": []})
        row["calls"].append({"round": round_index, "wall_s": t1 - t0, "requests": len(prompts), "error": error})
        row["requests"] += requests
        if error or any(r["output_tokens"] != args.new_tokens for r in requests):
            print(f"[prefix] {live.name} {workload}: call failed ({error}); dropped", flush=True)
            group.remove(live)
            ok = False
    return ok


def multi_turn(group: list[Live], args: argparse.Namespace, clock: Clock, rows: dict, skipped: list) -> None:
    messages = turn_messages(args.conversations, args.turns, args.max_context, args.new_tokens, args.seed)
    for live in group:
        live.history = {c: [] for c in range(args.conversations)}
    last = 0.0
    for t in range(args.turns):
        if clock.left() < (last * (t + 1) / t if t else 0.0) + args.round_margin_s:  # turns grow about linearly
            skipped.append(f"mt turns {t}..{args.turns - 1} on {[g.name for g in group]} (time budget)")
            return
        start = time.time()
        names = [f"mt-c{c:02d}-t{t}" for c in range(args.conversations)]
        prompts = {live.name: [next_prompt(live.history[c], messages[c][t]) for c in range(args.conversations)]
                   for live in group}
        timed_round(group, lambda live: prompts[live.name], names, args, clock, rows, "mt", t)
        for live in group:
            outs = rows[(live.name, "mt")]["requests"][-args.conversations:]
            for c in range(args.conversations):
                live.history[c] = prompts[live.name][c] + outs[c]["output_ids"]
        last = time.time() - start
        print(f"[prefix] mt turn {t}: {last:.0f}s, {clock.left():.0f}s left", flush=True)


def shared_prefix(group: list[Live], args: argparse.Namespace, clock: Clock, rows: dict, skipped: list) -> None:
    prompts = shared_prefix_prompts(args.shared_requests, args.shared_prefix, args.suffix_tokens, args.seed + 1000)
    phases = [[0], list(range(1, args.shared_requests))]  # the first alone, then the rest at once
    last = 0.0
    for phase, indices in enumerate(phases):
        if not indices:
            continue
        if clock.left() < last + args.round_margin_s:
            skipped.append(f"sp requests {indices[0]}.. on {[g.name for g in group]} (time budget)")
            return
        start = time.time()
        timed_round(group, lambda live: [prompts[i] for i in indices], [f"sp-{i:02d}" for i in indices],
                    args, clock, rows, "sp", phase)
        last = time.time() - start


def log_stats(segment: str) -> dict:
    """From a server log window: prefilled tokens, decode tok/s and TPOT (decode_log), decode trace."""
    batches = parse_batches(segment)
    out: dict = {"prefilled_tokens": sum(b.new_tokens for b in batches if not b.decode),
                 "decode_trace": decode_trace(batches)}
    try:
        out.update(decode_stats(batches))
    except ValueError:
        pass
    return out


def run_group(servers: list[Live], args: argparse.Namespace, clock: Clock, result: dict, rows: dict,
              save: Callable[[], None]) -> None:
    """Every workload on the group's servers (each turn or phase on each server in turn), then each
    server's log numbers and pools for that workload; ``save`` after each workload. A server whose
    call fails is left out of the rest (the caller still stops it)."""
    group = list(servers)
    for workload in args.workload_list:
        offsets = {live.name: len(live.server.log()) for live in group}
        (multi_turn if workload == "mt" else shared_prefix)(group, args, clock, rows, result["skipped"])
        for live in group:
            row = rows.get((live.name, workload))
            if row is None:
                continue
            try:
                live.server.settle(timeout=60)  # the last step's batch line is in the log
                row["log"] = log_stats(live.server.log()[offsets[live.name]:])
                row["pools"] = pools_after_workload(live)
            except Exception as e:  # noqa: BLE001 - recorded, the others go on
                row["pools"] = {"error": repr(e)[-800:]}
        save()


def start_one(name: str, args: argparse.Namespace) -> Live | Exception:
    """Launch and warm up one server (an exception is returned, not raised)."""
    t = time.time()
    try:
        live = launch(name, args)
        warm_up_or_stop(live, args)
    except Exception as e:  # noqa: BLE001 - the caller records it
        return e
    live.up_s = round(time.time() - t, 1)
    return live


def record_start(name: str, got: Live | Exception, args: argparse.Namespace, result: dict, gpu_mib: int | None
                 ) -> None:
    """The server's entry in ``result["servers"]``: how it started, or its error."""
    info = result["servers"].setdefault(name, {})
    if isinstance(got, Exception):
        info["error"] = repr(got)[-1500:]
        return
    info.update(impl=got.impl, radix_cache=got.radix, up_s=got.up_s, gpu_mib=gpu_mib, group=result["groups"],
                hisparse_config=hisparse_config(got.impl, args))
    print(f"[prefix] {name} up and warm in {got.up_s:.0f}s", flush=True)


def start_group(pending: list[str], args: argparse.Namespace, clock: Clock, result: dict) -> list[Live]:
    """Servers from ``pending`` (removed as taken), up side by side: the first alone, to measure
    what one takes of the GPU (warm-up included), then as many more as the free memory holds
    (how_many_fit), started in parallel. A server that fails beside others goes back to
    ``pending`` once (for a later group); one that fails alone is recorded."""
    if clock.left() < args.start_margin_s:
        result["skipped"] += [f"{name} not started (time budget)" for name in pending]
        pending.clear()
        return []
    name = pending.pop(0)
    before = gpu_free_mib()
    first = start_one(name, args)
    after = gpu_free_mib()
    used = before - after if before is not None and after is not None else None
    record_start(name, first, args, result, used)
    if isinstance(first, Exception):
        return []
    group = [first]
    fit = args.together - 1 if args.together > 0 else how_many_fit(after, used, growth_mib=args.growth_mib)
    more = pending[:fit] if clock.left() >= args.start_margin_s else []
    del pending[:len(more)]
    started: dict[str, Live | Exception] = {}
    threads = [threading.Thread(target=lambda n=n: started.__setitem__(n, start_one(n, args))) for n in more]
    for thread in threads:
        thread.start()
        time.sleep(START_STAGGER_S)  # distinct ports, process start order
    for thread in threads:
        thread.join()
    for n in more:
        record_start(n, started[n], args, result, None)
        if isinstance(started[n], Live):
            group.append(started[n])
        elif not result["servers"][n].get("retried"):
            result["servers"][n]["retried"] = True
            pending.append(n)
    print(f"[prefix] group {result['groups']}: {[g.name for g in group]} up, GPU free {gpu_free_mib()} MiB",
          flush=True)
    return group


# --- results ---------------------------------------------------------------------------------------
def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(row: dict) -> dict:
    """One server's numbers on one workload from its calls and requests."""
    reqs, calls = row["requests"], row["calls"]
    tokens = sum(r["output_tokens"] for r in reqs)
    wall = sum(c["wall_s"] for c in calls)
    prompt = sum(r["prompt_len"] for r in reqs)
    cached = sum(r["cached_tokens"] or 0 for r in reqs)
    return {"requests": len(reqs), "ttft_median_s": median([r["ttft_s"] for r in reqs]),
            "ttft_median_first_s": median([r["ttft_s"] for r in reqs if not r["later"]]),
            "ttft_median_later_s": median([r["ttft_s"] for r in reqs if r["later"]]),
            "ttft_max_s": max((r["ttft_s"] for r in reqs if r["ttft_s"] is not None), default=None),
            "ttft_median_by_round_s": [median([r["ttft_s"] for r in reqs if r["round"] == k])
                                       for k in sorted({r["round"] for r in reqs})],
            "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall if wall > 0 else None,
            "decode_tok_s_median": median([r["decode_tok_s"] for r in reqs]),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": cached / prompt if prompt else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(anchor: dict, other: dict) -> dict:
    """From two servers' summaries: the other's median TTFT / the anchor's (all requests, later
    ones), the anchor's output tok/s / the other's. Above 1: the anchor is faster."""
    return {"ttft_speedup": ratio(other["ttft_median_s"], anchor["ttft_median_s"]),
            "ttft_later_speedup": ratio(other["ttft_median_later_s"], anchor["ttft_median_later_s"]),
            "tok_s_ratio": ratio(anchor["output_tok_s"], other["output_tok_s"])}


def restrict(row: dict, names: set[str]) -> dict:
    """A row cut to the named requests and the calls of the rounds that hold them."""
    requests = [r for r in row["requests"] if r["name"] in names]
    rounds = {r["round"] for r in requests}
    return {"requests": requests, "calls": [c for c in row["calls"] if c["round"] in rounds]}


def summary_ratios(rows: dict[str, dict], anchor: str = ANCHOR) -> dict[str, dict]:
    """Per other server of one workload: ``ratios`` over the requests both it and the anchor
    served (a server cut short by the budget is compared on what it ran), and that count."""
    if anchor not in rows:
        return {}
    out = {}
    for name, row in rows.items():
        if name == anchor:
            continue
        names = {r["name"] for r in rows[anchor]["requests"]} & {r["name"] for r in row["requests"]}
        a, o = summarize(restrict(rows[anchor], names)), summarize(restrict(row, names))
        out[name] = {**ratios(a, o), "requests": a["requests"]}
    return out


def compare(base: list[dict], test: list[dict]) -> dict:
    """Token by token, requests matched by name; compared only where prompt digest and cached_tokens
    are equal on both sides (the rest listed with the reason)."""
    by_name = {r["name"]: r for r in test}
    out: dict = {"compared": 0, "identical": 0, "first_diff": {}, "excluded": {}}
    for r in base:
        t = by_name.get(r["name"])
        if t is None:
            out["excluded"][r["name"]] = "missing"
        elif t["prompt_digest"] != r["prompt_digest"]:
            out["excluded"][r["name"]] = "prompt differs (an earlier reply differed)"
        elif t["cached_tokens"] != r["cached_tokens"]:
            out["excluded"][r["name"]] = f"cached_tokens {t['cached_tokens']} vs {r['cached_tokens']}"
        else:
            out["compared"] += 1
            d = v4_probe.first_diff(r["output_ids"], t["output_ids"])
            if d is None:
                out["identical"] += 1
            else:
                out["first_diff"][r["name"]] = d
    return out


def finish(result: dict, rows: dict) -> dict:
    """Fill rows (output ids left out), exactness and summary into ``result``."""
    result["rows"] = []
    for (name, workload), row in rows.items():
        result["rows"].append({"server": name, "workload": workload, "summary": summarize(row), "calls": row["calls"],
                               "log": row.get("log"), "pools": row.get("pools"),
                               "requests": [{k: v for k, v in r.items() if k != "output_ids"}
                                            for r in row["requests"]]})
    result["exactness"] = [{"workload": w, "base": BASELINE, "test": ANCHOR,
                            "decode_trace": (rows[(ANCHOR, w)].get("log") or {}).get("decode_trace"),
                            "baseline_decode_trace": (rows[(BASELINE, w)].get("log") or {}).get("decode_trace"),
                            **compare(rows[(BASELINE, w)]["requests"], rows[(ANCHOR, w)]["requests"])}
                           for w in WORKLOADS if (ANCHOR, w) in rows and (BASELINE, w) in rows]
    result["summary"] = {w: summary_ratios({name: row for (name, wl), row in rows.items() if wl == w})
                         for w in WORKLOADS}
    return result


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    """The short summary printed at the end."""
    lines = []
    for w, title, unit in (("mt", "multi-turn", "turn"), ("sp", "shared prefix", "phase (first alone, rest)")):
        rows = [r for r in result["rows"] if r["workload"] == w]
        if not rows:
            continue
        lines += [f"### {title}", "", f"| server | requests | TTFT median s | by {unit} | output tok/s | "
                  "cached / prompt tokens | pools back |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            s, pools = r["summary"], r.get("pools") or {}
            by_round = " / ".join(_fmt(x, ".3f") for x in s["ttft_median_by_round_s"])
            lines.append(f"| {r['server']} | {s['requests']} | {_fmt(s['ttft_median_s'], '.3f')} | {by_round} | "
                         f"{_fmt(s['output_tok_s'], '.0f')} | {s['cached_tokens']} / {s['prompt_tokens']} | "
                         f"{pools.get('pools_back', '-')} |")
        for other, q in result["summary"].get(w, {}).items():
            lines.append(f"- {ANCHOR} vs {other} ({q['requests']} requests): TTFT {_fmt(q['ttft_speedup'])}x "
                         f"(later {_fmt(q['ttft_later_speedup'])}x), output tok/s {_fmt(q['tok_s_ratio'])}x")
        for x in result["exactness"]:
            if x["workload"] == w:
                excluded = f", {len(x['excluded'])} not compared" if x["excluded"] else ""
                lines.append(f"- exactness {x['test']} vs {x['base']}: {x['identical']} / {x['compared']} "
                             f"identical{excluded}")
        lines.append("")
    if result["skipped"]:
        lines.append("skipped: " + "; ".join(result["skipped"]))
    return "\n".join(lines)


def machine() -> dict:
    """The GPU (nvidia-smi), torch, CUDA and SGLang versions (v4_probe.device_info), CPUs, RAM."""
    info = v4_probe.device_info()
    info["cpus"] = os.cpu_count()
    try:
        info["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError):
        info["ram_gib"] = None
    return info


def machine_line(info: dict) -> str:
    """One line in perf.json's style: GPU, CPUs, RAM; SGLang, torch, CUDA."""
    return (f"{info.get('nvidia_smi') or 'GPU unknown'}; {info.get('cpus')} CPU cores, {info.get('ram_gib')} GiB RAM; "
            f"SGLang {info.get('sglang')}, torch {info.get('torch')}, CUDA {info.get('cuda')}")


def settings(args: argparse.Namespace) -> dict:
    keys = ("model", "conversations", "turns", "max_context", "new_tokens", "shared_requests", "shared_prefix",
            "suffix_tokens", "seed", "buffer", "ratio", "max_total_tokens", "mem_fraction", "locality", "kv_dtype",
            "strict", "decode_log_interval", "together", "growth_mib", "budget_s")
    return {**{k: getattr(args, k) for k in keys}, "graph_bs": graph_size(args), "server_flags": server_flags(args)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    device = machine()
    result: dict = {"machine": machine_line(device), "device": device,
                    "command": " ".join(["bash scripts/gpu/run.sh prefix", *argv]),
                    "settings": settings(args), "servers": {}, "groups": 0, "skipped": []}
    rows: dict = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["wall_s"] = round(time.time() - clock.t0, 1)
        out.write_text(json.dumps(finish(result, rows), indent=1))

    pending = list(args.server_list)
    while pending:
        group = start_group(pending, args, clock, result)  # takes at least one name from pending
        if not group:
            continue
        result["groups"] += 1
        try:
            run_group(group, args, clock, result, rows, save)
        except Exception as e:  # noqa: BLE001 - recorded, what ran is kept
            result["skipped"].append(f"group {[g.name for g in group]} failed: {repr(e)[-1500:]}")
        finally:
            for live in group:
                live.server.stop()
        save()
    save()
    print(markdown(result), flush=True)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
