#!/usr/bin/env python3
"""Benchmark: our resolve kernel on DeepSeek-V4's C4 rows vs SGLang 0.5.17's
load_cache_to_device_buffer_dsv4_mla, per layer call, on identical inputs.

The C4 layers of V4 select top_k = index_topk (512) compressed entries (4 tokens each) per step;
rows are 584 bytes in FlashMLA's 37440-byte pages (64 entries), on the host and on the device.
Each request has CONTEXT entries (100k tokens), host pages contiguous per request, B slots
holding random entries; its selection: the newest entry, round(miss * 512) misses, the rest hits.
Method as scripts/research/bench_resolve.py (its ``Bench.time_call``: restore, L2 flush, GPU spin,
CUDA graph replay timed with events; median / p10 / p90). Both kernels run with block size 960
(the DSA bench's; upstream's wrapper default 256 faults there). Every cell is checked: ours against
the batched oracle (outputs, tables, the copied rows' bytes through ``C4PagedRows``), upstream's
outputs against ours.

    python scripts/research/bench_resolve_c4.py --out $OUT        (writes kernel_bench_c4.json)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_resolve import BLOCK, Bench, log, stats  # noqa: E402
from sglang_hisparse.resolver import cuda as rcuda  # noqa: E402
from sglang_hisparse.resolver.batched import resolve_batched  # noqa: E402
from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES, C4_PAGE_BYTES, C4_PAGE_ENTRIES, C4PagedRows  # noqa: E402
from sglang_hisparse.resolver.report import machine_description, write_json  # noqa: E402

TOP_K = 512
CONTEXT = 25_000  # entries: 100k tokens
PAGES_PER_REQ = -(-CONTEXT // C4_PAGE_ENTRIES)


def make_cell(dev: torch.device, host: torch.Tensor, device_pages: torch.Tensor, B: int, batch: int, miss: float,
              seed: int) -> dict[str, Any]:
    """Pristine tables and one selection per request (``host``: every request's pages, in order)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    R, L = batch, CONTEXT
    M = min(TOP_K - 1, int(round(miss * TOP_K)))
    keys = torch.rand(R, L - 1, generator=g, device=dev)
    tokens = keys.topk(B, dim=1, largest=False).indices  # B distinct entries < L - 1
    lru = torch.rand(R, B, generator=g, device=dev).argsort(dim=1).to(torch.int16)
    hot = torch.randperm(R * (B + 1), generator=g, device=dev).view(R, B + 1).to(torch.int32)
    host_locs = torch.arange(R, device=dev)[:, None] * (PAGES_PER_REQ * C4_PAGE_ENTRIES) + torch.arange(L, device=dev)
    hits = tokens.gather(1, torch.rand(R, B, generator=g, device=dev).argsort(dim=1)[:, :TOP_K - 1 - M])
    held = torch.zeros(R, L - 1, dtype=torch.bool, device=dev).scatter_(1, tokens, True)
    misses = torch.rand(R, L - 1, generator=g, device=dev).masked_fill(held, 2.0).topk(M, dim=1, largest=False).indices
    sel = torch.cat([hits, misses, torch.full((R, 1), L - 1, dtype=torch.long, device=dev)], dim=1)
    sel = sel.gather(1, torch.rand(R, TOP_K, generator=g, device=dev).argsort(dim=1)).to(torch.int32).contiguous()
    return dict(B=B, batch=batch, miss=miss, top_k_positions=sel, hot_locs=hot, host_locs=host_locs.long(),
                seq_lens=torch.full((R,), L, dtype=torch.int64, device=dev),
                req_pool_indices=torch.arange(R, dtype=torch.int64, device=dev), host=host,
                device=device_pages[: -(-R * (B + 1) // C4_PAGE_ENTRIES)], tokens0=tokens.to(torch.int32).contiguous(),
                lru0=lru.contiguous(), num_real=torch.tensor([R], dtype=torch.int32, device=dev),
                up_tokens0=torch.cat([tokens.to(torch.int32), torch.full((R, 1), L - 1, dtype=torch.int32,
                                                                         device=dev)], dim=1).contiguous())


class Impl:
    """One kernel on one cell, its mutable tables restorable (``restore``) between timed calls."""

    def __init__(self, cell: dict[str, Any], tokens_key: str) -> None:
        self.cell, self.tokens_key = cell, tokens_key
        self.tokens = cell[tokens_key].clone()
        self.lru = cell["lru0"].clone()
        self.out = torch.empty_like(cell["top_k_positions"])

    def restore(self) -> None:
        self.tokens.copy_(self.cell[self.tokens_key])
        self.lru.copy_(self.cell["lru0"])


class Ours(Impl):
    def __init__(self, cell: dict[str, Any], ws, skip_io: bool = False) -> None:
        super().__init__(cell, "tokens0")
        c = cell
        self.bound = rcuda.bind_resolve_cuda(
            top_k=TOP_K, workspace=ws, block_size=BLOCK, hot_locs=c["hot_locs"], slot_tokens=self.tokens, lru=self.lru,
            host_locs=c["host_locs"], host_kv=C4PagedRows(c["host"]), device_kv=C4PagedRows(c["device"]),
            num_real_reqs=c["num_real"], device_buffer_size=c["B"], skip_io=skip_io, compress_ratio=4)

    def __call__(self) -> None:
        c = self.cell
        self.bound(c["top_k_positions"], c["seq_lens"], c["req_pool_indices"], self.out)


class Upstream(Impl):
    def __init__(self, cell: dict[str, Any], fn) -> None:
        super().__init__(cell, "up_tokens0")
        self.fn = fn

    def __call__(self) -> None:
        c = self.cell
        self.fn(c["top_k_positions"], self.tokens, c["host_locs"], c["hot_locs"], c["host"], c["device"], self.out,
                c["req_pool_indices"], c["seq_lens"], self.lru, C4_ITEM_BYTES, TOP_K, c["B"], page_size=1,
                block_size=BLOCK, num_real_reqs=c["num_real"])


def check_ours(ours: Ours) -> bool:
    """Outputs and tables equal the batched oracle's; each miss's device row holds its host row."""
    c = ours.cell
    ours.restore()
    ours()
    tok, lru, out = c["tokens0"].clone(), c["lru0"].clone(), torch.empty_like(ours.out)
    resolve_batched(top_k_positions=c["top_k_positions"], seq_lens=c["seq_lens"], req_pool_indices=c["req_pool_indices"],
                    hot_locs=c["hot_locs"], slot_tokens=tok, lru=lru, host_locs=c["host_locs"],
                    host_kv=C4PagedRows(c["host"]), device_kv=C4PagedRows(c["device"]), out=out,
                    num_real_reqs=c["batch"], device_buffer_size=c["B"], skip_io=True, compress_ratio=4)
    ok = torch.equal(ours.out, out) and torch.equal(ours.tokens, tok) and torch.equal(ours.lru, lru)
    pos = c["top_k_positions"].long()
    miss = ~torch.isin(pos, torch.cat([c["tokens0"].long(), (c["seq_lens"] - 1)[:, None]], 1))
    if ok and bool(miss.any()):
        src = c["host_locs"].gather(1, pos.clamp(min=0))[miss]
        copied = C4PagedRows(c["device"]).read(ours.out[miss].long())
        ok = torch.equal(copied, C4PagedRows(c["host"]).read(src.cpu()).to(copied.device))
    return bool(ok)


def load_upstream():
    try:
        from sglang.kernels.ops.kvcache.hisparse import load_cache_to_device_buffer_dsv4_mla

        return load_cache_to_device_buffer_dsv4_mla, "sglang.kernels.ops.kvcache.hisparse.load_cache_to_device_buffer_dsv4_mla"
    except Exception as e:  # reported, not hidden
        return None, f"upstream kernel unavailable: {type(e).__name__}: {e}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda")
    timer = Bench(max_batch=1, reps=args.reps, warmup=args.warmup, buffer_sizes=(1024,))  # its timer and L2 flush
    max_batch, max_B = max(args.batches), max(args.Bs)
    host = torch.empty(max_batch * PAGES_PER_REQ, C4_PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, device=dev))
    device_pages = torch.randint(0, 256, (-(-max_batch * (max_B + 1) // C4_PAGE_ENTRIES), C4_PAGE_BYTES),
                                 dtype=torch.uint8, device=dev)
    ws = rcuda.make_workspace(max_batch, dev, top_k=TOP_K)
    upstream, note = load_upstream()
    log(f"[bench-c4] upstream: {note}")
    rows, checks, seed, deadline = [], [], 0, time.time() + args.budget_s
    for B in args.Bs:
        for batch in args.batches:
            for miss in args.misses:
                if time.time() > deadline:
                    log(f"[bench-c4] budget spent: B={B} batch={batch} miss={miss} not run")
                    continue
                seed += 1
                cell = make_cell(dev, host, device_pages, B, batch, miss, seed)
                impls = [("ours", Ours(cell, ws)), ("ours_skip_io", Ours(cell, ws, skip_io=True))]
                impls += [("upstream", Upstream(cell, upstream))] if upstream is not None else []
                line = [f"B={B} batch={batch} miss={miss}"]
                for name, impl in impls:
                    st = stats(timer.time_call(impl, impl.restore, "graph"))
                    rows.append({"impl": name, "B": B, "batch": batch, "miss_frac": miss, "item_bytes": C4_ITEM_BYTES,
                                 "top_k": TOP_K, "timing": "graph", **st})
                    line.append(f"{name} {st['median_us']:.1f}us")
                ok = check_ours(impls[0][1])
                agree: Optional[bool] = None
                if upstream is not None:
                    up = impls[2][1]
                    up.restore()
                    up()
                    agree = bool(torch.equal(up.out, impls[0][1].out))
                checks.append({"cell": line[0], "ours_matches_oracle": ok, "upstream_agrees_with_ours": agree})
                log("[bench-c4] " + "; ".join(line) + f"; oracle {'ok' if ok else 'MISMATCH'}; upstream agrees {agree}")
    return {"machine": machine_description(), "upstream": note, "top_k": TOP_K, "context_entries": CONTEXT,
            "block": BLOCK, "rows": rows, "checks": checks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--Bs", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--misses", type=float, nargs="+", default=[0.0, 0.13, 1.0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--command", default=" ".join(sys.argv))
    args = p.parse_args()
    result = run(args)
    result["command"] = args.command
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "kernel_bench_c4.json", result)
    bad = [c["cell"] for c in result["checks"] if not c["ours_matches_oracle"]]
    log(f"[bench-c4] {len(result['checks'])} cells, oracle mismatches: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
