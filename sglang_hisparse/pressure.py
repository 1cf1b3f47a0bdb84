"""Decode steps with residency on: where each request's newest token goes, and pressure relief.

:class:`ResidentDecode` drives :class:`~sglang_hisparse.residency.Residency` (the mechanism and the
policy) from the coordinator's protocol calls. It owns one piece of state: the batch row of each
request slot in the last decode step (``batch_rows``), which says where that request's last
selections are in the coordinator's resolver output when it is demoted.

Ordering of a demotion (:meth:`ResidentDecode.demote`), with no host wait: the current stream is
ordered after the forward in flight (``quiesce``: it may read the rows and write the selections),
the request's newest position is written through to host, the next forward is ordered after that
copy, and only then do the tables and the mapping change. So the host copy is complete before any
row of the request is freed or reused.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from sglang_hisparse.residency import Residency, ResidencyPolicy

logger = logging.getLogger(__name__)


class ResidentDecode:
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
        self.batch_rows: dict[int, int] = {}
        self.resolver_tables = {"resident": residency.flags, "req_to_token": req_to_token,
                                "logical_to_device": allocator.logical_to_device}
        """The resolver's residency keywords (fixed tensors, CUDA-graph safe)."""

    @classmethod
    def build(cls, config, *, max_reqs: int, device: torch.device, hot, mirror, allocator, **kwargs) -> "ResidentDecode":
        """Residency for a server (``config.residency_watermark`` of the device pool kept free),
        wired into the allocator: admission counts reclaimable rows, a prefill reclaims them."""
        policy = ResidencyPolicy(watermark_rows=math.ceil(config.residency_watermark * allocator.device_size))
        residency = Residency(allocator, hot, max_reqs=max_reqs, device=device, policy=policy)
        driver = cls(residency, hot=hot, mirror=mirror, allocator=allocator, **kwargs)
        allocator.set_reclaimer(driver.reclaim, residency.reclaimable_rows)
        return driver

    def enter(self, idx: int, n: int, open_hot: Callable[[], bool]) -> bool:
        """A staged request of ``n`` positions enters decode: resident if the policy allows,
        else through ``open_hot`` (its hot buffer), demoting resident requests if it does not fit."""
        if self.residency.admit(idx, n) or open_hot():
            return True
        self.reclaim(self.hot.padded)
        return open_hot()

    def rows_now(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) holding ``positions`` now: a resident request's own rows, else the
        hot-buffer slot of a newest or fast-path token."""
        rows = self.hot.rows_of_positions(req_pool_idx, positions)
        if not self.residency.count():
            return rows
        own = self.residency.own_rows(self.req_to_token, req_pool_idx, positions)
        return torch.where(self.residency.flags[req_pool_idx].bool(), own, rows)

    def _hot_growth(self, idxs: list[int], lens: list[int]) -> int:
        """Free rows the hot buffers among ``idxs`` take in the step at ``lens``."""
        lengths = self.residency.lengths
        return self.hot.step_growth(*_unzip([(i, n) for i, n in zip(idxs, lens) if i not in lengths]))

    def rows_short(self, idxs: list[int], lens: list[int]) -> int:
        """Device rows the one-token step at ``lens`` lacks after every demotion that could help
        (0: it fits). What :meth:`newest_rows` reaches by demoting when it must."""
        rows, relief = self.residency.step_need(idxs, lens)
        return max(0, rows + self._hot_growth(idxs, lens) - relief - self.allocator.rows.room())

    def newest_rows(self, idxs: list[int], lens: list[int], req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
        """Rows (int64) for each request's newest position ``seq_len - 1``, after demoting (policy)
        until the step's new rows leave the watermark free, and then until they fit at all
        (requests whose demotion removes a page need, :meth:`Residency.short_of_a_page`). Hot
        buffers and resident requests take their next pages from the free rows."""
        residency, rows = self.residency, self.allocator.rows
        while residency.count() and (rows.room() - residency.rows_needed(idxs, lens) - self._hot_growth(idxs, lens)
                                     < residency.policy.watermark_rows):
            if not self.demote_one():
                break
        for idx in residency.short_of_a_page(idxs, lens, rows.room() - self._hot_growth(idxs, lens)):
            self.demote(idx)
        self.batch_rows = {idx: i for i, idx in enumerate(idxs)}
        resident, hot = [], []
        for k, idx in enumerate(idxs):
            (resident if idx in residency.lengths else hot).append(k)
        if not resident:
            return self.hot.newest_rows(idxs, lens, req_pool_indices, seq_lens)
        own = residency.grow([idxs[k] for k in resident], [lens[k] for k in resident], self.req_to_token)
        if not hot:
            return own
        self.hot.grow([idxs[k] for k in hot], [lens[k] for k in hot])
        rows = self.hot.rows_of_positions(req_pool_indices, seq_lens - 1)
        rows[torch.tensor(resident, dtype=torch.int64, device=rows.device)] = own.to(rows.device)
        return rows

    def reclaim(self, rows: int) -> None:
        """Demote resident requests (policy order) until ``rows`` device rows are free or none is
        left whose demotion frees rows."""
        while self.allocator.rows.room() < rows and self.demote_one():
            pass

    def demote_one(self) -> bool:
        """Demote the policy's first victim (see the module docstring for the ordering); False
        when no demotion would free rows."""
        residency = self.residency
        victims = residency.policy.victims(residency.reclaimable(), residency.lengths)
        if not victims:
            return False
        self.demote(victims[0])
        return True

    def demote(self, idx: int) -> None:
        """Demote resident request slot ``idx`` (see the module docstring for the ordering)."""
        residency = self.residency
        n = residency.lengths[idx]
        self.quiesce()
        self.mirror.write_through([idx], [n + 1], self.rows_now)  # host complete through n - 1
        self.mirror.order_forward_after_write_through()
        row = self.batch_rows.get(idx)
        selected = self.selections[row] if row is not None else None
        residency.demote(idx, self.req_to_token[idx, :n].to(torch.int64), selected)
        logger.info("sglang-hisparse: request slot %d (%d tokens) demoted to a hot buffer (%s)", idx, n,
                    self.allocator.debug_print())


def _unzip(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]
