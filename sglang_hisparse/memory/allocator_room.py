"""What a :class:`~sglang_hisparse.memory.allocator.HiSparseAllocator` may still hand out: the
admission numbers it reports to SGLang (policy), apart from the free lists it counts (mechanism).

Owned state (one owner: :class:`AllocatorRoom`, used only through the allocator): the host pool's
capacity (``host_capacity``, None until the coordinator configures it), the residency reclaimer
(``reclaim``/``reclaimable``: no-ops until residency installs its own) and the resource that last
limited admission (for the log line when it changes). The free lists it counts (logical ids,
device rows) belong to the allocator's ``PageAllocator`` and ``DeviceRows``; the room only reads
them, except through ``reclaim``, which demotes resident requests to free device rows.

Invariant: every number is a count of tokens (= rows) that is never negative, and
``available() <= decode_room()``: every logical id handed out will need a host slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from sglang_hisparse.memory.device_rows import DeviceRows
from sglang_hisparse.memory.paging import PageAllocator

logger = logging.getLogger("sglang_hisparse.memory.allocator")  # the allocator's log, as before the split


@dataclass(frozen=True)
class Budget:
    """A read-only ``available_size()``: what SGLang's PD decode path reads off the two
    sub-allocators of a HiSparse allocator (``logical_attn_allocator``, ``hisparse_attn_allocator``)."""

    available_size: Callable[[], int]


class AllocatorRoom:
    """Admission room of the dual address space: logical ids, host slots and device rows."""

    def __init__(self, logical: PageAllocator, rows: DeviceRows, logical_size: int, describe: Callable[[], str]):
        self.logical = logical
        self.rows = rows
        self.logical_size = logical_size
        self.describe = describe
        """The allocator's ``debug_print``: the state quoted when the limiting resource changes."""
        self.host_capacity: Optional[int] = None
        self._limited_by: Optional[str] = None
        self._reclaim: Callable[[int], None] = lambda rows: None
        self._reclaimable: Callable[[], int] = lambda: 0

    def set_reclaimer(self, reclaim: Callable[[int], None], reclaimable: Callable[[], int]) -> None:
        """Residency: ``reclaimable()`` device rows can be freed on demand by demoting resident
        requests, and ``reclaim(rows)`` does so until ``rows`` are free (or nothing is left)."""
        self._reclaim, self._reclaimable = reclaim, reclaimable

    def make_room(self, rows: int) -> bool:
        """Whether ``rows`` device rows are free. Side effect: when fewer are, resident requests
        are demoted first (``reclaim``), which frees rows and clears their residency."""
        if rows > self.rows.room():
            self._reclaim(rows)
        return rows <= self.rows.room()

    def logical_used(self) -> int:
        return self.logical_size - self.logical.available_tokens()

    def decode_room(self) -> int:
        """Logical ids that can still be handed out without running out of host slots."""
        logical_free = self.logical.available_tokens()
        host_room = logical_free if self.host_capacity is None else self.host_capacity - self.logical_used()
        return max(0, min(logical_free, host_room))

    def decode_room_with_freed(self, tokens: int) -> int:
        """What :meth:`decode_room` would be with ``tokens`` more logical ids free, and the host rows
        they hold (a prefix-cache eviction's gain). No side effects."""
        logical_free = self.logical.available_tokens() + tokens
        host_room = logical_free if self.host_capacity is None else self.host_capacity - (self.logical_used() - tokens)
        return max(0, min(logical_free, host_room))

    def available_with_freed(self, tokens: int) -> int:
        """What :meth:`available` would be with ``tokens`` more logical ids free, and the host rows
        they hold (a prefix-cache eviction's gain: no device rows come back). No side effects."""
        return min(self.decode_room_with_freed(tokens), self.device_room())

    def device_room(self) -> int:
        """Free device rows plus those that demoting resident requests would free."""
        return self.rows.room() + self._reclaimable()

    def available(self) -> int:
        """The tokens SGLang may admit: the smaller of :meth:`decode_room` and :meth:`device_room`.
        Side effect: logs the resource that limits it (below the free logical ids) when it changes."""
        logical_free = self.logical.available_tokens()
        decode_room = self.decode_room()
        device_room = self.device_room()
        room = max(0, min(decode_room, device_room))
        limited_by = None
        if room < logical_free:
            limited_by = "host pool" if decode_room <= device_room else "device pool (hot buffers)"
        if limited_by != self._limited_by:
            if limited_by is not None:
                logger.info(
                    "sglang-hisparse: admission limited by the %s: %d tokens admissible (%s)",
                    limited_by, room, self.describe(),
                )
            self._limited_by = limited_by
        return room
