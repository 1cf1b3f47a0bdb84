"""DeepSeek-V4: residency of C4 entries, and demotion to a hot buffer under pressure.

Opt-in (``"residency": true``): V4's default is hot buffers, which decoded faster on an H100 under
pressure (``config.V4_RESIDENCY_DEFAULT``); residency's host work per step was cut after that
measurement (rows read through the mapping, docs/deepseek_v4/gpu-probe.md) and is not re-measured.

The DSA path's mechanism and policy (:class:`~sglang_hisparse.memory.residency.Residency`,
:class:`~sglang_hisparse.memory.residency.ResidencyPolicy`) work unchanged in the compressed view:
positions are a request's completed C4 entries, logical ids their compressed ids, rows the C4
rows (:class:`~sglang_hisparse.memory.c4_allocator.C4Rows`, pages of 64 entries; a compressed
id's in-page offset is its entry's, so a resident request's entry ``k`` sits at the row of its
page's first entry plus ``k % 64``). A resident request keeps the rows its prefill wrote (or, PD,
rows its entries are loaded into) and takes the next row of its own pages for each entry a
decode step completes; the resolver reads its entries there (``req_to_token`` at each entry's
last token, divided by 4, through the C4 mapping) with no copy and no LRU work.

:class:`ResidentEntries` is what differs from DSA, and its only state is the request slots of the
last decode step in batch order (``_last_batch``: where a demoted request's last selections are):

* Growth: an entry completes only every 4th step, and the coordinator maps it on the host before
  the forward (no mapping inside the forward, no deferred write-through: a resident request's
  entries are copied to host one step after they complete, like a hot buffer's).
* Demotion: the hot buffer keeps at most ``padded`` of the request's rows (DSA's choice of pages);
  then the request's newest entry ``E - 1``, which a hot buffer holds in slot ``B`` (the resolver
  reads it there until the next entry completes), is copied into that slot's row from the row it
  had (in every C4 layer, before any freed row can be written again), since unlike a DSA token it
  is not rewritten by the next step. Before any row is freed the current stream is ordered after
  the forward in flight and the request's entries are all on host (an entry completed by the last
  forward is backed up first).
* Pressure: a decode step takes rows where a short hot buffer grows a page or a resident
  request's new entry starts a page; when they do not fit (or leave less than the watermark),
  resident requests are demoted longest first; a prefill short of rows demotes through the
  allocator's reclaimer (``C4Allocator.set_reclaimer``).

No promotion for C4 entries (a demoted request stays in its hot buffer until it finishes).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import numpy as np
import torch

from sglang_hisparse.decode.pressure import PressureRelief
from sglang_hisparse.memory.residency import Residency, ResidencyPolicy
from sglang_hisparse.resolver.c4_rows import C4_RATIO, C4PagedRows

logger = logging.getLogger(__name__)


class ResidentEntries(PressureRelief):
    def __init__(self, residency: Residency, *, rows, hot, mirror, device_pool, req_to_token: torch.Tensor,
                 selections: torch.Tensor, quiesce: Callable[[], None]):
        self.residency = residency
        self.rows = rows
        self.hot = hot
        self.mirror = mirror
        self.device_pool = device_pool
        self.req_to_token = req_to_token
        self.selections = selections
        """The resolver's output (int32 [max_reqs, top_k]: rows of the last C4 layer resolved)."""
        self.quiesce = quiesce
        self._last_batch = torch.zeros(0, dtype=torch.int64)
        self.resolver_tables = {"resident": residency.flags, "req_to_token": req_to_token,
                                "logical_to_device": rows.logical_to_device}
        """The resolver's residency keywords (fixed tensors, CUDA-graph safe)."""

    @classmethod
    def build(cls, watermark: float, *, rows, hot, max_reqs: int, device: torch.device, **kwargs) -> "ResidentEntries":
        """Residency keeping ``watermark`` of the C4 rows free (one more hot buffer of headroom:
        the DSA policy's promotion margin, unused here)."""
        policy = ResidencyPolicy(math.ceil(watermark * rows.device_size), hot.padded)
        return cls(Residency(rows, hot, max_reqs=max_reqs, device=device, policy=policy), rows=rows, hot=hot, **kwargs)

    # --- entering --------------------------------------------------------------------------------
    def admit(self, idx: int, entry_ids: torch.Tensor) -> bool:
        """After staging: keep the request's prefill rows (its ``entry_ids`` are mapped to them) if
        the policy allows. A request with no entry yet is never resident (it opens an empty buffer)."""
        return entry_ids.numel() > 0 and self.residency.admit(idx, entry_ids)

    def admit_loaded(self, idx: int, entry_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """PD: rows of its own for a transferred request's entries (mapped), if the policy allows;
        the caller loads them from host. None (nothing changed) otherwise."""
        if entry_ids.numel() == 0:
            return None
        return self.residency.admit_loaded(idx, entry_ids)

    # --- decode steps ----------------------------------------------------------------------------
    def note_batch(self, idxs: list[int]) -> None:
        """The request slots of the step about to run, in batch order: its selections' rows."""
        self._last_batch = torch.tensor(idxs, dtype=torch.int64)

    def entry_ids(self, idx: int, entries: int) -> torch.Tensor:
        """Compressed ids (int64) of request slot ``idx``'s first ``entries`` entries."""
        columns = torch.arange(entries, device=self.req_to_token.device) * C4_RATIO + (C4_RATIO - 1)
        return self.req_to_token[idx, columns].to(torch.int64) // C4_RATIO

    def step_rows_needed(self, completing: list[tuple[int, int]]) -> int:
        """Free rows a step takes for the requests ``(slot, entries after the step)`` whose token
        completes an entry: a page for a resident one starting a page, a short hot buffer's growth."""
        p, residency = self.hot.page_size, self.residency
        need = 0
        for idx, entries in completing:
            if residency.holds(idx):
                need += p if (entries - 1) % p == 0 else 0
            else:
                need += self.hot.step_growth([idx], [entries])
        return need

    def rows_short(self, completing: list[tuple[int, int]]) -> int:
        """C4 rows the step lacks after every demotion that could help (0: it fits). No side effects."""
        return self.shortfall(self._at_page_start(completing), self.step_rows_needed(completing))

    def relieve(self, completing: list[tuple[int, int]]) -> None:
        """Before the step's rows are taken: demote (policy order) until they leave the watermark
        free, then the requests whose demotion removes a page need until they fit."""
        self.relieve_for(self._at_page_start(completing), lambda: self.step_rows_needed(completing))

    def _at_page_start(self, completing: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The requests among ``completing`` whose new entry starts a page."""
        return [(idx, n) for idx, n in completing if (n - 1) % self.hot.page_size == 0]

    def grow(self, idxs: list[int], entries: list[int], entry_ids: torch.Tensor) -> torch.Tensor:
        """Resident requests ``idxs`` whose step completes their entry ``entries[i] - 1``
        (compressed ids ``entry_ids``, on the device): the row each new entry goes to (int64): a
        new page's first row where it starts one, else the row at its offset in its last page
        (whose first entry is mapped). The caller relieved pressure first and maps the rows."""
        idx_np, n_np = np.asarray(idxs, dtype=np.int64), np.asarray(entries, dtype=np.int64)
        new_page, pages = self.residency.grow(idx_np, n_np)
        rows = self.rows.resident_rows_of(entry_ids)
        if pages is not None:
            where = torch.from_numpy(new_page).to(rows.device, non_blocking=True)  # no host wait
            rows[where] = pages.to(rows.device, non_blocking=True) * self.hot.page_size
        return rows

    # --- demotion (reclaim, demote_one: PressureRelief) ------------------------------------------
    def demote(self, idx: int) -> None:
        """Resident request slot ``idx`` with ``E`` entries moves into a hot buffer of its own
        rows (see the module docstring for the ordering)."""
        E, B = self.residency.length_of(idx), self.hot.buffer_size
        self.quiesce()
        entry_ids = self.entry_ids(idx, E)
        newest_row = self.rows.resident_rows_of(entry_ids[E - 1:])
        pending = self.mirror.mirrored[idx]
        if pending < E:  # completed by the last forward, not yet on host
            assert pending == E - 1, "one entry per step at most"
            self.mirror.back_up([idx], [E - 1], newest_row)
        self.mirror.order_after_copies()  # host complete before any row is freed or reused
        row = (self._last_batch == idx).nonzero().view(-1)
        selected = self.selections[int(row[0])] if row.numel() else None
        self.residency.demote(idx, entry_ids, selected)
        if E > B:  # slot B holds the newest entry in a hot buffer
            self._copy_rows(newest_row, self.hot.slot_rows[idx, B:B + 1].to(torch.int64))
        logger.info("sglang-hisparse: request slot %d (%d C4 entries) demoted to a hot buffer (%s)", idx, E,
                    self.rows.debug_print())

    def _copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy C4 rows ``src`` onto ``dst`` in every C4 layer (device to device, current stream;
        the rows were read before the demotion freed any, and nothing writes a freed row before
        this copy on the same stream)."""
        for layer in range(self.device_pool.layer_num):
            view = C4PagedRows(self.device_pool.kv_buffer[layer])
            view.write(dst, view.read(src))
