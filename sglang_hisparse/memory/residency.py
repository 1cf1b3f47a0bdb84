"""Pressure-driven residency: decoding requests keep their whole KV on the device until rows run short.

A *resident* request keeps the device rows its prefill wrote (or, PD, rows loaded from host) and
gets a new row for every decoded token, like a server without HiSparse; the resolver maps its
selected positions to those rows with no copy and no LRU work. Its host copy is kept complete by
the same write-through as any decoding request, so *demotion* to a hot buffer copies nothing: it
keeps ``padded`` of the request's rows (the pages most selected by the last step), frees the others
and clears the mapping; later selections of dropped positions miss and are copied from host.

Mechanism (:class:`Residency`, this module) and policy (:class:`ResidencyPolicy`) are apart:
the policy says whether a request may stay resident, which resident requests to demote first and
which pages a demoted request keeps; the mechanism only moves rows, and keeps the record of who is
resident with how many positions and pages in its base class
(:class:`~sglang_hisparse.memory.resident_slots.ResidentSlots`).

*Promotion* is the way back: a request decoding from a hot buffer whose whole KV fits in free rows,
leaving the watermark and one more hot buffer free, takes rows of its own again; its caller
(``decode/promotion.py``) closes its hot buffer first and loads its KV from host into the rows.

Owned state (docs/design.md, "Ownership"): the per-request-slot resident flag ``flags`` (uint8
[max_reqs] on the KV device, read by the resolver) and the positions each resident request has on
the device (``length``, an int64 CPU tensor [max_reqs], 0 for a slot that is not resident, so that
a decode step updates every resident request in one tensor op). Counters: requests admitted
resident, demotions and promotions.

A resident request holds exactly the rows a server without HiSparse gives it, and nothing is set
aside for it: its next page comes from the free rows (checked before each decode step, with
demotions counted as relief: :meth:`Residency.relief`), and demoting it never needs rows (it
keeps at most ``padded`` of its own).

Invariants, per resident request slot ``idx`` with ``n`` positions on the device: its rows are
``round_up(n, page)`` whole pages, not hot-owned (a logical free releases them); its logical pages
are marked in ``allocator.page_resident`` (cleared at demotion, or by the free of its ids when it
finishes); the first id of each of its pages is mapped by the host
to the page's first row, and ``logical_to_device[req_to_token[idx, p]]`` is the row of every
``p < n`` once the forward that wrote ``p`` ran (the device pool maps ids past a page's first
inside the forward); host code reads resident rows from page starts
(``allocator.resident_rows_of``) or after waiting for the forward in flight; ``hot.holds(idx)`` is
false.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.resident_slots import ResidentSlots


@dataclass(frozen=True)
class ResidencyPolicy:
    """When to stay resident, whom to demote, what a demoted request keeps.

    * Admission: a request stays resident if, with its rows on the device, at least
      ``watermark_rows`` device rows stay free (``config.residency_watermark`` of the pool).
    * Pressure: before a decode step, if free rows minus what resident requests need this step
      fall under the watermark, or when a prefill or a hot buffer needs rows, resident requests
      are demoted **longest first** (each demotion frees the most rows, and a hot buffer costs a
      long request the least relative to its attention work), skipping those whose demotion
      frees nothing (at most ``padded`` rows).
    * Kept pages: the pages holding most of the last step's selections (ties: the newer page).
    * Promotion (back from a hot buffer): the shortest candidate first (the fewest rows to load, and
      the last a later demotion would take), only if ``watermark_rows + headroom_rows`` device
      rows stay free after it (``headroom_rows``: one hot buffer, so that the next admission
      needs no demotion of it).
    """

    watermark_rows: int
    headroom_rows: int = 0

    def admits(self, room_after: int) -> bool:
        """May a request stay resident, leaving ``room_after`` free device rows?"""
        return room_after >= self.watermark_rows

    def promotes(self, room_after: int) -> bool:
        """May a hot-buffer request become resident, leaving ``room_after`` free device rows?"""
        return room_after >= self.watermark_rows + self.headroom_rows

    @staticmethod
    def promotion_candidate(lengths: dict[int, int]) -> Optional[int]:
        """The request slot to promote first among ``lengths`` (slot -> positions): the shortest
        (ties: the lower slot); None for none."""
        return min(lengths, key=lambda idx: (lengths[idx], idx)) if lengths else None

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


class Residency(ResidentSlots):
    """Resident request slots and their rows (module docstring; who is resident, with how many
    positions and pages: :class:`ResidentSlots`). ``allocator``: the rows and mapping (DSA's
    ``HiSparseAllocator``, or DeepSeek-V4's ``C4Rows``); ``hot``: the hot buffers a demoted request
    moves into."""

    def __init__(self, allocator, hot, *, max_reqs: int, device: torch.device, policy: ResidencyPolicy):
        super().__init__(max_reqs=max_reqs, page_size=allocator.page_size, padded=hot.padded)
        self.allocator = allocator
        self.hot = hot
        self.policy = policy
        self.flags = torch.zeros(max_reqs, dtype=torch.uint8, device=device)
        self.admitted_total = 0
        self.demotions_total = 0
        self.promotions_total = 0

    # --- pressure ----------------------------------------------------------------------------
    def rows_needed(self, at_page_start: list[tuple[int, int]]) -> int:
        """Free rows the resident requests among ``at_page_start`` (``(slot, seq_len)`` of requests
        whose newest position ``seq_len - 1`` starts a page) take in a one-token step: a page each."""
        return self.page_size * sum(idx in self._members for idx, _ in at_page_start)

    def page_saved_by_demotion(self, idx: int, seq_len: int) -> int:
        """Rows of this step's page need that demoting resident ``idx``, whose newest position
        ``seq_len - 1`` starts a page, removes (its hot buffer would hold that position in a slot
        it already has: a request holding exactly ``padded`` rows)."""
        return self.page_size - self.hot.growth_after_opening(self.length_of(idx), seq_len)

    def relief(self, at_page_start: list[tuple[int, int]]) -> int:
        """The most that demotions can make up for in a one-token step: the rows every resident
        request's demotion frees plus the page needs of ``at_page_start`` that demotion removes."""
        return self._reclaimable_total + sum(self.page_saved_by_demotion(idx, n) for idx, n in at_page_start
                                             if idx in self._members)

    def first_victim(self) -> Optional[int]:
        """The resident slot to demote next (policy order); None when no demotion frees rows."""
        return next(iter(self.policy.victims(self.reclaimable(), self.lengths)), None)

    def short_of_a_page(self, at_page_start: list[tuple[int, int]], room: int) -> list[int]:
        """The resident requests among ``at_page_start`` to demote so that the others' new pages
        fit in ``room`` free rows when demoting for rows left nothing to free (a request holding
        exactly ``padded`` rows whose next position is its hot buffer's newest slot needs no page
        once demoted); longest first."""
        need = self.rows_needed(at_page_start)
        saving = {idx: self.page_saved_by_demotion(idx, n) for idx, n in at_page_start if idx in self._members}
        chosen = []
        for idx in sorted((i for i, s in saving.items() if s > 0), key=lambda i: -self.length_of(i)):
            if need <= room:
                break
            need -= saving[idx]
            chosen.append(idx)
        return chosen

    # --- into residency ----------------------------------------------------------------------
    def admit(self, idx: int, logical_ids: torch.Tensor) -> bool:
        """Keep request slot ``idx``'s mapped prefill positions (``logical_ids``, positions
        ``0..n-1``, page aligned from 0) on the device, if the policy allows (its rows are already
        held). Side effects when it does: the flag set, its logical pages marked resident."""
        if not self.policy.admits(self.allocator.rows.room()):
            return False
        self._enter(idx, logical_ids)
        self.admitted_total += 1
        return True

    def admit_loaded(self, idx: int, logical_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """PD: rows for a transferred request's ``n = len(logical_ids)`` positions (mapped), if
        the policy allows; the caller loads its KV from host into them. Returns the rows of
        positions ``0..n-1`` (int64), or None with nothing changed."""
        n = logical_ids.numel()
        rows_needed = self._rows(n)
        if rows_needed > self.allocator.rows.room() or not self.policy.admits(self.allocator.rows.room() - rows_needed):
            return None
        rows = self.allocator.rows.pages.alloc_tokens(rows_needed)[:n]
        self.allocator.map_logical(logical_ids, rows)
        self._enter(idx, logical_ids)
        self.admitted_total += 1
        return rows

    def can_promote(self, idx: int, n: int) -> bool:
        """Whether hot-buffer request slot ``idx`` with ``n`` positions may be promoted now (its
        buffer's rows count as free: they are given back first). No side effects."""
        room_after = self.allocator.rows.room() + self.hot.capacity[idx] - self._rows(n)
        return self.policy.promotes(room_after)

    def promote(self, idx: int, logical_ids: torch.Tensor) -> torch.Tensor:
        """Hot-buffer request slot ``idx`` becomes resident: rows for its ``n = len(logical_ids)``
        positions (whole pages, mapped, marked). The caller checked :meth:`can_promote`, closed its
        hot buffer (unmapping its ids) and loads its KV from host into the returned rows (int64,
        positions ``0..n-1``). HiSparsePluginError when the rows are not free (a caller bug)."""
        rows_needed = self._rows(logical_ids.numel())
        if rows_needed > self.allocator.rows.room():
            raise HiSparsePluginError(f"sglang-hisparse: promotion of request slot {idx} needs {rows_needed} free "
                                      f"device rows ({self.allocator.debug_print()})")
        rows = self.allocator.rows.pages.alloc_tokens(rows_needed)[: logical_ids.numel()]
        self.allocator.map_logical(logical_ids, rows)
        self._enter(idx, logical_ids)
        self.promotions_total += 1
        return rows

    def _enter(self, idx: int, logical_ids: torch.Tensor) -> None:
        self._set_length(idx, logical_ids.numel())
        self.flags[idx].fill_(1)  # fill_: ``flags[idx] = 1`` copies the scalar from pageable memory (a sync)
        self.allocator.mark_resident_pages(logical_ids[:: self.page_size], True)

    # --- decode ------------------------------------------------------------------------------
    def own_rows(self, req_to_token: torch.Tensor, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device rows (int64) of resident requests' ``positions``: their mapped logical ids'
        rows (``req_to_token`` is SGLang's position -> logical id table), from their pages' first
        rows (the others may be mapped only by a forward in flight)."""
        return self.allocator.resident_rows_of(req_to_token[req_pool_idx, positions].to(torch.int64))

    def grow(self, idxs: np.ndarray, seq_lens: np.ndarray, page_start: Optional[np.ndarray] = None
             ) -> tuple[np.ndarray, Optional[torch.Tensor]]:
        """Resident requests ``idxs`` (int64 numpy array), each one token longer than before
        (``seq_lens``, int64 numpy), take rows for their newest position ``seq_len - 1``: the next
        row of their last page, or a new page of free rows where the position starts one. Returns
        the indices into ``idxs`` of those that took a page (int64 numpy) and the pages (int64 CPU
        tensor, in that order; None when none did). The caller made sure enough rows are free
        (:meth:`rows_needed`) and computes the rows themselves on the device. numpy operations on
        the whole batch; Python work only for the requests that start a page. ``page_start``: the
        caller's ``(seq_lens - 1) % page == 0`` for these requests, when it has it."""
        p = self.page_size
        new_page = np.flatnonzero((seq_lens - 1) % p == 0 if page_start is None else page_start)
        pages = None
        if new_page.size:
            pages = self.grow_pages(list(zip(idxs[new_page].tolist(), seq_lens[new_page].tolist())))
        self.length.numpy()[idxs] = seq_lens  # within their last page: the reclaimable total is unchanged
        return new_page, pages

    def grow_pages(self, at_page_start: list[tuple[int, int]]) -> torch.Tensor:
        """Resident requests ``(slot, seq_len)`` whose newest position ``seq_len - 1`` starts a
        page take a page of free rows each; returns the pages (int64, in that order). The caller
        made sure they are free (:meth:`rows_needed`), maps the new pages and sets the other
        requests' lengths (``length``) after. Python work per request, one view of the free list."""
        pages = self.allocator.rows.pages.alloc_pages(len(at_page_start))
        if pages is None:
            raise HiSparsePluginError(
                f"sglang-hisparse: no free device rows for the next page of {len(at_page_start)} resident "
                f"request(s) ({self.allocator.debug_print()}); the decode memory check should have retracted "
                "a request")
        p = self.page_size
        for idx, seq_len in at_page_start:
            held = self._pages[idx]
            assert seq_len - 1 == held * p, "a resident request starts its next page one token at a time"
            self._set_pages(idx, held + 1)
        return pages

    # --- out of residency --------------------------------------------------------------------
    def demote(self, idx: int, logical_ids: torch.Tensor, selected_rows: Optional[torch.Tensor]) -> None:
        """Move resident request slot ``idx`` (``logical_ids``: its positions ``0..n-1``, all
        written and mirrored on host) into a hot buffer made of its own rows.

        At most ``padded`` rows: all of them (filled buffer, slot p = position p) or, for a longer
        request, the pages holding most of ``selected_rows`` (device rows the last step selected;
        None: the newest pages), the rest freed. Its mapping is cleared. Never fails: the
        buffer is made of rows the request holds.
        """
        n = logical_ids.numel()
        if self._rows(n) <= self.hot.padded:
            opened = self.hot.open(idx, logical_ids, filled=True)
            assert opened is not None, "a resident request's own pages did not make its hot buffer"
        else:
            self._demote_long(idx, logical_ids, selected_rows)
        self._leave(idx, logical_ids)
        self.demotions_total += 1

    def _demote_long(self, idx: int, logical_ids: torch.Tensor, selected_rows: Optional[torch.Tensor]) -> None:
        p, n = self.page_size, logical_ids.numel()
        page_starts = self.allocator.device_rows_of(logical_ids[::p])
        scores = torch.zeros(page_starts.numel(), dtype=torch.float64, device=page_starts.device)
        if selected_rows is not None and selected_rows.numel():
            rows = selected_rows.to(page_starts.device, torch.int64)  # no boolean mask: it waits for the device
            chosen = torch.where(rows >= 0, rows // p, -1)  # an empty selection: page -1, matching none
            scores = (page_starts.view(-1, 1) // p == chosen.view(1, -1)).sum(1).double()
        keep = self.policy.pages_to_keep(scores, self.hot.padded // p)
        keep = torch.cat([keep[1:], keep[:1]])  # the least useful kept page holds the newest slot B
        rows = self.allocator.rows.keep_pages(page_starts, keep)
        self.allocator.unmap_logical(logical_ids)
        positions = (keep.view(-1, 1) * p + torch.arange(p, device=keep.device)).reshape(-1)
        positions = torch.where(positions < n, positions, -1)
        self.hot.open_with_rows(idx, rows, positions)

    def release(self, idx: int) -> None:
        """A finishing resident request leaves: its flag and length are cleared; its rows stay
        mapped at its ids and its pages stay marked until SGLang's free of those ids, which always
        follows, releases the rows and clears the marks with the ids (``HiSparseAllocator.free``; with
        the radix cache on, the prefix cache's adoption: ``release_device_rows``). No tensor op on the device but the flag's write, no sync.
        Idempotent for a slot that is not resident."""
        if idx in self._members:
            self._drop(idx)

    def _drop(self, idx: int) -> None:
        """Slot ``idx`` stops being resident: its length (and page count) and its flag cleared."""
        self._set_length(idx, None)
        self.flags[idx].fill_(0)

    def _leave(self, idx: int, logical_ids: torch.Tensor) -> None:
        """A demoted request leaves residency but keeps its ids: its marks are cleared now."""
        self._drop(idx)
        self.allocator.mark_resident_pages(logical_ids[:: self.page_size], False)
