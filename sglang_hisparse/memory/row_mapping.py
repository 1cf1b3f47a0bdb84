"""Logical ids -> device rows: the mapping (:class:`LogicalMap`) and the allocator's methods that
move device rows and the mapping together for the coordinator, its hot buffers and residency
(:class:`HotBufferRows`, a mixin of :class:`~sglang_hisparse.memory.allocator.HiSparseAllocator`).

Owned state (one owner: :class:`LogicalMap`, held by the allocator as ``mapping``):

* ``logical_to_device``: logical id -> device row, 0 = not on device. Written at prefill
  (``alloc_extend``), cleared when a request's rows move into its hot buffer, and pointed at the
  reserved newest slot for the token being decoded. The last entry is -1 so that translating a
  last_loc of -1 gives -1.
* ``page_resident``: per logical page, 1 while it belongs to a resident request.

Both tensors are allocated once and only written in place: the device pool holds them too
(``attach_mapping``), so they are never rebound. :class:`HotBufferRows` owns no state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang_hisparse.memory.device_rows import DeviceRows
from sglang_hisparse.resolver.jit import decode_module


class LogicalMap:
    """The logical id -> device row table and the resident marks of the logical pages."""

    def __init__(self, logical_size: int, page_size: int, device: torch.device | str):
        self.page_size = page_size
        self.logical_to_device = torch.zeros(logical_size + page_size + 1, dtype=torch.int64, device=device)
        self.logical_to_device[-1] = -1
        self.page_resident = torch.zeros(self.logical_to_device.numel() // page_size + 1, dtype=torch.uint8,
                                         device=device)
        """Per logical page, 1 while it belongs to a resident request (its ids map to one page of
        rows, offset for offset): the device pool maps such a page's new ids inside the forward
        (``HiSparseDevicePool.map_resident_writes``). Set by ``Residency`` and ``ResidentDecode``; cleared by ``Residency``
        at demotion and by :meth:`forget` for the pages of freed ids (a finishing resident
        request's marks stay until SGLang frees its ids, which always follows)."""

    def rows_of(self, logical_ids: torch.Tensor) -> torch.Tensor:
        return self.logical_to_device[logical_ids]

    def resident_rows_of(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ids on resident pages, from their pages' first ids (see ``resident_rows_of``)."""
        offset = logical_ids % self.page_size
        return self.logical_to_device[logical_ids - offset] + offset

    def map(self, logical_ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.logical_to_device[logical_ids] = rows

    def unmap(self, logical_ids: torch.Tensor) -> None:
        """Clear the mapping of ``logical_ids`` (int64). ``index_fill_``: ``x[ids] = 0`` would copy
        the scalar to the device from pageable memory, which waits for the stream."""
        self.logical_to_device.index_fill_(0, logical_ids, 0)

    def forget(self, logical_ids: torch.Tensor) -> None:
        """Freed ids: clear their mapping and the resident marks of their pages."""
        self.unmap(logical_ids)
        self.page_resident.index_fill_(0, logical_ids // self.page_size, 0)

    def mark_resident(self, logical_ids: torch.Tensor, resident: bool) -> None:
        self.page_resident.index_fill_(0, logical_ids // self.page_size, int(resident))

    def map_new_pages(self, logical_pages: torch.Tensor, row_pages: torch.Tensor) -> None:
        """Map each logical page's first id to its row page's first row and mark it resident: on
        CUDA one kernel (``kernels/decode.cuh``, ``map_pages``), elsewhere its torch twin."""
        if self.logical_to_device.is_cuda:
            decode_module().map_pages(logical_pages, row_pages, self.logical_to_device, self.page_resident,
                                      self.page_size)
            return
        map_new_pages_torch(logical_pages, row_pages, self.logical_to_device, self.page_resident, self.page_size)

    def clear(self) -> None:
        """Unmap every logical id (the -1 entry stays; the resident marks are left as they are)."""
        self.logical_to_device[:-1].zero_()


def map_new_pages_torch(logical_pages: torch.Tensor, row_pages: torch.Tensor, logical_to_device: torch.Tensor,
                        page_resident: torch.Tensor, page_size: int) -> None:
    """The torch twin (and oracle) of the ``map_pages`` kernel (:meth:`HiSparseAllocator.map_new_pages`)."""
    logical_to_device[logical_pages * page_size] = row_pages * page_size
    page_resident.index_fill_(0, logical_pages, 1)


class HotBufferRows:
    """The allocator's methods for the coordinator: hot buffers and residency. They change device
    rows (``rows``) and the mapping (``mapping``) together: rows that become a hot buffer's
    (:meth:`take_hot_buffer`) or are freed (:meth:`free_prefill_rows`) leave the mapping in the same
    call; :meth:`release_hot_buffer` expects the caller to have unmapped the request's ids.

    Owns no state: the allocator provides ``mapping``, ``rows``, ``kvcache``, ``page_size`` and
    ``hot_buffer_rows`` (set by ``configure``)."""

    mapping: LogicalMap
    rows: DeviceRows
    kvcache: Any
    page_size: int
    hot_buffer_rows: int

    @property
    def logical_to_device(self) -> torch.Tensor:
        """The mapping's table (:class:`LogicalMap`; the device pool and residency read it)."""
        return self.mapping.logical_to_device

    @property
    def page_resident(self) -> torch.Tensor:
        """The mapping's resident page marks (:attr:`LogicalMap.page_resident`)."""
        return self.mapping.page_resident

    def device_rows_of(self, logical_ids: torch.Tensor) -> torch.Tensor:
        return self.mapping.rows_of(logical_ids)

    def resident_rows_of(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ids on resident pages, from their pages' first ids (mapped by the host): the
        ids past a page's first may be mapped only by a forward still in flight."""
        return self.mapping.resident_rows_of(logical_ids)

    def take_hot_buffer(self, logical_ids: torch.Tensor, keep_tokens: int, *, mapped: bool = True) -> Optional[torch.Tensor]:
        """Turn a request's device rows into its hot buffer (``DeviceRows.take_hot_buffer``) and
        clear the mapping of its ``logical_ids`` (positions ``0..n-1``, page aligned from 0).
        ``mapped``: its ids are mapped to rows (a prefill's), else none is (PD, logical ids only).
        Returns the kept rows (int64 [keep_tokens]) or None, changing nothing."""
        p = self.page_size
        assert keep_tokens % p == 0 and 0 < keep_tokens <= self.hot_buffer_rows
        page_starts = self.mapping.rows_of(logical_ids)[::p]
        assert page_starts.numel() * p >= keep_tokens, "fewer positions than the kept rows"
        rows = self.rows.take_hot_buffer(page_starts, keep_tokens, mapped=mapped)
        if rows is not None and mapped:
            self.mapping.unmap(logical_ids)
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
        self.mapping.map(logical_ids, rows.to(torch.int64))

    def enable_resident_pages(self) -> None:
        """Residency is on: the device pool maps resident pages' new ids inside the forward."""
        self.kvcache.attach_mapping(self.mapping.logical_to_device, self.mapping.page_resident)

    def map_new_pages(self, logical_pages: torch.Tensor, row_pages: torch.Tensor) -> None:
        """A resident step's new pages: map each logical page's first id to its row page's first
        row and mark the logical page resident (the forward maps the page's later ids). On CUDA one
        kernel (``kernels/decode.cuh``, ``map_pages``), elsewhere its torch twin."""
        self.mapping.map_new_pages(logical_pages, row_pages)

    def mark_resident_pages(self, logical_ids: torch.Tensor, resident: bool) -> None:
        """Mark the logical pages holding ``logical_ids`` as resident or not (``page_resident``)."""
        self.mapping.mark_resident(logical_ids, resident)

    def unmap_logical(self, logical_ids: torch.Tensor) -> None:
        """Clear the mapping of ``logical_ids`` (int64). ``index_fill_``: ``x[ids] = 0`` would copy
        the scalar to the device from pageable memory, which waits for the stream."""
        self.mapping.unmap(logical_ids)

    def free_prefill_rows(self, logical_ids: torch.Tensor) -> None:
        """Free the device rows of a request still in staging (abort) and clear its mapping."""
        self.rows.free_unowned(self.mapping.rows_of(logical_ids))
        self.mapping.unmap(logical_ids)
