"""A CPU rig of real SGLang 0.5.17 objects wired to our data plane, driven like the scheduler.

The rig plays SGLang's part of the protocol: prefill allocation and KV writes, staging admission,
collecting ready requests, per-step logical allocation + ``map_last_loc_to_buffer``, the KV
write of the new token, per-layer ``swap_in_selected_pages``, and finish/retract/abort followed
by ``release_kv_cache``-style frees. Every KV row written is a deterministic function of
(request, layer, position), so any device row can be checked against "the true KV".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

from sglang_hisparse.memory.allocator import HiSparseAllocator
from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.decode.coordinator import HiSparseCoordinator
from sglang_hisparse.memory.device_pool import HiSparseDevicePool

PAGE = 64
KV_LORA = 8
ROPE = 4
DIM = KV_LORA + ROPE


def true_row(uid: int, layer: int, position: int) -> torch.Tensor:
    """The KV row of a request's position in a layer (exact in float32)."""
    base = float(uid * 100_000 + position * 10 + layer)
    return torch.full((DIM,), base) + torch.arange(DIM) * 0.25


@dataclass
class Request:
    """The attributes of SGLang's ``Req`` that the coordinator reads."""

    uid: int
    prompt_len: int
    rid: str = ""
    req_pool_idx: Optional[int] = None
    hisparse_staging: bool = False
    kv: Optional[SimpleNamespace] = None
    extend_range: Optional[SimpleNamespace] = None
    seq_len: int = 0  # tokens with KV written (positions 0..seq_len-1)
    state: str = "new"  # new -> staging -> decoding -> gone
    last_selection: list = field(default_factory=list)

    def __post_init__(self):
        self.rid = f"req-{self.uid}"

    @property
    def seqlen(self) -> int:
        """SGLang's ``Req.seqlen``: the positions with KV plus the sampled token not yet written."""
        return self.seq_len + 1


