"""The coordinator for DeepSeek-V4: SGLang's HiSparse protocol over the C4 layers' entries.

DeepSeek-V4 (docs/design.md, "DeepSeek-V4") offloads only its C4 attention KV: one entry per 4
tokens, of which each C4 layer's attention reads the top-k (``index_topk``, 512). SWA, C128 and
the C4 indexer keys stay on the device as SGLang keeps them. This coordinator works in the
compressed view: a request's positions are its completed entries (entry ``k``: tokens
``4k .. 4k + 3``; ``E = tokens // 4`` of them), its logical ids their compressed ids
(``memory/c4_allocator.py``), and SGLang calls it with compressed lengths and positions
(``swap_in_selected_pages``) but token-level steps (``map_last_loc_to_buffer``).

Design (ours; the parts are the DSA path's where they fit):

* after a prefill the entries' rows are copied to host (:class:`~sglang_hisparse.memory.c4_mirror.C4Mirror`,
  staging lane); once copied, the request gets a hot buffer (:class:`~sglang_hisparse.memory.hot_buffers.HotBuffers`
  over the C4 rows, page 64) made of its first prefill pages: slot ``p`` holds entry ``p``; a long
  request's newest entry (``E - 1``, which stays newest until the next entry completes) is loaded
  into slot ``B``, a request with no entry yet opens empty;
* a decode step whose token completes an entry (``seq_len % 4 == 0``) maps the entry's compressed
  id to its slot's row (slot ``min(E - 1, B)``; a short buffer grows a page when the entry starts
  one) so the compressor writes it there; the next step copies it to host (backup lane, the
  forward after ordered behind it: ``wait_for_pending_backup``);
* each C4 layer's top-k entries are resolved by our kernel on C4 rows (``RowLayout<584>``).

* PD decode (``admit_request_direct``): the prefill instance writes the entries into host rows
  SGLang allocates here (``mem_pool_host.alloc_paged_token_slots`` with ``host_token_len``, page
  ids of 64 entries over Mooncake); the request then gets a hot buffer of new rows, loaded from
  host (all entries when ``E <= B``, else only the newest, into slot ``B``).

* residency (``"residency": true``; off by default for V4, measured slower than hot buffers on an
  H100: ``config.V4_RESIDENCY_DEFAULT``; ``decode/c4_residency.py``): a request that
  fits with the watermark free keeps its prefill rows (PD: rows its entries are loaded into) and
  takes the next row of its own pages for each new entry; the resolver reads its entries there.
  Under pressure (a decode step's new pages, a prefill's rows) the longest resident requests are
  demoted into hot buffers of their own rows, the newest entry copied into slot ``B``. No
  promotion back for C4 entries.

Speculative steps are refused (the server checks refuse them first). With ``--enable-metrics`` the
``sglang_hisparse_*`` series are published as for DSA (``export_to``; rows are C4 entries).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.decode.layers import LayerResolve
from sglang_hisparse.decode.lifecycle import agreed_count
from sglang_hisparse.decode.c4_report import C4Report
from sglang_hisparse.decode.c4_residency import ResidentEntries
from sglang_hisparse.decode.c4_steps import C4Steps
from sglang_hisparse.decode.startup import build_resolver, residency_label, reuse_levels_for
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.c4_mirror import C4Mirror
from sglang_hisparse.memory.copy_lane import order_current_after
from sglang_hisparse.memory.hot_buffers import HotBuffers
from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES, C4_RATIO, prefix_entry_ids
from sglang_hisparse.stats import HiSparseTokenStats, token_stats

logger = logging.getLogger(__name__)


class C4Coordinator:
    """Built by our ``HiSparseCoordinator`` for a DeepSeek-V4 allocator (same constructor)."""

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, top_k: int, device_buffer_size: int,
                 device: str, tp_group, host_to_device_ratio: float = 2, swap_in_block_size: int = 960, *,
                 config: HiSparseConfig, pin_memory: Optional[bool] = None):
        self.config, self.tp_group = config, tp_group
        device = torch.device(device)
        self.req_to_token_pool, self.allocator = req_to_token_pool, token_to_kv_pool_allocator
        self.rows, self.device_pool = self.allocator.c4, self.allocator.hisparse_kvcache
        req_to_token = req_to_token_pool.req_to_token
        max_reqs = req_to_token.shape[0]
        capacity = min(int(self.device_pool.size * host_to_device_ratio), self.allocator.get_kvcache().c4_logical_size)
        self.mirror = C4Mirror(self.device_pool, capacity, max_reqs=max_reqs, max_entries=req_to_token.shape[1] // C4_RATIO,
                               device=device, pin_memory=device.type == "cuda" if pin_memory is None else pin_memory)
        self.hot = HotBuffers(self.rows, layers=self.device_pool.layer_num, max_reqs=max_reqs,
                              buffer_size=device_buffer_size, device=device, history=config.replacement == "reuse")
        self.allocator.configure(self.hot.padded, self.mirror.pool.capacity_tokens, self.mirror.host_entries_used)
        # protocol attributes SGLang reads (the components' objects, never rebound)
        self.mem_pool_host, self.padded_buffer_size = self.mirror.pool, self.hot.padded
        self.req_to_host_pool, self.req_to_host_pool_allocated_len = self.mirror.row_table, self.mirror.rows_allocated
        self.raw_indices_buffer = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=device)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        """(selected, misses) over every C4 layer call since start-up."""
        self._producer_stream = None
        resolver = build_resolver(config, device=device, max_reqs=max_reqs, top_k=top_k, row_bytes=C4_ITEM_BYTES,
                                  buffer_size=device_buffer_size)
        selections = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=device)
        self.residency: Optional[ResidentEntries] = None
        if config.residency:
            self.residency = ResidentEntries.build(
                config.residency_watermark, rows=self.rows, hot=self.hot, max_reqs=max_reqs, device=device,
                mirror=self.mirror, device_pool=self.device_pool, req_to_token=req_to_token, selections=selections,
                quiesce=self._wait_for_producer)
            self.allocator.set_reclaimer(self.residency.reclaim, self.residency.residency.reclaimable_rows)
        self._layers = LayerResolve(
            resolver, layers=self.device_pool.layer_num, max_reqs=max_reqs, top_k=top_k, device=device, hot=self.hot,
            mirror=self.mirror, device_pool=self.device_pool, counters=self.counters, num_real_reqs=self.num_real_reqs,
            skip_io=config.skip_io, out=selections, topk_sources=None,
            residency_tables=self.residency.resolver_tables if self.residency is not None else {},
            reuse_levels=reuse_levels_for(device) if config.replacement == "reuse" else None,
            layer_rows=self.mirror.layer_rows, compress_ratio=C4_RATIO)
        self._steps = C4Steps(rows=self.rows, hot=self.hot, mirror=self.mirror, residency=self.residency,
                              req_to_token=req_to_token)
        self.report = C4Report(allocator=self.allocator, hot=self.hot, mirror=self.mirror, residency=self.residency,
                               counters=self.counters)
        logger.info("sglang-hisparse coordinator (DeepSeek-V4 C4 layers): B=%d entries, top_k=%d, C4 layers=%d, "
                    "resolver=%s, %d C4 device rows, %d host rows; residency %s", device_buffer_size, top_k,
                    self.device_pool.layer_num, resolver.name, self.rows.device_size, self.mirror.pool.capacity_tokens,
                    residency_label(config))

    # --- small protocol members --------------------------------------------------------------
    def set_decode_producer_stream(self, stream) -> None:
        self._producer_stream = stream
        self.mirror.producer_stream = stream

    def has_ongoing_staging(self) -> bool:
        return self.mirror.staged_count() > 0

    def host_token_len(self, kv_allocated_len: int) -> int:
        """Host rows of a request with ``kv_allocated_len`` tokens: its completed entries."""
        return kv_allocated_len // C4_RATIO

    def get_token_stats(self) -> HiSparseTokenStats:
        return token_stats(self.rows, self.mirror.pool)

    def destroy(self) -> None:
        self.mirror.drain()

    def export_to(self, export, interval: int = 40) -> None:
        """--enable-metrics: publish our series to ``export`` (:meth:`C4Report.export_to`)."""
        self.report.export_to(export, interval)

    def idle_report(self) -> Optional[str]:
        """The idle line once per busy -> idle transition (:meth:`C4Report.idle_report`)."""
        return self.report.idle_report()

    def _entries(self, req, tokens: int) -> torch.Tensor:
        """Compressed ids (int64) of the entries its first ``tokens`` tokens complete (no host wait)."""
        return prefix_entry_ids(self.req_to_token_pool.req_to_token[req.req_pool_idx], tokens)

    # --- into decode -------------------------------------------------------------------------
    def admit_request_into_staging(self, req) -> None:
        """After prefill: copy the request's entries (every C4 layer) to host rows, off the critical path."""
        self.report.busy()
        self.mirror.stage(req, self.rows.device_rows_of(self._entries(req, req.extend_range.end)))

    def collect_ready_reqs(self) -> List[Any]:
        """Staged requests, in order, whose copy finished on every rank (MIN all-reduce over the
        attention TP group), each moved into a hot buffer made of its first prefill pages."""
        if not self.mirror.staged_count():
            return []
        copied = self.mirror.staging.copied_prefix(block=self.config.wait_for_staging)
        ready = []
        for req in copied[: agreed_count(len(copied), self.tp_group)]:
            self._enter_decode(req)
            self.mirror.staging.pop()
            ready.append(req)
        return ready

    def _enter_decode(self, req) -> None:
        """With residency and room the request keeps its prefill rows (resident); otherwise its
        hot buffer opens from its prefill pages (no free row needed) and a long request's newest
        entry is loaded into slot B from its host row (staged: complete)."""
        idx, entries = req.req_pool_idx, self._entries(req, req.kv.kv_allocated_len)
        E, B = entries.numel(), self.hot.buffer_size
        if self.residency is not None and self.residency.admit(idx, entries):
            return  # its prefill rows stay mapped: every entry on the device
        if E == 0:
            self.hot.open_empty(idx)
            return
        if self.hot.open(idx, entries, filled=True) is None:
            raise HiSparsePluginError(f"sglang-hisparse: request {req.rid} could not keep its own C4 rows as its hot buffer")
        if E > B:
            self.mirror.load(idx, torch.tensor([E - 1]), self.hot.slot_rows[idx, B:B + 1].to(torch.int64))

    def admit_request_direct(self, req) -> None:
        """PD decode: the prefill wrote the request's entries into the host rows SGLang allocated
        (``alloc_paged_token_slots``, ``host_token_len``). With residency and room: rows of its own,
        every entry loaded. Else a hot buffer of new rows: all entries loaded when ``E <= B``, else
        only the newest, into slot ``B`` (where the resolver reads entry ``E - 1``), so no slot is
        read before it holds its entry. HiSparsePluginError when no rows are free (the PD budget,
        free and reclaimable rows // ``padded_buffer_size``, should prevent it)."""
        self.report.busy()
        idx, E, B = req.req_pool_idx, self.host_token_len(req.kv.kv_allocated_len), self.hot.buffer_size
        self.mirror.mark_transferred(idx, E)
        entries = self._entries(req, req.kv.kv_allocated_len)
        own = self.residency.admit_loaded(idx, entries) if self.residency is not None else None
        if own is not None:  # resident: every entry loaded into rows of its own
            self.mirror.load(idx, torch.arange(E), own)
            return
        if E == 0:
            self.hot.open_empty(idx)
            return
        rows = self.hot.open(idx, entries, filled=E <= B, mapped=False)
        if rows is None and self.residency is not None:
            self.residency.reclaim(self.hot.padded)
            rows = self.hot.open(idx, entries, filled=E <= B, mapped=False)
        if rows is None:
            raise HiSparsePluginError(
                f"sglang-hisparse: no C4 rows for the hot buffer of request {req.rid} ({self.allocator.debug_print()}); "
                "the PD admission budget should prevent this")
        if E <= B:
            self.mirror.load(idx, torch.arange(E), rows[:E])
        else:
            self.mirror.load(idx, torch.tensor([E - 1]), self.hot.slot_rows[idx, B:B + 1].to(torch.int64))

    # --- decode steps --------------------------------------------------------------------------
    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu) -> None:
        """Before a decode step: back up the previous step's new entries, map this step's
        (:meth:`C4Steps.map_one_step`)."""
        self.report.busy()
        self.report.note_decode_step()
        self._steps.map_one_step(out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu)

    def wait_for_pending_backup(self) -> None:
        """Order the forward after the last backup copy (the invariant of C4Mirror)."""
        self.mirror.order_forward()

    def device_rows_short(self, req_pool_indices: list[int], committed_lens: list[int]) -> int:
        """C4 rows the next decode step lacks, after every demotion that could help (:meth:`C4Steps.rows_short`)."""
        return self._steps.rows_short(req_pool_indices, committed_lens)

    def swap_in_selected_pages(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id: int) -> torch.Tensor:
        """One C4 layer's top-k entries (raw compressed positions; ``compressed_seq_lens``: each
        request's completed entries) -> device rows, int32 [num_reqs, top_k]. ``layer_id``: the C4
        layer index (``compress_layer_id``). SGLang's V4 indexer passes every argument by keyword."""
        return self._layers(layer_id, req_pool_indices, compressed_seq_lens, top_k_result)

    # --- leaving -----------------------------------------------------------------------------
    def request_finished(self, req) -> None:
        """Free everything the request holds here (idempotent): a staged request's prefill rows
        and host rows; a decoding one's hot buffer, host rows and mapped entries."""
        idx = req.req_pool_idx
        if idx is None:
            return
        self.report.busy()
        if self.mirror.is_staged(req):
            self.mirror.staging.drop(req)
            self.rows.free_prefill_rows(self._entries(req, req.extend_range.end))
            self.mirror.forget(idx)
            return
        self._wait_for_producer()  # the overlapped forward may still read its rows
        self.mirror.order_after_copies()
        if self.residency is not None and self.residency.residency.holds(idx):
            # its entries stay mapped to its rows: SGLang's free of its token ids, which follows,
            # frees them (C4Allocator.free)
            self.residency.residency.release(idx)
        else:
            self.rows.unmap_logical(self._entries(req, req.kv.kv_allocated_len))
            self.hot.close(idx)
        self.mirror.forget(idx)

    def retract_req(self, req) -> None:
        self.request_finished(req)

    def _wait_for_producer(self) -> None:
        """Order the current stream after the overlapped forward in flight (if any)."""
        order_current_after(self._producer_stream, self.num_real_reqs.device)
