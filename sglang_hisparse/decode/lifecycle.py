"""Requests entering and leaving decode: staging after prefill, PD direct admission, finish.

:class:`RequestLifecycle` implements the coordinator's per-request members
(``admit_request_into_staging``, ``collect_ready_reqs``, ``admit_request_direct``,
``request_finished``, the draft-state hand-over of speculative decoding). Entering, a request
becomes resident (residency on and room above the watermark) or gets a hot buffer; leaving, it
gives back whichever it holds, its host rows and (a hot buffer's) mapping.

Owned state: the staged requests' draft states (``_draft_state``) and the request whose wait in
staging was last logged (``_waiting_since``, one log line per episode). Everything else belongs to
the components it drives (host mirror: host rows and staging; hot buffers; allocator: rows and
mapping; :class:`~sglang_hisparse.decode.pressure.ResidentDecode`; stats).

Invariants: requests leave staging in order, the same ones on every rank of the attention TP group
(:func:`agreed_count`); a request's rows are freed only after the forward in flight and the copies
reading or writing them (``quiesce``, then the mirror's ordering).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.decode.pressure import ResidentDecode
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.residency import Residency
from sglang_hisparse.stats import timed

# The coordinator's logger: these lines were the coordinator's, and log configuration selects them
# by that name.
logger = logging.getLogger("sglang_hisparse.decode.coordinator")


class RequestLifecycle:
    def __init__(self, config: HiSparseConfig, *, tp_group, allocator, device_pool, req_to_token_pool, hot, mirror,
                 stats, resident: Optional[ResidentDecode], quiesce: Callable[[], None],
                 rows_now: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None):
        self.config, self.tp_group = config, tp_group
        self.allocator, self.device_pool, self.req_to_token_pool = allocator, device_pool, req_to_token_pool
        self.hot, self.mirror, self.stats = hot, mirror, stats
        self.resident = resident
        """The residency driver (None with residency off)."""
        self.quiesce = quiesce
        """Orders the current stream after the overlapped forward in flight (the coordinator's)."""
        self.host_time = allocator.host_time
        """Where :func:`~sglang_hisparse.stats.timed` adds our host time (the allocator's)."""
        self.rows_now = rows_now
        """Device rows holding positions of decoding requests now (the decode steps'): what a
        finishing request's last write-through reads."""
        self.prefix_cache: Any = None
        """The radix cache that takes finishing requests' host rows (``HostPrefixCache``; None
        with the radix cache off: a finishing request's host rows are freed)."""
        self._waiting_since: Optional[str] = None
        self._draft_state: dict[int, Any] = {}

    @property
    def residency(self) -> Optional[Residency]:
        return None if self.resident is None else self.resident.residency

    def logical_ids(self, req, n: int) -> torch.Tensor:
        """The logical ids (int64) of the request's positions ``0..n-1``; no side effects."""
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)

    # --- staging (after prefill) ---------------------------------------------------------------
    def stage(self, req) -> None:
        """After prefill: copy the request's KV (every layer) to host rows off the critical path.
        A request whose prefix was loaded from the prefix cache borrows the cache's host rows for
        it (``lend_rows``): only the positions after it are copied."""
        self.stats.note_activity()
        lent = self.prefix_cache.lend_rows(req) if self.prefix_cache is not None else None
        self.mirror.stage(req, self.allocator.device_rows_of(self.logical_ids(req, req.extend_range.end)), lent)

    def keep_draft_state(self, req_pool_idx: int, state: Any) -> None:
        """Hold a staged request's draft state (opaque) until it joins decode or leaves."""
        self._draft_state[req_pool_idx] = state

    def take_draft_state(self, req_pool_idx: int) -> Any:
        """The draft state kept for a request joining decode (KeyError when none was kept)."""
        return self._draft_state.pop(req_pool_idx)

    def collect_ready(self) -> List[Any]:
        """Staged requests, in order, whose copy finished on every rank and whose hot buffer fits.

        The ready count is agreed with a MIN all-reduce over the attention TP group so every
        rank returns the same requests. A request whose hot buffer does not fit yet stays in
        staging with the ones behind it (logged once per episode). With ``wait_for_staging`` the
        host first waits for every staging copy.
        """
        if not self.mirror.staged_count():
            return []
        copied = self.mirror.copied_prefix(block=self.config.wait_for_staging)
        count = agreed_count(len(copied), self.tp_group)
        return self._enter_copied(copied[:count]) if count else []

    @timed("ready")
    def _enter_copied(self, copied: list) -> List[Any]:
        """Move the copied requests at the front of staging into decode, in order, until one does
        not fit; returns those that entered."""
        ready = []
        for req in copied:
            if not self._enter_decode(req):
                self._log_waiting(req)
                break
            self.mirror.pop_staged()
            if self.prefix_cache is not None:
                self.prefix_cache.share_running(req)
            ready.append(req)
        if ready:
            self._waiting_since = None
        return ready

    def _enter_decode(self, req) -> bool:
        """A staged request whose host copy is done keeps its prefill rows resident (residency on
        and room above the watermark) or moves into a hot buffer made of its first prefill pages
        (needs no free rows). False, nothing changed, when neither fits."""
        idx, n = req.req_pool_idx, req.kv.kv_allocated_len
        logical = self.logical_ids(req, n)

        def open_hot() -> Optional[torch.Tensor]:
            return self.hot.open(idx, logical, filled=True)

        return open_hot() is not None if self.resident is None else self.resident.enter(idx, logical, open_hot)

    def _log_waiting(self, req) -> None:
        if self._waiting_since != req.rid:
            logger.info("sglang-hisparse: request %s waits in staging for device rows (%s)",
                        req.rid, self.allocator.debug_print())
            self._waiting_since = req.rid

    # --- PD decode -------------------------------------------------------------------------------
    def admit_direct(self, req) -> None:
        """PD decode: the request's KV is already in its host rows. With residency and room, it
        is loaded into rows of its own; otherwise it gets a hot buffer (short requests are loaded
        from host, long ones start empty and miss on first use). Its host rows may begin with a
        cached prefix's, lent by the radix tree (``prefix/pd_prefix.py``): they are read the same
        way. With the radix cache on, its prompt is then shared (as a colocated request's when it
        enters decode). Raises HiSparsePluginError when no hot buffer fits (the PD admission
        budget should prevent it)."""
        idx, n = req.req_pool_idx, req.kv.kv_allocated_len
        logical = self.logical_ids(req, n)
        rows = self.resident.admit_loaded(idx, logical) if self.resident is not None else None
        resident = rows is not None
        if rows is None:
            rows = self._open_direct(idx, logical, n)
            if rows is None:
                raise HiSparsePluginError(
                    f"sglang-hisparse: no device rows for the hot buffer of request {req.rid} "
                    f"({self.allocator.debug_print()}); the PD admission budget should prevent this"
                )
            rows = rows[:n] if n <= self.hot.open_size else None
        if rows is not None:
            self.mirror.pool.load_rows(self.device_pool, self.mirror.row_table[idx, :n], rows)
        self.mirror.mark_complete(idx, n)
        if resident:
            self.mirror.defer(idx)
        if self.prefix_cache is not None:
            self.prefix_cache.share_running(req)
        self.stats.note_activity()

    def _open_direct(self, idx: int, logical: torch.Tensor, n: int) -> Optional[torch.Tensor]:
        """PD: a hot buffer for a transferred request (rows unmapped; filled when ``n`` fits the
        opening size). When the free rows are short, first the rows SGLang's PD budget counted as
        reclaimable (``hisparse_attn_allocator``: grown buffers' lent rows, resident requests'
        demotions) are reclaimed. Returns the buffer's rows, or None when it still does not fit."""
        def open_hot() -> Optional[torch.Tensor]:
            return self.hot.open(idx, logical, filled=n <= self.hot.open_size, mapped=False)

        return open_hot() if self.resident is None else self.resident.open_hot_buffer(open_hot)

    # --- leaving ---------------------------------------------------------------------------------
    def finish(self, req) -> None:
        """Free everything the request holds here: hot buffer, host rows, mapping. Idempotent
        (a PD retraction calls it twice: our offload, then SGLang's ``retract_req``); a request
        still in staging leaves staging. Only a hot buffer's ids are unmapped: a resident
        request's ids stay mapped to its own rows for SGLang's free of them, which follows, and
        a request holding neither has nothing mapped of ours (a PD request whose transfer failed)
        or is gone already.

        With the prefix cache on, the request's committed positions are written through first and
        its host rows are handed to the cache instead of freed (its ``cache_finished_req``, which
        SGLang calls next, adopts or frees them)."""
        idx = req.req_pool_idx
        if idx is None:
            return
        self._draft_state.pop(idx, None)
        if self.mirror.is_staged(req):
            self._leave_staging(req)
            return
        self.quiesce()  # the overlapped forward may still read its rows
        resident = self.residency is not None and self.residency.holds(idx)
        in_hot_buffer = self.hot.holds(idx)
        to_cache = self.prefix_cache is not None and (resident or in_hot_buffer)
        if to_cache:
            self.mirror.write_through([idx], [req.kv_committed_len + 1], self.rows_now)
        self.mirror.order_after_writes()  # copies still reading its rows, or writing its host rows
        if resident:
            self.residency.release(idx)
        elif in_hot_buffer:
            self.allocator.unmap_logical(self.logical_ids(req, req.kv.kv_allocated_len))
        self.hot.close(idx)
        if to_cache:
            self.prefix_cache.hand_over(idx, *self.mirror.hand_over(idx))
        else:
            self.mirror.forget(idx)
        self.stats.note_activity()

    def _leave_staging(self, req) -> None:
        """A staged request leaves: wait for its copy, free its prefill rows and host rows."""
        self.mirror.drop_staged(req)
        self.allocator.free_prefill_rows(self.logical_ids(req, req.extend_range.end))
        self.mirror.forget(req.req_pool_idx)
        self.stats.note_activity()


def agreed_count(count: int, group) -> int:
    """The smallest ``count`` over the ranks of ``group`` (all ranks must admit the same requests)."""
    if torch.distributed.get_world_size(group=group) == 1:
        return count
    value = torch.tensor(count, dtype=torch.int64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(value)
