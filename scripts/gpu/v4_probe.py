"""SGLang 0.5.17's DeepSeek-V4 on the GPU machine with the tiny V4 model: none, upstream and ours side by side.

Runs on the GPU machine from the repository root after scripts/gpu/run.sh prepared /tmp/site
(the site, our wheel and the V4 bundle: TileLang for the mHC kernels; scripts/gpu/build_v4_bundle.sh).
For each implementation it starts one server of ``sglang_hisparse/models/tiny-dsv4`` (dummy weights
from the test-only dummy-init plugin, token-id requests), sends the same greedy requests one at a
time (batch size 1 throughout, so no batch-shape numerics; the servers run side by side on the one
GPU unless --sequential), stops the server by PID and records:
output ids, server start time, exit status, the pool / HiSparse lines of its log. Then it compares
every implementation with the first one token by token and writes ``$OUT/v4probe.json`` (after
every server, so a call cut short still brings back what ran).

    python scripts/gpu/v4_probe.py --impls none,upstream --out $OUT/v4probe.json
    python scripts/gpu/v4_probe.py --impls none,ours,ours@4096,upstream --concurrent-only --concurrent 12 \\
        --abort 3 --hisparse-config '{"top_k": 512, "device_buffer_size": 2048, "host_to_device_ratio": 2}'

Implementations (as scripts/gpu/e2e.py names them); ``impl@B`` is the same implementation with
``device_buffer_size`` B (its own server), so one call covers several B against one baseline:
  none      SGLang without HiSparse; every plugin of ours loaded (--enable-hisparse off)
  upstream  SGLang's own HiSparse; SGLANG_PLUGINS names only our test-only dummy-init plugin
  ours      this plugin's HiSparse (docs/design.md, "DeepSeek-V4"), the same --hisparse-config
  ours_hot  ours with ``"residency": false`` (every request in a hot buffer; V4's default since
            gpu_v4probe9, where ``ours`` still had residency on)
  ours_resident  ours with ``"residency": true`` (C4 entries resident while the device has room)

Concurrent phase (``--concurrent N``, off by default; after the one-at-a-time phase, or instead of
it with ``--concurrent-only``): N prompts (``--concurrent-lengths``, prompt + new tokens within the
model's context) decode together on every server, ``--abort K`` of them aborted mid-decode, and
the others compared token by token with the first implementation (``compare_concurrent`` in the
JSON). How the servers' decode batches are held equal (docs/e2e_gpu.md: greedy outputs follow the
batch shapes, so a token-identical comparison needs the same decode numerics on both sides):

* One batched, streamed ``/generate`` call per server (e2e.py's lockstep): SGLang 0.5.17's
  tokenizer manager sends a batch of token-id prompts to the scheduler as one message
  (``_send_batch_request``), so every server queues the N requests at once, in the same order.
* Aborts: ``abort_indices`` picks K requests spread evenly over the submission order (12 and 3:
  indices 2, 6, 10); each is aborted through ``/abort_request`` by its rid once its own stream has
  shown ``--abort-after`` tokens (default 8). It gets a larger token budget (``abort_new_tokens``)
  so that it is still decoding when the abort lands. The rids have one length and distinct
  prefixes (SGLang's scheduler aborts every rid that *starts with* the given one).
* An abort lands at a wall-clock step, and a HiSparse server under pressure admits requests later
  than the baseline, so scheduling alone cannot give both servers the same batches. As in e2e.py's
  arrival mode, every decode step runs in ONE CUDA-graph capture size (``--concurrent-graph``,
  e2e.py's syntax, default ``F<N>``: ``--cuda-graph-bs N --cuda-graph-max-bs N``), padded to N rows
  whatever the batch, so a request's decode numerics do not depend on which others run beside it
  (DSA: 16/16 with two aborts, docs/results/gpu_run19/21). ``--max-running-requests`` is at least
  N + 1: SGLang 0.5.17 without HiSparse decodes at most max-running-requests - 1 requests together.
* Every server (the baseline too) runs with ``--disable-overlap-schedule`` and ours with
  ``"wait_for_staging": true`` (e2e.py's ``--no-overlap --wait-for-staging``): a prefilled request
  joins decode in the same step as without HiSparse. V4's C4 rows are FP8 (584 bytes) and FlashMLA
  reads them with its FP8 kernels; on tiny-dsa with FP8 KV the fixed graph size alone gave 14/16
  (its split scheduling follows the batch, gpu_run28) and with these two 16/16 (gpu_run39).
  ``--overlap`` keeps SGLang's overlap scheduler and ours without the wait (e2e.py's gpu_run19 form).
* These flags are the servers' own, so with --concurrent the one-at-a-time phase (unless
  --concurrent-only) runs with them too: still the same on every server, so still comparable.
* Not held equal: the prefill chunks of requests that a HiSparse server under pressure admits
  later than the baseline. Each server's concurrent result records its schedule (prefill chunk
  sizes and decode batch runs, ``--decode-log-interval 1``), its decode trace and its retractions,
  so a difference can be told from a schedule effect.

Throughput phase (``--throughput N``, instead of the other phases; issue 42's paired point under
pressure): every server starts side by side, then each in turn (the others idle, so no GPU work is
shared) serves N prompts of ``--throughput-context`` tokens in one batched call with
``--throughput-new-tokens`` greedy tokens, ``--throughput-warmup`` rounds (recorded, not counted) then
``--throughput-repeats`` rounds over the servers; decode
tokens/s, TPOT and the most requests decoding at once come from the call's step lines
(``decode_log.decode_stats``), ours' misses and pools from its idle line; ``compare_throughput``
gives every ratio (``ours/none``, ``ours/upstream``). The servers run as a user's would: SGLang's
overlap scheduler, decode CUDA graphs up to N, ours without ``wait_for_staging`` (the torch top-k
environment stays, the same on every server). ``--hisparse-max-total-tokens`` sizes the HiSparse
servers' pools (equal C4 device rows: ratio x ``--max-total-tokens``).

    python scripts/gpu/v4_probe.py --impls none,ours,upstream --throughput 24 --throughput-context 12000 \\
        --hisparse-max-total-tokens 262144 --hisparse-config '{"top_k": 512, "device_buffer_size": 2048, "host_to_device_ratio": 2}'

Pools: ours logs ``sglang-hisparse idle (DeepSeek-V4 C4): ... leak=no`` once per busy -> idle
transition; after the concurrent phase the probe waits for that line and records whether every
pool (token ids, SWA, C4 device rows, C4 host rows) is back at its initial count.

docs/deepseek_v4/gpu-probe.md records what ran and what came out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import random
import re
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_hisparse.serving.launcher import MODELS_DIR, parse_idle_reports, start_server  # noqa: E402

import e2e  # noqa: E402  (the graph-mode syntax and output digests of the DSA exactness runs)
from decode_log import Batch, decode_stats, decode_trace, parse_batches  # noqa: E402

LOG_DIR = Path(os.environ.get("E2E_LOG_DIR", "/tmp/e2e_logs")) / "v4probe"  # packed by scripts/gpu/run.sh
IMPLS = ("none", "upstream", "ours", "ours_hot", "ours_resident")
RESIDENCY_SWITCH = {"ours_hot": False, "ours_resident": True}
"""Variants of ours with ``residency`` set explicitly."""
DEFAULT_LENGTHS = "1024,2500,3900,4300,5500,7000,9500,12000"
"""Prompt lengths: four at or below device_buffer_size * 4 = 4096 (the kernel's fast path with the
default buffer of 1024), four above; index_topk 512 makes the C4 attention sparse above 2048."""
DEFAULT_HISPARSE = '{"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 2}'
DEFAULT_CONCURRENT_LENGTHS = (16000, 1000, 12000, 4300, 14000, 600, 2500, 9500, 5500, 7000, 8200, 3900)
"""The concurrent phase's prompts, in submission order (cycled when --concurrent exceeds 12):
84,500 tokens, 21,125 C4 entries together (more than the 16,384 C4 device rows of a HiSparse server
at --max-total-tokens 131072 and host_to_device_ratio 2, fewer than its 32,768 host rows); short and
long ones alternate. Five are longer than 4 x 2048 tokens (more entries than B = 2048: they swap);
none has more than 4096 entries (B = 4096 holds every entry). With 3 aborts of 12 the aborted ones
are 12000 (3000 entries), 2500 (625) and 8200 (2050: two beyond B = 2048)."""
ABORT_BUDGET_FACTOR = 4
"""An aborted request may generate up to this many times --new-tokens (within the context), so that
it is still decoding when its abort lands."""
RETRACT_LINE = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
ENV = {
    # the tiny model is unquantized: the fp8 wo_a GEMM asserts an fp8 quantization_config
    "SGLANG_OPT_FP8_WO_A_GEMM": "0",
    # SGLang switches the prefill indexer to its non-paged path (bs 1, >= 8192 query rows) only
    # without a HiSparse coordinator (dsv4/indexer.py _can_use_nonpaged_indexer): both
    # implementations take the paged path so that their numerics can be compared
    "SGLANG_OPT_DSV4_NONPAGED_INDEXER": "0",
    # V4's default fused top-k is not run-to-run deterministic (near ties): two runs of the same
    # server differed after a few tokens on the H100 (docs/results/gpu_v4probe1b vs gpu_v4probe2);
    # the torch top-k makes the baseline repeatable, so a difference is the implementation's
    "SGLANG_TOPK_TRANSFORM_512_TORCH": "1",
}
POOL_LINE = re.compile(r"(DSV4 pool|pool siz|HiSparse|hisparse|KV Cache is allocated|max_total_num_tokens|"
                       r"Load weight end|Capture cuda graph|TileLang|tilelang|mhc|MHC|Using .*Backend|"
                       r"chunked_prefill_size|context_len)", re.IGNORECASE)
ERROR_LINE = re.compile(r"(Traceback|Error|error:|Exception|assert|CUDA|killed)")


def parse_impl(spec: str) -> tuple[str, int | None]:
    """``impl`` or ``impl@B`` -> (impl, B or None). Raises ValueError naming what is allowed."""
    impl, sep, buffer = spec.partition("@")
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {spec!r}; allowed: {', '.join(IMPLS)}, optionally @B for HiSparse")
    if not sep:
        return impl, None
    if impl == "none" or not buffer.isdigit() or int(buffer) < 1:
        raise ValueError(f"{spec!r}: @B takes a positive device_buffer_size, for upstream or ours only "
                         "(none has no buffer)")
    return impl, int(buffer)


def log_name(spec: str) -> str:
    """The server's name and log file stem: ``v4_<impl>`` or ``v4_<impl>_B<B>``."""
    impl, buffer = parse_impl(spec)
    return f"v4_{impl}" + (f"_B{buffer}" if buffer else "")


