"""The device KV pool's rows: who may take them, and which belong to hot buffers.

Owned state (one owner, used only through :class:`HiSparseAllocator`):

* ``pages``: the free list of device rows (page granular);
* ``hot_owned``: rows that belong to some request's hot buffer. Nothing but
  :meth:`release_hot_buffer` frees such a row, so a logical free cannot free a hot-buffer row;
* ``reserved``: rows promised to short requests' hot-buffer growth. They are free in ``pages``
  but no longer available to anyone else (``room``).

Invariant: ``0 <= reserved <= pages.available_tokens()``.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.paging import PageAllocator


class DeviceRows:
    def __init__(self, size: int, page_size: int, device: torch.device | str, debug: bool = False):
        self.page_size = page_size
        self.pages = PageAllocator(size // page_size, page_size, device, debug)
        self.hot_owned = torch.zeros(size + page_size, dtype=torch.bool, device=device)
        self.reserved = 0

    def room(self) -> int:
        """Free rows not promised to growth."""
        return self.pages.available_tokens() - self.reserved

    def clear(self) -> None:
        self.pages.clear()
        self.hot_owned.zero_()
        self.reserved = 0

    def free_unowned(self, rows: torch.Tensor) -> None:
        """Free the rows among ``rows`` (0 = none) that no hot buffer owns."""
        rows = rows[rows > 0]
        self.pages.free_tokens(rows[~self.hot_owned[rows]])

    def take_hot_buffer(self, page_starts: torch.Tensor, keep_tokens: int, slots: int) -> Optional[torch.Tensor]:
        """A request's device pages become its hot buffer of ``slots`` rows.

        ``page_starts``: the first device row of each of the request's pages, in position order
        (0 where a page is not on device). The pages of its first ``keep_tokens`` positions
        become rows ``0..keep_tokens-1`` (pages not on device are allocated); its later pages
        are freed; ``slots - keep_tokens`` rows are reserved for growth. Returns the kept rows,
        or None, changing nothing, when the fresh pages plus the reservation do not fit.
        """
        p = self.page_size
        kept = page_starts[: keep_tokens // p]
        unmapped = kept <= 0
        missing = int(unmapped.sum())
        growth = slots - keep_tokens
        if missing * p + growth > self.room():
            return None
        kept_pages = kept // p
        if missing:
            kept_pages[unmapped] = self.pages.alloc_pages(missing)
        dropped = page_starts[keep_tokens // p :]
        self.pages.free_pages_(dropped[dropped > 0] // p)
        rows = self.pages.page_rows(kept_pages)
        self.hot_owned[rows] = True
        self.reserved += growth
        return rows

    def reserve(self, n_tokens: int) -> None:
        """Promise ``n_tokens`` free rows to a request (a resident request's guarantee)."""
        assert 0 <= n_tokens <= self.room(), "reservation beyond the free rows"
        self.reserved += n_tokens

    def release_reservation(self, n_tokens: int) -> None:
        """Give back ``n_tokens`` of a promise (used, or no longer needed)."""
        assert 0 <= n_tokens <= self.reserved, "released more than was reserved"
        self.reserved -= n_tokens

    def keep_pages(self, page_starts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """A request's pages ``page_starts[keep]`` (its first device row per page, all on device)
        become hot-buffer rows, in the order of ``keep``; its other pages are freed. Returns the
        kept rows, page by page."""
        p = self.page_size
        dropped = torch.ones(page_starts.numel(), dtype=torch.bool, device=page_starts.device)
        dropped[keep] = False
        self.pages.free_pages_(page_starts[dropped] // p)
        rows = self.pages.page_rows(page_starts[keep] // p)
        self.hot_owned[rows] = True
        return rows

    def grow_hot_buffer(self, n_tokens: int) -> torch.Tensor:
        """Rows for a short request's growth, from the reservation (never fails)."""
        assert n_tokens <= self.reserved, "growth beyond the reservation"
        rows = self.pages.alloc_tokens(n_tokens)
        assert rows is not None, "reserved device rows were not free"
        self.reserved -= n_tokens
        self.hot_owned[rows] = True
        return rows

    def release_hot_buffer(self, rows: torch.Tensor, unused_reservation: int) -> None:
        """Free a hot buffer's rows and the part of its reservation it never used."""
        self.hot_owned[rows] = False
        self.pages.free_tokens(rows)
        self.reserved -= unused_reservation
        assert self.reserved >= 0
