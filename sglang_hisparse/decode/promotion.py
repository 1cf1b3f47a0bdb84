"""Promotion: a request decoding from a hot buffer takes rows of its own again when the pool has room.

Issue 44's elastic hot buffers, by whole requests: under pressure residency demotes resident
requests into hot buffers (``decode/pressure.py``); once rows are free again the policy's candidate
(:meth:`~sglang_hisparse.memory.residency.ResidencyPolicy.promotion_candidate`, shortest first)
becomes resident again, if the pool keeps the watermark and one more hot buffer free after it
(:meth:`~sglang_hisparse.memory.residency.Residency.can_promote`). Admission demotes it again when
a prefill needs the rows, as before.

Ordering of a promotion (:meth:`Promotion.promote`), the way back of a demotion's: the current
stream after the forward in flight (``quiesce``), the request's pending positions written through to
host, the stream after that copy; then its hot buffer is closed (its ids unmapped, its rows back to
the free list), it takes whole pages of its own (mapped, marked), and its KV is loaded from host
into them on the current stream, which the step's forward follows. So every position is on the
host before its hot-buffer row is reused, and in its own row before the forward reads it.

Owns one piece of state: the decode steps left until the next check. Everything else belongs to
the components it drives (residency, hot buffers, host mirror, allocator).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from sglang_hisparse.memory.residency import Residency

logger = logging.getLogger(__name__)


class Promotion:
    def __init__(self, residency: Residency, *, hot, mirror, allocator, device_pool, req_to_token: torch.Tensor,
                 quiesce: Callable[[], None], rows_now: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 interval: int):
        """``interval``: decode steps between two checks (``config.promotion_interval``; 0: never).
        ``rows_now``: the device rows holding positions of decoding requests now (the write-through's source)."""
        self.residency, self.hot, self.mirror, self.allocator = residency, hot, mirror, allocator
        self.device_pool, self.req_to_token = device_pool, req_to_token
        self.quiesce, self.rows_now = quiesce, rows_now
        self.interval = interval
        self._steps_left = interval

    @classmethod
    def for_driver(cls, driver, device_pool, interval: int) -> "Promotion":
        """The promotion of a residency driver (``decode/pressure.py``: its residency, tables and
        write-through source), over ``device_pool``."""
        return cls(driver.residency, hot=driver.hot, mirror=driver.mirror, allocator=driver.allocator,
                   device_pool=device_pool, req_to_token=driver.req_to_token, quiesce=driver.quiesce,
                   rows_now=driver.rows_now, interval=interval)

    def maybe_promote(self, idxs: torch.Tensor, lens: torch.Tensor) -> bool:
        """Before a one-token step (``idxs``, ``lens``: its int64 CPU tensors, lengths counting the
        new token): every :attr:`interval` steps, promote the policy's candidate among the step's
        hot-buffer requests if the rows allow. True when one was promoted (the caller reads the
        residency mask after this). Host work between checks: one integer decrement."""
        if not self.interval:
            return False
        self._steps_left -= 1
        if self._steps_left > 0:
            return False
        self._steps_left = self.interval
        idx_np, len_np = idxs.numpy(), lens.numpy()
        in_hot = [b for b in np.flatnonzero(~self.residency.mask(idx_np)).tolist() if self.hot.holds(int(idx_np[b]))]
        positions = {int(idx_np[b]): int(len_np[b]) - 1 for b in in_hot}
        idx = self.residency.policy.promotion_candidate(positions)
        if idx is None or not self.residency.can_promote(idx, positions[idx]):
            return False
        self.promote(idx, positions[idx])
        return True

    def promote(self, idx: int, n: int) -> None:
        """Move hot-buffer request slot ``idx`` (``n`` positions with KV) into rows of its own
        (module docstring, ordering). The caller checked :meth:`Residency.can_promote`."""
        self.quiesce()
        self.mirror.write_through([idx], [n + 1], self.rows_now)  # host complete through n - 1
        self.mirror.order_after_writes()
        logical = self.req_to_token[idx, :n].to(torch.int64)
        self.allocator.unmap_logical(logical)
        self.hot.close(idx)
        rows = self.residency.promote(idx, logical)
        self.mirror.pool.load_rows(self.device_pool, self.mirror.row_table[idx, :n], rows)
        self.mirror.defer(idx)
        logger.info("sglang-hisparse: request slot %d (%d tokens) promoted from its hot buffer to rows of its own (%s)",
                    idx, n, self.allocator.debug_print())
