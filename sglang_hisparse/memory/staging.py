"""The staging queue of the host mirror: prefilled requests whose rows are being copied to host.

Owned state (one owner: :class:`StagingQueue`, used only through
:class:`~sglang_hisparse.memory.host_mirror.HostMirror`): the staging
:class:`~sglang_hisparse.memory.copy_lane.CopyLane` and the queue of :class:`Staged` entries, one
per :meth:`StagingQueue.submit`, in submission order.

Invariant: the queue's order is the lane's order, and copies of one lane complete in submission
order, so an entry whose fence is done has every entry ahead of it done too; the front of the
queue always finishes first. The queue decides nothing about the requests: the coordinator asks
which ones finished (:meth:`StagingQueue.copied_prefix`) and takes them out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Iterable

import torch

from sglang_hisparse.memory.copy_lane import CopyLane, Fence


@dataclass(frozen=True)
class Staged:
    """A request in staging and the fence of its copy to host."""

    req: Any
    fence: Fence


class StagingQueue:
    """Staging copies on their own lane, so that a long one never delays a decode step."""

    def __init__(self, device: torch.device):
        self.lane = CopyLane(device)
        self.entries: Deque[Staged] = deque()

    def submit(self, req: Any, copy: Callable[[], None], *, reads: Iterable[torch.Tensor]) -> None:
        """Run ``copy()`` on the staging lane after the current stream (``reads``: the device
        tensors it reads, kept from reuse until it ran) and put ``req`` at the back of the queue."""
        fence = self.lane.submit(copy, reads=reads)
        self.entries.append(Staged(req, fence))

    def __len__(self) -> int:
        return len(self.entries)

    def contains(self, req: Any) -> bool:
        return any(entry.req is req for entry in self.entries)

    def copied_prefix(self, *, block: bool) -> list[Any]:
        """The requests at the front of the queue whose copy finished, in order; the queue is
        unchanged. With ``block`` the host first waits for every queued copy."""
        if block and self.entries:
            self.entries[-1].fence.wait()  # one lane: the newest fence done means all are done
        ready = []
        for entry in self.entries:
            if not entry.fence.done():
                break
            ready.append(entry.req)
        return ready

    def pop(self) -> Any:
        """Remove the front entry; returns its request."""
        return self.entries.popleft().req

    def drop(self, req: Any) -> None:
        """Remove ``req``'s entries and block until their copies finished (no effect for a
        request not in the queue)."""
        for entry in list(self.entries):
            if entry.req is req:
                self.entries.remove(entry)
                entry.fence.wait()

    def drain(self) -> None:
        """Block until every copy submitted on the staging lane finished."""
        self.lane.drain()
