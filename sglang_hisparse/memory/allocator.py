"""Dual address space allocator: logical ids for the scheduler, device rows for the GPU.

* Logical space: ``device_size x host_to_device_ratio`` ids. They are what ``req_to_token``
  stores and what the scheduler's capacity accounting counts; every logical id of a decoding
  request has a host slot (owned by the host pool, allocated by the coordinator).
* Device space: ``device_size`` rows of the device KV pool. A request holds device rows for its
  prefill (until staging completes) and then only its hot buffer.
* ``logical_to_device``: logical id -> device row, 0 = not on device. Written at prefill
  (``alloc_extend``), cleared when a request's rows move into its hot buffer, and pointed at the
  reserved newest slot for the token being decoded. The last entry is -1 so that translating a
  last_loc of -1 gives -1.

Ownership: this allocator owns the logical free list and the mapping; the device rows (their
free list and the ``hot_owned`` mask: ``free`` never releases a row a hot buffer owns) belong to
its :class:`~sglang_hisparse.memory.device_rows.DeviceRows`. Hot-buffer tables belong to the
coordinator's hot buffers, host slots to the host pool.

Admission (``available_size``) counts the logical space, the host pool (every logical id will
need a host slot) and the free device rows (with residency, plus the rows demoting resident
requests would free). A request is charged the rows it holds: its prefill's rows, then its own
rows while resident or at most one hot buffer (``min(round_up(context), padded)``), never a
buffer it does not use; SGLang's admission adds its own estimate of every request's growth, as
without HiSparse, so this server admits at least what the same pool admits without HiSparse. A
request that does not fit waits in SGLang's queue. Growth takes free rows page by page; whether
the next decode step's pages are free is checked before the step (``decode_memory_check`` seam),
and SGLang retracts requests when they are not, as it does without HiSparse.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from sglang_hisparse.memory.device_rows import DeviceRows
from sglang_hisparse.memory.paging import DecodeIds, PageAllocator
from sglang_hisparse.resolver.jit import decode_module
from sglang_hisparse.stats import HostTime, timed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Budget:
    """A read-only ``available_size()``: what SGLang's PD decode path reads off the two
    sub-allocators of a HiSparse allocator (``logical_attn_allocator``, ``hisparse_attn_allocator``)."""

    available_size: Callable[[], int]


class HiSparseAllocator(BaseTokenToKVPoolAllocator):
    """Replaces SGLang's ``HiSparseTokenToKVPoolAllocator`` (same constructor)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache,
        need_sort: bool,
        host_to_device_ratio: int = 2,
        debug: bool = False,
    ):
        if size % page_size:
            raise ValueError(f"device pool size {size} is not a multiple of page size {page_size}")
        self.device_size = size
        self.logical_size = size * host_to_device_ratio
        self.host_to_device_ratio = host_to_device_ratio
        super().__init__(self.logical_size, page_size, dtype, device, kvcache, need_sort)
        self.compress_ratio = 1  # SGLang reads this off HiSparse allocators
        self.logical = PageAllocator(self.logical_size // page_size, page_size, device, debug)
        self.rows = DeviceRows(size, page_size, device, debug)
        self.logical_to_device = torch.zeros(self.logical_size + page_size + 1, dtype=torch.int64, device=device)
        self.logical_to_device[-1] = -1
        self.page_resident = torch.zeros(self.logical_to_device.numel() // page_size + 1, dtype=torch.uint8,
                                         device=device)
        """Per logical page, 1 while it belongs to a resident request (its ids map to one page of
        rows, offset for offset): the device pool maps such a page's new ids inside the forward
        (``HiSparseDevicePool.map_resident_writes``). Set by ``Residency``; cleared by ``Residency``
        at demotion and by :meth:`free` for the pages of freed ids (a finishing resident request's
        marks stay until SGLang frees its ids, which always follows)."""
        self.hot_buffer_rows = 0
        self.host_capacity: Optional[int] = None
        self._limited_by: Optional[str] = None
        self._reclaim: Callable[[int], None] = lambda rows: None
        self._reclaimable: Callable[[], int] = lambda: 0
        self._logical_only = False
        self.last_decode: Optional[DecodeIds] = None
        """The last :meth:`alloc_decode`'s ids, page starts and new logical pages (read by the
        coordinator's ``map_last_loc_to_buffer`` of the same step)."""
        self.host_time = HostTime()
        """Our host time per decode step, by part (shared with the coordinator's stats)."""
        self.kvcache = kvcache
        kvcache.attach_mapping(self.logical_to_device)

    # --- configuration by the coordinator ----------------------------------------------------
    def configure(self, hot_buffer_rows: int, host_capacity_tokens: int) -> None:
        """Set the most rows a hot buffer holds (``padded``) and the host pool's capacity."""
        self.hot_buffer_rows = hot_buffer_rows
        self.host_capacity = host_capacity_tokens

    def set_reclaimer(self, reclaim: Callable[[int], None], reclaimable: Callable[[], int]) -> None:
        """Residency: ``reclaimable()`` device rows can be freed on demand by demoting resident
        requests, and ``reclaim(rows)`` does so until ``rows`` are free (or nothing is left).
        Admission counts them as room; a prefill that needs them reclaims them first."""
        self._reclaim, self._reclaimable = reclaim, reclaimable

    @contextlib.contextmanager
    def logical_only(self) -> Iterator[None]:
        """Within the block ``alloc`` and ``alloc_extend`` hand out logical ids only, no device
        rows: a speculative decode step allocates its verify window through them, and the
        coordinator maps the window's ids to hot-buffer slots (``begin_verify_step``)."""
        self._logical_only = True
        try:
            yield
        finally:
            self._logical_only = False

    def _device_room_for(self, rows: int) -> bool:
        """Whether ``rows`` device rows are free, demoting resident requests if needed."""
        if rows > self.rows.room():
            self._reclaim(rows)
        return rows <= self.rows.room()

    # --- SGLang's allocator protocol ---------------------------------------------------------
    @property
    def size_full(self) -> int:
        return self.logical_size

    @property
    def logical_attn_allocator(self) -> Budget:
        """PD decode admission (tokens): logical ids net of the host rows they will need."""
        return Budget(self.decode_available_size)

    @property
    def hisparse_attn_allocator(self) -> Budget:
        """PD decode admission (hot buffers): free device rows (and what demoting resident
        requests frees); SGLang divides it by ``padded_buffer_size``, one full hot buffer per
        request it admits."""
        return Budget(lambda: self.rows.room() + self._reclaimable())

    def debug_print(self) -> str:
        return (
            f"#logical free: {self.logical.available_tokens()}/{self.logical_size}, "
            f"#device free: {self.rows.pages.available_tokens()}/{self.device_size}, "
            f"host capacity {self.host_capacity}"
        )

    def logical_used(self) -> int:
        return self.logical_size - self.logical.available_tokens()

    def decode_available_size(self) -> int:
        """Logical ids that can still be handed out without running out of host slots."""
        logical_free = self.logical.available_tokens()
        host_room = logical_free if self.host_capacity is None else self.host_capacity - self.logical_used()
        return max(0, min(logical_free, host_room))

    def device_admission_room(self) -> int:
        """Device rows a new request may take for its prefill: the free rows and those that
        demoting resident requests would free (a prefill reclaims them, ``alloc_extend``)."""
        return self.rows.room() + self._reclaimable()

    def available_size(self) -> int:
        logical_free = self.logical.available_tokens()
        decode_room = self.decode_available_size()
        device_room = self.device_admission_room()
        room = max(0, min(decode_room, device_room))
        limited_by = None
        if room < logical_free:
            limited_by = "host pool" if decode_room <= device_room else "device pool (hot buffers)"
        if limited_by != self._limited_by:
            if limited_by is not None:
                logger.info(
                    "sglang-hisparse: admission limited by the %s: %d tokens admissible (%s)",
                    limited_by, room, self.debug_print(),
                )
            self._limited_by = limited_by
        return room

    def clear(self) -> None:
        self.logical.clear()
        self.rows.clear()
        self.logical_to_device[:-1].zero_()
        self.is_not_in_free_group = True
        self.free_group = []

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Logical ids with device rows for ``need_size`` tokens (whole pages; no rows inside
        :meth:`logical_only`)."""
        if need_size > self.logical.available_tokens():
            return None
        if self._logical_only:
            return self.logical.alloc_tokens(need_size)
        if not self._device_room_for(need_size):
            return None
        logical = self.logical.alloc_tokens(need_size)
        rows = self.rows.pages.alloc_tokens(need_size)
        self.logical_to_device[logical] = rows
        return logical

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Prefill: logical ids plus device rows (same in-page offsets), mapped one to one (logical
        ids only inside :meth:`logical_only`)."""
        pages = self.logical.pages_needed(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist())
        if pages > self.logical.available_pages():
            return None
        if self._logical_only:
            return self.logical.extend(prefix_lens_cpu, seq_lens_cpu, last_loc)
        if not self._device_room_for(pages * self.page_size):
            return None
        logical = self.logical.extend(prefix_lens_cpu, seq_lens_cpu, last_loc)
        rows = self.rows.pages.extend(prefix_lens_cpu, seq_lens_cpu, self.logical_to_device[last_loc])
        assert logical is not None and rows is not None
        self.logical_to_device[logical] = rows
        return logical

    def alloc_logical_only(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Logical ids only (PD decode: the KV arrives directly in host memory)."""
        return self.logical.extend(prefix_lens_cpu, seq_lens_cpu, last_loc)

    @timed("alloc")
    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """One logical id per request; the coordinator maps it to its row. Side effect: the step's
        page starts are kept in :attr:`last_decode` for the coordinator's ``map_last_loc_to_buffer``."""
        step = self.logical.decode(seq_lens_cpu.tolist(), last_loc)
        self.last_decode = step
        return None if step is None else step.ids

    def free(self, free_index: torch.Tensor) -> None:
        """Release logical ids, and the device rows still mapped to them that no hot buffer owns;
        the freed ids' pages are no longer resident (a finishing resident request leaves its marks
        to this free: ``Residency.release``)."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        free_index = free_index.long()  # SGLang frees req_to_token's int32 ids; index_fill_ takes int64
        self.rows.free_unowned(self.logical_to_device[free_index])
        self.logical_to_device.index_fill_(0, free_index, 0)  # index_fill_: no scalar copied to the device
        self.page_resident.index_fill_(0, free_index // self.page_size, 0)
        self.logical.free_tokens(free_index)

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs

    # --- hot buffers (called by the coordinator) ---------------------------------------------
    def device_rows_of(self, logical_ids: torch.Tensor) -> torch.Tensor:
        return self.logical_to_device[logical_ids]

    def resident_rows_of(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ids on resident pages, from their pages' first ids (mapped by the host): the
        ids past a page's first may be mapped only by a forward still in flight."""
        offset = logical_ids % self.page_size
        return self.logical_to_device[logical_ids - offset] + offset

    def take_hot_buffer(self, logical_ids: torch.Tensor, keep_tokens: int, *, mapped: bool = True) -> Optional[torch.Tensor]:
        """Turn a request's device rows into its hot buffer (``DeviceRows.take_hot_buffer``) and
        clear the mapping of its ``logical_ids`` (positions ``0..n-1``, page aligned from 0).
        ``mapped``: its ids are mapped to rows (a prefill's), else none is (PD, logical ids only).
        Returns the kept rows (int64 [keep_tokens]) or None, changing nothing."""
        p = self.page_size
        assert keep_tokens % p == 0 and 0 < keep_tokens <= self.hot_buffer_rows
        page_starts = self.logical_to_device[logical_ids][::p]
        assert page_starts.numel() * p >= keep_tokens, "fewer positions than the kept rows"
        rows = self.rows.take_hot_buffer(page_starts, keep_tokens, mapped=mapped)
        if rows is not None and mapped:
            self.logical_to_device.index_fill_(0, logical_ids, 0)
        return rows

    def grow_hot_buffer(self, n_tokens: int) -> Optional[torch.Tensor]:
        """Free rows for a short hot buffer's next page(s), or None when they are not free."""
        return self.rows.grow_hot_buffer(n_tokens)

    def release_hot_buffer(self, rows: torch.Tensor) -> None:
        """Free a hot buffer's rows. The caller first unmaps (or frees) the request's logical
        ids: a mapping left pointing at a released row would let a later ``free`` release it a
        second time."""
        self.rows.release_hot_buffer(rows)

    def map_logical(self, logical_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Point logical ids at device rows (the token being decoded -> its hot-buffer row)."""
        self.logical_to_device[logical_ids] = rows.to(torch.int64)

    def enable_resident_pages(self) -> None:
        """Residency is on: the device pool maps resident pages' new ids inside the forward."""
        self.kvcache.attach_mapping(self.logical_to_device, self.page_resident)

    def map_new_pages(self, logical_pages: torch.Tensor, row_pages: torch.Tensor) -> None:
        """A resident step's new pages: map each logical page's first id to its row page's first
        row and mark the logical page resident (the forward maps the page's later ids). On CUDA one
        kernel (``kernels/decode.cuh``, ``map_pages``), elsewhere its torch twin."""
        if self.logical_to_device.is_cuda:
            decode_module().map_pages(logical_pages, row_pages, self.logical_to_device, self.page_resident,
                                      self.page_size)
            return
        map_new_pages_torch(logical_pages, row_pages, self.logical_to_device, self.page_resident, self.page_size)

    def mark_resident_pages(self, logical_ids: torch.Tensor, resident: bool) -> None:
        """Mark the logical pages holding ``logical_ids`` as resident or not (``page_resident``)."""
        self.page_resident.index_fill_(0, logical_ids // self.page_size, int(resident))

    def unmap_logical(self, logical_ids: torch.Tensor) -> None:
        """Clear the mapping of ``logical_ids`` (int64). ``index_fill_``: ``x[ids] = 0`` would copy
        the scalar to the device from pageable memory, which waits for the stream."""
        self.logical_to_device.index_fill_(0, logical_ids, 0)

    def free_prefill_rows(self, logical_ids: torch.Tensor) -> None:
        """Free the device rows of a request still in staging (abort) and clear its mapping."""
        self.rows.free_unowned(self.logical_to_device[logical_ids])
        self.logical_to_device.index_fill_(0, logical_ids, 0)


def map_new_pages_torch(logical_pages: torch.Tensor, row_pages: torch.Tensor, logical_to_device: torch.Tensor,
                        page_resident: torch.Tensor, page_size: int) -> None:
    """The torch twin (and oracle) of the ``map_pages`` kernel (:meth:`HiSparseAllocator.map_new_pages`)."""
    logical_to_device[logical_pages * page_size] = row_pages * page_size
    page_resident.index_fill_(0, logical_pages, 1)
