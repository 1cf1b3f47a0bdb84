"""DeepSeek-V4: every decoding request's C4 entries, complete, in host rows.

The C4 counterpart of :class:`~sglang_hisparse.memory.host_mirror.HostMirror`, in the compressed
view: a request's positions are its completed C4 entries (entry ``k``: tokens ``4k .. 4k + 3``),
its host rows live in a :class:`~sglang_hisparse.memory.c4_host_pool.C4HostPool`.

Owned state: the host pool, the entry -> host row table of every request slot (``row_table``,
SGLang's ``req_to_host_pool``), rows per request (``rows_allocated``), ``mirrored`` (entries whose
copy to host has been submitted) per request, the staging queue (prefill copies, own lane) and the
backup lane (decode steps' new entries) with the fence of its last copy.

Invariant: for a request in decode with ``E`` completed entries, entries ``[0, mirrored)`` have a
host row and a submitted copy, and ``E - mirrored <= 1``: an entry completed by step ``t``'s
forward is copied by step ``t + 1`` (:meth:`back_up`), and the next forward is ordered after that
copy (:meth:`order_forward`). Its slot is overwritten at the earliest by the entry after it, four
steps later, so the copy always reads the entry itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.c4_host_pool import C4HostPool
from sglang_hisparse.memory.copy_lane import CopyLane, Fence, order_current_after
from sglang_hisparse.memory.staging import StagingQueue
from sglang_hisparse.resolver.c4_rows import C4_PAGE_ENTRIES, C4PagedRows


class C4Mirror:
    def __init__(self, device_pool, capacity_entries: int, *, max_reqs: int, max_entries: int,
                 device: torch.device, pin_memory: bool):
        self.device_pool = device_pool
        self.pool = C4HostPool.from_device_pool(device_pool, capacity_entries, pin_memory=pin_memory)
        self.row_table = torch.full((max_reqs, max_entries + C4_PAGE_ENTRIES), -1, dtype=torch.int64, device=device)
        """int64 [max_reqs, max_entries + 64]: host row of each entry (-1: none)."""
        self.rows_allocated = torch.zeros(max_reqs, dtype=torch.int64)
        self.mirrored = [0] * max_reqs
        self.staging = StagingQueue(device)
        self.backups = CopyLane(device)
        self._last_backup: Optional[Fence] = None
        self.producer_stream = None

    def layer_rows(self, layer: int) -> tuple[C4PagedRows, C4PagedRows]:
        """(host, device) row views of one C4 layer's KV, for the resolver."""
        return C4PagedRows(self.pool.kv_buffer[layer]), C4PagedRows(self.device_pool.kv_buffer[layer])

    def host_entries_used(self) -> int:
        return self.pool.capacity_tokens - self.pool.available_size()

    # --- staging ---------------------------------------------------------------------------------
    def stage(self, req: Any, device_rows: torch.Tensor) -> None:
        """After a prefill: host rows for its ``len(device_rows)`` entries and their copy on the
        staging lane, after the current stream (the prefill's forward)."""
        idx, n = req.req_pool_idx, device_rows.numel()
        host_rows = self.pool.alloc_paged_token_slots(self.row_table, self.rows_allocated, idx, 0, n)
        self.staging.submit(req, lambda: self.pool.write_back(self.device_pool, device_rows, host_rows),
                            reads=(device_rows, host_rows))
        self.mirrored[idx] = n

    def mark_transferred(self, idx: int, entries: int) -> None:
        """PD decode: request slot ``idx``'s first ``entries`` entries were written into its host
        rows by the prefill instance (SGLang allocated them, ``alloc_paged_token_slots``): they
        count as mirrored. Raises HiSparsePluginError when fewer rows were allocated."""
        if int(self.rows_allocated[idx]) < entries:
            raise HiSparsePluginError(
                f"sglang-hisparse: request slot {idx} received {entries} C4 entries but holds "
                f"{int(self.rows_allocated[idx])} host rows")
        self.mirrored[idx] = entries

    def staged_count(self) -> int:
        return len(self.staging)

    def is_staged(self, req: Any) -> bool:
        return self.staging.contains(req)

    # --- decode steps ------------------------------------------------------------------------------
    def back_up(self, idxs: list[int], entries: list[int], device_rows: torch.Tensor) -> None:
        """Copy each request's newest completed entry ``entries[i]`` (one per request, the one
        after its mirrored ones) from ``device_rows[i]`` to a host row, on the backup lane after
        the current stream and the producer stream (the forward that wrote it)."""
        if not idxs:
            return
        idx_t, pos = torch.tensor(idxs, dtype=torch.int64), torch.tensor(entries, dtype=torch.int64)
        self.pool.grow_rows(self.row_table, self.rows_allocated, idx_t, pos + 1)
        where = torch.stack((idx_t, pos)).to(self.row_table.device, non_blocking=True)  # no host wait
        host_rows = self.row_table[where[0], where[1]]
        self._last_backup = self.backups.submit(
            lambda: self.pool.write_back(self.device_pool, device_rows, host_rows),
            after=(self.producer_stream,), reads=(device_rows, host_rows))
        for idx, entry in zip(idxs, entries):
            self.mirrored[idx] = entry + 1

    def order_forward(self) -> None:
        """Order the current stream (the next forward) after the last backup copy."""
        if self._last_backup is not None:
            self._last_backup.order_before(torch.get_device_module(self.row_table.device).current_stream())
            self._last_backup = None

    def load(self, idx: int, entries: torch.Tensor, device_rows: torch.Tensor) -> None:
        """Copy host rows of ``entries`` of request slot ``idx`` into ``device_rows``, every layer,
        on the current stream."""
        self.pool.load_rows(self.device_pool,
                            self.row_table[idx, entries.to(self.row_table.device, non_blocking=True)], device_rows)

    # --- leaving -----------------------------------------------------------------------------------
    def order_after_copies(self) -> None:
        """Order the current stream after every backup copy submitted so far (before rows they
        read are freed and handed out again). No host wait."""
        order_current_after(self.backups.stream, self.row_table.device)

    def forget(self, idx: int) -> None:
        """Free request slot ``idx``'s host rows and reset its record."""
        self.pool.free_request_rows(self.row_table, self.rows_allocated, idx)
        self.mirrored[idx] = 0

    def drain(self) -> None:
        self.staging.drain()
        self.backups.drain()
