"""The host mirror: every decoding request's KV, complete, in host rows.

Owns the host pool, the position -> host row table of every request slot, and the copies that
keep the table's rows complete: *staging* (all of a prefill's rows, once, after the prefill) and
*write-through* (decoded tokens: every step where the next one overwrites their row, a page at a
time for a short hot buffer, every :data:`DEFERRED_FLUSH_STEPS` steps for a resident request; see
the invariant below).

Ordering (two :class:`~sglang_hisparse.memory.copy_lane.CopyLane`\\ s, so that a long staging copy never
delays a decode step):

* staging lane (:class:`~sglang_hisparse.memory.staging.StagingQueue`): a prefill's copy runs after
  the prefill's forward (current stream). Its fence tells when the request may leave staging;
  until then its prefill device rows stay allocated.
* write-through lane (:class:`~sglang_hisparse.memory.write_through.WriteThroughLane`): a step's
  copy runs after the current stream and the producer stream (the overlap scheduler's forward,
  which wrote the token); the next forward is ordered after it with
  :meth:`order_forward_after_write_through` before it writes the newest slot again.

Invariant (per request slot): positions ``[0, mirrored_len)`` have a host row and a copy to it
has been submitted; positions ``[mirrored_len, L - 1)`` of a decode step with ``seq_len = L`` are
*pending*. A step copies a request's pending positions at once when their rows will be overwritten
(a long hot buffer's newest slot, which the step's token takes next) and orders the next forward
after that copy; pending positions in a short hot buffer's slots below B, which stay put, are
copied a page at a time, with no forward waiting for them. A resident request's pending positions
(its own rows, which stay put until it is demoted) are *deferred* (:meth:`defer`): never due at a
step, they are copied for all resident requests of a batch at once every
:data:`DEFERRED_FLUSH_STEPS` decode steps (:meth:`write_through_deferred`) and before a demotion or
a PD offload (:meth:`write_through`). So a resident decode step has no write-through work. Every
copy that reads a request's rows is ordered before the rows are freed or overwritten
(:meth:`order_after_writes`, and a pending-everything copy before a demotion or a retraction).
"""

from __future__ import annotations

from typing import Any, Callable, Deque, Optional, Sequence, Union

import numpy as np
import torch

from sglang_hisparse.memory.host_pool import HiSparseHostPool
from sglang_hisparse.memory.staging import Staged, StagingQueue
from sglang_hisparse.memory.write_through import (
    WriteThroughLane,
    due_again_at,
    due_requests,
    in_newest_slots,
    overwrites_newest_slot,
    pending_positions,
)

DEFERRED_FLUSH_STEPS = 256
"""Decode steps between two copies of the deferred (resident) requests' pending positions: at most
this many positions (plus the step in flight) per resident request wait for a demotion's copy.
A copy's host cost is mostly fixed (a dozen launches and the batch's new host pages): on the H200
machine's host at batch 128, a step's ``map`` averaged 28-31 us above its median with a copy every
64 steps and 11-12 us with one every 256 (page starts included; gpu_run74). A demotion then copies
up to 256 positions per request (10-18 MB at DeepSeek-V3.2's 656- or 1152-byte rows over 61
layers: a fraction of a millisecond at the host link's speed)."""
NEVER = 2**62
"""``flush_at`` of a deferred request: no position count reaches it."""


