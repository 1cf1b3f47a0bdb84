"""Per-request hot-buffer sizes: which slots of the slot tables a request uses, and where its rows sit.

The slot tables are ``B`` wide (``table_size``: the kernel's B, ``max_device_buffer_size``); a
request uses the slots ``[0, S)`` of them plus the window (slot ``B`` on for one-token steps), with
``open_size <= S <= B`` (``open_size``: ``device_buffer_size``, every buffer's size when it opens).
With ``S == B`` for every request (``max_device_buffer_size`` not set) this is the fixed layout of
one size, and nothing here changes what the hot buffers did before.

A buffer's rows are counted, not listed: it holds the first ``capacity`` *virtual* slots, where
virtual slot ``k`` is slot ``k`` below ``S`` and window slot ``B + k - S`` from ``S`` on. So a short
request fills slots ``0, 1, ...`` page by page as before, and a buffer that grows or shrinks its
size keeps its window rows where they are (their virtual numbers move with ``S``).

Owned state: ``host`` (int64 numpy [max_reqs], each request slot's S) and, only when sizes can
differ from B, ``device`` (int32 [max_reqs] on the device: the resolver's ``buffer_sizes``,
written in place so that captured graphs see the current sizes). Invariant: ``device`` equals
``host`` wherever it exists (every write goes through :meth:`set`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from sglang_hisparse.errors import HiSparsePluginError


class BufferSizes:
    def __init__(self, *, max_reqs: int, open_size: int, table_size: int, page: int, device: torch.device):
        """Raises HiSparsePluginError when sizes can differ and the two sizes are not whole pages."""
        if not 0 < open_size <= table_size:
            raise ValueError(f"buffer sizes need 0 < open_size <= table_size, got {open_size}, {table_size}")
        if open_size < table_size and (open_size % page or table_size % page):
            raise HiSparsePluginError(
                f"sglang-hisparse: device_buffer_size={open_size} and max_device_buffer_size={table_size} must be "
                f"multiples of the page size ({page}) for elastic hot buffers")
        self.open_size, self.table_size = open_size, table_size
        self.host = np.full(max_reqs, open_size, dtype=np.int64)
        self.device: Optional[torch.Tensor] = (
            torch.full((max_reqs,), open_size, dtype=torch.int32, device=device) if open_size < table_size else None)

    @property
    def elastic(self) -> bool:
        """Whether sizes may differ from the table size (the resolver then needs :attr:`device`)."""
        return self.device is not None

    def of(self, idx: int) -> int:
        return int(self.host[idx])

    def set(self, idx: int, size: int) -> None:
        """Request slot ``idx`` uses ``size`` slots (a device fill, no copy from host memory)."""
        if not self.open_size <= size <= self.table_size:
            raise ValueError(f"buffer size {size} outside [{self.open_size}, {self.table_size}]")
        self.host[idx] = size
        if self.device is not None:
            self.device[idx : idx + 1].fill_(size)

    def runs(self, idx: int, first: int, count: int) -> list[tuple[int, int]]:
        """The slots of request slot ``idx``'s virtual slots ``first .. first + count - 1``, as at
        most two runs ``(first slot, length)``: those below the request's size S (virtual k is
        slot k), then those of the window (virtual k is slot ``B + k - S``). Pure host arithmetic."""
        size = int(self.host[idx])
        below = max(0, min(first + count, size) - first)
        out = [(first, below)] if below else []
        if count > below:
            out.append((self.table_size + first + below - size, count - below))
        return out

    def place(self, slot_rows: torch.Tensor, idx: int, first: int, rows: torch.Tensor) -> None:
        """Write ``rows`` into ``slot_rows[idx]`` (the hot buffers' table) at request slot
        ``idx``'s virtual slots ``first ..`` (none: nothing). Slices only: no index built on the
        host (a pageable copy to the device would wait for the work in flight)."""
        done = 0
        for slot, length in self.runs(idx, first, rows.numel()):
            slot_rows[idx, slot : slot + length] = rows[done : done + length].to(torch.int32)
            done += length

    def rows_held(self, slot_rows: torch.Tensor, idx: int, first: int, count: int) -> torch.Tensor:
        """The rows (int64) in ``slot_rows[idx]`` at request slot ``idx``'s virtual slots
        ``first .. first + count - 1``. Reads only; slices, as :meth:`place`."""
        parts = [slot_rows[idx, slot : slot + length] for slot, length in self.runs(idx, first, count)]
        if not parts:
            return slot_rows.new_zeros(0, dtype=torch.int64)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.int64)

    def step_slots(self, idx: int, seq_len: int) -> int:
        """Virtual slots a one-token step at ``seq_len`` uses: the newest position's and all below."""
        return min(seq_len, int(self.host[idx]) + 1)

    def newest_slots(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots (int64, on ``positions``' device) of one-token steps' positions: slot ``p`` below
        the request's size, else the window slot B. Without elastic sizes the sizes are all B."""
        if self.device is None:
            return positions.clamp(max=self.table_size)
        size = self.device[req_pool_idx].to(torch.int64)
        return torch.where(positions < size, positions, self.table_size)
