"""Ordered host <-> device copies off the compute stream: a lane of copies and their fences.

A :class:`CopyLane` is one side stream. ``submit`` orders a copy after everything already issued
on the streams it is given, runs it on the lane and returns a :class:`Fence` for it. The
ordering design of sglang-hisparse rests on three facts about a lane:

* copies of one lane complete in submission order, so a fence that is done implies every
  earlier fence of the lane is done (callers may test only the newest one they care about);
* a consumer stream that must read what a copy wrote (or overwrite what it reads) is ordered
  after it on the device with ``fence.order_before(stream)``: no host wait;
* memory a copy reads is marked as used by the lane (``record_stream``), so the caching
  allocator cannot hand it out again before the copy ran, whoever drops the last reference.

On a CPU device streams and events are no-ops: copies run eagerly and fences are done at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch


def order_current_after(stream: Optional[Any], device: torch.device) -> None:
    """Make ``device``'s current stream wait (on the device, no host wait) for everything issued so
    far on ``stream``; nothing for None."""
    if stream is not None:
        torch.get_device_module(device).current_stream().wait_stream(stream)


@dataclass(frozen=True)
class Fence:
    """The completion of one copy on a lane (``seq``: its position in the lane's order)."""

    seq: int
    event: Any = field(compare=False)

    def done(self) -> bool:
        """True once the copy finished (host-side poll; never blocks)."""
        return bool(self.event.query())

    def wait(self) -> None:
        """Block the host until the copy finished."""
        self.event.synchronize()

    def order_before(self, stream: Any) -> None:
        """Make ``stream``'s later work wait on the device for the copy (no host wait)."""
        stream.wait_event(self.event)


class CopyLane:
    """One side stream whose copies complete in submission order (see the module docstring)."""

    def __init__(self, device: torch.device):
        self._module = torch.get_device_module(device)
        self.stream = self._module.Stream()
        self._submitted = 0

    def submit(
        self,
        copy: Callable[[], None],
        *,
        after: Iterable[Optional[Any]] = (),
        reads: Iterable[torch.Tensor] = (),
    ) -> Fence:
        """Run ``copy()`` on the lane after all work issued so far on the current stream and on
        each stream in ``after`` (None entries are skipped). ``reads`` are device tensors the copy
        reads that the caller may drop before the copy ran. Returns the copy's fence.
        """
        current = self._module.current_stream()
        with self._module.stream(self.stream):
            self.stream.wait_stream(current)
            for producer in after:
                if producer is not None:
                    self.stream.wait_stream(producer)
            copy()
            event = self._module.Event()
            event.record(self.stream)
        for tensor in reads:
            if tensor.is_cuda:
                tensor.record_stream(self.stream)
        self._submitted += 1
        return Fence(self._submitted, event)

    def drain(self) -> None:
        """Block the host until every copy submitted so far finished."""
        synchronize = getattr(self.stream, "synchronize", None)
        if synchronize is not None:  # CPU streams have none: their copies already ran
            synchronize()
