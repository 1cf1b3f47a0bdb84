"""Elastic hot buffers (issue 44): long hot-buffer requests grow into rows nobody needs, and give
them back before pressure demotes or retracts anything.

Under pressure, rows are short for whole requests but often not for everyone's buffer: a pool of
R rows serving n hot-buffer requests at B each leaves ``R - n * padded`` rows idle, which larger
buffers turn into fewer misses (doubling B roughly halves them on the recorded traces,
docs/policies.md). Policy (:class:`ElasticBuffers`), every ``interval`` decode steps: the rows
free beyond the residency watermark and one more hot buffer (the next admission's) are shared
equally among the step's long hot-buffer requests, in whole pages, each up to the largest size
(``max_device_buffer_size``) and below its previous token's position (the resolver's fast path
``L <= S`` must stay closed: slots added to a long buffer hold no positions yet; and the previous
token, still pending in the window, must stay where the write-through reads it). Mechanism:
:meth:`HotBuffers.resize <sglang_hisparse.memory.hot_buffers.HotBuffers.resize>`.

Trading residents (:class:`ResidentsForGrowth`): when the free rows cannot grow every long hot
buffer to its limit, the longest resident request is demoted if its rows, less its own buffer's
growth, grow at least two other buffers fully (misses halve roughly when a buffer doubles; a
resident request has none, so one request's grown-buffer misses buy two buffers' halving). Under
uniform pressure (every request long, the pool full) this spreads the rows of a few whole
requests over everyone's buffers.

Giving back (:meth:`ElasticBuffers.give_back`), called by the pressure relief before it demotes
(``decode/pressure.py``) and by a prefill's reclaim: the largest grown buffers shrink first, by
the whole pages the shortfall needs, never below the opening size, so no fewer requests are held
than without elastic buffers. Admission sees the room it would have without them: a request
entering decode, or admitted directly on a PD decode instance, may stay resident if it would have
without grown buffers (``PressureRelief.unlend``), and a PD hot buffer reclaims what SGLang's PD
budget counted as reclaimable before it opens. Ordering of a shrink: the current stream after the
forward in flight (``quiesce``: it may read those rows) and after every write-through copy (which
may read them), then the rows go back to the free list.

Owns: the steps left until the next growth check and the row totals the idle report shows
(:class:`ElasticBuffers`), the count of trades (:class:`ResidentsForGrowth`). The sizes are the hot
buffers' (``hot.sizes``; a buffer that closes is back at the opening size), the rows the
allocator's, residency the driver's.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

ELASTIC_INTERVAL = 32
"""Decode steps between growth checks when ``promotion_interval`` is 0 (else that interval)."""


class ElasticBuffers:
    def __init__(self, hot, allocator, mirror, *, reserve_rows: int, quiesce: Callable[[], None], interval: int,
                 residents: Optional["ResidentsForGrowth"] = None):
        """``reserve_rows``: rows growth leaves free (the residency watermark and one hot buffer).
        ``interval``: decode steps between two growth checks (> 0). ``residents``: the resident
        requests growth may demote (:class:`ResidentsForGrowth`; None: growth uses free rows only)."""
        self.hot, self.allocator, self.mirror = hot, allocator, mirror
        self.reserve_rows, self.quiesce, self.interval = reserve_rows, quiesce, max(1, interval)
        self.residents = residents
        self._steps_left = self.interval
        self.grown_rows_total = 0
        """Rows buffers took by growing, since start (the idle report's ``grown``)."""
        self.given_back_rows_total = 0
        """Rows grown buffers gave back, since start (the idle report's ``given_back``)."""

    @classmethod
    def for_driver(cls, driver, config) -> Optional["ElasticBuffers"]:
        """A residency driver's elastic buffers (``decode/pressure.py``: its hot buffers, allocator,
        mirror, watermark and ``quiesce``), or None when ``config.max_device_buffer_size`` is 0.
        Checks every ``promotion_interval`` steps (:data:`ELASTIC_INTERVAL` when that is 0)."""
        if not config.max_device_buffer_size:
            return None
        reserve = driver.residency.policy.watermark_rows + driver.hot.padded
        return cls(driver.hot, driver.allocator, driver.mirror, reserve_rows=reserve, quiesce=driver.quiesce,
                   interval=config.promotion_interval or ELASTIC_INTERVAL,
                   residents=ResidentsForGrowth(driver.residency, driver.demote))

    def grown(self) -> dict[int, int]:
        """Request slot -> size of every open buffer above the opening size. Reads only."""
        hot = self.hot
        above = np.flatnonzero(hot.sizes.host > hot.open_size).tolist()
        return {idx: hot.sizes.of(idx) for idx in above if hot.holds(idx)}

    def lent_rows(self) -> int:
        """Rows the grown buffers hold above the opening size (what :meth:`give_back` can free)."""
        return sum(size - self.hot.open_size for size in self.grown().values())

    def maybe_grow(self, idxs: torch.Tensor, lens: torch.Tensor, hot_mask: np.ndarray) -> int:
        """Before a one-token step (``idxs``, ``lens``: its int64 CPU tensors, lengths counting the
        new token; ``hot_mask``: which requests decode from a hot buffer): every :attr:`interval`
        steps, grow the long hot buffers into the spare rows (module docstring). Returns the rows
        taken. Host work between checks: one integer decrement."""
        self._steps_left -= 1
        if self._steps_left > 0:
            return 0
        self._steps_left = self.interval
        hot, page = self.hot, self.hot.page_size
        spare = self.allocator.rows.room() - self.reserve_rows
        at = np.flatnonzero(hot_mask)
        if at.size == 0 or (spare < page and self.residents is None):
            return 0
        idx_np, len_np = idxs.numpy()[at], lens.numpy()[at]
        # the most each may take: the table width, and no slot for the previous token's position
        # (len - 2: still pending in the window for this step's write-through) or the newest's
        # (the fast path L <= S stays closed), whole pages
        limits = np.minimum((len_np - 2) // page * page, hot.buffer_size)
        sizes = hot.sizes.host[idx_np]
        long_buffer = [hot.capacity[i] > size for i, size in zip(idx_np.tolist(), sizes.tolist())]
        room = np.maximum(np.where(long_buffer, limits - sizes, 0), 0)
        if not room.any():
            return 0
        if self.residents is not None and spare < int(room.sum()):
            spare += self.residents.trade(int(room.sum()) - spare, hot.buffer_size - hot.open_size)
        if spare < page:
            return 0
        share = max(page, spare // int((room > 0).sum()) // page * page)
        taken = 0
        for idx, size, extra in zip(idx_np.tolist(), sizes.tolist(), np.minimum(room, share).tolist()):
            extra = min(extra, (spare - taken) // page * page)
            if extra <= 0:
                continue
            taken += self.hot.resize(idx, size + extra)
        self.grown_rows_total += taken
        if taken:
            logger.debug("sglang-hisparse: elastic hot buffers took %d rows (%s)", taken, self.allocator.debug_print())
        return taken

    def give_back(self, rows: int) -> int:
        """Shrink grown buffers (largest first, by the pages still short, down to the opening size)
        until ``rows`` device rows are free or none is grown. Returns the rows freed."""
        grown = self.grown()
        if not grown or self.allocator.rows.room() >= rows:
            return 0
        self.quiesce()
        self.mirror.order_after_writes()
        freed, page, floor = 0, self.hot.page_size, self.hot.open_size
        while grown and self.allocator.rows.room() < rows:
            idx = max(grown, key=grown.get)
            size = grown.pop(idx)
            cut = min(size - floor, -(-(rows - self.allocator.rows.room()) // page) * page)
            freed -= self.hot.resize(idx, size - cut)
            if size - cut > floor:
                grown[idx] = size - cut
        self.given_back_rows_total += freed
        return freed


class ResidentsForGrowth:
    """Policy: when free rows cannot grow every long hot buffer to its limit, a long resident
    request is worth more as rows for others' buffers. Misses roughly halve when a buffer doubles
    (docs/policies.md); a resident request has none. Demoting one (its buffer then grows to the
    largest size like the others) loses about one grown buffer's misses and gains one full growth's
    worth for every other buffer its rows grow, so it pays when its rows, net of its own growth,
    grow at least two other buffers fully. Longest first (the residency policy's victim order).
    ``residency``: the driver's; ``demote(idx)``: the driver's demotion (its ordering and write-through)."""

    def __init__(self, residency, demote: Callable[[int], None]):
        self.residency, self.demote = residency, demote
        self.demotions_total = 0
        """Resident requests demoted to grow others' buffers, since start."""

    def trade(self, short: int, full_growth: int) -> int:
        """Demote resident requests (longest first) while the growth still lacks ``short`` rows of
        at least two full growths (``full_growth`` rows each) and the next victim's rows, less its
        own full growth, cover two. Returns the rows the demotions freed. Side effects: demotions."""
        freed_total = 0
        while full_growth > 0 and short >= 2 * full_growth:
            victim = self.residency.first_victim()
            if victim is None:
                break
            freed = self.residency.reclaimable()[victim]
            if freed - full_growth < 2 * full_growth:
                break
            self.demote(victim)
            self.demotions_total += 1
            freed_total += freed
            short -= freed - full_growth
        if freed_total:
            logger.info("sglang-hisparse: %d rows of resident requests traded for hot-buffer growth", freed_total)
        return freed_total
