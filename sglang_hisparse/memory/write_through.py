"""Write-through of the host mirror, apart from the mirror's state: the lane its copies run on and
the fences the next forward (or a free) is ordered after (:class:`WriteThroughLane`, mechanism),
which positions a copy covers (:func:`pending_positions`) and when a request is next due
(:func:`due_again_at`, :func:`overwrites_newest_slot`, policy).

Owned state (:class:`WriteThroughLane`, used only through
:class:`~sglang_hisparse.memory.host_mirror.HostMirror`): the write-through
:class:`~sglang_hisparse.memory.copy_lane.CopyLane`, ``last`` (the last copy of any kind) and
``unordered`` (the last copy of rows the next step overwrites, until the forward is ordered after
it). Invariant: ``unordered`` is None or no later than ``last`` on the lane; ordering the current
stream after ``last`` covers ``unordered`` too (lane order), so it clears both.
The functions only read their int64 numpy arrays (views of the mirror's CPU tensors) and change no
state.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from sglang_hisparse.memory.copy_lane import CopyLane, Fence


class WriteThroughLane:
    """The write-through copies' lane and the two fences a consumer stream may wait for."""

    def __init__(self, device: torch.device):
        self._module = torch.get_device_module(device)
        self.lane = CopyLane(device)
        self.last: Optional[Fence] = None
        """The last write-through copy of any kind (lane order: done means every earlier one is)."""
        self.unordered: Optional[Fence] = None
        """The last copy of rows the next step overwrites, until the forward is ordered after it."""

    def submit(self, copy: Callable[[], None], *, after: Iterable[Optional[Any]], reads: Iterable[torch.Tensor],
               urgent: bool) -> None:
        """Run ``copy()`` on the lane after the current stream and the streams ``after``
        (``CopyLane.submit``); it becomes ``last`` and, when ``urgent`` (it reads rows the next step
        overwrites), ``unordered``."""
        self.last = self.lane.submit(copy, after=after, reads=reads)
        if urgent:
            self.unordered = self.last

    def order_forward(self) -> None:
        """Make the current stream wait (on the device) for ``unordered``, then clear it; nothing
        when it is None."""
        if self.unordered is not None:
            self.unordered.order_before(self._module.current_stream())
            self.unordered = None

    def order_all(self) -> None:
        """Make the current stream wait (on the device) for ``last``, then clear both fences;
        nothing when no copy was submitted since the stream was last ordered after them all."""
        if self.last is not None:
            self.last.order_before(self._module.current_stream())
            self.last = self.unordered = None

    def drain(self) -> None:
        """Block the host until every submitted write-through copy finished."""
        self.lane.drain()


def pending_positions(idx: np.ndarray, start: np.ndarray, pending: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flatten the positions ``start[i] .. start[i] + pending[i] - 1`` of each request slot
    ``idx[i]`` (``pending > 0``), request by request: ``(request slots, positions)``. The common
    step, one pending position each (the previous token), returns its inputs with no work."""
    if (pending == 1).all():  # each request's previous token
        return idx, start
    reqs = np.repeat(idx, pending)
    offsets = np.arange(reqs.size) - np.repeat(np.cumsum(pending) - pending, pending)
    return reqs, np.repeat(start, pending) + offsets


def overwrites_newest_slot(end: np.ndarray, buffer_size: int) -> bool:
    """Whether a step's copy, up to position counts ``end`` of the due requests, includes the
    newest slot of some long hot buffer (position ``end - 1 >= buffer_size``): the step's token
    takes that slot, so the forward must be ordered after the copy."""
    return bool((end > buffer_size).any())


def in_newest_slots(start: np.ndarray, end: np.ndarray, buffer_size: int) -> bool:
    """Whether every copied range ``[start, end)`` is one position in its request's newest slot
    (a long hot buffer's previous token): the rows to copy are then the newest slots' rows, the
    rows the step's token takes."""
    return bool(((end - start == 1) & (start >= buffer_size)).all())


def due_requests(idx: np.ndarray, end: np.ndarray,
                 flush_at: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """The requests of a step (slots ``idx``, position counts ``end``) whose pending positions are
    due (``end >= flush_at[idx]``): ``(slots, ends, at)`` with ``at`` their indices in the batch,
    or None when every request is due (the inputs are then returned as they are)."""
    due = end >= flush_at[idx]
    if due.all():
        return idx, end, None
    at = np.flatnonzero(due)
    return idx[at], end[at], at


def due_again_at(end: np.ndarray, *, page_size: int, buffer_size: int) -> np.ndarray:
    """The position count at which requests copied up to ``end`` are next due: the next step in a
    long hot buffer (its newest slot is overwritten every step), else a page later or when the
    buffer's newest slot is reached, whichever comes first."""
    return np.minimum(end + page_size, np.maximum(end + 1, buffer_size + 1))
