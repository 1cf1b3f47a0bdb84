"""Hot buffers: the device rows each decoding request holds, and what every layer keeps in them.

A request's hot buffer is ``B`` slots plus the *window*: ``N`` slots ``B .. B + N - 1`` for the
tokens a step writes (N = 1: the newest token; linear speculation: N = 1 + draft tokens, the
verify window), ``padded = round_up(B + N, page)`` device rows in all. A step that writes
positions ``start .. start + N - 1`` puts position ``p`` in slot ``p`` while ``p < B`` (a short
request fills its buffer in position order) and in window slot ``B + p - start`` otherwise. Per
request slot this table owns (preallocated, fixed addresses for CUDA graphs):

* ``slot_rows`` (int32 [max_reqs, padded]): the device row of each slot;
* ``capacity`` (host ints): slots with a row so far (``capacity <= padded``; a buffer takes its
  next page from the free rows when its newest slot reaches it);
* the per-layer slot tables ``slot_positions``, ``recency``, ``history`` and ``slot_map``
  (:class:`~sglang_hisparse.memory.slot_tables.SlotTables`, ``tables``; written by the resolver,
  set here where a buffer opens, closes or empties slots);
* ``window_start`` (int64 [max_reqs], only for N > 1): the first position of each request's
  current window (positions ``>= B`` of the previous window are read from there by the next
  step's write-through).

With N > 1 a window may hold rejected draft tokens. Slots ``< B`` still only ever hold the KV
of their own position when read: a position ``p < B`` written in a window and rejected lies at
or after the next window's start (which is the committed length), so that window rewrites slot
``p`` before anything reads it.

Per-request sizes (``max_buffer_size`` > ``buffer_size``, issue 44's elastic buffers): the tables
are ``max_buffer_size`` wide and each request uses ``S`` of the slots below the window
(:class:`~sglang_hisparse.memory.buffer_sizes.BufferSizes`, ``sizes``): a buffer opens at
``buffer_size`` and :meth:`HotBuffers.resize` grows or shrinks it; ``capacity`` counts its
*virtual* slots there. ``B`` below is then the request's S wherever it says which positions sit
in slot ``p``, and the table width where it names the window.

A buffer starts either as the request's own first positions (slot ``p`` holds position ``p``:
the staging path keeps the prefill's first pages) or empty (PD: a long request's first
selections all miss). A short request (``seq_len <= B``) grows page by page from the free rows
(whether they are free is checked before each decode step: :meth:`HotBuffers.step_growth`); rows
come from and go back to the allocator, which owns every free list.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.admission import hot_buffer_rows
from sglang_hisparse.memory.buffer_sizes import BufferSizes
from sglang_hisparse.memory.slot_tables import SlotTables


class HotBuffers:
    def __init__(self, allocator, *, layers: int, max_reqs: int, buffer_size: int, device: torch.device,
                 history: bool = False, window: int = 1, map_columns: int = 0, max_buffer_size: int = 0):
        """``map_columns`` > 0: keep the position -> slot map with that many positions per row (the
        host row table's columns); 0: none. ``max_buffer_size`` > ``buffer_size``: per-request
        sizes up to it (one-token steps only); 0: every buffer ``buffer_size``."""
        page = allocator.page_size
        self.allocator = allocator
        self.buffer_size = B = max(buffer_size, max_buffer_size)
        """The table width: the resolver's B (``buffer_size`` without per-request sizes)."""
        self.open_size = buffer_size
        """Slots below the window a buffer opens with (``device_buffer_size``)."""
        assert window == 1 or B == buffer_size, "per-request buffer sizes are for one-token steps"
        self.sizes = BufferSizes(max_reqs=max_reqs, open_size=buffer_size, table_size=B, page=page, device=device)
        self.window = window
        self.page_size = page
        self.padded = hot_buffer_rows(buffer_size, window, page)
        """Rows a buffer holds at its opening size, window included (what admission counts)."""
        self.slot_rows = torch.zeros((max_reqs, hot_buffer_rows(B, window, page)), dtype=torch.int32, device=device)
        self.capacity = [0] * max_reqs
        self.tables = SlotTables(layers=layers, max_reqs=max_reqs, width=B, device=device, history=history,
                                 map_columns=map_columns)
        t = self.tables  # the resolver's names for them
        self.slot_positions, self.recency, self.history, self.slot_map = t.positions, t.recency, t.history, t.slot_map
        self.window_start: Optional[torch.Tensor] = (
            torch.zeros(max_reqs, dtype=torch.int64, device=device) if window > 1 else None)
        self._window_offsets = torch.arange(window, dtype=torch.int64, device=device)

    def holds(self, idx: int) -> bool:
        return self.capacity[idx] > 0

    # --- opening -----------------------------------------------------------------------------
    def open(self, idx: int, logical_ids: torch.Tensor, *, filled: bool, mapped: bool = True) -> Optional[torch.Tensor]:
        """Give request slot ``idx`` a hot buffer for its ``n = len(logical_ids)`` positions.

        Keeps ``min(round_up(n, page), padded)`` rows: the device pages of its first positions
        (``mapped``; the allocator frees the rest and clears the mapping), or new pages (not
        ``mapped``).
        Later slots get rows as the request grows (:meth:`grow`). ``filled``: slot ``p`` holds
        position ``p`` in every layer (its KV is in the kept rows, or will be loaded there by the
        caller); otherwise every slot is empty. ``mapped``: its ids are mapped to device rows (a
        prefill's or a resident request's), else none is (PD). Returns the kept rows (int64), or
        None with nothing changed when the device rows are not free.
        """
        keep = min(-(-logical_ids.numel() // self.page_size) * self.page_size, self.padded)
        rows = self.allocator.take_hot_buffer(logical_ids, keep, mapped=mapped)
        if rows is None:
            return None
        self.sizes.set(idx, self.open_size)
        self.sizes.place(self.slot_rows, idx, 0, rows)
        self.capacity[idx] = keep
        if filled:
            self.tables.fill(idx)
        else:
            self.tables.empty(idx)
        if self.window_start is not None:
            self.window_start[idx] = logical_ids.numel()
        return rows

    def open_empty(self, idx: int) -> None:
        """Give request slot ``idx`` a hot buffer with no position yet (a DeepSeek-V4 request
        shorter than one C4 entry): no rows (its first page comes with its first position,
        :meth:`grow`), tables as :meth:`open` ``filled`` leaves them (slot ``p`` will hold
        position ``p``). If it never gets a row, :meth:`close` has nothing to give back and leaves
        these tables as they are; every way of opening a buffer sets them again."""
        self.capacity[idx] = 0
        self.sizes.set(idx, self.open_size)
        self.tables.fill(idx)

    def open_with_rows(self, idx: int, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Give request slot ``idx`` a full hot buffer of the given ``padded`` rows (a demoted
        resident request's own pages), at the opening size S: slot ``s < S`` is ``rows[s]`` and
        holds ``positions[s]`` (-1: none) in every layer; ``rows[S:]`` are the newest-token page.
        Recency is the slot order (the caller puts the rows most worth keeping last)."""
        assert rows.numel() == self.padded == positions.numel()
        S = self.open_size
        self.sizes.set(idx, S)
        self.sizes.place(self.slot_rows, idx, 0, rows)
        self.capacity[idx] = self.padded
        self.tables.hold(idx, positions[:S].to(torch.int32))

    # --- growth ------------------------------------------------------------------------------
    def _slots_for_window(self, start: int) -> int:
        """Slots a verify step writing ``start .. start + N - 1`` uses (the window rule above)."""
        N = self.window
        return start + N if start + N <= self.buffer_size else self.buffer_size + N

    def _rows_to_add(self, have: int, slots: int) -> int:
        return max(0, -(-slots // self.page_size) * self.page_size - have)

    def step_growth(self, idxs: list[int], seq_lens: list[int]) -> int:
        """Free rows a one-token step at ``seq_lens`` takes for these request slots' buffers (whole pages)."""
        return sum(self._rows_to_add(self.capacity[idx], self.sizes.step_slots(idx, n)) for idx, n in zip(idxs, seq_lens))

    def window_growth(self, idxs: list[int], starts: list[int]) -> int:
        """Free rows a verify step writing from ``starts`` takes for these request slots' buffers."""
        return sum(self._rows_to_add(self.capacity[idx], self._slots_for_window(s)) for idx, s in zip(idxs, starts))

    def growth_after_opening(self, n: int, seq_len: int) -> int:
        """Free rows the one-token step at ``seq_len`` would take for a buffer opened filled now
        with ``n`` positions (what a demoted resident request needs instead of its next page)."""
        keep = min(-(-n // self.page_size) * self.page_size, self.padded)
        return self._rows_to_add(keep, min(seq_len, self.open_size + 1))

    def grow(self, idxs, seq_lens) -> None:
        """Before a one-token step (``idxs``, ``seq_lens``: int64 CPU tensors or numpy arrays): a
        request whose newest position ``seq_len - 1 <= B`` has no row yet gets the next page(s)
        from the free rows. That only ever happens where the position starts a page (capacities are whole
        pages), so only those requests are looked at."""
        idxs, seq_lens = np.asarray(idxs), np.asarray(seq_lens)
        at_page_start = np.flatnonzero((seq_lens - 1) % self.page_size == 0)
        for idx, seq_len in zip(idxs[at_page_start].tolist(), seq_lens[at_page_start].tolist()):
            self._grow_to(idx, self.sizes.step_slots(idx, seq_len))

    def _grow_to(self, idx: int, needed: int) -> None:
        """Rows for slots ``0 .. needed - 1`` of request slot ``idx``, whole pages of free rows.
        Raises HiSparsePluginError when they are not free: the decode memory check before the
        step (``patches/decode_memory_check.py``) must have retracted requests instead."""
        have = self.capacity[idx]
        add = self._rows_to_add(have, needed)
        if not add:
            return
        rows = self.allocator.grow_hot_buffer(add)
        if rows is None:
            raise HiSparsePluginError(
                f"sglang-hisparse: no free device rows for the next page of request slot {idx}'s hot buffer "
                f"({add} rows; {self.allocator.debug_print()}); the decode memory check should have retracted a request")
        self.sizes.place(self.slot_rows, idx, have, rows)
        self.capacity[idx] = have + add

    def newest_rows(self, idxs: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens_t: torch.Tensor) -> torch.Tensor:
        """Before a step: grow short buffers (:meth:`grow`; ``idxs`` and ``seq_lens`` on the CPU)
        and return each request's row (int64, on the device) for its newest position ``seq_len - 1``."""
        self.grow(idxs, seq_lens)
        return self.rows_of_positions(req_pool_indices, seq_lens_t - 1)

    def window_rows(self, idxs: list[int], starts: list[int],
                    req_pool_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a step writing positions ``start .. start + N - 1`` of each request: grow short
        buffers to cover the window's slots, record the window starts, and return the window's
        positions and the rows they go to (both int64 [len(idxs), N], module docstring). Needs N > 1."""
        assert self.window_start is not None, "window_rows is the N > 1 form of newest_rows"
        for idx, start in zip(idxs, starts):
            self._grow_to(idx, self._slots_for_window(start))
        starts_t = torch.tensor(starts, dtype=torch.int64).to(self.window_start.device, non_blocking=True)
        self.window_start[req_pool_indices] = starts_t
        positions = starts_t[:, None] + self._window_offsets
        return positions, self.rows_of_positions(req_pool_indices[:, None], positions)

    # --- per-request sizes --------------------------------------------------------------------
    def resize(self, idx: int, size: int) -> int:
        """Long buffer ``idx`` (a row for every slot below its size S) uses ``size`` slots (whole
        pages) from now on; returns the rows taken (> 0) or given back (< 0). Growing takes free
        rows for slots ``[S, size)`` (the caller checked the room) and empties those slots in every
        layer (a stale position must not hit); shrinking frees the rows of ``[size, S)`` (their
        positions stay: the resolver ignores slots beyond a size). The window's rows stay. The
        caller orders a shrink after every reader of those rows and keeps ``size`` below the
        request's length (the fast path ``L <= S`` must not open)."""
        S, have = self.sizes.of(idx), self.capacity[idx]
        assert have > S and size % self.page_size == 0, f"resize of buffer {idx} ({have} rows, size {S}) to {size}"
        if size > S:
            rows = self.allocator.grow_hot_buffer(size - S)
            assert rows is not None, f"no free rows to grow buffer {idx} to {size} ({self.allocator.debug_print()})"
            self.slot_rows[idx, S:size] = rows.to(torch.int32)
            self.tables.empty_slots(idx, S, size)
        elif size < S:
            self.allocator.release_hot_buffer(self.slot_rows[idx, size:S].to(torch.int64))
        self.sizes.set(idx, size)
        self.capacity[idx] = have + size - S
        return size - S

    # --- lookups -----------------------------------------------------------------------------
    def rows_of_positions(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) now holding ``positions`` (broadcast with ``req_pool_idx``) as a
        window or fast-path token: slot ``position`` below B, else its window slot (N = 1: slot B)."""
        positions = positions.to(torch.int64)
        B = self.buffer_size
        if self.window_start is None:
            slots = self.sizes.newest_slots(req_pool_idx, positions)
        else:
            slots = torch.where(positions < B, positions, B + positions - self.window_start[req_pool_idx])
        return self.slot_rows[req_pool_idx, slots].to(torch.int64)

    # --- closing -----------------------------------------------------------------------------
    def close(self, idx: int) -> None:
        """Give request slot ``idx``'s rows back and reset its tables (idempotent; the slot map
        keeps its entries: with every slot empty none is confirmed). The caller unmaps the
        request's logical ids first. A slot holding no buffer has reset tables already: nothing to do."""
        if not self.capacity[idx]:
            return
        rows = self.sizes.rows_held(self.slot_rows, idx, 0, self.capacity[idx])
        self.allocator.release_hot_buffer(rows)
        self.sizes.set(idx, self.open_size)
        self.slot_rows[idx].zero_()
        self.capacity[idx] = 0
        self.tables.empty(idx)
