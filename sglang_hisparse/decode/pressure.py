"""Decode steps with residency on: where each request's newest token goes, and pressure relief.

:class:`ResidentDecode` drives :class:`~sglang_hisparse.memory.residency.Residency` (the mechanism and the
policy) from the coordinator's protocol calls. It owns one piece of state: the request slots of
the last decode step in batch order (``_last_batch``), which says where a request's last
selections are in the coordinator's resolver output when it is demoted.

Ordering of a demotion (:meth:`ResidentDecode.demote`), with no host wait: the current stream is
ordered after the forward in flight (``quiesce``: it may read the rows and write the selections),
the request's newest position is written through to host, the next forward is ordered after that
copy, and only then do the tables and the mapping change. So the host copy is complete before any
row of the request is freed or reused.

The way back, promotion, is ``decode/promotion.py`` (:class:`Promotion`, the driver's ``promotion``).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import numpy as np
import torch

from sglang_hisparse.decode.elastic import ElasticBuffers
from sglang_hisparse.decode.promotion import Promotion
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.host_mirror import DEFERRED_FLUSH_STEPS
from sglang_hisparse.memory.residency import Residency, ResidencyPolicy

logger = logging.getLogger(__name__)


class PressureRelief:
    """Demotion under pressure, one algorithm for the DSA driver (:class:`ResidentDecode`) and the
    DeepSeek-V4 one (``decode/c4_residency.py``, ``ResidentEntries``). The driver provides
    ``residency`` (its :class:`Residency`, whose ``allocator.rows`` are the device rows) and
    ``demote(idx)``; the rows a step takes are the driver's own count, passed as ``taken``."""

    residency: Residency
    elastic: Optional[ElasticBuffers] = None
    """Grown hot buffers, given back before any demotion (DSA with ``max_device_buffer_size``)."""

    def demote(self, idx: int) -> None:
        raise NotImplementedError

    def _free_rows(self) -> int:
        return self.residency.allocator.rows.room()

    def reclaim(self, rows: int) -> None:
        """Demote resident requests (policy order) until ``rows`` device rows are free or none is
        left whose demotion frees rows (the allocator's reclaimer, for a prefill)."""
        while self._free_rows() < rows and self.demote_one():
            pass

    def demote_one(self) -> bool:
        """Demote the policy's first victim; False when no demotion would free rows."""
        victim = self.residency.first_victim()
        if victim is None:
            return False
        self.demote(victim)
        return True

    def unlend(self, rows: int) -> None:
        """Shrink grown hot buffers until ``rows`` device rows are free, so an admission sees the
        room it would have without elastic buffers. No demotion; nothing shrinks without elastic
        buffers, when the rows are free already, or when even every lent row would not free them."""
        if self.elastic is not None and self._free_rows() + self.elastic.lent_rows() >= rows:
            self.elastic.give_back(rows)

    def shortfall(self, at_page_start: list[tuple[int, int]], taken: int) -> int:
        """Rows a step taking ``taken`` free rows lacks after every demotion that could help (0: it
        fits); ``at_page_start``: ``(slot, length)`` of the step's requests whose newest position
        starts a page. No side effects."""
        short = taken - self._free_rows()
        if short <= 0:
            return 0
        lent = self.elastic.lent_rows() if self.elastic is not None else 0
        return max(0, short - lent - self.residency.relief(at_page_start))

    def relieve_for(self, at_page_start: list[tuple[int, int]], taken: Callable[[], int]) -> bool:
        """Demote (policy order) until the step's new rows (``taken()``, counted again after each
        demotion) leave the watermark free, then, if they still do not fit, the requests whose
        demotion removes a page need. True when it demoted."""
        residency = self.residency
        demotions = residency.demotions_total
        if self.elastic is not None:  # grown buffers first: shrinking holds every request
            self.elastic.give_back(taken() + residency.policy.watermark_rows)
        while (residency.reclaimable_rows() and
               self._free_rows() - taken() < residency.policy.watermark_rows and self.demote_one()):
            pass
        need = taken()
        if self._free_rows() < need:
            resident_need = residency.rows_needed(at_page_start)
            for idx in residency.short_of_a_page(at_page_start, self._free_rows() - (need - resident_need)):
                self.demote(idx)
        return residency.demotions_total != demotions


