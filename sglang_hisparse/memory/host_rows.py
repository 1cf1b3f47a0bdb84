"""Host rows of request slots, by whole pages: the record both host pools keep (DSA's
``HiSparseHostPool``, DeepSeek-V4's ``C4HostPool``).

Owns each request slot's rows as CPU chunks (``_rows_of``); the rows' free list belongs to the pool
that mixes this in, the position -> host row table to its caller (the host mirror). A slot may
start with borrowed rows (``_borrowed_of``: a cached prefix's, lent by the radix tree): they are in
the slot's record and table like its own, but never freed through the slot.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np
import torch


class RequestRowRecord:
    """Host rows of request slots, by whole pages, written into a position -> host row table the
    caller owns (the host mirror's ``row_table`` and ``rows_allocated``), and kept on the host too
    (``_rows_of``: CPU int64 chunks in position order), so that freeing a request reads nothing back
    from the table's device. Invariant: a slot's record equals its table row up to its allocated
    end, which is a multiple of ``page_size``. Subclasses provide ``page_size``, ``alloc``,
    ``free`` and ``available_size`` (the free list: SGLang's for the DSA pool, ours for C4) and
    set ``_rows_of = {}`` and ``_borrowed_of = {}``."""

    page_size: int
    pool_label = "host pool"
    """What an exhaustion error calls the pool."""
    _rows_of: dict[int, list[torch.Tensor]]
    """The record (set to ``{}`` by the subclass's constructor)."""
    _borrowed_of: dict[int, int]
    """Slot -> how many leading rows of its record are borrowed (set to ``{}`` likewise)."""
    _first_rows_lent: Optional[torch.Tensor] = None
    """Rows the next :meth:`alloc_paged_token_slots` of a slot with none borrows first (while
    :meth:`lending_first_rows` is open)."""

    @contextmanager
    def lending_first_rows(self, rows: torch.Tensor) -> Iterator[None]:
        """While open, the first :meth:`alloc_paged_token_slots` from position 0 for a slot with no
        rows borrows ``rows`` (:meth:`borrow_request_rows`) as its first positions' rows before it
        grows the rest: how a PD decode request preallocated by SGLang's code gets a cached prefix's
        host rows (``prefix/pd_prefix.py``). At most one slot takes them; the offer ends at exit
        whether taken or not (the caller checks :meth:`borrowed_count`)."""
        self._first_rows_lent = rows
        try:
            yield
        finally:
            self._first_rows_lent = None

    def borrow_request_rows(self, table: torch.Tensor, lengths: torch.Tensor, req_pool_idx: int,
                            rows: "torch.Tensor | None", limit: int) -> int:
        """Make ``rows`` (CPU int64, whole pages, owned elsewhere: a cached prefix's host rows) the
        rows of positions ``0..len(rows)-1`` of a slot that has none; returns how many (0 for None
        or empty: no effect). Side effects: the table row, the allocated end and the record as for
        own rows, and the borrowed count; later growth adds own pages after them.
        :meth:`free_request_rows` never frees borrowed rows; :meth:`release_request_rows` returns
        them with the rest (its caller lent them). Raises AssertionError for a slot that has rows,
        a length that is not whole pages or more rows than ``limit`` (the positions to cover)."""
        count = 0 if rows is None else int(rows.numel())
        if count == 0:
            return 0
        if count % self.page_size or count > limit:
            raise AssertionError(f"borrowed host rows must be whole pages within {limit} positions: {count} rows, "
                                 f"page {self.page_size}")
        if int(lengths[req_pool_idx]) != 0 or req_pool_idx in self._rows_of:
            raise AssertionError(f"slot {req_pool_idx} borrows host rows but already has some")
        rows = rows.to(torch.int64)
        table[req_pool_idx, :count] = rows.to(table.device, non_blocking=True)
        lengths[req_pool_idx] = count
        self._rows_of[req_pool_idx] = [rows]
        self._borrowed_of[req_pool_idx] = count
        return count

    def give_up_leading_rows(self, req_pool_idx: int, count: int) -> None:
        """The slot's rows of positions ``0..count-1`` now belong to another owner (the radix tree
        took a running request's prefix) and are borrowed from it: the borrowed count grows to
        ``count`` (whole pages, within the allocated end; AssertionError otherwise). No row moves."""
        allocated = sum(int(chunk.numel()) for chunk in self._rows_of.get(req_pool_idx, []))
        if count % self.page_size or not self.borrowed_count(req_pool_idx) <= count <= allocated:
            raise AssertionError(f"slot {req_pool_idx}: cannot give up {count} leading host rows "
                                 f"({self.borrowed_count(req_pool_idx)} borrowed, {allocated} held)")
        self._borrowed_of[req_pool_idx] = count

    def borrowed_count(self, req_pool_idx: int) -> int:
        """How many leading rows of a slot are borrowed (0 for none). No side effects."""
        return self._borrowed_of.get(req_pool_idx, 0)

    def alloc_paged_token_slots(self, req_to_host_pool: torch.Tensor, req_to_host_pool_allocated_len: torch.Tensor,
                                req_pool_idx: int, start_pos: int, num_tokens: int) -> torch.Tensor:
        """Host rows of positions ``start_pos .. start_pos + num_tokens - 1`` of a request (the
        contract SGLang's PD decode path calls; it sends ``rows[::64] // 64`` as page ids and the
        prefill writes whole pages there). Grows the request's rows by whole pages as needed;
        ``start_pos`` must not pass the allocated end (AssertionError). Side effects: those of
        :meth:`grow_request_rows`. Returns a view of the table row (the table's device)."""
        if num_tokens <= 0:
            return torch.empty((0,), dtype=torch.int64, device=req_to_host_pool.device)
        allocated = int(req_to_host_pool_allocated_len[req_pool_idx])
        lent, self._first_rows_lent = self._first_rows_lent, None
        if lent is not None and start_pos == 0 and allocated == 0:
            allocated = self.borrow_request_rows(req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx, lent,
                                                 limit=num_tokens)
        if start_pos > allocated:
            raise AssertionError(f"host rows must grow in order: start {start_pos} > allocated {allocated}")
        end = start_pos + num_tokens
        self.grow_request_rows(req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx, end)
        return req_to_host_pool[req_pool_idx, start_pos:end]

    def _exhausted(self, needed: int) -> RuntimeError:
        return RuntimeError(f"sglang-hisparse: {self.pool_label} exhausted ({self.available_size()} rows free, "
                            f"{needed} needed); admission should have prevented this")

    def grow_request_rows(self, table: torch.Tensor, lengths: torch.Tensor, req_pool_idx: int, end: int) -> None:
        """Give positions ``0..end-1`` of a request a host row each, adding whole pages. Side
        effects: pages taken from the free list, their rows written into ``table`` and the record,
        the new allocated end into ``lengths`` (only when a page is added). Raises RuntimeError
        when the pool is exhausted (admission counts this pool: a bug, not a load condition)."""
        allocated = int(lengths[req_pool_idx])
        new_end = -(-end // self.page_size) * self.page_size
        if new_end <= allocated:
            return
        rows = self.alloc(new_end - allocated)
        if rows is None:
            raise self._exhausted(new_end - allocated)
        table[req_pool_idx, allocated:new_end] = rows.to(table.device, non_blocking=True)
        lengths[req_pool_idx] = new_end
        self._rows_of.setdefault(req_pool_idx, []).append(rows)

    def grow_rows(self, table: torch.Tensor, lengths: torch.Tensor, idxs, ends) -> None:
        """:meth:`grow_request_rows` for many requests at once (``idxs``, ``ends``: int64 numpy
        arrays or CPU tensors, distinct slots): one allocation, one table write; a call that adds
        no page costs five numpy operations. Same side effects and error."""
        p = self.page_size
        idxs, ends = np.asarray(idxs, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        allocated_of = lengths.numpy()  # a view: written below
        allocated = allocated_of[idxs]
        need = np.maximum((ends + p - 1) // p * p - allocated, 0)
        total = int(need.sum())
        if not total:
            return
        rows = self.alloc(total)
        if rows is None:
            raise self._exhausted(total)
        rows = rows.to(torch.int64)
        req = np.repeat(idxs, need)
        first = np.repeat(np.cumsum(need) - need, need)
        pos = np.repeat(allocated, need) + np.arange(total) - first
        where = torch.from_numpy(np.stack((req, pos, rows.numpy()))).to(table.device, non_blocking=True)
        table[where[0], where[1]] = where[2]
        allocated_of[idxs] = allocated + need
        for idx, count, chunk in zip(idxs.tolist(), need.tolist(), rows.split(need.tolist())):
            if count:
                self._rows_of.setdefault(idx, []).append(chunk)

    def free_request_rows(self, table: torch.Tensor, lengths: torch.Tensor, req_pool_idx: int) -> int:
        """Return every host row of a request to the free list, except borrowed ones (their owner
        keeps them), and clear its table row (to -1), allocated end and borrowed count. Returns the
        rows freed (0 for a slot with none). Reads only the record."""
        borrowed = self.borrowed_count(req_pool_idx)
        rows = self.release_request_rows(table, lengths, req_pool_idx)[borrowed:]
        return self.free(rows) if rows.numel() else 0

    def release_request_rows(self, table: torch.Tensor, lengths: torch.Tensor, req_pool_idx: int) -> torch.Tensor:
        """Clear a request's record, table row (to -1), allocated end and borrowed count without
        freeing its rows; returns them (CPU int64, position order, borrowed ones first) to whoever
        frees them (the prefix cache takes a finished request's: ``HostMirror.hand_over``; it knows
        which it lent)."""
        allocated = int(lengths[req_pool_idx])
        chunks = self._rows_of.pop(req_pool_idx, [])
        self._borrowed_of.pop(req_pool_idx, None)
        if allocated == 0:
            return torch.empty(0, dtype=torch.int64)
        rows = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        assert rows.numel() == allocated, f"host rows kept for slot {req_pool_idx}: {rows.numel()} != {allocated}"
        table[req_pool_idx, :allocated] = -1
        lengths[req_pool_idx] = 0
        return rows

    def rows_of(self, req_pool_idx: int) -> torch.Tensor:
        """The host rows of a request slot in position order (CPU int64; empty for none): its
        table row up to its allocated end. No side effects."""
        chunks = self._rows_of.get(req_pool_idx, [])
        return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