def model_config(model: str) -> dict | None:
    """The model's config.json (None where the directory has none)."""
    model_dir = Path(model) if os.path.isdir(model) else MODELS_DIR / model
    path = model_dir / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def abort_indices(n: int, k: int) -> list[int]:
    """The ``k`` of ``n`` requests (submission order) to abort: one in the middle of each of ``k``
    equal parts, ``floor((2j + 1) n / 2k)``: distinct, deterministic, spread over the batch (12 and
    3: 2, 6, 10; 12 and 2: 3, 9). ``0 <= k < n``: at least one request stays to compare."""
    if not 0 <= k < n:
        raise ValueError(f"abort count must be in [0, {n - 1}] for {n} requests, got {k}")
    return [(2 * j + 1) * n // (2 * k) for j in range(k)]


def abort_new_tokens(prompt_len: int, new_tokens: int, context: int | None) -> int:
    """Token budget of an aborted request: ``ABORT_BUDGET_FACTOR`` x --new-tokens, within the context."""
    budget = ABORT_BUDGET_FACTOR * new_tokens
    return budget if context is None else min(budget, context - prompt_len)


def concurrent_lengths(args: argparse.Namespace) -> list[int]:
    """The N prompt lengths of the concurrent phase: --concurrent-lengths, or the default list
    (cycled, or cut to N)."""
    if args.concurrent_lengths:
        return [int(x) for x in args.concurrent_lengths.split(",") if x.strip()]
    return [DEFAULT_CONCURRENT_LENGTHS[i % len(DEFAULT_CONCURRENT_LENGTHS)] for i in range(args.concurrent)]


def concurrent_plan(args: argparse.Namespace) -> dict:
    """What the concurrent phase sends: lengths, the aborted indices, each request's max_new_tokens."""
    lengths = args.concurrent_length_list
    aborted = abort_indices(len(lengths), args.abort)
    max_new = [abort_new_tokens(n, args.new_tokens, args.context) if i in aborted else args.new_tokens
               for i, n in enumerate(lengths)]
    return {"n": len(lengths), "lengths": lengths, "abort_indices": aborted, "abort_after": args.abort_after,
            "max_new_tokens": max_new, "graph": args.concurrent_graph, "overlap_schedule": args.overlap,
            "wait_for_staging_ours": holds_shapes(args), "max_running": max_running(args)}


def request_ids(n: int, tag: str) -> list[str]:
    """rids of one batch: ``v4c-<tag>-<i, 4 digits>``, one length, so none is a prefix of another
    (SGLang's scheduler aborts every request whose rid starts with the one given)."""
    return [f"v4c-{tag}-{i:04d}" for i in range(n)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="none,upstream,ours",
                   help="comma list of: " + ", ".join(IMPLS) + "; upstream@B / ours@B: that implementation with "
                        "device_buffer_size B (its own server); the first one is every other's baseline")
    p.add_argument("--model", default="tiny-dsv4", help="a directory under sglang_hisparse/models (or a path)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in tokens, comma list")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    p.add_argument("--hisparse-config", default=DEFAULT_HISPARSE, help="--hisparse-config of upstream and ours")
    p.add_argument("--max-total-tokens", type=int, default=131072)
    p.add_argument("--hisparse-max-total-tokens", type=int, default=0, metavar="M",
                   help="--max-total-tokens of the HiSparse servers (default: --max-total-tokens). With V4 a "
                        "HiSparse server keeps 1/host_to_device_ratio of its C4 entries on the device: "
                        "M = ratio x --max-total-tokens gives it the C4 device rows of the server without "
                        "HiSparse (its SWA, C128 and indexer pools grow with M; the pool lines record them)")
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--graph", action="store_true", help="decode CUDA graphs (off by default: --disable-cuda-graph)")
    p.add_argument("--extra-env", action="append", default=[], metavar="K=V", help="more server environment")
    p.add_argument("--extra-arg", action="append", default=[], metavar="FLAG", help="more server flags (repeat)")
    p.add_argument("--sequential", action="store_true",
                   help="one server after the other (default: all at once on the one GPU, sharing the JIT "
                        "caches, whose builds are file-locked; each server still serves one request at a time)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="seconds for the whole probe: a server is given what is left (less a margin)")
    p.add_argument("--ready-timeout", type=float, default=330.0, help="most seconds one server may take to start")
    p.add_argument("--request-timeout", type=float, default=240.0)
    c = p.add_argument_group("concurrent phase (off by default; see the module docstring)")
    c.add_argument("--concurrent", type=int, default=0, metavar="N",
                   help="after the one-at-a-time requests, N requests in one batched call on every server")
    c.add_argument("--concurrent-only", action="store_true",
                   help="the concurrent phase only (no one-at-a-time requests)")
    c.add_argument("--concurrent-lengths", default="",
                   help="its N prompt lengths, comma list (default: %s, cycled)"
                        % ",".join(map(str, DEFAULT_CONCURRENT_LENGTHS)))
    c.add_argument("--abort", type=int, default=0, metavar="K",
                   help="abort K of the N mid-decode through /abort_request (which ones: abort_indices)")
    c.add_argument("--abort-after", type=int, default=8, metavar="T",
                   help="abort a chosen request once its stream has shown T tokens")
    c.add_argument("--concurrent-graph", default=None, metavar="MODE",
                   help="decode CUDA graphs of every server with --concurrent, e2e.py's syntax: 0 off, 1 SGLang's "
                        "capture sizes, F<n> one capture size n >= N (default F<N>: every decode step padded to "
                        "N rows)")
    c.add_argument("--overlap", action="store_true",
                   help="keep SGLang's overlap scheduler and ours without wait_for_staging (default with --concurrent: "
                        "every server --disable-overlap-schedule, ours \"wait_for_staging\": true)")
    t = p.add_argument_group("throughput phase (off by default; instead of the other phases)")
    t.add_argument("--throughput", type=int, default=0, metavar="N",
                   help="once every server is up: N requests of --throughput-context tokens in one batched call "
                        "on each server in turn (the others idle), --throughput-repeats rounds; decode tok/s "
                        "from the servers' step lines (decode_log.py); SGLang's overlap scheduler, decode CUDA "
                        "graphs up to N, ours without wait_for_staging")
    t.add_argument("--throughput-context", type=int, default=12000, metavar="L", help="prompt tokens per request")
    t.add_argument("--throughput-new-tokens", type=int, default=128, metavar="T", help="greedy tokens per request")
    t.add_argument("--throughput-repeats", type=int, default=2, help="rounds over the servers (paired, alternating)")
    t.add_argument("--throughput-warmup", type=int, default=1,
                   help="rounds before the measured ones, recorded but left out of the medians (first-use JIT "
                        "and caches: gpu_v4probe8's first round ran 10x slower on one server)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "v4probe.json"))
    args = p.parse_args(argv)
    args.impl_list = [i.strip() for i in args.impls.split(",") if i.strip()]
    if not args.impl_list:
        p.error(f"--impls: empty; allowed: {', '.join(IMPLS)}")
    for spec in args.impl_list:
        try:
            parse_impl(spec)
        except ValueError as e:
            p.error(f"--impls: {e}")
    if len(set(args.impl_list)) != len(args.impl_list):
        p.error(f"--impls: {args.impls!r} names a server twice")
    try:
        args.length_list = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be integers, got {args.lengths!r}")
    if not args.length_list or min(args.length_list) < 1:
        p.error("--lengths must be positive")
    hisparse = json.loads(args.hisparse_config)  # fail here, not on the GPU machine's server
    for spec in args.impl_list:
        buffer = parse_impl(spec)[1]
        if buffer is not None and buffer < hisparse.get("top_k", 0):
            p.error(f"--impls: {spec}: device_buffer_size below top_k {hisparse['top_k']}")
    for kv in args.extra_env:
        if "=" not in kv:
            p.error(f"--extra-env wants K=V, got {kv!r}")
    config = model_config(args.model)
    args.context = config.get("max_position_embeddings") if config else None
    if args.hisparse_max_total_tokens < 0:
        p.error("--hisparse-max-total-tokens must be >= 0 (0: the same as --max-total-tokens)")
    _check_concurrent(p, args)
    _check_throughput(p, args)
    return args


def _check_throughput(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.throughput:
        return
    if args.throughput < 0 or args.throughput_repeats < 1 or args.throughput_new_tokens < 1:
        p.error("--throughput, --throughput-repeats and --throughput-new-tokens must be positive")
    if args.throughput_warmup < 0:
        p.error(f"--throughput-warmup {args.throughput_warmup}: must be >= 0")
    if args.concurrent:
        p.error("--throughput replaces the other phases: leave out --concurrent")
    end = args.throughput_context + args.throughput_new_tokens
    if args.throughput_context < 1 or (args.context is not None and end > args.context):
        p.error(f"--throughput-context {args.throughput_context} + --throughput-new-tokens "
                f"{args.throughput_new_tokens} must be within the model's context ({args.context})")


def _check_concurrent(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The concurrent phase's options (all unused, and left as given, without --concurrent)."""
    if args.concurrent < 0:
        p.error("--concurrent must be >= 0")
    if not args.concurrent:
        if args.concurrent_only or args.abort or args.concurrent_lengths or args.concurrent_graph:
            p.error("--concurrent-only, --abort, --concurrent-lengths and --concurrent-graph need --concurrent N")
        args.concurrent_length_list = []
        return
    try:
        args.concurrent_length_list = concurrent_lengths(args)
    except ValueError:
        p.error(f"--concurrent-lengths must be integers, got {args.concurrent_lengths!r}")
    if len(args.concurrent_length_list) != args.concurrent:
        p.error(f"--concurrent-lengths has {len(args.concurrent_length_list)} lengths for "
                f"--concurrent {args.concurrent}")
    if min(args.concurrent_length_list) < 1:
        p.error("--concurrent-lengths must be positive")
    if not 0 <= args.abort < args.concurrent:
        p.error(f"--abort must be in [0, {args.concurrent - 1}] (at least one request is compared)")
    if args.abort_after < 1:
        p.error("--abort-after must be >= 1 (an aborted request has produced tokens)")
    aborted = abort_indices(args.concurrent, args.abort)
    for i, n in enumerate(args.concurrent_length_list):
        need = n + args.new_tokens
        if args.context is not None and need > args.context:
            p.error(f"--concurrent-lengths: {n} + {args.new_tokens} new tokens exceed the model's "
                    f"context {args.context}")
        if i in aborted and abort_new_tokens(n, args.new_tokens, args.context) <= args.abort_after:
            p.error(f"--abort-after {args.abort_after}: the aborted {n}-token prompt has only "
                    f"{abort_new_tokens(n, args.new_tokens, args.context)} tokens of budget within the context")
    if args.concurrent_graph is None:
        args.concurrent_graph = f"F{args.concurrent}"
    try:
        _, graph_bs = e2e.parse_graph(args.concurrent_graph)
    except ValueError as e:
        p.error(f"--concurrent-graph: {e}")
    if graph_bs is not None and graph_bs < args.concurrent:
        p.error(f"--concurrent-graph {args.concurrent_graph}: the capture size must hold all {args.concurrent} "
                "requests (larger batches would run eagerly, shapes following the batch)")


def holds_shapes(args: argparse.Namespace) -> bool:
    """Concurrent phase without --overlap: every server --disable-overlap-schedule, ours wait_for_staging."""
    return bool(args.concurrent) and not args.overlap


def max_running(args: argparse.Namespace) -> int:
    """--max-running-requests: with --concurrent N at least N + 1 (SGLang 0.5.17 without HiSparse
    decodes at most max-running-requests - 1 together; tests/test_sglang_admission.py)."""
    n = args.concurrent or args.throughput
    return max(args.max_running, n + 1) if n else args.max_running


def graph_flags(args: argparse.Namespace) -> list[str]:
    """CUDA-graph flags: --graph / --disable-cuda-graph, or with --concurrent its graph mode; with
    --throughput SGLang's capture sizes up to N (as a user's server decodes)."""
    if args.throughput:
        return ["--cuda-graph-max-bs", str(min(max(args.throughput, 8), 128)), "--cuda-graph-backend-prefill", "disabled"]
    if not args.concurrent:
        return [] if args.graph else ["--disable-cuda-graph"]
    graph, graph_bs = e2e.parse_graph(args.concurrent_graph)
    if not graph:
        return ["--disable-cuda-graph"]
    if graph_bs is not None:
        return ["--cuda-graph-bs", str(graph_bs), "--cuda-graph-max-bs", str(graph_bs),
                "--cuda-graph-backend-prefill", "disabled"]
    return ["--cuda-graph-max-bs", str(min(max(max_running(args), 8), 128)), "--cuda-graph-backend-prefill", "disabled"]


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--grammar-backend", "none", "--max-running-requests", str(max_running(args)),
             "--mem-fraction-static", "0.35",
             # every step with --concurrent: its schedule and decode trace come from these lines
             "--decode-log-interval", "1" if args.concurrent or args.throughput else "8",
             # SGLang sizes the SWA pool at 10% of the full pool by default (13056 tokens with
             # --max-total-tokens 131072): a longer prompt waited for SWA room forever, with and without
             # HiSparse (docs/results/gpu_v4probe4); 0.2 leaves room for tiny-dsv4's 16384-token context
             "--swa-full-tokens-ratio", "0.2"]
    flags += graph_flags(args)
    if holds_shapes(args):
        flags.append("--disable-overlap-schedule")
    return flags + list(args.extra_arg)


def server_env(impl: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(ENV)
    env.update(kv.split("=", 1) for kv in args.extra_env)
    if parse_impl(impl)[0] == "upstream":
        env["SGLANG_PLUGINS"] = "hisparse_dummy_init"  # SGLang's own HiSparse, our dummy weights only
    return env


def hisparse_config(spec: str, args: argparse.Namespace) -> str | None:
    """The server's --hisparse-config: None for none; --hisparse-config as given, with
    device_buffer_size B for ``impl@B`` and, for ours in the held-shapes concurrent phase,
    ``"wait_for_staging": true`` (SGLang's HiSparse has no such key)."""
    impl, buffer = parse_impl(spec)
    if impl == "none":
        return None
    wait = impl.startswith("ours") and holds_shapes(args)
    if buffer is None and not wait and impl not in RESIDENCY_SWITCH:
        return args.hisparse_config
    config = json.loads(args.hisparse_config)
    if buffer is not None:
        config["device_buffer_size"] = buffer
    if wait:
        config["wait_for_staging"] = True
    if impl in RESIDENCY_SWITCH:
        config["residency"] = RESIDENCY_SWITCH[impl]  # the A/B points of C4 residency
    return json.dumps(config)


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def first_diff(a: list[int] | None, b: list[int] | None) -> int | None:
    """None: identical; -1: one side missing; else the first index where they differ."""
    if a is None or b is None:
        return -1
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(results: dict, lengths: list[int]) -> dict:
    """Every implementation against the first one that served all requests."""
    impls = [i for i, r in results.items() if r.get("requests")]
    if len(impls) < 2:
        return {"baseline": impls[0] if impls else None, "against": {}, "identical": None}
    base = impls[0]
    against = {}
    for impl in impls[1:]:
        rows = []
        for k, n in enumerate(lengths):
            a = results[base]["requests"][k].get("output_ids") if k < len(results[base]["requests"]) else None
            b = results[impl]["requests"][k].get("output_ids") if k < len(results[impl]["requests"]) else None
            rows.append({"prompt_len": n, "first_diff": first_diff(a, b)})
        against[impl] = {"identical": all(r["first_diff"] is None for r in rows), "per_request": rows}
    return {"baseline": base, "against": against,
            "identical": all(v["identical"] for v in against.values())}


# --- the concurrent phase: pure parts ------------------------------------------------------------
def finish_type(request: dict) -> str | None:
    """``length``, ``abort``, ... or None (no finish reason seen)."""
    reason = request.get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def completed(request: dict) -> bool:
    """A request that generated all its tokens (finish ``length``, max_new_tokens ids)."""
    ids = request.get("output_ids")
    return finish_type(request) == "length" and ids is not None and len(ids) == request.get("max_new_tokens")


def compare_concurrent(results: dict) -> dict:
    """Every implementation's concurrent phase against the first one whose phase ran: the requests
    not chosen for abort token by token (``first_diff``: None identical, -1 one side incomplete),
    the chosen ones by how they ended (``abort`` expected) and how many tokens they had; with
    ``pools_back_to_initial`` (ours' idle line after the phase; None for the others) and whether
    the decode traces (batch sizes per step) are equal. ``not_run``: servers whose phase did not run
    (not started, budget spent), left out of ``identical``."""
    ran = [name for name, row in results.items() if (row.get("concurrent") or {}).get("requests")]
    not_run = [name for name in results if name not in ran]
    if len(ran) < 2:
        return {"baseline": ran[0] if ran else None, "against": {}, "identical": None, "not_run": not_run}
    base = ran[0]
    base_phase = results[base]["concurrent"]
    against = {}
    for name in ran[1:]:
        phase = results[name]["concurrent"]
        rows, aborted = [], []
        for b, t in zip(base_phase["requests"], phase["requests"]):
            if b.get("abort_chosen"):
                aborted.append({"index": b["index"], "prompt_len": b["prompt_len"], "finish": finish_type(t),
                                "tokens": len(t.get("output_ids") or []), "baseline_finish": finish_type(b),
                                "baseline_tokens": len(b.get("output_ids") or [])})
                continue
            rows.append({"index": b["index"], "prompt_len": b["prompt_len"],
                         "first_diff": first_diff(b["output_ids"] if completed(b) else None,
                                                  t["output_ids"] if completed(t) else None)})
        identical = sum(r["first_diff"] is None for r in rows)
        against[name] = {"identical": bool(rows) and identical == len(rows), "identical_count": identical,
                         "compared": len(rows), "per_request": rows, "aborted": aborted,
                         "aborts_took_effect": all(a["finish"] == "abort" for a in aborted),
                         "pools_back_to_initial": phase.get("pools_back_to_initial"),
                         "decode_trace_equal": phase.get("decode_trace") == base_phase.get("decode_trace")}
    return {"baseline": base, "against": against, "identical": all(v["identical"] for v in against.values()),
            "not_run": not_run}


def idle_reports(log: str) -> list[dict]:
    """Ours' DeepSeek-V4 idle lines, parsed (the launcher's parser: counts ``name -> (now, initial)``,
    leak, selected, misses)."""
    return parse_idle_reports(log, layout="c4")


def pools_back(report: dict | None) -> bool | None:
    """Every pool at its initial count and ``leak=no`` (None: no idle line)."""
    if report is None:
        return None
    counts = report["counts"].values()
    return not report["leak"] and bool(counts) and all(now == initial for now, initial in counts)


def schedule_trace(batches: list[Batch]) -> str:
    """Prefill chunks and decode runs in order: ``p<new tokens>`` per prefill batch, ``<batch>x<steps>``
    per run of decode steps of one batch size, e.g. "p8192 p8192 p3000 12x5 p600 12x59 9x190"."""
    words: list[str] = []
    run: list[int] | None = None
    for b in batches:
        if not b.decode:
            if run:
                words.append(f"{run[0]}x{run[1]}")
                run = None
            words.append(f"p{b.new_tokens}")
        elif run and run[0] == b.running:
            run[1] += 1
        else:
            if run:
                words.append(f"{run[0]}x{run[1]}")
            run = [b.running, 1]
    if run:
        words.append(f"{run[0]}x{run[1]}")
    return " ".join(words)


def retractions(log: str) -> int:
    """Requests SGLang retracted because the KV pool was full."""
    return sum(int(n) for n in RETRACT_LINE.findall(log))


def sse_payloads(lines):
    """The JSON payloads of a server-sent event stream (``data: {...}`` lines) up to ``data: [DONE]``."""
    for raw in lines:
        line = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class BatchTracker:
    """The state of one batched, streamed /generate call: each request's output ids (SGLang
    streams them cumulatively by default; a chunk whose length does not match ``completion_tokens``
    is taken as a delta) and finish reason, and when to abort the chosen ones: ``update`` returns
    the indices whose abort is due (once each, when the request has ``abort_after`` tokens and has
    not finished)."""

    def __init__(self, rids: list[str], abort: list[int], abort_after: int):
        self.rids = list(rids)
        self.index_of = {rid: i for i, rid in enumerate(self.rids)}
        self.abort, self.abort_after = set(abort), abort_after
        self.ids: list[list[int]] = [[] for _ in self.rids]
        self.finish: list = [None] * len(self.rids)
        self.abort_sent_after: list[int | None] = [None] * len(self.rids)
        self.errors: list[str] = []
        self.chunks = 0

    def update(self, chunk: dict) -> list[int]:
        self.chunks += 1
        if "error" in chunk:
            self.errors.append(json.dumps(chunk["error"])[:500])
            return []
        meta = chunk.get("meta_info") or {}
        i = chunk.get("index")
        if i is None:
            i = self.index_of.get(meta.get("id"), 0 if len(self.rids) == 1 else None)
        if i is None or not 0 <= i < len(self.rids):
            self.errors.append(f"chunk for no request of this batch: {json.dumps(chunk)[:200]}")
            return []
        ids = list(chunk.get("output_ids") or [])
        total = meta.get("completion_tokens")
        if total is not None and len(ids) != total and len(self.ids[i]) + len(ids) == total:
            self.ids[i] += ids  # incremental streaming
        elif len(ids) >= len(self.ids[i]):
            self.ids[i] = ids
        if meta.get("finish_reason") is not None:
            self.finish[i] = meta["finish_reason"]
        if (i in self.abort and self.abort_sent_after[i] is None and self.finish[i] is None
                and len(self.ids[i]) >= self.abort_after):
            self.abort_sent_after[i] = len(self.ids[i])
            return [i]
        return []

    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def results(self, lengths: list[int], max_new: list[int]) -> list[dict]:
        return [{"index": i, "rid": rid, "prompt_len": lengths[i], "max_new_tokens": max_new[i],
                 "abort_chosen": i in self.abort, "abort_sent_after_tokens": self.abort_sent_after[i],
                 "finish_reason": self.finish[i], "output_ids": self.ids[i]}
                for i, rid in enumerate(self.rids)]


def batch_body(inputs: list[list[int]], max_new: list[int], rids: list[str]) -> dict:
    """One streamed /generate call for every prompt (greedy, ignore_eos, per-request max_new_tokens)."""
    return {"input_ids": inputs, "rid": rids, "stream": True,
            "sampling_params": [{"max_new_tokens": m, "temperature": 0.0, "ignore_eos": True} for m in max_new]}


# --- the concurrent phase on a server ----------------------------------------------------------
def run_concurrent(server, impl: str, args: argparse.Namespace, plan: dict, inputs: list[list[int]],
                   deadline: float) -> dict:
    """Send the plan's prompts as one batched, streamed call; abort the chosen requests by rid once
    they have ``abort_after`` tokens; then (ours) wait for the idle line. Returns the phase's record."""
    rids = request_ids(plan["n"], uuid.uuid4().hex[:6])
    tracker = BatchTracker(rids, plan["abort_indices"], plan["abort_after"])
    if parse_impl(impl)[0].startswith("ours"):
        try:
            server.settle(timeout=60)  # the idle line of the requests before this phase is in the log
        except Exception:  # noqa: BLE001 - not needed for the phase itself
            pass
    log0 = server.log()
    offset, idle_before = len(log0), len(idle_reports(log0))
    out: dict = {}
    t0 = time.time()
    read_timeout = max(10.0, min(args.request_timeout, deadline - time.time() - 10))
    body = json.dumps(batch_body(inputs, plan["max_new_tokens"], rids)).encode()
    request = urllib.request.Request(f"{server.url}/generate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=read_timeout) as response:
            for chunk in sse_payloads(response):
                for i in tracker.update(chunk):
                    try:
                        server.abort(rids[i])
                        print(f"[v4probe] {impl}: aborted request {i} ({plan['lengths'][i]} tokens) after "
                              f"{tracker.abort_sent_after[i]} tokens", flush=True)
                    except Exception as e:  # noqa: BLE001 - recorded
                        tracker.errors.append(f"abort {rids[i]}: {e!r}")
                if time.time() > deadline - 15:
                    out["error"] = "stopped: probe budget spent"
                    break
    except Exception as e:  # noqa: BLE001 - recorded with what came back
        out["error"] = repr(e)[:2000]
    out["wall_s"] = round(time.time() - t0, 2)
    out["chunks"] = tracker.chunks
    if parse_impl(impl)[0].startswith("ours"):
        report = wait_for_idle(server, idle_before, min(60.0, max(0.0, deadline - time.time() - 5)))
        out["idle_report"] = report
        out["pools_back_to_initial"] = pools_back(report)
    else:
        time.sleep(1.0)  # the last step's batch line follows its output
        out["pools_back_to_initial"] = None
    segment = server.log()[offset:]
    batches = parse_batches(segment)
    out.update(decode_trace=decode_trace(batches), schedule=schedule_trace(batches), retracted=retractions(segment),
               max_running=max((b.running for b in batches if b.decode), default=0), errors=tracker.errors)
    out["requests"] = tracker.results(plan["lengths"], plan["max_new_tokens"])
    out["digests"] = e2e.digests({str(r["index"]): r for r in out["requests"]})
    done = sum(completed(r) for r in out["requests"] if not r["abort_chosen"])
    ab = [finish_type(r) for r in out["requests"] if r["abort_chosen"]]
    print(f"[v4probe] {impl}: concurrent {done}/{plan['n'] - len(ab)} completed, aborted ones ended {ab}, "
          f"trace {out['decode_trace'][:200]}, pools back {out['pools_back_to_initial']}", flush=True)
    return out


def wait_for_idle(server, before: int, timeout: float) -> dict | None:
    """Ours' last idle report once there are more than ``before`` (None after ``timeout``): after the
    phase's requests returned and the server settled, that is the phase's busy -> idle line."""
    t_end = time.time() + timeout
    try:
        server.settle(timeout=60)
    except Exception:  # noqa: BLE001 - then poll for the line
        pass
    while True:
        reports = idle_reports(server.log())
        if len(reports) > before:
            return reports[-1]
        if time.time() > t_end:
            return None
        time.sleep(0.5)


def interesting_lines(log: str, pattern: re.Pattern = POOL_LINE, limit: int = 60, width: int = 400) -> list[str]:
    """Matching log lines, cut to ``width`` characters; the one-line ``server_args=`` dump is left
    out (it names every option, HiSparse's included)."""
    lines = [ln[:width] for ln in log.splitlines() if pattern.search(ln) and "server_args=" not in ln]
    return lines[:limit]


def start_impl(impl: str, args: argparse.Namespace, deadline: float) -> tuple[dict, Any]:
    """Start ``impl``'s server within what is left of the budget: its row (env, config, start time,
    command; ``error`` when it did not start) and the server (None when it did not start)."""
    row: dict = {"impl": impl, "env": server_env(impl, args), "started": False,
                 "hisparse_config": hisparse_config(impl, args)}
    ready_timeout = max(30.0, min(args.ready_timeout, deadline - time.time() - 45))
    row["max_total_tokens"] = max_total_tokens(impl, args)
    t0 = time.time()
    try:
        server = start_server(model=args.model, hisparse_config=row["hisparse_config"], extra_args=server_flags(args),
                              env=row["env"], log_dir=LOG_DIR, cpu=False, name=log_name(impl),
                              max_total_tokens=row["max_total_tokens"], ready_timeout=ready_timeout)
    except Exception as e:  # noqa: BLE001 - a server that does not start is a result
        row["error"] = f"{type(e).__name__}: {e}"
        row["start_s"] = round(time.time() - t0, 1)
        print(f"[v4probe] {impl}: FAILED after {row['start_s']} s: {str(e)[:4000]}", flush=True)
        if not isinstance(e, (RuntimeError, TimeoutError)):
            row["traceback"] = traceback.format_exc()
        return row, None
    row.update(started=True, start_s=round(time.time() - t0, 1), command=server.args)
    print(f"[v4probe] {impl}: server up in {row['start_s']} s", flush=True)
    return row, server


def max_total_tokens(impl: str, args: argparse.Namespace) -> int:
    """The server's --max-total-tokens: --hisparse-max-total-tokens (when given) for upstream and ours."""
    hisparse = parse_impl(impl)[0] != "none"
    return args.hisparse_max_total_tokens if hisparse and args.hisparse_max_total_tokens else args.max_total_tokens


def stop_impl(row: dict, server: Any) -> None:
    """Stop the server (if it started) and add what its log shows to ``row``."""
    if server is not None:
        row["alive_at_stop"] = server.process.poll() is None
        server.stop()
        row["exit_code"] = server.process.returncode
    log_path = LOG_DIR / f"{log_name(row['impl'])}.log"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    row["log_lines"] = len(log.splitlines())
    row["pool_lines"] = interesting_lines(log)
    row["idle_lines"] = [ln[:400] for ln in log.splitlines() if "sglang-hisparse idle" in ln][-40:]
    row["error_lines"] = interesting_lines(log, ERROR_LINE, limit=40)
    row["log_tail"] = [ln[:400] for ln in log.splitlines()[-60:]]


def run_impl(impl: str, args: argparse.Namespace, inputs: list[list[int]], deadline: float,
             concurrent_inputs: list[list[int]] | None = None, plan: dict | None = None) -> dict:
    row, server = start_impl(impl, args, deadline)
    try:
        if server is None:
            return row
        row["requests"] = []
        for n, ids in zip([] if args.concurrent_only else args.length_list, inputs):
            if time.time() > deadline - 20:
                row["requests"].append({"prompt_len": n, "error": "skipped: probe budget spent"})
                continue
            t1 = time.time()
            try:
                out = server.generate(ids, args.new_tokens, timeout=min(args.request_timeout, deadline - time.time()))
                req = {"prompt_len": n, "output_ids": out.get("output_ids"), "latency_s": round(time.time() - t1, 2),
                       "finish_reason": (out.get("meta_info") or {}).get("finish_reason")}
            except Exception as e:  # noqa: BLE001 - recorded
                req = {"prompt_len": n, "error": repr(e), "latency_s": round(time.time() - t1, 2)}
            print(f"[v4probe] {impl}: {n} tokens -> {req.get('output_ids', req.get('error'))!s:.160}", flush=True)
            row["requests"].append(req)
        if plan is not None:
            if time.time() > deadline - 30:
                row["concurrent"] = {"error": "skipped: probe budget spent"}
            else:
                row["concurrent"] = run_concurrent(server, impl, args, plan, concurrent_inputs, deadline)
    except Exception as e:  # noqa: BLE001 - recorded
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    finally:
        stop_impl(row, server)
    return row


# --- throughput phase ------------------------------------------------------------------------------
def measure_throughput(server: Any, impl: str, batch: list[list[int]], new_tokens: int, timeout: float) -> dict:
    """One batched call of ``batch`` on ``server``: wall time, output tokens, decode tok/s, TPOT and
    most requests decoding at once from the step lines of this call (decode_log.py); for ours, its
    idle report after the call (misses, pools). A failed call is recorded as ``error``."""
    ours = parse_impl(impl)[0].startswith("ours")
    reports = len(idle_reports(server.log()))
    mark = len(server.log())
    t0 = time.time()
    try:
        outs = server.generate(batch, new_tokens, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - recorded
        return {"error": repr(e), "wall_s": round(time.time() - t0, 2)}
    run: dict = {"wall_s": round(time.time() - t0, 2),
                 "output_tokens": sum(len(o.get("output_ids") or []) for o in outs)}
    report = wait_for_idle(server, reports, timeout=60) if ours else None
    if not ours:
        server.settle(timeout=60)
    try:
        run.update(decode_stats(parse_batches(server.log()[mark:])))
    except ValueError as e:
        run["error"] = str(e)
    if report is not None:
        run["miss_rate"] = report["misses"] / report["selected"] if report["selected"] else None
        run["pools_back_to_initial"] = pools_back(report)
    return run


def summarize_throughput(runs: list[dict]) -> dict:
    """Medians over a server's measured runs (those without an error, warm-up rounds left out)."""
    runs = [r for r in runs if not r.get("warmup")]
    good = [r for r in runs if "decode_tok_s" in r]
    if not good:
        return {"runs": len(runs), "measured": 0}
    rates = sorted(r["decode_tok_s"] for r in good)
    misses = [r["miss_rate"] for r in good if r.get("miss_rate") is not None]
    by_running: dict[str, list[list[float]]] = {}
    for r in good:
        for size, (count, ms) in r.get("step_ms_by_running", {}).items():
            by_running.setdefault(size, []).append([count, ms])
    step_ms = {size: [sum(c for c, _ in v), statistics.median(ms for _, ms in v)] for size, v in by_running.items()}
    return {"runs": len(runs), "measured": len(good), "decode_tok_s": statistics.median(rates),
            "step_ms_by_running": step_ms,
            "decode_tok_s_spread": [rates[0], rates[-1]], "tpot_ms": statistics.median(r["tpot_ms"] for r in good),
            "held": max(r["max_running"] for r in good), "wall_s": statistics.median(r["wall_s"] for r in good),
            "miss_rate": statistics.median(misses) if misses else None,
            "pools_back_to_initial": all(r.get("pools_back_to_initial", True) for r in good)}


def compare_throughput(impls: dict) -> dict:
    """Each server's decode tok/s over every other's: the ratio of their medians (``ours/none``),
    under ``paired`` the median of the per-round ratios (rounds both measured, warm-ups left
    out: the servers of one round ran back to back, so drift between rounds cancels), and under
    ``step_time`` the decode step time per batch size (:func:`step_time_ratios`)."""
    rates = {name: row["throughput"]["summary"].get("decode_tok_s") for name, row in impls.items()
             if row.get("throughput")}
    out: dict = {f"{a}/{b}": rates[a] / rates[b] for a in rates for b in rates
                 if a != b and rates[a] and rates[b]}
    by_round = {name: {r["round"]: r["decode_tok_s"] for r in row["throughput"]["runs"]
                       if not r.get("warmup") and r.get("decode_tok_s")}
                for name, row in impls.items() if row.get("throughput")}
    paired = {}
    for a in by_round:
        for b in by_round:
            common = sorted(set(by_round[a]) & set(by_round[b]))
            if a != b and common:
                paired[f"{a}/{b}"] = statistics.median(by_round[a][k] / by_round[b][k] for k in common)
    out["paired"] = paired
    out["step_time"] = step_time_ratios({name: row["throughput"]["summary"].get("step_ms_by_running", {})
                                         for name, row in impls.items() if row.get("throughput")})
    return out


def step_time_ratios(step_ms: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """``a/b``: the time b's decode steps would take at a's median step time per batch size, over
    the time they took at b's (batch sizes both ran): below 1, a decodes the same batches faster.
    A comparison of the decode step itself, apart from the schedule's mix of batch sizes and from
    prefill (each server's ``step_ms_by_running``: [steps, median ms] per size, over its rounds)."""
    out = {}
    for a, ms_a in step_ms.items():
        for b, ms_b in step_ms.items():
            common = set(ms_a) & set(ms_b)
            base = sum(ms_b[k][0] * ms_b[k][1] for k in common)
            if a != b and base > 0:
                out[f"{a}/{b}"] = sum(ms_b[k][0] * ms_a[k][1] for k in common) / base
    return out


def run_throughput(args: argparse.Namespace, inputs: list[list[int]], deadline: float,
                   report: dict, write: Callable[[], None]) -> None:
    """Start every server side by side, then measure them one at a time, round after round (the
    others idle: no GPU work shared), then stop them all. Rows into ``report["impls"]``."""
    started: dict[str, tuple[dict, Any]] = {}
    threads = [threading.Thread(target=lambda i=impl: started.__setitem__(i, start_impl(i, args, deadline)))
               for impl in args.impl_list]
    for thread in threads:
        thread.start()
        time.sleep(2)  # distinct ports and process start order
    for thread in threads:
        thread.join()
    live = [impl for impl in args.impl_list if started[impl][1] is not None]
    for impl in live:
        started[impl][0]["throughput"] = {"runs": []}
    try:
        warmup = args.throughput_warmup
        for round_ in range(warmup + args.throughput_repeats):
            for impl in live:
                row, server = started[impl]
                if time.time() > deadline - 30:
                    row["throughput"]["runs"].append({"error": "skipped: probe budget spent"})
                    continue
                run = measure_throughput(server, impl, inputs, args.throughput_new_tokens,
                                         timeout=min(args.request_timeout, deadline - time.time()))
                run["round"] = round_ - warmup  # negative: a warm-up round
                if round_ < warmup:
                    run["warmup"] = True
                row["throughput"]["runs"].append(run)
                print(f"[v4probe] {impl} throughput round {round_}: {json.dumps(run)[:300]}", flush=True)
    finally:
        for impl in args.impl_list:
            row, server = started[impl]
            stop_impl(row, server)
            if "throughput" in row:
                row["throughput"]["summary"] = summarize_throughput(row["throughput"]["runs"])
            report["impls"][impl] = row
        report["compare_throughput"] = compare_throughput(report["impls"])
        write()


def device_info() -> dict:
    info: dict = {}
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = repr(e)
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001
        info["torch"] = repr(e)
    for mod in ("sglang", "tilelang"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            info[mod] = repr(e)
    return info


def concurrent_served(row: dict) -> bool:
    """Every request of the concurrent phase not chosen for abort completed."""
    requests = (row.get("concurrent") or {}).get("requests")
    return bool(requests) and all(completed(r) for r in requests if not r["abort_chosen"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.budget_s
    model_dir = Path(args.model) if os.path.isdir(args.model) else MODELS_DIR / args.model
    config = json.loads((model_dir / "config.json").read_text())
    inputs = prompts(args.length_list, int(config["vocab_size"]), args.seed)
    plan = concurrent_plan(args) if args.concurrent else None
    # the concurrent prompts: their own seed, so that none of them repeats a one-at-a-time prompt
    concurrent_inputs = prompts(plan["lengths"], int(config["vocab_size"]), args.seed + 100) if plan else None
    report: dict = {
        "argv": sys.argv[1:] if argv is None else argv,
        "model": str(model_dir.relative_to(ROOT)) if model_dir.is_relative_to(ROOT) else str(model_dir),
        "model_config": config, "lengths": [] if args.concurrent_only else args.length_list,
        "new_tokens": args.new_tokens, "seed": args.seed,
        "server_flags": server_flags(args), "max_total_tokens": args.max_total_tokens,
        "hisparse_max_total_tokens": args.hisparse_max_total_tokens or args.max_total_tokens,
        "device": device_info(), "impls": {},
    }
    if plan:
        report["concurrent"] = plan
    if args.throughput:
        report["lengths"] = []
        report["throughput"] = {"n": args.throughput, "context": args.throughput_context,
                                "new_tokens": args.throughput_new_tokens, "repeats": args.throughput_repeats,
                                "warmup": args.throughput_warmup}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        report["compare"] = compare(report["impls"], report["lengths"])
        if plan:
            report["compare_concurrent"] = compare_concurrent(report["impls"])
        report["wall_s"] = round(time.time() - t_start, 1)
        out.write_text(json.dumps(report, indent=1))

    if args.throughput:
        batch = prompts([args.throughput_context] * args.throughput, int(config["vocab_size"]), args.seed + 200)
        run_throughput(args, batch, deadline, report, write)
        summary = {name: row.get("throughput", {}).get("summary", {"error": row.get("error")})
                   for name, row in report["impls"].items()}
        print(f"[v4probe] throughput: {json.dumps(summary)[:2000]}", flush=True)
        print(f"[v4probe] compare_throughput: {json.dumps(report['compare_throughput'])}", flush=True)
        return 0 if all(s.get("measured") == args.throughput_repeats for s in summary.values()) else 1

    lock = threading.Lock()

    def one(impl: str) -> None:
        if time.time() > deadline - 60:
            row = {"impl": impl, "started": False, "error": "skipped: probe budget spent"}
        else:
            try:
                row = run_impl(impl, args, inputs, deadline, concurrent_inputs, plan)
            except Exception as e:  # noqa: BLE001 - recorded
                row = {"impl": impl, "started": False, "error": repr(e), "traceback": traceback.format_exc()}
        with lock:
            report["impls"][impl] = row
            write()

    report["parallel"] = not args.sequential
    if args.sequential:
        for impl in args.impl_list:
            one(impl)
    else:
        threads = [threading.Thread(target=one, args=(impl,)) for impl in args.impl_list]
        for t in threads:
            t.start()
            time.sleep(2)  # distinct ports and process start order
        for t in threads:
            t.join()
    report["impls"] = {impl: report["impls"][impl] for impl in args.impl_list}
    write()
    print(f"[v4probe] compare: {json.dumps(report['compare'])[:2000]}", flush=True)
    if plan:
        keys = ("identical_count", "compared", "aborts_took_effect", "pools_back_to_initial", "decode_trace_equal")
        summary = {name: {k: v[k] for k in keys}
                   for name, v in report["compare_concurrent"]["against"].items()}
        print(f"[v4probe] compare_concurrent (baseline {report['compare_concurrent']['baseline']}): "
              f"{json.dumps(summary)[:2000]}", flush=True)
    served = args.concurrent_only or all(r.get("requests") and all("output_ids" in q for q in r["requests"])
                                         for r in report["impls"].values())
    if plan:
        served = served and all(concurrent_served(r) for r in report["impls"].values())
    return 0 if served else 1


if __name__ == "__main__":
    sys.exit(main())
