"""The host side of a decode or verify step, before its forward: write-through, growth, mapping.

:class:`DecodeSteps` implements the coordinator's per-step members that run on the host before a
forward (``map_last_loc_to_buffer``, ``begin_verify_step``, ``wait_for_pending_backup``) and the
decode memory check (``device_rows_short``). It owns no state of its own: it drives the
coordinator's components, each the owner of its state: the host mirror (host rows, write-through
copies), the hot buffers (slots, growth), the allocator (the logical -> row mapping) and, with
residency on, :class:`~sglang_hisparse.decode.pressure.ResidentDecode` (resident requests). Its
host time goes to the allocator's ``host_time`` by part (``map``, ``check``, ``wait``).

Invariant: a one-token step (``map_one_token_step``) runs only on a server whose decode steps are
one token per request (``config.query_rows`` 1); a verify step (``map_verify_step``) on one whose
steps verify ``config.query_rows`` > 1 tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.decode.pressure import ResidentDecode
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.stats import timed


class DecodeSteps:
    def __init__(self, config: HiSparseConfig, *, allocator, req_to_token_pool, hot, mirror, stats,
                 resident: Optional[ResidentDecode]):
        self.config = config
        self.allocator, self.req_to_token_pool = allocator, req_to_token_pool
        self.hot, self.mirror, self.stats = hot, mirror, stats
        self.resident = resident
        """The residency driver (None with residency off)."""
        self.host_time = allocator.host_time
        """Where :func:`~sglang_hisparse.stats.timed` adds our host time (the allocator's)."""

    @timed("map")
    def map_one_token_step(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu) -> None:
        """Before a decode step (``seq_lens`` count the new token): write the previous tokens
        through to host where they are due (at once where the step overwrites their rows, a page at
        a time in a short hot buffer, every few hundred steps for resident requests:
        :meth:`HostMirror.write_through_step`, :meth:`ResidentDecode.flush_deferred`), grow short
        buffers and resident requests, and map the new token's logical id to its row. A batch of
        resident requests takes :meth:`ResidentDecode.resident_step` (Python over the batch, one
        CPU tensor op, one device launch when some request starts a page); any other batch a few
        tensor ops for the whole batch, plus Python only for requests starting a page."""
        if self.config.query_rows > 1:
            raise HiSparsePluginError("sglang-hisparse: a one-token decode step on a server whose decode steps "
                                      f"verify {self.config.query_rows} tokens (begin_verify_step maps those)")
        idxs, lens = req_pool_indices_cpu.to(torch.int64), seq_lens_cpu.to(torch.int64)
        self.stats.note_decode_step(int(lens.numel()))
        driver = self.resident
        if driver is not None:
            driver.promotion.maybe_promote(idxs, lens)
            if driver.elastic is not None:
                driver.elastic.maybe_grow(idxs, lens, ~driver.residency.mask(idxs.numpy()))
            driver.flush_deferred(idxs, lens)
            if driver.resident_step(idxs.tolist(), lens.tolist(), idxs, lens):
                return
        if driver is None:
            rows = self.hot.newest_rows(idxs, lens, req_pool_indices, seq_lens)
        else:
            rows = driver.newest_rows(idxs, lens, req_pool_indices, seq_lens, out_cache_loc,
                                      driver.residency.mask(idxs))
        # after the newest rows (growth and demotions change no pending position's row): a long
        # hot buffer's previous token sits in the newest slot, whose row the step's token takes
        sizes = self.hot.sizes.host if self.hot.sizes.elastic else self.hot.buffer_size
        self.mirror.write_through_step(idxs, lens, self.rows_now, buffer_size=sizes, newest_rows=rows)
        self.allocator.map_logical(out_cache_loc, rows)

    def map_verify_step(self, req_pool_indices: torch.Tensor, req_pool_indices_cpu: list[int],
                        committed_lens: list[int]) -> None:
        """Before a verify step, after SGLang allocated its ids (``req_to_token[r, L .. L + N)``,
        ``L`` = the committed length): write the positions committed since the last step through
        to host, grow short hot buffers, and map the window's logical ids to their slots (the hot
        buffers' window rule). Side effects: host rows and a write-through copy (the forward
        waits for it, :meth:`order_forward`), rows from the reserve, the mapping."""
        self.stats.note_decode_step(len(committed_lens))
        self.mirror.write_through(req_pool_indices_cpu, [L + 1 for L in committed_lens], self.rows_now)
        positions, rows = self.hot.window_rows(req_pool_indices_cpu, committed_lens, req_pool_indices)  # [bs, N]
        logical = self.req_to_token_pool.req_to_token[req_pool_indices[:, None].long(), positions]
        self.allocator.map_logical(logical.reshape(-1).long(), rows.reshape(-1))

    @timed("check")
    def rows_short(self, req_pool_indices: list[int], committed_lens: list[int]) -> int:
        """Device rows the next step of these requests lacks (0: it fits), after every demotion of
        a resident request that could help (counted, not done). ``committed_lens``: positions with
        KV; the step writes position ``committed`` (one-token steps) or ``committed .. committed +
        N - 1`` (verify steps). No side effects."""
        if self.config.query_rows > 1:
            short = self.hot.window_growth(req_pool_indices, committed_lens) - self.allocator.rows.room()
            return max(0, short)
        # A one-token step takes free rows only where the position it writes (the committed length
        # c) starts a page: one pass over the batch, then work for those requests alone.
        p = self.hot.page_size
        at_page_start = [(idx, c + 1) for idx, c in zip(req_pool_indices, committed_lens) if c % p == 0]
        if self.resident is not None:
            return self.resident.rows_short(at_page_start)
        return max(0, sum(self.hot.step_growth([idx], [n]) for idx, n in at_page_start) - self.allocator.rows.room())

    @timed("wait")
    def order_forward(self) -> None:
        """Order the forward after the last copy of a newest slot it overwrites (if any)."""
        self.mirror.order_forward_after_write_through()

    def rows_now(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) holding ``positions`` of decoding requests now (a resident
        request's own rows, else its newest or fast-path hot-buffer slot); no side effects."""
        if self.resident is None:
            return self.hot.rows_of_positions(req_pool_idx, positions)
        return self.resident.rows_now(req_pool_idx, positions)
