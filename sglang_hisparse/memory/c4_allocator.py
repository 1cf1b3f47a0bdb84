"""DeepSeek-V4: the allocator SGLang calls, over two address spaces of different grain.

DeepSeek-V4 mixes layer kinds (``compress_ratios``): every layer keeps a sliding window (SWA) of
token KV, ratio-128 layers a dense compressed KV, ratio-4 (C4) layers a compressed KV of one entry
per 4 tokens that attention reads sparsely (top-k entries). Only the C4 attention KV goes through
HiSparse (docs/design.md, "DeepSeek-V4"); everything else stays on the device as SGLang lays it out.

* Token logical ids: SGLang's SWA allocator (``logical_attn_allocator``, built by SGLang, pages
  of 256 tokens) hands them out and frees them; this class delegates every token-level call.
* C4 entries: entry ``k`` of a request completes at its token ``4k + 3``; its compressed logical
  id is that token's id divided by 4 (a 256-token logical page is a 64-entry compressed page, the
  in-page offsets agree). :class:`C4Rows` owns the C4 device rows (pages of 64 entries), the
  compressed id -> device row mapping and the hot-buffer methods the coordinator's hot buffers
  call; the C4 device pool translates the compressor's writes through the same mapping.

A prefill's completed entries get device rows (same in-page offsets) with its token ids; a decode
step's token ids are logical only (the coordinator maps a completed entry to its hot-buffer slot).
``free`` releases token ids and the device rows still mapped to their entries that no hot buffer
owns: a request that finishes at prefill, or is aborted in staging, gives its rows back here.

Ownership: the SWA allocator owns token ids; :class:`C4Rows` the C4 rows and the mapping; the
host capacity (entries) is set by the coordinator (:meth:`configure`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from sglang.srt.mem_cache.allocator.hisparse import DeepSeekV4HiSparseTokenToKVPoolAllocator

from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.allocator_room import Budget
from sglang_hisparse.memory.device_rows import DeviceRows
from sglang_hisparse.memory.row_mapping import HotBufferRows, LogicalMap
from sglang_hisparse.resolver.c4_rows import C4_PAGE_ENTRIES, C4_RATIO, completed_entry_ids

__all__ = ["C4Allocator", "C4Rows", "C4_RATIO", "completed_entry_ids"]


class C4Rows(HotBufferRows):
    """The C4 device rows in the compressed address space: free rows and hot-buffer ownership
    (``rows``, pages of 64 entries), the compressed id -> row mapping (``mapping``), and the
    hot-buffer methods of :class:`HotBufferRows` (``page_size`` 64 is the hot buffers' page)."""

    def __init__(self, device_rows: int, logical_entries: int, kvcache, device: torch.device | str,
                 debug: bool = False):
        self.page_size = C4_PAGE_ENTRIES
        self.rows = DeviceRows(device_rows, C4_PAGE_ENTRIES, device, debug)
        self.mapping = LogicalMap(logical_entries, C4_PAGE_ENTRIES, device)
        self.kvcache = kvcache
        self.hot_buffer_rows = 0
        self.device_size = device_rows

    def debug_print(self) -> str:
        return f"#C4 rows free: {self.rows.room()}/{self.device_size}"


class C4Allocator(DeepSeekV4HiSparseTokenToKVPoolAllocator):
    """Replaces SGLang's ``DeepSeekV4HiSparseTokenToKVPoolAllocator`` (same constructor: the SWA
    allocator SGLang built; subclassed because SGLang's schedule policy and chunk cache check the
    class with ``isinstance``; none of its behaviour is inherited)."""

    def __init__(self, logical_attn_allocator, debug: bool = False):
        kvcache = logical_attn_allocator._kvcache
        c4_pool = getattr(kvcache, "c4_kv_pool", None)
        if c4_pool is None or not hasattr(c4_pool, "attach_mapping"):
            raise HiSparsePluginError(
                "sglang-hisparse: DeepSeek-V4's C4 KV pool is not ours (SGLang built "
                f"{type(c4_pool).__name__}); the c4_device_pool seam did not take effect")
        self.logical_attn_allocator = logical_attn_allocator
        self._kvcache = kvcache
        self.hisparse_kvcache = c4_pool
        self.compress_ratio = C4_RATIO
        self.page_size = logical_attn_allocator.page_size  # SGLang's token page (256)
        self.hisparse_page_size = C4_PAGE_ENTRIES
        self.dtype, self.device = c4_pool.dtype, c4_pool.device
        self.need_sort = logical_attn_allocator.need_sort
        self.c4 = C4Rows(c4_pool.size, kvcache.c4_logical_size, c4_pool, self.device, debug)
        c4_pool.attach_mapping(self.c4.mapping.logical_to_device)
        self.host_capacity_entries: Optional[int] = None
        self.host_entries_used = lambda: 0
        self._reclaim: Callable[[int], None] = lambda rows: None
        self._reclaimable: Callable[[], int] = lambda: 0
        self.is_not_in_free_group = True
        self.free_group = []

    # --- configuration by the coordinator ----------------------------------------------------
    def configure(self, hot_buffer_rows: int, host_capacity_entries: int, host_entries_used) -> None:
        """Rows a hot buffer holds, and the host pool's capacity and use (entries), for admission."""
        self.c4.hot_buffer_rows = hot_buffer_rows
        self.host_capacity_entries = host_capacity_entries
        self.host_entries_used = host_entries_used

    def set_reclaimer(self, reclaim: Callable[[int], None], reclaimable: Callable[[], int]) -> None:
        """Residency of C4 entries: ``reclaimable()`` C4 rows can be freed on demand by demoting
        resident requests, and ``reclaim(rows)`` does so until ``rows`` are free (or none is left).
        Admission counts them as free; a prefill short of rows reclaims them first."""
        self._reclaim, self._reclaimable = reclaim, reclaimable

    # --- token-level protocol: the SWA allocator's -------------------------------------------
    @property
    def size_full(self) -> int:
        return self.logical_attn_allocator.size_full

    @property
    def size(self) -> int:
        return self.logical_attn_allocator.size

    @property
    def size_swa(self) -> int:
        return self.logical_attn_allocator.size_swa

    @property
    def full_to_swa_index_mapping(self):
        return self.logical_attn_allocator.full_to_swa_index_mapping

    def get_kvcache(self):
        return self._kvcache

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor):
        return self.logical_attn_allocator.translate_loc_from_full_to_swa(kv_indices)

    def swa_available_size(self) -> int:
        return self.logical_attn_allocator.swa_available_size()

    def free_swa(self, free_indices: torch.Tensor) -> None:
        self.logical_attn_allocator.free_swa(free_indices)

    def debug_print(self) -> str:
        return f"{self.logical_attn_allocator.debug_print()}{self.c4.debug_print()}, host {self._host_room()} entries free"

    # --- admission ---------------------------------------------------------------------------
    @property
    def hisparse_attn_allocator(self) -> Budget:
        """PD decode admission reads ``available_size()`` here (free C4 rows and those demoting
        resident requests would free; SGLang divides it by ``padded_buffer_size``, one hot buffer
        per request it admits)."""
        return Budget(lambda: self.c4.rows.room() + self._reclaimable())

    def _host_room(self) -> int:
        if self.host_capacity_entries is None:
            return 1 << 62
        return self.host_capacity_entries - self.host_entries_used()

    def _c4_token_room(self) -> int:
        """Tokens whose entries fit the free C4 rows (with those demotions would free) and the
        free host rows."""
        return C4_RATIO * min(self.c4.rows.room() + self._reclaimable(), self._host_room())

    def full_available_size(self) -> int:
        return min(self.logical_attn_allocator.full_available_size(), self._c4_token_room())

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self._c4_token_room())

    # --- allocation --------------------------------------------------------------------------
    def alloc(self, need_size: int):
        raise HiSparsePluginError("sglang-hisparse: DeepSeek-V4 allocates through alloc_extend / alloc_decode only")

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        """Prefill: token ids from the SWA allocator and a device row for every entry the
        extension completes (same in-page offsets as its compressed id). None, nothing taken, when
        either does not fit."""
        prefix_c, seq_c = prefix_lens_cpu // C4_RATIO, seq_lens_cpu // C4_RATIO
        pages = self.c4.rows.pages
        needed = pages.pages_needed(prefix_c.tolist(), seq_c.tolist())
        if needed > pages.available_pages():
            self._reclaim(needed * C4_PAGE_ENTRIES)  # demote resident requests (none: nothing happens)
        if needed > pages.available_pages():
            return None
        ids = self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                       last_loc, extend_num_tokens)
        if ids is None:
            return None
        rows = pages.extend(prefix_c, seq_c, self._last_entry_rows(last_loc, prefix_lens))
        assert rows is not None, "C4 rows were checked free"
        self.c4.mapping.map(completed_entry_ids(ids), rows)
        return ids

    def _last_entry_rows(self, last_loc: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
        """Device row of each request's last completed entry before the extension (any value for
        an empty prefix): the row of its token ``4 * (prefix // 4) - 1``, found from ``last_loc``
        (the token ``prefix - 1``) and the prefix's offset mod 4."""
        last_loc = last_loc.to(torch.int64)
        back = prefix_lens.to(last_loc.device, torch.int64) % C4_RATIO
        entry_ids = ((last_loc - back - (C4_RATIO - 1)) // C4_RATIO).clamp(min=0)
        return self.c4.mapping.rows_of(entry_ids)

    def alloc_extend_swa_tail(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                              extend_num_tokens, swa_tail_len):
        """PD decode: token ids for a transferred prompt (its C4 KV goes to host rows directly)."""
        return self.logical_attn_allocator.alloc_extend_swa_tail(
            prefix_lens=prefix_lens, prefix_lens_cpu=prefix_lens_cpu, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
            last_loc=last_loc, extend_num_tokens=extend_num_tokens, swa_tail_len=swa_tail_len)

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        """PD decode: token ids only."""
        return self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                        last_loc, extend_num_tokens)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        """One token id per request (the coordinator maps a completed entry to its slot)."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    # --- release -----------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        """Release token ids, and the C4 rows their entries are still mapped to that no hot buffer
        owns (a prefill's rows: a request finishing at prefill, or aborted in staging)."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        entries = completed_entry_ids(free_index)
        self.c4.rows.free_unowned(self.c4.mapping.rows_of(entries))
        self.c4.mapping.forget(entries)  # and the resident marks of their pages
        self.logical_attn_allocator.free(free_index)

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.c4.rows.clear()
        self.c4.mapping.clear()
        self.is_not_in_free_group = True
        self.free_group = []

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return (last_locs - (C4_RATIO - 1)) // C4_RATIO
