"""The bookkeeping of resident request slots, apart from the rows they hold.

:class:`ResidentSlots` records which request slots are resident, the positions each has on the
device (``length``, an int64 CPU tensor [max_reqs], 0 for a slot that is not resident, so that a
decode step updates every resident request in one tensor op), the pages of rows each holds (a
Python dict, so that a page start costs no tensor op) and the rows demoting all of them would free
(a running total, so that the decode memory check does no per-request work). It moves no rows and
touches no device tensor: :class:`~sglang_hisparse.memory.residency.Residency` (a subclass) moves
the rows and keeps this record up to date through :meth:`ResidentSlots._set_length` and
:meth:`ResidentSlots._set_pages`, the only writers besides whole-batch updates of ``length``
within requests' last pages.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class ResidentSlots:
    """Resident request slots, their positions on the device and their pages (see the module
    docstring). ``page_size``: rows per page; ``padded``: the rows a hot buffer keeps (a demoted
    request keeps at most that many of its rows and frees the others)."""

    def __init__(self, *, max_reqs: int, page_size: int, padded: int):
        self.page_size = page_size
        self._padded = padded
        self.length = torch.zeros(max_reqs, dtype=torch.int64)
        """Per request slot, the positions a resident request has on the device (0: not resident)."""
        self._members: set[int] = set()
        self._pages: dict[int, int] = {}
        """Per resident request slot, the pages of rows it holds (Python, so that a page start
        costs no tensor op)."""
        self._reclaimable_total = 0
        """Sum of :meth:`reclaimable` (kept up to date on every change of ``length``)."""

    # --- queries -----------------------------------------------------------------------------
    def holds(self, idx: int) -> bool:
        return idx in self._members

    def count(self) -> int:
        return len(self._members)

    def holds_all(self, idxs: list[int]) -> bool:
        """Are all these request slots resident? (Python set work, no tensor op.)"""
        return self._members.issuperset(idxs)

    def length_of(self, idx: int) -> int:
        """Positions resident slot ``idx`` has on the device."""
        return int(self.length[idx])

    @property
    def lengths(self) -> dict[int, int]:
        """Resident request slot -> positions on the device (a copy; per-request work: not for the
        decode step's hot path, which uses :meth:`mask` and ``length``)."""
        return {idx: int(self.length[idx]) for idx in self._members}

    def mask(self, idxs) -> np.ndarray:
        """Which of the request slots ``idxs`` (int64 CPU tensor or numpy array) are resident (a
        bool numpy array: two numpy operations, no torch op)."""
        return self.length.numpy()[np.asarray(idxs)] > 0

    def reclaimable(self) -> dict[int, int]:
        """Per resident request slot, the device rows its demotion would free."""
        return {idx: self._over_padded(pages) for idx, pages in self._pages.items()}

    def reclaimable_rows(self) -> int:
        """The rows demoting every resident request would free (no per-request work)."""
        return self._reclaimable_total

    # --- the writers -------------------------------------------------------------------------
    def _rows(self, n: int) -> int:
        """Rows of the whole pages holding ``n`` positions."""
        return -(-n // self.page_size) * self.page_size

    def _over_padded(self, pages: int) -> int:
        """Rows a resident request holding ``pages`` pages frees when demoted."""
        return max(0, pages * self.page_size - self._padded)

    def _set_pages(self, idx: int, pages: Optional[int]) -> None:
        """The writer of one slot's page count (None: the slot leaves), keeping the reclaimable
        total and the members."""
        if idx in self._members:
            self._reclaimable_total -= self._over_padded(self._pages.pop(idx))
        if pages is None:
            self._members.discard(idx)
        else:
            self._members.add(idx)
            self._pages[idx] = pages
            self._reclaimable_total += self._over_padded(pages)

    def _set_length(self, idx: int, n: Optional[int]) -> None:
        """The writer of one slot's ``length`` (None: the slot leaves), keeping the reclaimable
        total and the members (``Residency.grow`` updates many slots at once)."""
        if n is None:
            self._set_pages(idx, None)
            self.length[idx] = 0
        else:
            assert n > 0, "a resident request has positions on the device"
            self._set_pages(idx, -(-n // self.page_size))
            self.length[idx] = n
