"""DeepSeek-V4: the C4 coordinator's decode step, before the forward.

Each step (``map_one_step``): the entry each request completed in the previous step is copied to
host (read through the C4 mapping), then the entry this step's token completes, if any, is mapped
to its row: a hot buffer's slot (a short buffer grows a page where the entry starts one) or, for
a resident request, the next row of its own pages after pressure relief (``ResidentEntries``).
``rows_short`` answers the decode memory check. Owns no state: the rows, hot buffers, mirror and
residency are the coordinator's components.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.resolver.c4_rows import C4_RATIO


class C4Steps:
    def __init__(self, *, rows, hot, mirror, residency, req_to_token: torch.Tensor):
        """``residency``: the coordinator's ``ResidentEntries`` or None (residency off)."""
        self.rows, self.hot, self.mirror, self.req_to_token = rows, hot, mirror, req_to_token
        self.residency: Optional[object] = residency

    def map_one_step(self, out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu) -> None:
        """Before a decode step (``seq_lens_cpu`` include its token): copy each request's entry the
        previous step completed to host, then map the entry this step's token completes (if any)
        to its row: a hot buffer's slot (growing a short buffer by a page where the entry starts
        one) or a resident request's next row of its own pages, after demoting resident requests
        if those pages would leave less than the watermark free."""
        lens, idxs = seq_lens_cpu.tolist(), req_pool_indices_cpu.tolist()
        self._back_up_previous_entries(lens, idxs, req_pool_indices)
        done = [i for i, n in enumerate(lens) if n % C4_RATIO == 0]
        if done:
            self._map_completed_entries(done, lens, idxs, out_cache_loc, req_pool_indices, req_pool_indices_cpu)
        if self.residency is not None:
            self.residency.note_batch(idxs)  # the batch order of this step's selections, for a later demotion

    def _map_completed_entries(self, done: list[int], lens: list[int], idxs: list[int], out_cache_loc,
                               req_pool_indices, req_pool_indices_cpu) -> None:
        """Map the entry each request of batch rows ``done`` completes with this step's token to
        its row (see :meth:`map_one_step`)."""
        completing = [(idxs[i], lens[i] // C4_RATIO) for i in done]
        resident = [False] * len(done)
        if self.residency is not None and self.residency.residency.count():
            self.residency.relieve(completing)  # may demote some of them: they then take the hot path
            resident = [self.residency.residency.holds(idx) for idx, _ in completing]
        device = req_pool_indices.device
        done_t = torch.tensor(done, dtype=torch.int64)
        # index lists go to the device without the host waiting (pageable, non-blocking: staged
        # before the call returns; a blocking copy would sync the stream every step)
        entry_ids = out_cache_loc[done_t.to(device, non_blocking=True)].to(torch.int64) // C4_RATIO
        rows = torch.empty(len(done), dtype=torch.int64, device=device)
        in_hot = [k for k, r in enumerate(resident) if not r]
        if in_hot:
            at = torch.tensor(in_hot, dtype=torch.int64)
            newest = torch.tensor([completing[k][1] - 1 for k in in_hot], dtype=torch.int64)
            sel = done_t[at]  # their batch rows
            self.hot.grow(req_pool_indices_cpu.to(torch.int64)[sel], newest + 1)
            at_sel_newest = torch.stack((at, sel, newest)).to(device, non_blocking=True)
            rows[at_sel_newest[0]] = self.hot.rows_of_positions(req_pool_indices[at_sel_newest[1]], at_sel_newest[2])
        own = [k for k, r in enumerate(resident) if r]
        if own:
            at = torch.tensor(own, dtype=torch.int64).to(device, non_blocking=True)
            rows[at] = self.residency.grow([completing[k][0] for k in own], [completing[k][1] for k in own],
                                           entry_ids[at])
        self.rows.map_logical(entry_ids, rows)

    def _back_up_previous_entries(self, lens: list[int], idxs: list[int], req_pool_indices: torch.Tensor) -> None:
        """The entry each request completed in the previous step (the one after its mirrored
        entries), from its device row to a host row (:meth:`C4Mirror.back_up`). The row is the
        one the previous step mapped the entry's compressed id to (its hot-buffer slot or, resident,
        its own row), read through the mapping: one lookup for the batch, whatever the path."""
        rows_i, reqs, entries = [], [], []
        for i, (n, idx) in enumerate(zip(lens, idxs)):
            completed = (n - 1) // C4_RATIO
            if self.mirror.mirrored[idx] < completed:
                assert self.mirror.mirrored[idx] == completed - 1, "one entry per step at most"
                rows_i.append(i)
                reqs.append(idx)
                entries.append(completed - 1)
        if reqs:
            req_to_token = self.req_to_token
            where = torch.tensor([rows_i, [k * C4_RATIO + C4_RATIO - 1 for k in entries]]).to(req_to_token.device,
                                                                                              non_blocking=True)
            tokens = req_to_token[req_pool_indices[where[0]].to(req_to_token.device, non_blocking=True), where[1]]
            self.mirror.back_up(reqs, entries, self.rows.device_rows_of(tokens.to(torch.int64) // C4_RATIO))

    def rows_short(self, req_pool_indices: list[int], committed_lens: list[int]) -> int:
        """C4 rows the next decode step of these requests lacks (0: it fits), after every
        demotion that could help; no side effects. Only a step whose token completes an entry
        takes a row (a short hot buffer's next page, a resident request's next page)."""
        completing = [(idx, (n + 1) // C4_RATIO) for idx, n in zip(req_pool_indices, committed_lens)
                      if (n + 1) % C4_RATIO == 0]
        if self.residency is not None:
            return self.residency.rows_short(completing)
        need = self.hot.step_growth([idx for idx, _ in completing], [e for _, e in completing])
        return max(0, need - self.rows.rows.room())
