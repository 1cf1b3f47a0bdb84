"""The device KV pool's rows: who may take them, and which belong to hot buffers.

Owned state (one owner, used only through :class:`HiSparseAllocator`):

* ``pages``: the free list of device rows (page granular);
* ``hot_owned``: rows that belong to some request's hot buffer. Nothing but
  :meth:`release_hot_buffer` frees such a row, so a logical free cannot free a hot-buffer row.

Nothing is promised ahead: a request holds the rows it uses, and a short hot buffer or a resident
request takes its next page from the free rows when it reaches it (as SGLang's own paged pool
does). Whether the next decode step's pages are free is checked before the step, with SGLang's
decode memory check (``patches/decode_memory_check.py``), which retracts requests when they are not.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.memory.paging import PageAllocator


class DeviceRows:
    def __init__(self, size: int, page_size: int, device: torch.device | str, debug: bool = False):
        self.page_size = page_size
        self.debug = debug
        self.pages = PageAllocator(size // page_size, page_size, device, debug)
        self.hot_owned = torch.zeros(size + page_size, dtype=torch.bool, device=device)

    def room(self) -> int:
        """Free rows."""
        return self.pages.available_tokens()

    def clear(self) -> None:
        self.pages.clear()
        self.hot_owned.zero_()

    def free_unowned(self, rows: torch.Tensor) -> None:
        """Free the rows among ``rows`` (0 = none) that no hot buffer owns."""
        rows = rows[rows > 0]
        self.pages.free_tokens(rows[~self.hot_owned[rows]])

    def take_hot_buffer(self, page_starts: torch.Tensor, keep_tokens: int, *, mapped: bool) -> Optional[torch.Tensor]:
        """A request's device pages become the first ``keep_tokens`` rows of its hot buffer.

        ``page_starts``: the first device row of each of the request's pages, in position order.
        ``mapped``: every page is on the device (a prefill's pages; the pages of its first
        ``keep_tokens`` positions become rows ``0..keep_tokens-1`` and its later pages are freed);
        otherwise none is (PD: logical ids only; ``keep_tokens`` rows are allocated). Returns the
        kept rows, or None, changing nothing, when rows to allocate are not free. No host sync
        (nothing is counted on the device); ``debug`` checks ``mapped`` against ``page_starts``."""
        p = self.page_size
        kept_count = keep_tokens // p
        if self.debug:
            on_device = page_starts > 0
            assert bool(on_device.all() if mapped else ~on_device.any()), \
                f"take_hot_buffer(mapped={mapped}) of pages {page_starts.tolist()}"
        if mapped:
            kept_pages = page_starts[:kept_count] // p
            self.pages.free_pages_(page_starts[kept_count:] // p)
        else:
            kept_pages = self.pages.alloc_pages(kept_count)
            if kept_pages is None:
                return None
        rows = self.pages.page_rows(kept_pages)
        self.hot_owned.index_fill_(0, rows, True)
        return rows

    def keep_pages(self, page_starts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """A request's pages ``page_starts[keep]`` (its first device row per page, all on device;
        ``keep`` distinct) become hot-buffer rows, in the order of ``keep``; its other pages are
        freed. Returns the kept rows, page by page. No host sync."""
        p = self.page_size
        dropped = torch.ones(page_starts.numel(), dtype=torch.int8, device=page_starts.device)
        dropped[keep] = 0
        # the dropped pages first (a stable sort of the flags), as many as the host knows there are:
        # no boolean mask, whose compaction would wait for the device
        first_dropped = torch.argsort(dropped, descending=True, stable=True)[: page_starts.numel() - keep.numel()]
        self.pages.free_pages_(page_starts[first_dropped] // p)
        rows = self.pages.page_rows(page_starts[keep] // p)
        self.hot_owned.index_fill_(0, rows, True)
        return rows

    def grow_hot_buffer(self, n_tokens: int) -> Optional[torch.Tensor]:
        """Free rows for a short hot buffer's next page(s), now hot-owned; None (nothing taken)
        when fewer are free."""
        rows = self.pages.alloc_tokens(n_tokens)
        if rows is not None:
            self.hot_owned.index_fill_(0, rows, True)
        return rows

    def release_hot_buffer(self, rows: torch.Tensor) -> None:
        """Free a hot buffer's rows: whole pages, each in row order (every way a hot buffer gets rows
        hands them out so), so the pages are the rows ``rows[::page]`` start; no host sync."""
        p = self.page_size
        if self.debug:
            assert rows.numel() % p == 0 and torch.equal(rows.view(-1, p), self.pages.page_rows(rows[::p] // p).view(-1, p)), \
                "a hot buffer's rows are whole pages"
        self.hot_owned.index_fill_(0, rows, False)
        self.pages.free_pages_(rows[::p] // p)
