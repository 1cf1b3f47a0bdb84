"""Pressure-driven residency: decoding requests keep their whole KV on the device until rows run short.

A *resident* request keeps the device rows its prefill wrote (or, PD, rows loaded from host) and
gets a new row for every decoded token, like a server without HiSparse; the resolver maps its
selected positions to those rows with no copy and no LRU work. Its host copy is kept complete by
the same write-through as any decoding request, so *demotion* to a hot buffer copies nothing: it
keeps ``padded`` of the request's rows (the pages most selected by the last step), frees the others
and clears the mapping; later selections of dropped positions miss and are copied from host.

Mechanism (:class:`Residency`, this module) and policy (:class:`ResidencyPolicy`) are apart:
the policy says whether a request may stay resident, which resident requests to demote first and
which pages a demoted request keeps; the mechanism only moves rows.

Owned state (docs/design.md, "Ownership"): the per-request-slot resident flag ``flags`` (uint8
[max_reqs] on the KV device, read by the resolver), the positions each resident request has on the
device, and its *guarantee*: the rows reserved (``DeviceRows.reserved``) so that it can always
become a hot buffer, ``max(0, padded - its rows)``. Counters: requests admitted resident and
demotions. Promotion back to resident is not done: a demoted request stays a hot-buffer request.

Invariants, per resident request slot ``idx`` with ``n`` positions on the device:
``logical_to_device[req_to_token[idx, p]]`` is its row for every ``p < n`` (its rows are mapped,
not hot-owned, so a logical free releases them); its rows are ``round_up(n, page)`` whole pages;
``rows + guarantee >= padded``; ``hot.holds(idx)`` is false.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ResidencyPolicy:
    """When to stay resident, whom to demote, what a demoted request keeps.

    * Admission: a request stays resident if, after its guarantee and rows, at least
      ``watermark_rows`` device rows stay free (``config.residency_watermark`` of the pool).
    * Pressure: before a decode step, if free rows minus what resident requests need this step
      fall under the watermark, or when a prefill or a hot buffer needs rows, resident requests
      are demoted **longest first** (each demotion frees the most rows, and a hot buffer costs a
      long request the least relative to its attention work), skipping those whose demotion
      frees nothing (at most ``padded`` rows).
    * Kept pages: the pages holding most of the last step's selections (ties: the newer page).
    """

    watermark_rows: int

    def admits(self, room_after: int) -> bool:
        """May a request stay resident, leaving ``room_after`` free device rows?"""
        return room_after >= self.watermark_rows

    @staticmethod
    def victims(reclaimable: dict[int, int], lengths: dict[int, int]) -> list[int]:
        """Resident request slots in demotion order: those whose demotion frees rows, longest first."""
        return sorted((idx for idx, rows in reclaimable.items() if rows > 0), key=lambda idx: -lengths[idx])

    @staticmethod
    def pages_to_keep(scores: torch.Tensor, count: int) -> torch.Tensor:
        """Indices of the ``count`` pages to keep, best last (they take the most recent LRU
        slots). ``scores`` (float [pages]): selections per page; ties go to the newer page."""
        pages = scores.numel()
        ranked = scores.double() + torch.arange(pages, dtype=torch.float64, device=scores.device) / (pages + 1)
        return torch.topk(ranked, count).indices.flip(0)


class Residency:
    """Resident request slots and their rows (see the module docstring).

    ``allocator``: our :class:`~sglang_hisparse.allocator.HiSparseAllocator` (mapping and rows);
    ``hot``: the :class:`~sglang_hisparse.hot_buffers.HotBuffers` a demoted request moves into.
    """

    def __init__(self, allocator, hot, *, max_reqs: int, device: torch.device, policy: ResidencyPolicy):
        self.allocator = allocator
        self.hot = hot
        self.policy = policy
        self.page_size = allocator.page_size
        self.flags = torch.zeros(max_reqs, dtype=torch.uint8, device=device)
        self.lengths: dict[int, int] = {}
        """Resident request slot -> positions with a device row."""
        self._guarantee: dict[int, int] = {}
        self.admitted_total = 0
        self.demotions_total = 0

    # --- queries -----------------------------------------------------------------------------
    def holds(self, idx: int) -> bool:
        return idx in self.lengths

    def count(self) -> int:
        return len(self.lengths)

    def _rows(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def reclaimable(self) -> dict[int, int]:
        """Per resident request slot, the device rows its demotion would free."""
        return {idx: max(0, self._rows(n) - self.hot.padded) for idx, n in self.lengths.items()}

    def reclaimable_rows(self) -> int:
        return sum(self.reclaimable().values())

    def rows_needed(self, idxs: list[int], seq_lens: list[int]) -> int:
        """Device rows (beyond guarantees) the resident requests among ``idxs`` take when their
        newest position ``seq_len - 1`` gets a row: a page where that position starts one."""
        p, need = self.page_size, 0
        for idx, seq_len in zip(idxs, seq_lens):
            if (seq_len - 1) % p == 0 and idx in self.lengths:
                need += max(0, p - self._guarantee[idx])
        return need

    def short_of_a_page(self, idxs: list[int], seq_lens: list[int], room: int) -> list[int]:
        """The resident requests among ``idxs`` to demote so that the others' new pages fit in
        ``room`` free rows (when demoting for rows left nothing to free: e.g. every resident
        request holds exactly ``padded`` rows); longest first."""
        p, need, short = self.page_size, 0, []
        for idx, seq_len in zip(idxs, seq_lens):
            if (seq_len - 1) % p == 0 and idx in self.lengths and self._guarantee[idx] < p:
                need += p - self._guarantee[idx]
                short.append(idx)
        short.sort(key=lambda idx: -self.lengths[idx])
        chosen = []
        for idx in short:
            if need <= room:
                break
            need -= p - self._guarantee[idx]
            chosen.append(idx)
        return chosen

    # --- into residency ----------------------------------------------------------------------
    def admit(self, idx: int, n: int) -> bool:
        """Keep request slot ``idx``'s ``n`` mapped prefill positions on the device, if the policy
        allows. Side effects when it does: the guarantee is reserved, the flag set."""
        guarantee = max(0, self.hot.padded - self._rows(n))
        if not self.policy.admits(self.allocator.rows.room() - guarantee):
            return False
        self.allocator.rows.reserve(guarantee)
        self._enter(idx, n, guarantee)
        return True

    def admit_loaded(self, idx: int, logical_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """PD: rows for a transferred request's ``n = len(logical_ids)`` positions (mapped), if
        the policy allows; the caller loads its KV from host into them. Returns the rows of
        positions ``0..n-1`` (int64), or None with nothing changed."""
        n = logical_ids.numel()
        rows_needed, guarantee = self._rows(n), max(0, self.hot.padded - self._rows(n))
        if not self.policy.admits(self.allocator.rows.room() - rows_needed - guarantee):
            return None
        rows = self.allocator.rows.pages.alloc_tokens(rows_needed)[:n]
        self.allocator.map_logical(logical_ids, rows)
        self.allocator.rows.reserve(guarantee)
        self._enter(idx, n, guarantee)
        return rows

    def _enter(self, idx: int, n: int, guarantee: int) -> None:
        self.lengths[idx] = n
        self._guarantee[idx] = guarantee
        self.flags[idx] = 1
        self.admitted_total += 1

    # --- decode ------------------------------------------------------------------------------
    def own_rows(self, req_to_token: torch.Tensor, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device rows (int64) of resident requests' ``positions``: their mapped logical ids'
        rows (``req_to_token`` is SGLang's position -> logical id table)."""
        return self.allocator.logical_to_device[req_to_token[req_pool_idx, positions].to(torch.int64)]

    def grow(self, idxs: list[int], seq_lens: list[int], logical_of: torch.Tensor) -> torch.Tensor:
        """Rows (int64, one per entry of ``idxs``, all resident, each one token longer than
        before) for each request's newest position ``seq_len - 1``: the next row of its last page,
        or the first row of a new page (from its guarantee first). ``logical_of`` is SGLang's
        req_to_token. The caller made sure enough rows are free (:meth:`rows_needed`)."""
        p, rows = self.page_size, self.allocator.rows
        new_page = []
        for k, (idx, seq_len) in enumerate(zip(idxs, seq_lens)):
            assert seq_len == self.lengths[idx] + 1, "a resident request grows one token per step"
            self.lengths[idx] = seq_len
            if (seq_len - 1) % p == 0:
                from_guarantee = min(p, self._guarantee[idx])
                rows.release_reservation(from_guarantee)
                self._guarantee[idx] -= from_guarantee
                new_page.append(k)
        device = logical_of.device
        newest = self.own_rows(logical_of, torch.tensor(idxs, device=device), torch.tensor(seq_lens, device=device) - 2) + 1
        if new_page:
            pages = rows.pages.alloc_pages(len(new_page))
            assert pages is not None, "resident growth beyond the free rows (pressure relief failed)"
            newest[torch.tensor(new_page, device=newest.device)] = pages.to(newest.device) * p
        return newest

    # --- out of residency --------------------------------------------------------------------
    def demote(self, idx: int, logical_ids: torch.Tensor, selected_rows: Optional[torch.Tensor]) -> None:
        """Move resident request slot ``idx`` (``logical_ids``: its positions ``0..n-1``, all
        written and mirrored on host) into a hot buffer made of its own rows.

        At most ``padded`` rows: all of them (filled buffer, slot p = position p) or, for a longer
        request, the pages holding most of ``selected_rows`` (device rows the last step selected;
        None: the newest pages), the rest freed. Its mapping is cleared. Never fails: the
        guarantee covers a short request's growth.
        """
        n = logical_ids.numel()
        self.allocator.rows.release_reservation(self._guarantee[idx])
        if self._rows(n) <= self.hot.padded:
            opened = self.hot.open(idx, logical_ids, filled=True)
            assert opened is not None, "a resident request's guarantee did not cover its hot buffer"
        else:
            self._demote_long(idx, logical_ids, selected_rows)
        self._leave(idx)
        self.demotions_total += 1

    def _demote_long(self, idx: int, logical_ids: torch.Tensor, selected_rows: Optional[torch.Tensor]) -> None:
        p, n = self.page_size, logical_ids.numel()
        page_starts = self.allocator.device_rows_of(logical_ids[::p])
        scores = torch.zeros(page_starts.numel(), dtype=torch.float64, device=page_starts.device)
        if selected_rows is not None and selected_rows.numel():
            chosen = selected_rows[selected_rows >= 0].to(page_starts.device, torch.int64) // p
            scores = (page_starts.view(-1, 1) // p == chosen.view(1, -1)).sum(1).double()
        keep = self.policy.pages_to_keep(scores, self.hot.padded // p)
        keep = torch.cat([keep[1:], keep[:1]])  # the least useful kept page holds the newest slot B
        rows = self.allocator.rows.keep_pages(page_starts, keep)
        self.allocator.unmap_logical(logical_ids)
        positions = (keep.view(-1, 1) * p + torch.arange(p, device=keep.device)).reshape(-1)
        positions = torch.where(positions < n, positions, -1)
        self.hot.open_with_rows(idx, rows, positions)

    def release(self, idx: int, logical_ids: torch.Tensor) -> None:
        """A resident request leaves: its rows (mapped at ``logical_ids``) and guarantee are freed,
        the mapping cleared (idempotent for a slot that is not resident)."""
        if idx not in self.lengths:
            return
        self.allocator.free_prefill_rows(logical_ids)
        self.allocator.rows.release_reservation(self._guarantee[idx])
        self._leave(idx)

    def _leave(self, idx: int) -> None:
        del self.lengths[idx]
        del self._guarantee[idx]
        self.flags[idx] = 0