class Rig:
    def __init__(
        self,
        group,
        *,
        device_rows: int = PAGE * 24,
        device_buffer_size: int = 128,
        top_k: int = 32,
        ratio: int = 2,
        layers: int = 2,
        max_reqs: int = 12,
        max_context: int = 1024,
        host_ratio: Optional[float] = None,
        wait_for_staging: bool = False,
        residency: bool = False,
        residency_watermark: float = 0.05,
        promotion_interval: int = 32,
        topk_sources: Optional[list] = None,
        indexshare_prefetch: bool = True,
        replacement: str = "lru",
        query_rows: int = 1,
        slot_map: bool = False,
        max_device_buffer_size: int = 0,
        device: str = "cpu",
        debug: bool = True,
    ):
        self.device = torch.device(device)
        self.layers = layers
        self.query_rows = query_rows
        self.top_k = top_k
        self.B = device_buffer_size
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context, device, False)
        self.pool = HiSparseDevicePool(
            device_rows, page_size=PAGE, kv_lora_rank=KV_LORA, dtype=torch.float32,
            qk_rope_head_dim=ROPE, layer_num=layers, device=device, index_head_dim=128,
            enable_memory_saver=False, kv_cache_dim=DIM, host_to_device_ratio=ratio,
        )
        self.allocator = HiSparseAllocator(
            device_rows, PAGE, torch.float32, device, self.pool, need_sort=False,
            host_to_device_ratio=ratio, debug=debug,
        )
        self.config = HiSparseConfig(
            top_k=top_k, device_buffer_size=device_buffer_size, host_to_device_ratio=ratio,
            swap_in_block_size=256, resolver="reference", wait_for_staging=wait_for_staging,
            residency=residency, residency_watermark=residency_watermark, promotion_interval=promotion_interval,
            indexshare_prefetch=indexshare_prefetch,
            replacement=replacement, query_rows=query_rows, slot_map=slot_map,
            max_device_buffer_size=max_device_buffer_size,
        )
        self.coord = HiSparseCoordinator(
            self.req_to_token_pool, self.allocator, top_k, device_buffer_size, device, group,
            ratio, 256, config=self.config, pin_memory=self.device.type == "cuda", host_to_device_ratio_override=host_ratio,
            topk_sources=topk_sources,
        )
        self.initial_counts = self.counts()

    def counts(self) -> dict:
        c = self.coord.stats.free_counts()
        c["req_slots"] = self.req_to_token_pool.available_size()
        c["resident_pages_marked"] = int(self.allocator.page_resident.sum())
        return c

    # --- prefill -----------------------------------------------------------------------------
    def can_admit(self, n: int) -> bool:
        """SGLang's admission test, reduced: the prompt plus a page must fit."""
        return n + PAGE <= self.allocator.available_size() and self.req_to_token_pool.available_size() > 0

    def prefill(self, req: Request, *, write_kv: bool = True) -> bool:
        """SGLang's prefill of ``req`` reduced to what we see: logical ids, their device rows, and
        (``write_kv``) the true KV of every position in every layer (benchmarks skip it)."""
        if not self.can_admit(req.prompt_len):
            return False
        req.req_pool_idx = self.req_to_token_pool.free_slots.pop(0)
        n = req.prompt_len
        d = self.device
        logical = self.allocator.alloc_extend(
            torch.tensor([0], device=d), torch.tensor([0]), torch.tensor([n], device=d), torch.tensor([n]),
            torch.tensor([-1], device=d), n
        )
        assert logical is not None, "admission said yes, allocation said no"
        self.req_to_token_pool.write((req.req_pool_idx, slice(0, n)), logical.to(torch.int32))
        rows = self.allocator.device_rows_of(logical)
        assert bool((rows > 0).all())
        for layer in range(self.layers if write_kv else 0):
            self.pool.kv_buffer[layer][rows] = torch.stack(
                [true_row(req.uid, layer, p) for p in range(n)]
            ).view(n, 1, DIM).to(self.device)
        req.kv = SimpleNamespace(kv_allocated_len=n)
        req.extend_range = SimpleNamespace(start=0, end=n)
        req.seq_len = n
        return True

    def admit_direct(self, req: Request, *, write_kv: bool = True) -> bool:
        """PD decode: logical ids only, KV (``write_kv``; benchmarks skip it) written straight into
        host rows, then direct admission."""
        if not self.pd_prealloc(req, req.prompt_len):
            return False
        host = self.coord.mem_pool_host
        rows = self.coord.req_to_host_pool[req.req_pool_idx, : req.prompt_len]
        for layer in range(self.layers if write_kv else 0):
            host.kv_buffer[layer][rows] = torch.stack(
                [true_row(req.uid, layer, p) for p in range(req.prompt_len)]
            ).view(req.prompt_len, 1, DIM)
        req.seq_len = req.prompt_len
        self.coord.admit_request_direct(req)
        req.state = "decoding"
        return True

    def pd_prealloc(self, req: Request, n: int) -> bool:
        """What SGLang's PD decode path does before a transfer (or a resume): a request slot,
        logical ids for positions 0..n-1 and host rows for them."""
        if not self.can_admit(n):
            return False
        req.req_pool_idx = self.req_to_token_pool.free_slots.pop(0)
        logical = self.allocator.alloc_logical_only(
            torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n
        )
        self.req_to_token_pool.write((req.req_pool_idx, slice(0, n)), logical.to(torch.int32))
        self.coord.mem_pool_host.alloc_paged_token_slots(
            self.coord.req_to_host_pool, self.coord.req_to_host_pool_allocated_len, req.req_pool_idx, 0, n
        )
        req.kv = SimpleNamespace(kv_allocated_len=n)
        req.extend_range = SimpleNamespace(start=0, end=n)
        return True

    def stage(self, req: Request) -> None:
        self.coord.admit_request_into_staging(req)
        req.state = "staging"

    def collect(self) -> list:
        ready = self.coord.collect_ready_reqs()
        for req in ready:
            req.state = "decoding"
        return ready

    def enter_by_prefill(self, reqs: list, *, write_kv: bool = True) -> None:
        """Prefill and stage ``reqs``, wait for their staging copies, and collect them all into
        decode (SGLang's order)."""
        for req in reqs:
            assert self.prefill(req, write_kv=write_kv)
            self.stage(req)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the staging copies done: every request enters at the next collect
        assert self.collect() == reqs

    # --- decode ------------------------------------------------------------------------------
    def decode_fits(self, reqs: list) -> bool:
        """SGLang's decode memory check with our seam (patches/decode_memory_check.py): a logical
        id and host row per new page (SGLang's ``new_tokens_required_next_decode``), and the
        device rows the coordinator says the step lacks."""
        new_pages = sum(r.seq_len % PAGE == 0 for r in reqs)
        if self.allocator.decode_available_size() < new_pages * PAGE:
            return False
        return self.coord.device_rows_short([r.req_pool_idx for r in reqs], [r.seq_len for r in reqs]) == 0

    def decode_step(self, reqs: list) -> bool:
        """Allocate and write the next token of each request (positions seq_len). Returns
        False (nothing changed) when the decode check says there is no room."""
        if not reqs:
            return True
        if not self.decode_fits(reqs):
            return False
        idx = torch.tensor([r.req_pool_idx for r in reqs])
        seq_lens = torch.tensor([r.seq_len + 1 for r in reqs])
        idx_d, seq_lens_d = idx.to(self.device), seq_lens.to(self.device)  # SGLang's device copies
        last_loc = self.req_to_token_pool.req_to_token[idx_d, seq_lens_d - 2].to(torch.int64)
        out_loc = self.allocator.alloc_decode(seq_lens_d, seq_lens, last_loc)
        assert out_loc is not None
        self.req_to_token_pool.write((idx_d, seq_lens_d - 1), out_loc.to(torch.int32))
        for r in reqs:
            r.kv.kv_allocated_len += 1
            r.seq_len += 1
        self.coord.map_last_loc_to_buffer(seq_lens_d, out_loc, idx_d, seq_lens, idx)
        self.coord.wait_for_pending_backup()
        for layer in range(self.layers):
            rows = torch.stack([true_row(r.uid, layer, r.seq_len - 1) for r in reqs]).to(self.device)
            self.pool.set_mla_kv_buffer(
                SimpleNamespace(layer_id=layer), out_loc,
                rows[:, :KV_LORA].view(-1, 1, KV_LORA), rows[:, KV_LORA:].view(-1, 1, ROPE),
            )
        return True

    def resolve_and_check(self, reqs: list, layer: int, selections: list, num_padded: int = 0) -> None:
        """Run one layer's swap-in and check that every selected position's device row holds
        that position's true KV. ``num_padded`` extra rows imitate CUDA-graph padding."""
        top_k = self.top_k
        padded = [sel + [-1] * (top_k - len(sel)) for sel in selections] + [[-1] * top_k] * num_padded
        positions = torch.tensor(padded, dtype=torch.int32, device=self.device)
        idx = torch.tensor([r.req_pool_idx for r in reqs] + [0] * num_padded, device=self.device)
        seq_lens = torch.tensor([r.seq_len for r in reqs] + [1] * num_padded, device=self.device)
        self.coord.num_real_reqs.fill_(len(reqs))
        out = self.coord.swap_in_selected_pages(idx, seq_lens, positions, layer)
        for i, (r, sel) in enumerate(zip(reqs, selections)):
            for j, p in enumerate(sel):
                row = int(out[i, j])
                got = self.pool.kv_buffer[layer][row, 0]
                want = true_row(r.uid, layer, p).to(self.device)
                assert torch.equal(got, want), f"req {r.uid} layer {layer} pos {p}: row {row} holds {got[0].item()}"
            assert out[i, len(sel):].eq(-1).all()
        self.check_slot_map()

    def check_slot_map(self) -> None:
        """With the position -> slot map: its invariant in every layer of every request slot that
        holds a hot buffer (a slot holding position p is the one the map names for p)."""
        hot = self.coord.hot
        if hot.slot_map is None:
            return
        for idx in range(len(hot.capacity)):
            if not hot.holds(idx):
                continue
            for layer in range(self.layers):
                tokens = hot.slot_positions[layer, idx].long()
                held = (tokens >= 0).nonzero(as_tuple=True)[0]
                named = hot.slot_map[layer, idx, tokens[held]].long()
                assert torch.equal(named, held), f"slot map of request slot {idx}, layer {layer}"

    # --- speculative verify steps (query_rows = N tokens per request) ------------------------
    def verify_step(self, reqs: list, accepts: list) -> None:
        """One linear-speculation step the way SGLang 0.5.17 runs it: ids grow to
        ``round_up(committed + 2N, page)`` (``eagle_prepare_for_decode``, logical only inside our
        seam), ``begin_verify_step``, then the verify forward writes the KV of positions
        ``L .. L + N - 1``: the true KV for the ``accept`` positions the step will commit, a
        rejected draft's (negated) KV for the others. Call :meth:`resolve_verify_and_check` per
        layer, then :meth:`commit`."""
        N = self.query_rows
        idx = torch.tensor([r.req_pool_idx for r in reqs])
        cur = torch.tensor([r.kv.kv_allocated_len for r in reqs])
        nxt = torch.tensor([max(r.kv.kv_allocated_len, -(-(r.seq_len + 2 * N) // PAGE) * PAGE) for r in reqs])
        if bool((nxt > cur).any()):
            last_loc = self.req_to_token_pool.req_to_token[idx, cur - 1].to(torch.int64)
            with self.allocator.logical_only():
                logical = self.allocator.alloc_extend(cur, cur, nxt, nxt, last_loc, int((nxt - cur).sum()))
            assert logical is not None
            start = 0
            for r, a, b in zip(reqs, cur.tolist(), nxt.tolist()):
                self.req_to_token_pool.req_to_token[r.req_pool_idx, a:b] = logical[start : start + b - a].to(torch.int32)
                start += b - a
                r.kv.kv_allocated_len = b
        self.coord.begin_verify_step(idx, idx.tolist(), [r.seq_len for r in reqs])
        self.coord.wait_for_pending_backup()
        window = torch.stack([self.req_to_token_pool.req_to_token[r.req_pool_idx, r.seq_len : r.seq_len + N]
                              for r in reqs]).reshape(-1).to(torch.int64)
        for layer in range(self.layers):
            rows = torch.stack([self.window_kv(r, layer, j, a) for r, a in zip(reqs, accepts) for j in range(N)])
            self.pool.set_mla_kv_buffer(
                SimpleNamespace(layer_id=layer), window,
                rows[:, :KV_LORA].reshape(-1, 1, KV_LORA), rows[:, KV_LORA:].reshape(-1, 1, ROPE),
            )
        self._accepts = dict(zip((r.uid for r in reqs), accepts))

    @staticmethod
    def window_kv(req: Request, layer: int, j: int, accept: int) -> torch.Tensor:
        """The KV the verify forward writes for window token j: true when it will be committed."""
        row = true_row(req.uid, layer, req.seq_len + j)
        return row if j < accept else -row - 1

    def resolve_verify_and_check(self, reqs: list, layer: int, rows_per_req: list) -> None:
        """``rows_per_req[i][j]``: the positions verify row j of request i selects (< L + j + 1).
        Every selected position's device row must hold its true KV (a committed position) or
        the KV this step wrote (a window position)."""
        N, top_k = self.query_rows, self.top_k
        padded = [sel + [-1] * (top_k - len(sel)) for rows in rows_per_req for sel in rows]
        idx = torch.tensor([r.req_pool_idx for r in reqs])
        seq_lens = torch.tensor([r.seq_len for r in reqs])
        self.coord.num_real_reqs.fill_(len(reqs))
        out = self.coord.resolve_verify(idx, seq_lens, torch.tensor(padded, dtype=torch.int32), layer)
        for i, (r, rows) in enumerate(zip(reqs, rows_per_req)):
            for j, sel in enumerate(rows):
                for c, p in enumerate(sel):
                    got = self.pool.kv_buffer[layer][int(out[i * N + j, c]), 0]
                    want = (true_row(r.uid, layer, p) if p < r.seq_len
                            else self.window_kv(r, layer, p - r.seq_len, self._accepts[r.uid]))
                    assert torch.equal(got, want), f"req {r.uid} layer {layer} row {j} pos {p} (L={r.seq_len})"
                assert out[i * N + j, len(sel):].eq(-1).all()

    def commit(self, reqs: list) -> None:
        """The accepted tokens of the last verify step become committed."""
        for r in reqs:
            r.seq_len += self._accepts[r.uid]

    def run_flow(self, reqs: list, steps: int, seed: int) -> None:
        """Prefill and stage ``reqs``, collect them all into decode, run ``steps`` decode steps
        (each layer resolved and checked against the true KV), release them; every pool is then
        back at its initial count."""
        rng = random.Random(seed)
        self.enter_by_prefill(reqs)
        for _ in range(steps):
            assert self.decode_step(reqs)
            for layer in range(self.layers):
                selections = [rng.sample(range(r.seq_len), min(self.top_k, r.seq_len)) for r in reqs]
                self.resolve_and_check(reqs, layer, selections)
        for req in reqs:
            self.release(req)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        assert self.counts() == self.initial_counts

    # --- leaving -----------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the coordinator: wait for its copies, unpin the host pool. Call it before
        dropping a CUDA rig: a host range left registered after its mapping is freed makes the
        next pool whose mapping lands there fail to register ("already mapped")."""
        self.coord.destroy()

    def release(self, req: Request, *, retract: bool = False) -> None:
        """Finish (or retract) a request the way SGLang does: coordinator, then KV, then slot."""
        if req.state in ("staging", "decoding"):
            (self.coord.retract_req if retract else self.coord.request_finished)(req)
        n = req.kv.kv_allocated_len
        self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64))
        self.req_to_token_pool.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = None
        req.state = "gone"
