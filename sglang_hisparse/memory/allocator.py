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

Ownership: this allocator owns the logical free list; the mapping and the resident page marks
belong to its :class:`~sglang_hisparse.memory.row_mapping.LogicalMap` (``mapping``), the device
rows (their free list and the ``hot_owned`` mask: ``free`` never releases a row a hot buffer owns)
to its :class:`~sglang_hisparse.memory.device_rows.DeviceRows` (``rows``), the admission numbers
(host capacity, reclaimer) to its :class:`~sglang_hisparse.memory.allocator_room.AllocatorRoom`
(``room``). The methods the coordinator calls come from
:class:`~sglang_hisparse.memory.row_mapping.HotBufferRows`. Hot-buffer tables belong to the
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
from typing import Callable, Iterator, Optional

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from sglang_hisparse.memory.allocator_room import AllocatorRoom, Budget
from sglang_hisparse.memory.device_rows import DeviceRows
from sglang_hisparse.memory.paging import DecodeIds, PageAllocator
from sglang_hisparse.memory.row_mapping import HotBufferRows, LogicalMap, map_new_pages_torch
from sglang_hisparse.stats import HostTime, timed

__all__ = ["Budget", "HiSparseAllocator", "map_new_pages_torch"]


class HiSparseAllocator(HotBufferRows, BaseTokenToKVPoolAllocator):
    """Replaces SGLang's ``HiSparseTokenToKVPoolAllocator`` (same constructor): SGLang's allocator
    protocol and admission here, the coordinator's methods in :class:`HotBufferRows`."""

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
        self.mapping = LogicalMap(self.logical_size, page_size, device)
        self.room = AllocatorRoom(self.logical, self.rows, self.logical_size, self.debug_print)
        self.hot_buffer_rows = 0
        self._logical_only = False
        self.last_decode: Optional[DecodeIds] = None
        """The last :meth:`alloc_decode`'s ids, page starts and new logical pages (read by the
        coordinator's ``map_last_loc_to_buffer`` of the same step)."""
        self.host_time = HostTime()
        """Our host time per decode step, by part (shared with the coordinator's stats)."""
        self.kvcache = kvcache
        kvcache.attach_mapping(self.mapping.logical_to_device)

    # --- configuration by the coordinator ----------------------------------------------------
    def configure(self, hot_buffer_rows: int, host_capacity_tokens: int) -> None:
        """Set the most rows a hot buffer holds (``padded``) and the host pool's capacity."""
        self.hot_buffer_rows = hot_buffer_rows
        self.room.host_capacity = host_capacity_tokens

    @property
    def host_capacity(self) -> Optional[int]:
        """The host pool's capacity in tokens (None until :meth:`configure`; owned by ``room``)."""
        return self.room.host_capacity

    def set_reclaimer(self, reclaim: Callable[[int], None], reclaimable: Callable[[], int]) -> None:
        """Residency: ``reclaimable()`` device rows can be freed on demand by demoting resident
        requests, and ``reclaim(rows)`` does so until ``rows`` are free (or nothing is left).
        Admission counts them as room; a prefill that needs them reclaims them first."""
        self.room.set_reclaimer(reclaim, reclaimable)

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
        return Budget(self.room.device_room)

    def debug_print(self) -> str:
        return (
            f"#logical free: {self.logical.available_tokens()}/{self.logical_size}, "
            f"#device free: {self.rows.pages.available_tokens()}/{self.device_size}, "
            f"host capacity {self.host_capacity}"
        )

    def logical_used(self) -> int:
        return self.room.logical_used()

    def decode_available_size(self) -> int:
        """Logical ids that can still be handed out without running out of host slots."""
        return self.room.decode_room()

    def device_admission_room(self) -> int:
        """Device rows a new request may take for its prefill: the free rows and those that
        demoting resident requests would free (a prefill reclaims them, ``alloc_extend``)."""
        return self.room.device_room()

    def available_size(self) -> int:
        """Tokens SGLang may admit (``AllocatorRoom.available``; logs what limits it)."""
        return self.room.available()

    def clear(self) -> None:
        self.logical.clear()
        self.rows.clear()
        self.mapping.clear()
        self.is_not_in_free_group = True
        self.free_group = []

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Logical ids with device rows for ``need_size`` tokens (whole pages; no rows inside
        :meth:`logical_only`)."""
        if need_size > self.logical.available_tokens():
            return None
        if self._logical_only:
            return self.logical.alloc_tokens(need_size)
        if not self.room.make_room(need_size):
            return None
        logical = self.logical.alloc_tokens(need_size)
        rows = self.rows.pages.alloc_tokens(need_size)
        self.mapping.map(logical, rows)
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
        if not self.room.make_room(pages * self.page_size):
            return None
        logical = self.logical.extend(prefix_lens_cpu, seq_lens_cpu, last_loc)
        rows = self.rows.pages.extend(prefix_lens_cpu, seq_lens_cpu, self.mapping.rows_of(last_loc))
        assert logical is not None and rows is not None
        self.mapping.map(logical, rows)
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
        self.release_device_rows(free_index)
        self.logical.free_tokens(free_index)

    def release_device_rows(self, logical_ids: torch.Tensor) -> None:
        """The device rows mapped to ``logical_ids`` that no hot buffer owns go back to the free
        list; the ids stay allocated, unmapped, their pages no longer resident (the prefix cache
        adopting a finished request's ids: it keeps their KV in host rows only)."""
        logical_ids = logical_ids.long()
        self.rows.free_unowned(self.mapping.rows_of(logical_ids))
        self.mapping.forget(logical_ids)

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs
