"""Host KV pool: the authoritative copy of every decoding request's KV, in (pinned) DRAM.

Built on SGLang's HiCache host pool (``MLATokenToKVPoolHost``: layer-first buffers, pinning,
the free-slot list and the device<->host transfer ops), with our page-granular per-request slot
allocation on top. ``pin_memory`` is a constructor argument (False on machines without a GPU).

Owns: host rows (the free-slot list) and the host KV bytes. The per-request position -> host
row table (``req_to_host_pool``) belongs to the coordinator and is passed in; this class writes
the rows it hands out into it.

Copies use SGLang's transfer kernels on CUDA and a torch fallback elsewhere.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

logger = logging.getLogger(__name__)


class HiSparseHostPool(MLATokenToKVPoolHost):
    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float,
        page_size: int,
        pin_memory: bool,
    ):
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

    @property
    def capacity_tokens(self) -> int:
        """Rows this pool can hand out (whole pages)."""
        return (self.logical_size // self.page_size) * self.page_size

    def _round_up(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    # --- per-request slots -------------------------------------------------------------------
    def alloc_paged_token_slots(
        self,
        req_to_host_pool: torch.Tensor,
        req_to_host_pool_allocated_len: torch.Tensor,
        req_pool_idx: int,
        start_pos: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """Host rows of positions ``start_pos .. start_pos + num_tokens - 1`` of a request.

        Grows the request's allocation by whole pages when the range passes its end (pages are
        appended in position order; ``start_pos`` must not pass the allocated end). Writes the
        new rows into ``req_to_host_pool`` and the new end into ``req_to_host_pool_allocated_len``.
        Same contract as SGLang's PD decode path expects.

        Raises RuntimeError if the pool is exhausted: admission (the allocator counts this pool)
        makes that a bug, not a load condition.
        """
        if num_tokens <= 0:
            return torch.empty((0,), dtype=torch.int64, device=req_to_host_pool.device)
        end = start_pos + num_tokens
        allocated = int(req_to_host_pool_allocated_len[req_pool_idx])
        if start_pos > allocated:
            raise AssertionError(f"host slots must grow in order: start {start_pos} > allocated {allocated}")
        self.ensure_allocated(req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx, end)
        return req_to_host_pool[req_pool_idx, start_pos:end]

    def ensure_allocated(
        self,
        req_to_host_pool: torch.Tensor,
        req_to_host_pool_allocated_len: torch.Tensor,
        req_pool_idx: int,
        end: int,
    ) -> None:
        """Grow a request's host rows by whole pages until positions ``0..end-1`` have one.
        Writes the table only when a page is added (a decode step crosses a page boundary once
        every page_size steps)."""
        allocated = int(req_to_host_pool_allocated_len[req_pool_idx])
        new_end = self._round_up(end)
        if new_end <= allocated:
            return
        rows = self.alloc(new_end - allocated)
        if rows is None:
            raise RuntimeError(
                f"sglang-hisparse: host pool exhausted ({self.available_size()} rows free, "
                f"{new_end - allocated} needed); admission should have prevented this"
            )
        req_to_host_pool[req_pool_idx, allocated:new_end] = rows.to(req_to_host_pool.device, non_blocking=True)
        req_to_host_pool_allocated_len[req_pool_idx] = new_end

    def allocated_host_indices(self, req_to_host_pool, req_pool_idx: int, allocated_len: int) -> torch.Tensor:
        rows = req_to_host_pool[req_pool_idx, : int(allocated_len)]
        return rows[rows >= 0]

    def free_request_slots(
        self, req_to_host_pool: torch.Tensor, req_to_host_pool_allocated_len: torch.Tensor, req_pool_idx: int
    ) -> int:
        """Free every host row of a request and reset its table row. Returns rows freed."""
        allocated = int(req_to_host_pool_allocated_len[req_pool_idx])
        rows = self.allocated_host_indices(req_to_host_pool, req_pool_idx, allocated)
        freed = self.free(rows) if rows.numel() else 0
        req_to_host_pool[req_pool_idx, :allocated] = -1
        req_to_host_pool_allocated_len[req_pool_idx] = 0
        return freed

    # --- copies ------------------------------------------------------------------------------
    def write_back(self, device_pool, device_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Copy device rows to host rows, all layers (on the current stream)."""
        if device_rows.numel() == 0:
            return
        if device_rows.is_cuda:
            self.backup_from_device_all_layer(device_pool, host_rows, device_rows, io_backend="kernel")
            return
        src, dst = device_rows.cpu(), host_rows.cpu()
        for layer in range(self.layer_num):
            self.kv_buffer[layer][dst] = device_pool.kv_buffer[layer][src].to(self.kv_buffer.device)

    def load_rows(self, device_pool, host_rows: torch.Tensor, device_rows: torch.Tensor, layer_id: Optional[int] = None) -> None:
        """Copy host rows into device rows for one layer, or all layers when ``layer_id`` is None."""
        if device_rows.numel() == 0:
            return
        layers = range(self.layer_num) if layer_id is None else [layer_id]
        for layer in layers:
            if device_rows.is_cuda:
                self.load_to_device_per_layer(device_pool, host_rows, device_rows, layer, io_backend="kernel")
            else:
                device_pool.kv_buffer[layer][device_rows.cpu()] = self.kv_buffer[layer][host_rows.cpu()]
