"""What every layer keeps in the hot buffers' slots: the resolver's per-layer tables.

Per request slot and layer (preallocated, fixed addresses for CUDA graphs; ``width`` slots: the
resolver's B):

* ``positions`` (int32 [layers, max_reqs, width]): the position each slot holds, -1 for none
  (written by the resolver, set here when a buffer opens or a slot is emptied);
* ``recency`` (int16 [layers, max_reqs, width]): each layer's slots, least recently used first
  (written by the resolver, reset here to slot order);
* ``history`` (int16, only with ``replacement: "reuse"``, else None): each layer's packed per-slot
  age and selection count (``resolver/reuse.py``; zeroed here wherever ``recency`` is reset);
* ``slot_map`` (int16 [layers, max_reqs, map_columns], only with ``slot_map: true``, else None):
  each layer's position -> slot map, a hint the resolver validates against ``positions``.
  Invariant: ``positions[l, r, s] == p >= 0`` implies ``slot_map[l, r, p] == s``. Written here
  where slots are filled and by the resolver for each miss; never cleared (stale entries are
  confirmed by no slot).

Owned by :class:`~sglang_hisparse.memory.hot_buffers.HotBuffers` (which also owns the rows); the
resolver writes ``positions``, ``recency``, ``history`` and ``slot_map`` in place.
"""

from __future__ import annotations

from typing import Optional

import torch


class SlotTables:
    def __init__(self, *, layers: int, max_reqs: int, width: int, device: torch.device, history: bool,
                 map_columns: int):
        self.positions = torch.full((layers, max_reqs, width), -1, dtype=torch.int32, device=device)
        self.recency = torch.empty((layers, max_reqs, width), dtype=torch.int16, device=device)
        self._slot_numbers = torch.arange(width, dtype=torch.int32, device=device)
        self.recency.copy_(self._slot_numbers.to(torch.int16).expand_as(self.recency))
        self.history: Optional[torch.Tensor] = (
            torch.zeros((layers, max_reqs, width), dtype=torch.int16, device=device) if history else None)
        self.slot_map: Optional[torch.Tensor] = (
            torch.full((layers, max_reqs, map_columns), -1, dtype=torch.int16, device=device) if map_columns > 0
            else None)
        self._map_prefix = min(width, map_columns)  # positions 0 .. width-1 a filled buffer holds, within the map

    def fill(self, idx: int) -> None:
        """Slot ``p`` holds position ``p`` in every layer (a buffer of the request's first
        positions); recency in slot order."""
        self.positions[:, idx] = self._slot_numbers
        if self.slot_map is not None:
            self.slot_map[:, idx, : self._map_prefix] = self._slot_numbers[: self._map_prefix].to(torch.int16)
        self.reset_order(idx)

    def empty(self, idx: int) -> None:
        """Every slot of request slot ``idx`` holds nothing; recency in slot order."""
        self.positions[:, idx] = -1
        self.reset_order(idx)

    def hold(self, idx: int, held: torch.Tensor) -> None:
        """Slots ``s < len(held)`` hold ``held[s]`` (int32, -1: none) in every layer, the rest
        nothing; recency in slot order."""
        n = held.numel()
        self.positions[:, idx, :n] = held
        self.positions[:, idx, n:] = -1
        if self.slot_map is not None:
            slots = (held >= 0).nonzero(as_tuple=True)[0]
            self.slot_map[:, idx, held[slots].long()] = slots.to(torch.int16)
        self.reset_order(idx)

    def empty_slots(self, idx: int, first: int, end: int) -> None:
        """Slots ``first .. end - 1`` of request slot ``idx`` hold nothing in any layer (their
        recency and history stay: the resolver treats an empty slot as evictable wherever it is)."""
        self.positions[:, idx, first:end] = -1

    def reset_order(self, idx: int) -> None:
        """Request slot ``idx``'s recency back to slot order and its history (if any) to zero."""
        self.recency[:, idx] = self._slot_numbers.to(torch.int16)
        if self.history is not None:
            self.history[:, idx] = 0