class HostMirror:
    """Owns the host pool, ``row_table``, ``rows_allocated``, ``mirrored_len`` and ``flush_at``
    (the invariant's state); its staging queue and write-through lane own the copies' fences."""

    def __init__(
        self,
        device_pool,
        host_ratio: float,
        *,
        max_reqs: int,
        max_context: int,
        device: torch.device,
        pin_memory: bool,
    ):
        page = device_pool.page_size
        self.device_pool = device_pool
        self.pool = HiSparseHostPool(device_pool, host_ratio, page, pin_memory)
        self.row_table = torch.full((max_reqs, max_context + page), -1, dtype=torch.int64, device=device)
        """int64 [max_reqs, max_context + page]: host row of each position (-1: none)."""
        self.rows_allocated = torch.zeros(max_reqs, dtype=torch.int64)
        """int64 [max_reqs] (CPU): positions of each request that have a host row (whole pages)."""
        self.mirrored_len = torch.zeros(max_reqs, dtype=torch.int64)
        """int64 [max_reqs] (CPU): positions of each request whose copy to host was submitted."""
        self.flush_at = torch.zeros(max_reqs, dtype=torch.int64)
        """int64 [max_reqs] (CPU): the position count (``seq_len - 1``) at which each decoding
        request's pending positions are next due (:meth:`write_through_step`)."""
        self._mirrored, self._flush_at = self.mirrored_len.numpy(), self.flush_at.numpy()
        """numpy views of the two (same memory): ~1 us per numpy operation, several per torch op."""
        self.producer_stream: Optional[Any] = None
        """The overlap scheduler's forward stream (set by the coordinator): write-through copies
        run after it."""
        self._staging = StagingQueue(device)
        self._writes = WriteThroughLane(device)

    @property
    def _staged(self) -> Deque[Staged]:
        """The staging queue's entries, front first (the queue itself: tests replace a fence)."""
        return self._staging.entries

    # --- staging -----------------------------------------------------------------------------
    def stage(self, req: Any, device_rows: torch.Tensor, lent_rows: Optional[torch.Tensor] = None) -> None:
        """Queue the copy of a prefilled request's rows (positions ``0..n-1``) to host. ``lent_rows``
        (a cached prefix's host rows, lent by the radix tree) already hold positions ``0..L-1``:
        they become its rows there, borrowed (``borrow_request_rows``), and are not copied. Side
        effects: host rows for the positions; a copy on the staging lane after the current stream;
        the request joins the back of the staging queue."""
        idx, n = req.req_pool_idx, device_rows.numel()
        lent = self.pool.borrow_request_rows(self.row_table, self.rows_allocated, idx, lent_rows, limit=n)
        device_rows = device_rows[lent:]
        host_rows = self.pool.alloc_paged_token_slots(self.row_table, self.rows_allocated, idx, lent, n - lent)
        self._staging.submit(req, lambda: self.pool.write_back(self.device_pool, device_rows, host_rows),
                             reads=(device_rows, host_rows))
        self.mirrored_len[idx] = n
        self.flush_at[idx] = n + 1

    def staged_count(self) -> int:
        return len(self._staging)

    def is_staged(self, req: Any) -> bool:
        return self._staging.contains(req)

    def copied_prefix(self, *, block: bool) -> list[Any]:
        """The requests at the front of the staging queue whose copy finished, in order. With
        ``block`` the host first waits for every queued copy (all of them are then returned)."""
        return self._staging.copied_prefix(block=block)

    def pop_staged(self) -> Any:
        """Remove the front of the staging queue (its copy finished); returns its request."""
        return self._staging.pop()

    def drop_staged(self, req: Any) -> None:
        """Remove ``req`` from the staging queue and block until its copy finished (its device
        rows may then be freed and reused). No effect for a request not in the queue."""
        self._staging.drop(req)

    # --- direct admission (PD) ---------------------------------------------------------------
    def mark_complete(self, req_pool_idx: int, n_tokens: int) -> None:
        """The KV of positions ``0..n-1`` reached host rows by other means (PD transfer)."""
        self.mirrored_len[req_pool_idx] = n_tokens
        self.flush_at[req_pool_idx] = n_tokens + 1

    def defer(self, req_pool_idx: int) -> None:
        """A request whose rows stay put (resident): its pending positions are never due at a
        step (:meth:`write_through_step`); :meth:`write_through_deferred` and
        :meth:`write_through` copy them. Undone by :meth:`write_through` (a demotion)."""
        self.flush_at[req_pool_idx] = NEVER

    # --- write-through -----------------------------------------------------------------------
    def write_through(
        self,
        req_pool_idxs: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        device_rows_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """Copy every pending position of these requests now (see the invariant), and order the
        next forward after the copy (:meth:`order_forward_after_write_through`): before a demotion
        or a retraction, and each verify step. ``device_rows_of(req_pool_idx, position)`` (int64
        device tensors) gives the device row holding each position now."""
        idx = np.asarray(req_pool_idxs, dtype=np.int64)
        end = np.asarray(seq_lens, dtype=np.int64) - 1
        self._copy(idx, end, device_rows_of, urgent=True)
        self._flush_at[idx] = end + 1

    def write_through_deferred(self, req_pool_idxs: torch.Tensor, seq_lens: torch.Tensor,
                               device_rows_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Copy the pending positions of these deferred requests (:meth:`defer`; int64 CPU
        tensors) in one copy that no forward waits for: their rows stay put. They stay deferred."""
        self._copy(np.asarray(req_pool_idxs), np.asarray(seq_lens) - 1, device_rows_of, urgent=False)

    def write_through_step(
        self,
        req_pool_idxs: torch.Tensor,
        seq_lens: torch.Tensor,
        device_rows_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        buffer_size: Union[int, np.ndarray],
        newest_rows: Optional[torch.Tensor] = None,
    ) -> None:
        """The write-through of a one-token decode step at ``seq_lens`` (int64 CPU tensors).

        A request is *due* (:func:`due_requests`, ``flush_at``) when its previous token sits in a hot buffer's
        newest slot, which this step's token takes (every step of a long hot buffer), or a page of positions is
        pending in a hot buffer still on the fast path; deferred (resident) requests never are. The forward is
        ordered after the copy only when it includes a newest slot. ``newest_rows`` (optional, int64 on the device,
        batch order), the rows the step's tokens take, are the rows copied when every due request has only its
        previous token pending, in its newest slot (the steady state): ``device_rows_of`` is then not called.
        ``buffer_size``: B, or each request slot's (numpy). Side effects: host rows for the copied positions; at
        most one copy on the write-through lane, after the current and producer streams.
        """
        idx, end, at = due_requests(req_pool_idxs.numpy(), seq_lens.numpy() - 1, self._flush_at)
        if idx.size == 0:
            return
        buffer_size = buffer_size[idx] if isinstance(buffer_size, np.ndarray) else buffer_size
        if newest_rows is not None and in_newest_slots(self._mirrored[idx], end, buffer_size):
            device_rows_of = _newest_rows_reader(newest_rows, at)
        self._copy(idx, end, device_rows_of, urgent=overwrites_newest_slot(end, buffer_size))
        self._flush_at[idx] = due_again_at(end, page_size=self.pool.page_size, buffer_size=buffer_size)

    def _copy(self, idx: np.ndarray, end: np.ndarray, device_rows_of, *, urgent: bool) -> None:
        """Submit the copy of positions ``[mirrored_len, end)`` of each request ``idx`` (int64
        numpy; those with nothing pending skipped) and advance ``mirrored_len``. ``device_rows_of``
        gets the positions' slots and positions (device tensors) request by request, in order."""
        start = self._mirrored[idx]
        pending = end - start
        take = pending > 0
        if not take.any():
            return
        if not take.all():
            idx, start, end, pending = idx[take], start[take], end[take], pending[take]
        self.pool.grow_rows(self.row_table, self.rows_allocated, idx, end)
        self._mirrored[idx] = end
        reqs, positions = pending_positions(idx, start, pending)
        where = torch.from_numpy(np.stack((reqs, positions))).to(self.row_table.device, non_blocking=True)
        host_rows = self.row_table[where[0], where[1]]
        device_rows = device_rows_of(where[0], where[1])
        self._writes.submit(
            lambda: self.pool.write_back(self.device_pool, device_rows, host_rows),
            after=(self.producer_stream,),
            reads=(device_rows, host_rows),
            urgent=urgent,
        )

    def order_forward_after_write_through(self) -> None:
        """Make the current stream wait (on the device) for the last copy of rows the next step
        overwrites (none pending: nothing to wait for)."""
        self._writes.order_forward()

    def order_after_writes(self) -> None:
        """Make the current stream wait (on the device) for every write-through copy submitted so
        far: before rows they read are freed, or host rows they write are handed out again."""
        self._writes.order_all()

    # --- retraction (PD decode): KV out of the host pool and back ------------------------------
    def snapshot(self, req_pool_idx: int, n_tokens: int) -> torch.Tensor:
        """A copy of positions ``0..n-1`` (every layer) in ordinary CPU memory, taken after every
        submitted write-through finished. Shape ``[layers, n, 1, row]``; the rows stay allocated."""
        self._writes.drain()
        rows = self.row_table[req_pool_idx, :n_tokens].cpu()
        return self.pool.kv_buffer[:, rows].clone()

    def restore(self, req_pool_idx: int, snapshot: torch.Tensor) -> None:
        """Write a :meth:`snapshot` into the request's (new) host rows of the same positions."""
        rows = self.row_table[req_pool_idx, : snapshot.shape[1]].cpu()
        self.pool.kv_buffer[:, rows] = snapshot

    # --- leaving -----------------------------------------------------------------------------
    def forget(self, req_pool_idx: int) -> None:
        """Free a request's host rows and clear its table row (idempotent)."""
        self.pool.free_request_rows(self.row_table, self.rows_allocated, req_pool_idx)
        self.mirrored_len[req_pool_idx] = 0

    def hand_over(self, req_pool_idx: int) -> tuple[torch.Tensor, int]:
        """A finishing request's host rows, unfreed, and how many leading positions hold its KV."""
        complete, self.mirrored_len[req_pool_idx] = int(self.mirrored_len[req_pool_idx]), 0
        return self.pool.release_request_rows(self.row_table, self.rows_allocated, req_pool_idx), complete

    def drain(self) -> None:
        """Block until every submitted copy finished."""
        self._staging.drain()
        self._writes.drain()


def _newest_rows_reader(newest_rows: torch.Tensor, at: Optional[np.ndarray]) -> Callable[..., torch.Tensor]:
    """A ``device_rows_of`` for a copy of one position per due request, each in its newest slot:
    the copy's order is the due requests' batch order, so its rows are ``newest_rows`` (every
    request due, ``at`` None) or ``newest_rows[at]`` (one H2D of ``at``)."""
    if at is not None:
        newest_rows = newest_rows[torch.from_numpy(at).to(newest_rows.device, non_blocking=True)]
    return lambda _reqs, _positions: newest_rows
