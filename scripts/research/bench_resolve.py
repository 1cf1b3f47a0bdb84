#!/usr/bin/env python3
"""Benchmark: our fused RESOLVE kernel vs SGLang 0.5.17's load_cache_to_device_buffer_mla, per
layer call, on identical inputs.

Method (../shared/notes/h200-measurements.md): for every measured call the mutable tables are
restored from pristine copies, L2 is flushed (a write of max(2.5 x L2, 256 MB)), a ~200 us GPU
spin hides the host-side launch cost, then CUDA events bracket the one call; median / p10 / p90 of
--reps (>= 50) timings after --warmup calls. --timing graph (the tables' numbers): the call is
captured once in a CUDA graph and its replay is timed, as a decode step runs it; eager: the Python
call itself is timed, and its host-side cost is recorded as host_us. Host KV rows of a request are contiguous (about
115 MB per request at 1152 B, as in the upstream measurements); each request has seq_len 100000,
B slots holding random positions, and selects top_k = 2048 positions: the newest, then
round(miss_frac * 2048) misses (capped at 2047) and the rest hits.

Grid: B in {2048, 4096} x item {1152, 656} x batch {1, 4, 16, 64} x miss {0, 0.13, 1.0}; rows for
ours, ours with skip-IO (planning cost) and upstream (block size 960, the server default; its
wrapper's own default 256 faults). Each cell is also checked: our outputs against the batched
oracle, upstream's outputs against ours. --stage-clock adds the diagnostic build's per-stage
cycle counts of one planner (B=4096, 1152 B); a sweep of copier CTAs and block sizes follows.

Writes kernel_bench.json, kernel_bench.md and kernel_bench.png into --out (or
$HISPARSE_RESULTS_DIR) and prints the table. --budget-s stops starting new cells when exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sglang_hisparse.resolver import cuda as rcuda  # noqa: E402
from sglang_hisparse.resolver.batched import resolve_batched  # noqa: E402
from sglang_hisparse.resolver.reuse import history_table, reuse_levels  # noqa: E402
from sglang_hisparse_testkit.resolver_cases import kv_view, random_history  # noqa: E402
from sglang_hisparse.resolver.report import machine_description, write_json  # noqa: E402

TOP_K = 2048
CONTEXT = 100_000
BLOCK = 960
BS = (2048, 4096)
ITEMS = (1152, 656)
BATCHES = (1, 4, 16, 64)
MISSES = (0.0, 0.13, 1.0)
TARGETS = [  # (description, B, item, batch, miss, limit_us)
    ("0 misses, batch 16", 4096, 1152, 16, 0.0, 8.0),
    ("13% misses, batch 1", 4096, 1152, 1, 0.13, 15.0),
    ("13% misses, batch 16", 4096, 1152, 16, 0.13, 100.0),
    ("13% misses, batch 64", 4096, 1152, 64, 0.13, 370.0),
]
IO_TARGET_GBPS = 45.0
STAGE_CLOCK_CELLS = ((1, 0.0, True), (1, 0.13, False), (16, 0.0, True), (16, 0.13, False), (64, 0.13, False),
                     (64, 0.13, True))  # (batch, miss, skip-IO) of --stage-clock, B=4096, 1152 B


def log(msg: str) -> None:
    print(msg, flush=True)


def n_misses(miss_frac: float) -> int:
    return min(TOP_K - 1, int(round(miss_frac * TOP_K)))


class Bench:
    """Shared buffers: the pinned host pool, device KV, L2 flush buffer, workspace."""

    def __init__(self, max_batch: int, reps: int, warmup: int, buffer_sizes: tuple[int, ...] = BS) -> None:
        self.dev = torch.device("cuda")
        self.reps = reps
        self.warmup = warmup
        props = torch.cuda.get_device_properties(0)
        l2 = int(getattr(props, "L2_cache_size", 60 << 20) or (60 << 20))
        self.flush = torch.empty(max(int(2.5 * l2), 256 << 20), dtype=torch.uint8, device=self.dev)
        self.max_batch = max_batch
        host_bytes = max_batch * CONTEXT * max(ITEMS)
        t0 = time.time()
        self.host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
        chunk = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device=self.dev)
        for off in range(0, host_bytes, chunk.numel()):
            n = min(chunk.numel(), host_bytes - off)
            self.host[off : off + n].copy_(chunk[:n])
        torch.cuda.synchronize()
        log(f"[bench] pinned {host_bytes / 2**30:.1f} GiB host KV in {time.time() - t0:.1f}s; "
            f"L2 {l2 >> 20} MiB, flush buffer {self.flush.numel() >> 20} MiB")
        dev_bytes = max_batch * (max(buffer_sizes) + 1) * max(ITEMS)
        self.device_flat = torch.empty(dev_bytes, dtype=torch.uint8, device=self.dev)
        self.device_flat.random_(0, 256)
        # B above the shared-memory layout's limit (16011 LRU at top_k 2048): the spilled planner
        spill = any(rcuda.planner_spills(B, TOP_K, reuse) for B in buffer_sizes for reuse in (False, True))
        self.ws = rcuda.make_workspace(max_batch, self.dev, top_k=TOP_K, spill=spill)

    def time_call(self, call: Callable[[], None], restore: Callable[[], None], mode: str = "graph") -> list[float]:
        """Per-call microseconds of `call`, each after restore + L2 flush + a GPU spin.

        mode "graph": `call` is captured once in a CUDA graph and the events bracket its replay (how
        a decode step runs it in the server: no Python, no argument checks). mode "eager": the
        events bracket the Python call itself; the spin (~200 us) is longer than the host-side cost
        of the call, so the kernel is queued before the start event runs. Host-side cost of the
        eager call: see host_call_us.
        """
        replay = call
        if mode == "graph":
            restore()
            call()  # first launch outside capture (builds, sets launch attributes)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            restore()
            with torch.cuda.graph(graph):
                call()
            replay = graph.replay
        elif mode != "eager":
            raise ValueError(f"timing mode must be graph or eager, got {mode!r}")
        times = []
        for i in range(self.warmup + self.reps):
            restore()
            self.flush.zero_()
            torch.cuda._sleep(400_000)  # ~200 us at 1.98 GHz: covers the host-side call cost
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            if i >= self.warmup:
                times.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1000.0 for s, e in times]

    def host_call_us(self, call: Callable[[], None], restore: Callable[[], None], n: int = 30) -> float:
        """Median host-side microseconds of one eager call (Python checks + FFI + launch)."""
        out = []
        for _ in range(n):
            restore()
            torch.cuda._sleep(400_000)  # keep the queue non-empty so the launch never blocks
            t = time.perf_counter()
            call()
            out.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        return round(sorted(out)[len(out) // 2], 2)


def make_cell(bench: Bench, B: int, item: int, batch: int, miss_frac: float, seed: int) -> dict[str, Any]:
    """Pristine tables and the selection of one cell, for both kernels."""
    dev = bench.dev
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    R = batch
    L = CONTEXT
    M = n_misses(miss_frac)
    H = TOP_K - 1 - M
    keys = torch.rand(R, L - 1, generator=g, device=dev)
    tokens = keys.topk(B, dim=1, largest=False).indices  # B distinct positions < L - 1
    lru = torch.rand(R, B, generator=g, device=dev).argsort(dim=1).to(torch.int16)
    hot = torch.randperm(R * (B + 1), generator=g, device=dev).view(R, B + 1).to(torch.int32)
    host_locs = (torch.arange(R, device=dev)[:, None] * CONTEXT + torch.arange(CONTEXT, device=dev)[None, :])
    hit_pick = torch.rand(R, B, generator=g, device=dev).argsort(dim=1)[:, :H]
    hits = tokens.gather(1, hit_pick)
    in_table = torch.zeros(R, L - 1, dtype=torch.bool, device=dev)
    in_table.scatter_(1, tokens, True)
    miss_keys = torch.rand(R, L - 1, generator=g, device=dev).masked_fill(in_table, 2.0)
    misses = miss_keys.topk(M, dim=1, largest=False).indices if M > 0 else tokens[:, :0]
    newest = torch.full((R, 1), L - 1, dtype=torch.long, device=dev)
    sel = torch.cat([hits, misses, newest], dim=1)
    sel = sel.gather(1, torch.rand(R, TOP_K, generator=g, device=dev).argsort(dim=1)).to(torch.int32).contiguous()
    host_kv = kv_view(bench.host, item)
    device_kv = kv_view(bench.device_flat[: R * (B + 1) * item], item)
    up_tokens = torch.cat([tokens.to(torch.int32), torch.full((R, 1), L - 1, dtype=torch.int32, device=dev)], dim=1)
    slot_map = torch.full((R, CONTEXT), -1, dtype=torch.int16, device=dev)  # the position -> slot map's state
    slot_map.scatter_(1, tokens, torch.arange(B, dtype=torch.int16, device=dev).expand(R, B).contiguous())
    return dict(
        map0=slot_map,
        hist0=random_history(g, (R, B)).contiguous(),  # the reuse policy's state
        levels=reuse_levels(history_table().table).to(dev),
        B=B, item=item, batch=batch, miss_frac=miss_frac, misses=M,
        top_k_positions=sel,
        seq_lens=torch.full((R,), L, dtype=torch.int64, device=dev),
        req_pool_indices=torch.arange(R, dtype=torch.int64, device=dev),
        hot_locs=hot, host_locs=host_locs.to(torch.int64), host_kv=host_kv, device_kv=device_kv,
        tokens0=tokens.to(torch.int32).contiguous(), lru0=lru.contiguous(), up_tokens0=up_tokens.contiguous(),
        num_real=torch.tensor([R], dtype=torch.int32, device=dev),
    )


class Ours:
    """Our kernel on one cell, called as a server calls it: the layer's resolver bound once
    (``bind_resolve_cuda``), then per call only the batch tensors (the stage-clock build goes
    through ``resolve_cuda``). ``reuse``: the reuse-table policy (random history, packaged levels).
    ``slot_map``: planning with the position -> slot map (the cell's tables mapped). ``sized``: the
    per-request buffer sizes passed, every one B (the same outputs: what reading them costs)."""

    def __init__(self, bench: Bench, cell: dict[str, Any], skip_io: bool, block: int = BLOCK,
                 num_copiers: Optional[int] = None, stage_clock: bool = False, reuse: bool = False,
                 slot_map: bool = False, sized: bool = False) -> None:
        self.bench, self.cell, self.skip_io, self.block, self.num_copiers = bench, cell, skip_io, block, num_copiers
        self.stage_clock, self.reuse = stage_clock, reuse
        self.tokens = cell["tokens0"].clone()
        self.lru = cell["lru0"].clone()
        self.hist = cell["hist0"].clone()
        self.map = cell["map0"].clone() if slot_map else None
        rows = cell["hot_locs"].shape[0]
        self.sizes = torch.full((rows,), cell["B"], dtype=torch.int32, device=cell["hot_locs"].device) if sized else None
        self.out = torch.empty_like(cell["top_k_positions"])
        c = cell
        self.static = dict(
            hot_locs=c["hot_locs"], slot_tokens=self.tokens, lru=self.lru, host_locs=c["host_locs"],
            host_kv=c["host_kv"], device_kv=c["device_kv"], num_real_reqs=c["num_real"], device_buffer_size=c["B"],
            skip_io=skip_io, num_copiers=num_copiers,
            **(dict(slot_history=self.hist, reuse_levels=c["levels"]) if reuse else {}),
            **(dict(slot_map=self.map) if slot_map else {}),
            **(dict(buffer_sizes=self.sizes) if sized else {}))
        self.bound = None if stage_clock else rcuda.bind_resolve_cuda(
            top_k=TOP_K, workspace=bench.ws, block_size=block, **self.static)

    def restore(self) -> None:
        self.tokens.copy_(self.cell["tokens0"])
        self.lru.copy_(self.cell["lru0"])
        self.hist.copy_(self.cell["hist0"])
        if self.map is not None:
            self.map.copy_(self.cell["map0"])

    def __call__(self) -> None:
        c = self.cell
        if self.bound is not None:
            self.bound(c["top_k_positions"], c["seq_lens"], c["req_pool_indices"], self.out)
            return
        rcuda.resolve_cuda(
            top_k_positions=c["top_k_positions"], seq_lens=c["seq_lens"], req_pool_indices=c["req_pool_indices"],
            out=self.out, workspace=self.bench.ws, block_size=self.block, stage_clock=self.stage_clock, **self.static)


class Upstream:
    def __init__(self, fn: Callable[..., None], cell: dict[str, Any]) -> None:
        self.fn, self.cell = fn, cell
        self.tokens = cell["up_tokens0"].clone()
        self.lru = cell["lru0"].clone()
        self.out = torch.empty_like(cell["top_k_positions"])

    def restore(self) -> None:
        self.tokens.copy_(self.cell["up_tokens0"])
        self.lru.copy_(self.cell["lru0"])

    def __call__(self) -> None:
        c = self.cell
        self.fn(
            c["top_k_positions"], self.tokens, c["host_locs"], c["hot_locs"], c["host_kv"], c["device_kv"], self.out,
            c["req_pool_indices"], c["seq_lens"], self.lru, c["item"], TOP_K, c["B"], page_size=1, block_size=BLOCK,
            num_real_reqs=c["num_real"],
        )


def check_ours(ours: Ours) -> bool:
    """Our outputs, tables and copied rows equal the batched oracle's on this cell."""
    c = ours.cell
    ours.restore()
    ours()
    ref_tokens, ref_lru, ref_hist = c["tokens0"].clone(), c["lru0"].clone(), c["hist0"].clone()
    ref_map = c["map0"].clone() if ours.map is not None else None
    ref_out = torch.empty_like(ours.out)
    ref_kv = torch.empty_like(c["device_kv"])
    host_mirror = None if ours.skip_io else c["host_kv"]
    resolve_batched(
        top_k_positions=c["top_k_positions"], seq_lens=c["seq_lens"], req_pool_indices=c["req_pool_indices"],
        hot_locs=c["hot_locs"], slot_tokens=ref_tokens, lru=ref_lru, host_locs=c["host_locs"],
        host_kv=c["host_kv"], device_kv=ref_kv, out=ref_out, num_real_reqs=c["batch"], device_buffer_size=c["B"],
        skip_io=True, slot_map=ref_map, buffer_sizes=ours.sizes,
        **(dict(slot_history=ref_hist, reuse_levels=c["levels"]) if ours.reuse else {}),
    )
    ok = torch.equal(ours.out, ref_out) and torch.equal(ours.tokens, ref_tokens) and torch.equal(ours.lru, ref_lru)
    ok = ok and (not ours.reuse or torch.equal(ours.hist, ref_hist))
    ok = ok and (ours.map is None or torch.equal(ours.map, ref_map))
    if ok and host_mirror is not None:  # the miss rows now hold their host rows
        miss = ~torch.isin(c["top_k_positions"].long(), torch.cat([c["tokens0"].long(), (c["seq_lens"] - 1)[:, None]], 1))
        rows = ours.out[miss].long()
        src = c["host_locs"].gather(1, c["top_k_positions"].long().clamp(min=0))[miss]
        if rows.numel():
            ok = torch.equal(c["device_kv"][rows].cpu().view(torch.uint8), host_mirror[src.cpu()].view(torch.uint8))
    return bool(ok)


def stats(times: list[float]) -> dict[str, float]:
    t = torch.tensor(times, dtype=torch.float64)
    return {
        "median_us": round(float(t.median()), 2),
        "p10_us": round(float(t.quantile(0.1)), 2),
        "p90_us": round(float(t.quantile(0.9)), 2),
    }


def load_upstream() -> tuple[Optional[Callable[..., None]], str]:
    try:
        from sglang.kernels.ops.kvcache.hisparse import load_cache_to_device_buffer_mla

        return load_cache_to_device_buffer_mla, "sglang.kernels.ops.kvcache.hisparse.load_cache_to_device_buffer_mla"
    except Exception as e:  # reported, not hidden
        return None, f"upstream kernel unavailable: {type(e).__name__}: {e}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.time()
    deadline = start + args.budget_s
    upstream, upstream_note = load_upstream() if args.upstream else (None, "not run (--no-upstream)")
    log(f"[bench] upstream: {upstream_note}")
    stage_batches = [cell[0] for cell in STAGE_CLOCK_CELLS] if args.stage_clock else []
    bench = Bench(max(args.batches + stage_batches), args.reps, args.warmup, tuple(args.Bs) + BS)
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    skipped: list[str] = []
    sweep: list[dict[str, Any]] = []
    try:
        measure_grid(args, bench, upstream, deadline, rows, checks, skipped)
    except KeyboardInterrupt:  # the suite's time limit: keep what was measured
        log("[bench] interrupted: writing the rows measured so far")
        skipped.append("interrupted")
        deadline = 0.0
    stage_clock: list[dict[str, Any]] = []
    if args.stage_clock and time.time() < deadline:
        try:
            stage_clock = run_stage_clock(bench, deadline, twice=args.stage_clock == "twice",
                                          slot_map=(False, True) if args.slot_map else (False,))
        except KeyboardInterrupt:
            log("[bench] stage clock interrupted")
    if args.sweep and time.time() < deadline:
        try:
            sweep = run_sweep(bench, deadline, args.timing[0])
        except KeyboardInterrupt:
            log("[bench] sweep interrupted")
    return {"rows": rows, "checks": checks, "skipped": skipped, "sweep": sweep, "stage_clock": stage_clock,
            "upstream": upstream_note, "timing": args.timing, "seconds": round(time.time() - start, 1)}


def measure_grid(args: argparse.Namespace, bench: Bench, upstream: Optional[Callable[..., None]], deadline: float,
                 rows: list[dict[str, Any]], checks: list[dict[str, Any]], skipped: list[str]) -> None:
    """The main grid: ours, ours skip-IO and upstream on every cell (appends to the lists)."""
    seed = 0
    for B in args.Bs:
        for item in args.items:
            for batch in args.batches:
                for miss in args.misses:
                    tag = f"B={B} item={item} batch={batch} miss={miss}"
                    if time.time() > deadline:
                        skipped.append(tag)
                        continue
                    seed += 1
                    cell = make_cell(bench, B, item, batch, miss, seed)
                    impls: list[tuple[str, bool, Any]] = [("ours", False, Ours(bench, cell, False)),
                                                           ("ours", True, Ours(bench, cell, True))]
                    if upstream is not None:
                        impls.append(("upstream", False, Upstream(upstream, cell)))
                    if args.reuse:  # the reuse-table policy's kernel on the same cell
                        impls.append(("ours_reuse", False, Ours(bench, cell, False, reuse=True)))
                    if args.slot_map:  # planning with the position -> slot map, same cell
                        impls.append(("ours_map", False, Ours(bench, cell, False, slot_map=True)))
                    if args.sized:  # the per-request buffer sizes passed (each B): their read's cost
                        impls.append(("ours_sized", False, Ours(bench, cell, False, sized=True)))
                    line = [tag]
                    for mode in args.timing:
                        for name, skip, impl in impls:
                            try:
                                st = stats(bench.time_call(impl, impl.restore, mode))
                                if mode == "eager":
                                    st["host_us"] = bench.host_call_us(impl, impl.restore)
                            except Exception as e:
                                log(f"[bench] {name} ({mode}) failed on {tag}: {e}")
                                traceback.print_exc()
                                if name == "upstream":
                                    continue
                                raise
                            rows.append({"impl": name, "B": B, "batch": batch, "miss_frac": miss, "item_bytes": item,
                                         "skip_io": skip, "timing": mode, **st})
                            line.append(f"{name}{'(skip-IO)' if skip else ''}[{mode}] {st['median_us']:.1f}us")
                    ok = check_ours(impls[0][2]) and all(check_ours(i) for n, _, i in impls
                                                         if n in ("ours_reuse", "ours_map", "ours_sized"))
                    agree = None
                    if upstream is not None:
                        try:
                            up = impls[2][2]
                            up.restore()
                            up()
                            agree = bool(torch.equal(up.out, impls[0][2].out))
                        except Exception as e:
                            log(f"[bench] upstream check failed on {tag}: {e}")
                    checks.append({"cell": tag, "ours_matches_oracle": ok, "upstream_agrees_with_ours": agree})
                    line.append(f"oracle {'ok' if ok else 'MISMATCH'}; upstream {'agrees' if agree else agree}")
                    log("[bench] " + "; ".join(line))
                    del cell, impls


def run_sweep(bench: Bench, deadline: float, mode: str) -> list[dict[str, Any]]:
    """Copier CTAs and block size at B=4096, 1152 B (for docs/kernel.md's design choices)."""
    out = []
    plans = [(batch, miss, {"num_copiers": c})
             for batch, miss in ((1, 0.13), (4, 0.13), (16, 0.13), (64, 0.13), (1, 1.0), (16, 1.0), (64, 1.0))
             for c in (None, 0, 16, 33, 66, 132)]
    plans += [(batch, miss, {"block": b}) for batch, miss in ((1, 0.13), (16, 0.0), (16, 0.13)) for b in (256, 512, 768, 960, 1024)]
    seed = 1000
    for batch, miss, knob in plans:
        if time.time() > deadline:
            break
        seed += 1
        cell = make_cell(bench, 4096, 1152, batch, miss, seed)
        impl = Ours(bench, cell, False, **knob)
        st = stats(bench.time_call(impl, impl.restore, mode))
        ok = check_ours(impl)
        copiers = knob.get("num_copiers")
        row = {"B": 4096, "item_bytes": 1152, "batch": batch, "miss_frac": miss,
               "num_copiers": "auto" if copiers is None else copiers,
               "block_size": knob.get("block", BLOCK), "verified": ok, "timing": mode, **st}
        out.append(row)
        log(f"[sweep] batch {batch} miss {miss} {knob}: {st['median_us']:.1f}us {'ok' if ok else 'MISMATCH'}")
    return out


def run_stage_clock(bench: Bench, deadline: float, reps: int = 20, twice: bool = False,
                    slot_map: tuple[bool, ...] = (False,)) -> list[dict[str, Any]]:
    """Where a planner's time goes: the diagnostic build's per-stage stamps of CTA 0 (median of
    `reps` launches, each after restore + L2 flush), B=4096, 1152 B; each cell planned with the
    hash table and, when ``slot_map`` holds True, with the position -> slot map too."""
    out = []
    seed = 2000
    for batch, miss, skip in STAGE_CLOCK_CELLS:
        for flush, with_map in ((f, m) for f in (True, False) for m in slot_map):
            if time.time() > deadline:
                break
            seed += 1
            cell = make_cell(bench, 4096, 1152, batch, miss, seed)
            impl = Ours(bench, cell, skip, stage_clock="twice" if twice else True, slot_map=with_map)
            samples: list[dict[str, float]] = []
            for _ in range(reps):
                impl.restore()
                if flush:
                    bench.flush.zero_()
                else:  # warm: the same launch just ran, its code and tables are in L2
                    impl()
                    impl.restore()
                torch.cuda._sleep(400_000)
                impl()
                samples.append(rcuda.read_stage_clock(bench.ws))  # synchronises
            med = {k: sorted(sm[k] for sm in samples)[len(samples) // 2] for k in samples[0]}
            row = {"B": 4096, "item_bytes": 1152, "batch": batch, "miss_frac": miss, "skip_io": skip,
                   "l2_flushed": flush, "slot_map": with_map, "second_pass": twice and skip, **med}
            out.append(row)
            log(f"[stage-clock] {json.dumps(row)}")
    return out


def find(rows: list[dict[str, Any]], impl: str, B: int, item: int, batch: int, miss: float, skip: bool,
         timing: str = "graph") -> Optional[dict]:
    for r in rows:
        if (r["impl"], r["B"], r["item_bytes"], r["batch"], r["miss_frac"], r["skip_io"], r.get("timing", "eager")) == (
                impl, B, item, batch, miss, skip, timing):
            return r
    return None


VARIANTS = (  # (impl, section title, column, ratio label): variants of ours timed on the same cells
    ("ours_reuse", "The reuse-table policy's kernel (same cell, same misses)", "ours_reuse us", "reuse / LRU"),
    ("ours_map", "Planning with the position -> slot map (same cell, same outputs)", "ours_map us", "map / hash"),
    ("ours_sized", "Per-request buffer sizes passed, each B (same cell, same outputs)", "ours_sized us",
     "sized / plain"),
)


def variant_section(rows: list[dict[str, Any]], timing: str, impl: str, title: str, column: str,
                    ratio: str) -> list[str]:
    """Markdown lines pairing a variant of ours with ours (LRU, hash-table planning) on every cell
    that has both (none: [])."""
    table = []
    for B in BS:
        for item in ITEMS:
            for batch in BATCHES:
                for miss in MISSES:
                    o = find(rows, "ours", B, item, batch, miss, False, timing)
                    r = find(rows, impl, B, item, batch, miss, False, timing)
                    if o and r:
                        table.append(f"| {B} | {item} | {batch} | {miss:g} | {o['median_us']:.1f} | "
                                     f"{r['median_us']:.1f} | {r['median_us'] / o['median_us']:.2f}x |")
    if not table:
        return []
    return ["", f"## {title}", "", f"| B | item B | batch | miss | ours us | {column} | {ratio} |",
            "|---|---|---|---|---|---|---|", *table]


def report_markdown(result: dict[str, Any], machine: str, command: str) -> str:
    rows = result["rows"]
    timing = result.get("timing", ["eager"])
    main = timing[0]
    eager = "eager" in timing and main != "eager"
    eager_note = ("; eager columns: events around the Python call, host us = host-side cost of that call"
                  if eager else "")
    lines = [
        "# Resolve kernel benchmark (per layer call)", "",
        f"Machine: {machine}  ", f"Command: `{command}`  ",
        f"Upstream: {result['upstream']}  ",
        f"Median of CUDA-event timings with L2 flushed (p10-p90 in the JSON); top_k 2048; timing: {main} "
        f"({'the call captured in a CUDA graph, events around its replay' if main == 'graph' else 'events around the Python call'})"
        f"; IO rate = bytes copied / (ours - ours skip-IO); e2e rate = bytes / ours{eager_note}.", "",
        "| B | item B | batch | miss | ours us | upstream us | upstream/ours | ours skip-IO us | IO GB/s | e2e GB/s |"
        + (" ours eager us | upstream eager us | ours host us | upstream host us |" if eager else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if eager else ""),
    ]
    for B in BS:
        for item in ITEMS:
            for batch in BATCHES:
                for miss in MISSES:
                    o = find(rows, "ours", B, item, batch, miss, False, main)
                    if o is None:
                        continue
                    s = find(rows, "ours", B, item, batch, miss, True, main)
                    u = find(rows, "upstream", B, item, batch, miss, False, main)
                    nbytes = batch * n_misses(miss) * item
                    io = e2e = None
                    if nbytes:
                        e2e = nbytes / (o["median_us"] * 1e3)
                        if s and o["median_us"] > s["median_us"]:
                            io = nbytes / ((o["median_us"] - s["median_us"]) * 1e3)
                    cells = [str(B), str(item), str(batch), f"{miss:g}", f"{o['median_us']:.1f}"]
                    cells += [f"{u['median_us']:.1f}", f"{u['median_us'] / o['median_us']:.2f}x"] if u else ["n/a", "n/a"]
                    cells += [f"{s['median_us']:.1f}" if s else "n/a"]
                    cells += [f"{io:.1f}" if io else "-", f"{e2e:.1f}" if e2e else "-"]
                    if eager:
                        oe = find(rows, "ours", B, item, batch, miss, False, "eager")
                        ue = find(rows, "upstream", B, item, batch, miss, False, "eager")
                        cells += [f"{oe['median_us']:.1f}" if oe else "n/a", f"{ue['median_us']:.1f}" if ue else "n/a",
                                  f"{oe['host_us']:.1f}" if oe and "host_us" in oe else "n/a",
                                  f"{ue['host_us']:.1f}" if ue and "host_us" in ue else "n/a"]
                    lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets (B=4096, 1152 B)", ""]
    for desc, B, item, batch, miss, limit in TARGETS:
        o = find(rows, "ours", B, item, batch, miss, False, main)
        if o is None:
            lines.append(f"- {desc} <= {limit:g} us: not measured")
            continue
        verdict = "met" if o["median_us"] <= limit else "MISSED"
        lines.append(f"- {desc} <= {limit:g} us: {o['median_us']:.1f} us, {verdict}")
    for batch in BATCHES:
        o = find(rows, "ours", 4096, 1152, batch, 0.13, False, main)
        s = find(rows, "ours", 4096, 1152, batch, 0.13, True, main)
        if o and s and o["median_us"] > s["median_us"]:
            io = batch * n_misses(0.13) * 1152 / ((o["median_us"] - s["median_us"]) * 1e3)
            lines.append(f"- IO rate >= {IO_TARGET_GBPS:g} GB/s at 13% misses, batch {batch}: {io:.1f} GB/s, "
                         f"{'met' if io >= IO_TARGET_GBPS else 'MISSED'}")
    for variant in VARIANTS:
        lines += variant_section(rows, main, *variant)
    bad = [c["cell"] for c in result["checks"] if not c["ours_matches_oracle"]]
    lines += ["", f"Oracle check of our outputs on every cell: {'all match' if not bad else 'MISMATCH on ' + ', '.join(bad)}."]
    disagree = [c["cell"] for c in result["checks"] if c["upstream_agrees_with_ours"] is False]
    if any(c["upstream_agrees_with_ours"] is not None for c in result["checks"]):
        lines.append(f"Upstream outputs equal ours on {'every cell' if not disagree else 'all but ' + ', '.join(disagree)}.")
    if result["skipped"]:
        lines.append(f"Skipped (time budget): {', '.join(result['skipped'])}.")
    if result.get("stage_clock"):
        keys = rcuda.STAGE_CLOCK_STAGES
        lines += ["", "## Where a planner's time goes (diagnostic build, CTA 0, median of 20; cycles at ~1.98 GHz)", "",
                  "| batch | miss | skip-IO | L2 flushed | slot map | " + " | ".join(keys) + " | total cycles | planner ns | copier 0 acquired ns | copier 0 done ns |",
                  "|---|---|---|---|---|" + "---|" * (len(keys) + 4)]
        for r in result["stage_clock"]:
            lines.append(f"| {r['batch']} | {r['miss_frac']:g} | {r['skip_io']} | {r.get('l2_flushed', True)} | "
                         f"{r.get('slot_map', False)} | "
                         + " | ".join(f"{r['cycles_' + k]:.0f}" for k in keys)
                         + f" | {r['cycles_total']:.0f} | {r['ns_planner']:.0f} | {r['ns_copier0_acquired']:.0f} | "
                         f"{r['ns_copier0_done']:.0f} |")
    if result["sweep"]:
        lines += ["", "## Sweep (B=4096, 1152 B)", "", "| batch | miss | copiers | block | median us | verified |",
                  "|---|---|---|---|---|---|"]
        for r in result["sweep"]:
            lines.append(f"| {r['batch']} | {r['miss_frac']:g} | {r['num_copiers']} | {r['block_size']} | "
                         f"{r['median_us']:.1f} | {r['verified']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, timing: str = "graph") -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.figure().clear()  # fails here, not midway, when pyplot cannot start (e.g. a stub IPython)
        plt.close("all")
    except Exception as e:  # noqa: BLE001 - the JSON and markdown are written already
        return f"no plot ({type(e).__name__}: {e}); rebuild it with --from-json"
    fig, axes = plt.subplots(len(BS), len(ITEMS), figsize=(11, 8), squeeze=False)
    colors = {0.0: "tab:green", 0.13: "tab:blue", 1.0: "tab:red"}
    for bi, B in enumerate(BS):
        for ii, item in enumerate(ITEMS):
            ax = axes[bi][ii]
            for miss in MISSES:
                for impl, style in (("ours", "-"), ("upstream", "--")):
                    pts = [(b, find(rows, impl, B, item, b, miss, False, timing)) for b in BATCHES]
                    pts = [(b, r["median_us"]) for b, r in pts if r]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=colors[miss],
                                label=f"{impl} {int(miss * 100)}% miss")
                pts = [(b, find(rows, "ours", B, item, b, miss, True, timing)) for b in BATCHES]
                pts = [(b, r["median_us"]) for b, r in pts if r]
                if pts and miss == 0.13:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", marker="x", color="gray", label="ours skip-IO")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"B={B}, {item} B rows")
            ax.set_xlabel("batch")
            ax.set_ylabel("us per layer call")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"RESOLVE per layer call ({timing} timing), top_k 2048: ours (solid) vs SGLang 0.5.17 (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description="Benchmark our resolve kernel against upstream SGLang's.")
    parser.add_argument("--out", default=os.environ.get("HISPARSE_RESULTS_DIR", str(ROOT / "docs" / "results")))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--Bs", type=int, nargs="+", default=list(BS))
    parser.add_argument("--items", type=int, nargs="+", default=list(ITEMS))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--misses", type=float, nargs="+", default=list(MISSES))
    parser.add_argument("--no-sweep", dest="sweep", action="store_false")
    parser.add_argument("--no-upstream", dest="upstream", action="store_false",
                        help="leave SGLang's kernel out (e.g. at a B it was not built for)")
    parser.add_argument("--no-reuse", dest="reuse", action="store_false",
                        help="leave out ours_reuse (the reuse-table policy's kernel) from the grid")
    parser.add_argument("--no-map", dest="slot_map", action="store_false",
                        help="leave out ours_map (planning with the position -> slot map) from the grid and the "
                             "stage clock")
    parser.add_argument("--sized", action="store_true",
                        help="add ours_sized (the per-request buffer sizes passed, each B) to the grid")
    parser.add_argument("--timing", nargs="+", choices=("graph", "eager"), default=["graph", "eager"],
                        help="timing modes, the first is the one the tables and targets use (see Bench.time_call)")
    parser.add_argument("--stage-clock", nargs="?", const="once", choices=("once", "twice"), default=None,
                        help="also run the diagnostic build with per-stage clock stamps (B=4096, 1152 B); "
                             "twice: skip-IO cells plan twice per launch and report the second pass")
    parser.add_argument("--from-json", default=None,
                        help="rebuild the markdown table and the plot from an earlier kernel_bench.json (no GPU)")
    args = parser.parse_args()
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        out = Path(args.out)
        md = report_markdown(payload, payload["machine"], payload["command"])
        (out / "kernel_bench.md").write_text(md)
        note = plot(payload["rows"], out / "kernel_bench.png", payload.get("timing", ["eager"])[0])
        print(note or f"wrote {out / 'kernel_bench.md'} and {out / 'kernel_bench.png'}")
        return 0
    if args.reps < 50:
        log("[bench] note: fewer than 50 reps requested; the issue asks for >= 50")
    if not torch.cuda.is_available():
        log("[bench] no CUDA GPU: nothing to measure")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = os.environ.get("HISPARSE_BENCH_COMMAND", "python " + " ".join(sys.argv))
    machine = machine_description()
    t0 = time.time()
    for item in args.items:  # build before timing (cached across runs)
        for B in args.Bs:
            rcuda.warmup_build(item, B, TOP_K, BLOCK)
            if args.reuse:
                rcuda.warmup_build(item, B, TOP_K, BLOCK, reuse=True)
    log(f"[bench] kernels ready in {time.time() - t0:.1f}s")
    result = run(args)
    payload = {"machine": machine, "command": command, "rows": result["rows"], "checks": result["checks"],
               "sweep": result["sweep"], "stage_clock": result["stage_clock"], "skipped": result["skipped"],
               "upstream": result["upstream"], "timing": result["timing"],
               "method": "median/p10/p90 of CUDA-event timings per call; tables restored, L2 flushed and a "
                         f"~200 us GPU spin before each call; {args.reps} reps after {args.warmup} warm-up; block 960; "
                         "timing 'graph': the call captured in a CUDA graph, events around its replay (as in a "
                         "decode step); 'eager': events around the Python call; host_us: host-side cost of the "
                         "eager call",
               "seconds": result["seconds"]}
    write_json(out / "kernel_bench.json", payload)
    md = report_markdown(result, machine, command)
    (out / "kernel_bench.md").write_text(md)
    note = plot(result["rows"], out / "kernel_bench.png", args.timing[0])
    if note:
        log(f"[bench] {note}")
    print(md)
    bad = [c for c in result["checks"] if not c["ours_matches_oracle"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