class ResidentDecode(PressureRelief):
    def __init__(self, residency: Residency, *, hot, mirror, allocator, req_to_token: torch.Tensor,
                 selections: torch.Tensor, quiesce: Callable[[], None]):
        self.residency = residency
        self.hot = hot
        self.mirror = mirror
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.selections = selections
        """The coordinator's resolver output (int32 [max_reqs, top_k], rows of the last layer)."""
        self.quiesce = quiesce
        self.promotion: Optional[Promotion] = None  # the way back (set by the coordinator: Promotion.for_driver)
        self._last_batch = torch.zeros(0, dtype=torch.int64)
        """The request slots of the last decode step, in batch order (their rows of ``selections``; CPU)."""
        self._steps = 0
        """Decode steps so far (:meth:`flush_deferred`)."""
        self.flush_every = DEFERRED_FLUSH_STEPS
        """Decode steps between two copies of the resident requests' pending positions
        (:meth:`flush_deferred`; a benchmark may change it)."""
        self.resolver_tables = {"resident": residency.flags, "req_to_token": req_to_token,
                                "logical_to_device": allocator.logical_to_device}
        """The resolver's residency keywords (fixed tensors, CUDA-graph safe)."""

    @classmethod
    def build(cls, config, *, max_reqs: int, device: torch.device, hot, mirror, allocator, **kwargs) -> "ResidentDecode":
        """Residency for a server (``config.residency_watermark`` of the device pool kept free),
        wired into the allocator: admission counts reclaimable rows, a prefill reclaims them."""
        policy = ResidencyPolicy(math.ceil(config.residency_watermark * allocator.device_size), hot.padded)
        residency = Residency(allocator, hot, max_reqs=max_reqs, device=device, policy=policy)
        driver = cls(residency, hot=hot, mirror=mirror, allocator=allocator, **kwargs)
        allocator.set_reclaimer(driver.reclaim, driver.reclaimable_rows)
        return driver

    def reclaimable_rows(self) -> int:
        """Rows a prefill can have on demand: resident requests' and grown hot buffers' above their opening size."""
        return self.residency.reclaimable_rows() + (self.elastic.lent_rows() if self.elastic is not None else 0)

    def enter(self, idx: int, logical_ids: torch.Tensor, open_hot: Callable[[], Optional[torch.Tensor]]) -> bool:
        """A staged request (``logical_ids``: its positions' ids) enters decode: resident if the
        policy allows (grown hot buffers give back the watermark's rows first), else through
        ``open_hot`` (its hot buffer, :meth:`open_hot_buffer`)."""
        self.unlend(self.residency.policy.watermark_rows)
        if self.residency.admit(idx, logical_ids):
            self.mirror.defer(idx)
            return True
        return self.open_hot_buffer(open_hot) is not None

    def open_hot_buffer(self, open_hot: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """``open_hot()`` (a hot buffer's opening: its rows, or None when they are not free), once
        more after reclaiming one hot buffer's rows (:meth:`reclaim`) when it did not fit."""
        rows = open_hot()
        if rows is None:
            self.reclaim(self.hot.padded)
            rows = open_hot()
        return rows

    def admit_loaded(self, idx: int, logical_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """PD: :meth:`Residency.admit_loaded` after grown hot buffers gave back what the request's
        pages and the watermark need (:meth:`unlend`). Rows of its positions, or None."""
        page = self.hot.page_size
        self.unlend(-(-logical_ids.numel() // page) * page + self.residency.policy.watermark_rows)
        return self.residency.admit_loaded(idx, logical_ids)

    def rows_now(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) holding ``positions`` now: a resident request's own rows, else the
        hot-buffer slot of a newest or fast-path token."""
        rows = self.hot.rows_of_positions(req_pool_idx, positions)
        if not self.residency.count():
            return rows
        own = self.residency.own_rows(self.req_to_token, req_pool_idx, positions)
        return torch.where(self.residency.flags[req_pool_idx].bool(), own, rows)

    def _rows_taken(self, at_page_start: list[tuple[int, int]]) -> int:
        """Free rows the step takes for the requests of ``at_page_start`` as they are now."""
        residency, p = self.residency, self.hot.page_size
        return sum(p if residency.holds(idx) else self.hot.step_growth([idx], [n]) for idx, n in at_page_start)

    def rows_short(self, at_page_start: list[tuple[int, int]]) -> int:
        """Device rows a one-token step lacks after every demotion that could help (0: it fits).
        ``at_page_start``: ``(slot, seq_len)`` of the step's requests whose newest position
        ``seq_len - 1`` starts a page, the only ones that take free rows (a short hot buffer's
        growth and a resident request's new page both happen there). What :meth:`newest_rows`
        reaches by demoting when it must. No side effects."""
        return self.shortfall(at_page_start, self._rows_taken(at_page_start))

    def _relieve(self, at_page_start: list[tuple[int, int]]) -> bool:
        """Pressure relief before the step's rows are taken (:meth:`PressureRelief.relieve_for`)."""
        return self.relieve_for(at_page_start, lambda: self._rows_taken(at_page_start))

    def resident_step(self, idx_list: list[int], len_list: list[int], idxs: torch.Tensor, lens: torch.Tensor) -> bool:
        """A one-token decode step whose requests are all resident; False, nothing changed, when
        one is not or when pressure relief demoted one (the caller then takes the full path).

        Each request's new id is mapped to its row inside the forward
        (``HiSparseDevicePool.map_resident_writes``) except a page's first id: a request whose
        newest position starts a page takes a page of free rows (after pressure relief), and the
        new logical page (the allocator's, ``allocator.last_decode``) is mapped to it and marked
        resident. Resident requests have no write-through at a step (``HostMirror.defer``).
        ``idx_list``, ``len_list``: the step's slots and lengths; ``idxs``, ``lens``: the same as
        int64 CPU tensors. Host work: Python over the batch, one CPU tensor op (the lengths) and
        one device launch when some request starts a page (``allocator.map_new_pages``). Raises
        HiSparsePluginError when the allocator's last decode step is not this batch's."""
        residency = self.residency
        if not residency.holds_all(idx_list):
            return False
        step = self.allocator.last_decode
        if step is None or step.seq_lens != len_list:
            raise HiSparsePluginError(
                "sglang-hisparse: map_last_loc_to_buffer of a batch whose ids were not handed out by the "
                f"allocator's last alloc_decode (lengths {len_list[:8]} against "
                f"{None if step is None else step.seq_lens[:8]})")
        starts = step.starts
        if starts:
            at_page_start = [(idx_list[b], len_list[b]) for b in starts]
            if self._relieve(at_page_start):
                return False
            self.allocator.map_new_pages(step.pages, residency.grow_pages(at_page_start))
        residency.length[idxs] = lens
        self._last_batch = idxs
        return True

    def flush_deferred(self, idxs: torch.Tensor, lens: torch.Tensor) -> None:
        """Every :attr:`flush_every`-th decode step (counted here), copy the pending
        positions of the batch's resident requests to host in one copy (``idxs``, ``lens``: the
        step's int64 CPU tensors); other steps: nothing."""
        self._steps += 1
        if self._steps % self.flush_every:
            return
        resident = self.residency.mask(idxs)
        if resident.any():
            self.mirror.write_through_deferred(idxs.numpy()[resident], lens.numpy()[resident], self._own_rows)

    def _own_rows(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.residency.own_rows(self.req_to_token, req_pool_idx, positions)

    def newest_rows(self, idxs: torch.Tensor, lens: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, resident: np.ndarray) -> torch.Tensor:
        """Rows (int64, on the device) for each request's newest position ``seq_len - 1``.

        ``idxs``, ``lens`` are the step's int64 CPU tensors, ``resident`` its :meth:`Residency.mask`;
        ``out_cache_loc`` the new tokens' logical ids. A step takes free rows only where a newest
        position starts a page, so only then does it demote (policy) until the new rows leave the
        watermark free, and then until they fit at all (requests whose demotion removes a page
        need, :meth:`Residency.short_of_a_page`); the mask is recomputed after a demotion. A
        resident request's row is its page's first row plus the offset (logical ids, like rows, run
        on within a page; ``allocator.resident_rows_of``) or, starting a page, a new page's first
        row (the page is then marked resident); a hot buffer's is its slot's. Host work: numpy
        operations on the batch, Python only for requests starting a page, and a few device ops."""
        idx_np, len_np = idxs.numpy(), lens.numpy()
        page_start = (len_np - 1) % self.hot.page_size == 0
        if page_start.any():
            at = np.flatnonzero(page_start)
            if self._relieve(list(zip(idx_np[at].tolist(), len_np[at].tolist()))):
                resident = self.residency.mask(idx_np)
        self._last_batch = idxs
        count = int(resident.sum())
        if not count:
            return self.hot.newest_rows(idx_np, len_np, req_pool_indices, seq_lens)
        mixed = count < idx_np.size
        if mixed:
            self.hot.grow(idx_np[~resident], len_np[~resident])
            at = np.flatnonzero(resident)
            new_page, pages = self.residency.grow(idx_np[at], len_np[at], page_start[at])
            new_page = at[new_page]
        else:
            new_page, pages = self.residency.grow(idx_np, len_np, page_start)
        own = self.allocator.resident_rows_of(out_cache_loc)  # page starts: replaced below
        if pages is not None:
            where = torch.from_numpy(new_page).to(own.device, non_blocking=True)
            own[where] = pages.to(own.device) * self.hot.page_size
            self.allocator.mark_resident_pages(out_cache_loc[where], True)
        if not mixed:
            return own
        rows = self.hot.rows_of_positions(req_pool_indices, seq_lens - 1)
        return torch.where(self.residency.flags[req_pool_indices].bool(), own, rows)

    def reclaim(self, rows: int) -> None:
        """Shrink grown hot buffers, then demote resident requests (policy order), until ``rows``
        device rows are free or nothing is left that frees rows."""
        if self.elastic is not None:
            self.elastic.give_back(rows)
        while self.allocator.rows.room() < rows and self.demote_one():
            pass

    def demote(self, idx: int) -> None:
        """Demote resident request slot ``idx`` (see the module docstring for the ordering)."""
        residency = self.residency
        n = residency.length_of(idx)
        self.quiesce()
        self.mirror.write_through([idx], [n + 1], self.rows_now)  # host complete through n - 1
        self.mirror.order_after_writes()
        row = (self._last_batch == idx).nonzero().view(-1)
        selected = self.selections[int(row[0])] if row.numel() else None
        residency.demote(idx, self.req_to_token[idx, :n].to(torch.int64), selected)
        logger.info("sglang-hisparse: request slot %d (%d tokens) demoted to a hot buffer (%s)", idx, n,
                    self.allocator.debug_print())
