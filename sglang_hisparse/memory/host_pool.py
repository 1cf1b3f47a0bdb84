"""Host KV pool: host rows and their bytes, in (pinned) DRAM.

Built on SGLang's generic HiCache host pool (``MLATokenToKVPoolHost``: layer-first buffers,
pinning, the free-row list, the device <-> host transfer ops); ``pin_memory`` is a constructor
argument (False on machines without a GPU). On top: page-granular rows per request, written into
a position -> host row table that the caller owns and passes in (the host mirror's).

``MLATokenToKVPoolHost`` also mixes in SGLang's own HiSparse host-pool helpers. None of their
behaviour is ours to inherit: :meth:`alloc_paged_token_slots` (which SGLang's PD decode path
calls) is our own, and every other mixin member is blocked here (it raises if called).

Owns: host rows (the free-row list), each request slot's rows as CPU tensors (so that freeing them
reads nothing back from the device table), and the host KV bytes. Copies use SGLang's transfer
kernels on CUDA and torch indexing elsewhere.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

logger = logging.getLogger(__name__)


class HiSparseHostPool(MLATokenToKVPoolHost):
    def __init__(self, device_pool, host_to_device_ratio: float, page_size: int, pin_memory: bool):
        super().__init__(
            device_pool=device_pool,
            host_to_device_ratio=host_to_device_ratio,
            host_size=0,
            page_size=page_size,
            layout="layer_first",
            pin_memory=pin_memory,
            override_kv_cache_dim=device_pool.kv_cache_dim,
        )
        self.row_bytes = self.token_stride_size
        self._rows_of: dict[int, list[torch.Tensor]] = {}
        """Request slot -> the host rows it was given (CPU int64 chunks, position order): the same
        rows as its table row up to its allocated end, kept on the host so that a request's rows
        are freed without reading the (device) table back."""

    @property
    def capacity_tokens(self) -> int:
        """Rows this pool can hand out (whole pages)."""
        return (self.logical_size // self.page_size) * self.page_size

    # --- rows of one request -----------------------------------------------------------------
    def alloc_paged_token_slots(
        self,
        req_to_host_pool: torch.Tensor,
        req_to_host_pool_allocated_len: torch.Tensor,
        req_pool_idx: int,
        start_pos: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """Host rows of positions ``start_pos .. start_pos + num_tokens - 1`` of a request (the
        contract SGLang's PD decode path calls: it writes the prefill's KV into these rows).

        Grows the request's rows by whole pages as needed (``start_pos`` must not pass the
        request's allocated end). Raises RuntimeError when the pool is exhausted.
        """
        if num_tokens <= 0:
            return torch.empty((0,), dtype=torch.int64, device=req_to_host_pool.device)
        allocated = int(req_to_host_pool_allocated_len[req_pool_idx])
        if start_pos > allocated:
            raise AssertionError(f"host rows must grow in order: start {start_pos} > allocated {allocated}")
        end = start_pos + num_tokens
        self.grow_request_rows(req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx, end)
        return req_to_host_pool[req_pool_idx, start_pos:end]

    def grow_request_rows(self, table: torch.Tensor, lengths: torch.Tensor, req_pool_idx: int, end: int) -> None:
        """Give positions ``0..end-1`` of a request a host row each, adding whole pages.

        Side effects: pages taken from the free list; their rows written into ``table`` and the
        new allocated end into ``lengths`` (only when a page is added). Raises RuntimeError when
        the pool is exhausted: admission counts this pool, so that is a bug, not a load condition.
        """
        allocated = int(lengths[req_pool_idx])
        new_end = -(-end // self.page_size) * self.page_size
        if new_end <= allocated:
            return
        rows = self.alloc(new_end - allocated)
        if rows is None:
            raise RuntimeError(
                f"sglang-hisparse: host pool exhausted ({self.available_size()} rows free, "
                f"{new_end - allocated} needed); admission should have prevented this"
            )
        table[req_pool_idx, allocated:new_end] = rows.to(table.device, non_blocking=True)
        lengths[req_pool_idx] = new_end
        self._rows_of.setdefault(req_pool_idx, []).append(rows)

    def grow_rows(self, table: torch.Tensor, lengths: torch.Tensor, idxs: torch.Tensor, ends: torch.Tensor) -> None:
        """:meth:`grow_request_rows` for many requests at once (``idxs``, ``ends``: int64 CPU
        tensors, distinct slots) in a fixed number of tensor ops: one allocation, one table write.
        Same side effects and the same error."""
        p = self.page_size
        allocated = lengths[idxs]
        need = ((ends + p - 1) // p * p - allocated).clamp(min=0)
        total = int(need.sum())
        if not total:
            return
        rows = self.alloc(total)
        if rows is None:
            raise RuntimeError(
                f"sglang-hisparse: host pool exhausted ({self.available_size()} rows free, "
                f"{total} needed); admission should have prevented this"
            )
        req = idxs.repeat_interleave(need)
        first = (need.cumsum(0) - need).repeat_interleave(need)
        pos = allocated.repeat_interleave(need) + torch.arange(total) - first
        where = torch.stack([req, pos, rows.to(torch.int64)]).to(table.device, non_blocking=True)
        table[where[0], where[1]] = where[2]
        lengths[idxs] = allocated + need
        for idx, count, chunk in zip(idxs.tolist(), need.tolist(), rows.split(need.tolist())):
            if count:
                self._rows_of.setdefault(idx, []).append(chunk)

    def free_request_rows(self, table: torch.Tensor, lengths: torch.Tensor, req_pool_idx: int) -> int:
        """Return every host row of a request to the free list and clear its table row.
        Returns the number of rows freed (0 for a request with none). Reads only host memory (the
        rows kept at growth), so no device sync whatever ``table``'s device."""
        allocated = int(lengths[req_pool_idx])
        chunks = self._rows_of.pop(req_pool_idx, [])
        if allocated == 0:
            return 0
        rows = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        assert rows.numel() == allocated, f"host rows kept for slot {req_pool_idx}: {rows.numel()} != {allocated}"
        freed = self.free(rows)
        table[req_pool_idx, :allocated] = -1
        lengths[req_pool_idx] = 0
        return freed

    def rows_of(self, req_pool_idx: int) -> torch.Tensor:
        """The host rows of a request slot, in position order, from the host-side record (CPU int64;
        empty for a slot with none). Equals its table row up to its allocated end."""
        chunks = self._rows_of.get(req_pool_idx, [])
        return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)

    # --- copies ------------------------------------------------------------------------------
    def write_back(self, device_pool, device_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Copy device rows to host rows, every layer, on the current stream."""
        if device_rows.numel() == 0:
            return
        if device_rows.is_cuda:
            self.backup_from_device_all_layer(device_pool, host_rows, device_rows, io_backend="kernel")
            return
        src, dst = device_rows.cpu(), host_rows.cpu()
        for layer in range(self.layer_num):
            self.kv_buffer[layer][dst] = device_pool.kv_buffer[layer][src].to(self.kv_buffer.device)

    def load_rows(self, device_pool, host_rows: torch.Tensor, device_rows: torch.Tensor, layer_id: Optional[int] = None) -> None:
        """Copy host rows into device rows for one layer, or every layer when ``layer_id`` is None."""
        if device_rows.numel() == 0:
            return
        layers = range(self.layer_num) if layer_id is None else [layer_id]
        for layer in layers:
            if device_rows.is_cuda:
                self.load_to_device_per_layer(device_pool, host_rows, device_rows, layer, io_backend="kernel")
            else:
                device_pool.kv_buffer[layer][device_rows.cpu()] = self.kv_buffer[layer][host_rows.cpu()]


def _block_inherited_hisparse_helpers(cls: type) -> list[str]:
    """Shadow every member ``cls`` would inherit from SGLang's HiSparse host-pool mixin (and does
    not define itself) by a method that raises. Returns the names blocked."""
    from sglang.srt.mem_cache.pool_host.hisparse import HiSparseHostPoolMixin

    def blocked(name: str):
        def refuse(self, *args, **kwargs):
            raise NotImplementedError(
                f"sglang-hisparse: {cls.__name__}.{name} is SGLang's own HiSparse helper, which this "
                "host pool does not use"
            )

        refuse.__name__ = name
        return refuse

    names = []
    for name, member in vars(HiSparseHostPoolMixin).items():
        if callable(member) and not name.startswith("__") and name not in vars(cls):
            setattr(cls, name, blocked(name))
            names.append(name)
    return names


BLOCKED_MIXIN_MEMBERS = tuple(_block_inherited_hisparse_helpers(HiSparseHostPool))
"""SGLang HiSparse mixin members our host pool refuses (all but the PD protocol method)."""
