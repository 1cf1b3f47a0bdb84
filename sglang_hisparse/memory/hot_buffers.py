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
* ``slot_positions`` (int32 [layers, max_reqs, B]): the position each slot holds in each layer,
  -1 for none (written by the resolver, reset here);
* ``recency`` (int16 [layers, max_reqs, B]): each layer's slots, least recently used first
  (written by the resolver, reset here);
* ``history`` (int16 [layers, max_reqs, B], only with ``replacement: "reuse"``, else None): each
  layer's packed per-slot age and selection count (``replacement/reuse.py``; written by the
  resolver, zeroed here wherever ``recency`` is reset);
* ``slot_map`` (int16 [layers, max_reqs, map_columns], only with ``slot_map: true``, else None):
  each layer's position -> slot map, a hint the kernel validates against ``slot_positions``
  (resolver/reference.py). Invariant: ``slot_positions[l, r, s] == p >= 0`` implies
  ``slot_map[l, r, p] == s``. Written here where slots are filled (``open`` with ``filled``,
  ``open_with_rows``) and by the resolver for each miss; never cleared (``close`` leaves stale
  entries, which no slot table confirms);
* ``window_start`` (int64 [max_reqs], only for N > 1): the first position of each request's
  current window (positions ``>= B`` of the previous window are read from there by the next
  step's write-through).

With N > 1 a window may hold rejected draft tokens. Slots ``< B`` still only ever hold the KV
of their own position when read: a position ``p < B`` written in a window and rejected lies at
or after the next window's start (which is the committed length), so that window rewrites slot
``p`` before anything reads it.

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


class HotBuffers:
    def __init__(self, allocator, *, layers: int, max_reqs: int, buffer_size: int, device: torch.device,
                 history: bool = False, window: int = 1, map_columns: int = 0):
        """``map_columns`` > 0: keep the position -> slot map with that many positions per row (the
        host row table's columns); 0: none."""
        page = allocator.page_size
        self.allocator = allocator
        self.buffer_size = B = buffer_size
        self.window = window
        self.page_size = page
        self.padded = hot_buffer_rows(B, window, page)
        self.slot_rows = torch.zeros((max_reqs, self.padded), dtype=torch.int32, device=device)
        self.capacity = [0] * max_reqs
        self.slot_positions = torch.full((layers, max_reqs, B), -1, dtype=torch.int32, device=device)
        self.recency = torch.empty((layers, max_reqs, B), dtype=torch.int16, device=device)
        self._slot_numbers = torch.arange(B, dtype=torch.int32, device=device)
        self.recency.copy_(self._slot_numbers.to(torch.int16).expand_as(self.recency))
        self.history: Optional[torch.Tensor] = (
            torch.zeros((layers, max_reqs, B), dtype=torch.int16, device=device) if history else None)
        self.slot_map: Optional[torch.Tensor] = (
            torch.full((layers, max_reqs, map_columns), -1, dtype=torch.int16, device=device) if map_columns > 0
            else None)
        self._map_prefix = min(B, map_columns)  # positions 0 .. B-1 a filled buffer holds, within the map
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
        self.slot_rows[idx, :keep] = rows.to(torch.int32)
        self.capacity[idx] = keep
        self.slot_positions[:, idx] = self._slot_numbers if filled else -1
        if filled and self.slot_map is not None:
            self.slot_map[:, idx, : self._map_prefix] = self._slot_numbers[: self._map_prefix].to(torch.int16)
        self._reset_order(idx)
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
        self.slot_positions[:, idx] = self._slot_numbers
        if self.slot_map is not None:
            self.slot_map[:, idx, : self._map_prefix] = self._slot_numbers[: self._map_prefix].to(torch.int16)
        self._reset_order(idx)

    def open_with_rows(self, idx: int, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Give request slot ``idx`` a full hot buffer of the given ``padded`` rows (a demoted
        resident request's own pages): slot ``s`` is ``rows[s]`` and holds ``positions[s]``
        (-1: none) in every layer; slots from ``B`` on are the newest-token page. Recency is the
        slot order (the caller puts the rows most worth keeping last)."""
        assert rows.numel() == self.padded == positions.numel()
        self.slot_rows[idx] = rows.to(torch.int32)
        self.capacity[idx] = self.padded
        held = positions[: self.buffer_size].to(torch.int32)
        self.slot_positions[:, idx] = held
        if self.slot_map is not None:
            slots = (held >= 0).nonzero(as_tuple=True)[0]
            self.slot_map[:, idx, held[slots].long()] = slots.to(torch.int16)
        self._reset_order(idx)

    # --- growth ------------------------------------------------------------------------------
    def _slots_for_step(self, seq_len: int) -> int:
        """Slots a one-token step at ``seq_len`` uses: its newest position's slot ``min(seq_len - 1, B)`` and all below."""
        return min(seq_len, self.buffer_size + 1)

    def _slots_for_window(self, start: int) -> int:
        """Slots a verify step writing ``start .. start + N - 1`` uses (the window rule above)."""
        N = self.window
        return start + N if start + N <= self.buffer_size else self.buffer_size + N

    def _rows_to_add(self, have: int, slots: int) -> int:
        return max(0, -(-slots // self.page_size) * self.page_size - have)

    def step_growth(self, idxs: list[int], seq_lens: list[int]) -> int:
        """Free rows a one-token step at ``seq_lens`` takes for these request slots' buffers (whole pages)."""
        return sum(self._rows_to_add(self.capacity[idx], self._slots_for_step(n)) for idx, n in zip(idxs, seq_lens))

    def window_growth(self, idxs: list[int], starts: list[int]) -> int:
        """Free rows a verify step writing from ``starts`` takes for these request slots' buffers."""
        return sum(self._rows_to_add(self.capacity[idx], self._slots_for_window(s)) for idx, s in zip(idxs, starts))

    def growth_after_opening(self, n: int, seq_len: int) -> int:
        """Free rows the one-token step at ``seq_len`` would take for a buffer opened filled now
        with ``n`` positions (what a demoted resident request needs instead of its next page)."""
        keep = min(-(-n // self.page_size) * self.page_size, self.padded)
        return self._rows_to_add(keep, self._slots_for_step(seq_len))

    def grow(self, idxs, seq_lens) -> None:
        """Before a one-token step (``idxs``, ``seq_lens``: int64 CPU tensors or numpy arrays): a
        request whose newest position ``seq_len - 1 <= B`` has no row yet gets the next page(s)
        from the free rows. That only ever happens where the position starts a page (capacities are whole
        pages), so only those requests are looked at."""
        idxs, seq_lens = np.asarray(idxs), np.asarray(seq_lens)
        at_page_start = np.flatnonzero((seq_lens - 1) % self.page_size == 0)
        for idx, seq_len in zip(idxs[at_page_start].tolist(), seq_lens[at_page_start].tolist()):
            self._grow_to(idx, self._slots_for_step(seq_len))

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
        self.slot_rows[idx, have : have + add] = rows.to(torch.int32)
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

    # --- lookups -----------------------------------------------------------------------------
    def rows_of_positions(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) now holding ``positions`` (broadcast with ``req_pool_idx``) as a
        window or fast-path token: slot ``position`` below B, else its window slot (N = 1: slot B)."""
        positions = positions.to(torch.int64)
        B = self.buffer_size
        if self.window_start is None:
            slots = positions.clamp(max=B)
        else:
            slots = torch.where(positions < B, positions, B + positions - self.window_start[req_pool_idx])
        return self.slot_rows[req_pool_idx, slots].to(torch.int64)

    def _reset_order(self, idx: int) -> None:
        """Request slot ``idx``'s recency back to slot order and its history (if any) to zero."""
        self.recency[:, idx] = self._slot_numbers.to(torch.int16)
        if self.history is not None:
            self.history[:, idx] = 0

    # --- closing -----------------------------------------------------------------------------
    def close(self, idx: int) -> None:
        """Give request slot ``idx``'s rows back and reset its tables (idempotent; the slot map
        keeps its entries: with every slot empty none is confirmed). The caller unmaps the
        request's logical ids first. A slot holding no buffer has reset tables already: nothing to do."""
        if not self.capacity[idx]:
            return
        rows = self.slot_rows[idx, : self.capacity[idx]].to(torch.int64)
        self.allocator.release_hot_buffer(rows)
        self.slot_rows[idx].zero_()
        self.capacity[idx] = 0
        self.slot_positions[:, idx] = -1
        self._reset_order(idx)
