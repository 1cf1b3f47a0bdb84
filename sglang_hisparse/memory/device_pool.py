"""DSA device KV pool whose KV rows are addressed through the logical->device mapping.

SGLang hands the pool logical ids (what ``req_to_token`` stores). KV writes and reads translate
them to device rows with the allocator's mapping; the indexer-key buffer is indexed by logical
id directly and sized for the whole logical space, so indexer state never leaves the GPU.

A pool built inside :func:`resident_pools` is *resident* instead: KV rows for the whole logical
space, indexed by logical id, no mapping. It is the draft (MTP) model's pool of a speculative
server (``patches/draft_runner.py``): the draft layer keeps its whole KV on the device and runs
SGLang's non-HiSparse path, so rejected drafts stay SGLang's business.

Subclasses SGLang's ``DSATokenToKVPool`` because SGLang checks pools with ``isinstance``
(DSA/MLA code paths, PD transfer). Owns: the device KV buffers (rows) and the indexer buffers
(copied out and back by page when a PD decode instance retracts a request: ``index_key_pages``).
Reads, never writes: the mapping (owned by the allocator).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

_BUILD_RESIDENT: ContextVar[bool] = ContextVar("sglang_hisparse_build_resident_pool", default=False)


@contextlib.contextmanager
def resident_pools() -> Iterator[None]:
    """HiSparse device pools constructed within the block are resident (module docstring)."""
    token = _BUILD_RESIDENT.set(True)
    try:
        yield
    finally:
        _BUILD_RESIDENT.reset(token)


class HiSparseDevicePool(DSATokenToKVPool):
    """Replaces SGLang's ``HiSparseDSATokenToKVPool``. SGLang builds it as it builds a DSA pool
    (``size`` positional, the DSA pool's keywords) plus ``host_to_device_ratio``."""

    def __init__(self, size: int, *, host_to_device_ratio: int = 2, **dsa_pool_args: Any):
        # KV rows: ``size`` (the device space), or the whole logical space when resident.
        # Indexer keys: one per logical id, so that a request's selection state never leaves the
        # GPU while its KV lives in host rows.
        self.resident = _BUILD_RESIDENT.get()
        logical_size = size * host_to_device_ratio
        super().__init__(logical_size if self.resident else size, index_buf_size=logical_size, **dsa_pool_args)
        self.row_bytes = self.kv_cache_dim * self.store_dtype.itemsize
        self.logical_to_device: Optional[torch.Tensor] = None
        self.page_resident: Optional[torch.Tensor] = None

    def attach_mapping(self, logical_to_device: torch.Tensor, page_resident: Optional[torch.Tensor] = None) -> None:
        """Called once by the allocator that owns the mapping and the resident-page marks (never
        for a resident pool)."""
        assert not self.resident, "a resident pool is indexed by logical id"
        self.logical_to_device = logical_to_device
        self.page_resident = page_resident

    def _rows(self, loc: torch.Tensor) -> torch.Tensor:
        return loc if self.resident else self.logical_to_device[loc]

    def map_resident_writes(self, loc: torch.Tensor) -> None:
        """Map the ids ``loc`` about to be written that sit on a resident page, past its first id,
        to their row: the page's first row plus the offset (a resident request's ids and rows run
        on together within a page). Inside the forward, so a CUDA graph replays it: a decode step
        of resident requests needs no host work to map its new tokens. Idempotent (ids the host
        mapped get the same rows); a page's first id is always mapped by the host."""
        p = self.page_size
        offset = loc % p
        on_page = self.page_resident[loc // p].bool() & (offset != 0)
        l2d = self.logical_to_device
        l2d[loc] = torch.where(on_page, l2d[loc - offset] + offset, l2d[loc])

    def _write_rows(self, layer, loc: torch.Tensor) -> torch.Tensor:
        """Rows for a KV write of ``loc``; the first layer's write maps resident pages' new ids."""
        if self.resident:
            return loc
        if self.page_resident is not None and layer.layer_id == self.start_layer:
            self.map_resident_writes(loc)
        return self.logical_to_device[loc]

    def translate_loc_to_hisparse_device(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Device rows of logical ids (SGLang's DSA backend translates prefill page tables)."""
        return self._rows(logical_ids)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        return super().set_kv_buffer(layer, self._write_rows(layer, loc), cache_k, cache_v, *args, **kwargs)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope, *args, **kwargs):
        rows = self._write_rows(layer, loc)
        if self.device_kind != "cuda":
            return self._write_rows_torch(layer.layer_id, rows, cache_k_nope, cache_k_rope)
        return super().set_mla_kv_buffer(layer, rows, cache_k_nope, cache_k_rope, *args, **kwargs)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None, *args, **kwargs):
        rows = self._rows(loc)
        if self.device_kind != "cuda":
            kv = self.kv_buffer[layer.layer_id - self.start_layer][rows].view(self.dtype)
            dst_dtype = dst_dtype or self.dtype
            return (
                kv[..., : self.kv_lora_rank].to(dst_dtype),
                kv[..., self.kv_lora_rank : self.kv_lora_rank + self.qk_rope_head_dim].to(dst_dtype),
            )
        return super().get_mla_kv_buffer(layer, rows, dst_dtype, *args, **kwargs)

    @property
    def device_kind(self) -> str:
        return torch.device(self.device).type

    def _write_rows_torch(self, layer_id, rows, cache_k_nope, cache_k_rope) -> None:
        """Torch write of MLA rows (CPU path; SGLang's writer is a Triton kernel)."""
        if self.store_dtype != self.dtype or self.kv_cache_dim != self.kv_lora_rank + self.qk_rope_head_dim:
            raise NotImplementedError(
                "sglang-hisparse: the torch KV write path supports unquantized bf16/fp16/fp32 KV only"
            )
        row = torch.cat([cache_k_nope.to(self.dtype), cache_k_rope.to(self.dtype)], dim=-1)
        self.kv_buffer[layer_id - self.start_layer][rows] = row.view(-1, 1, self.kv_cache_dim)

    def index_key_pages(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """A copy in ordinary CPU memory of the indexer-key pages holding ``logical_ids`` (a
        request's ids, page-aligned as the allocator hands them out): ``[layers, pages, bytes]``.
        No side effects."""
        pages = torch.unique_consecutive(logical_ids // self.page_size)
        return torch.stack([buf[pages].cpu() for buf in self.index_k_with_scale_buffer])

    def restore_index_key_pages(self, logical_ids: torch.Tensor, pages: torch.Tensor) -> None:
        """Write pages taken by :meth:`index_key_pages` into the pages holding ``logical_ids``
        (new ids of the same positions; in-page offsets are kept, so whole pages carry over).
        Side effect: the indexer-key buffer of every layer."""
        target = torch.unique_consecutive(logical_ids // self.page_size)
        if target.numel() != pages.shape[1]:
            raise ValueError(f"{target.numel()} indexer-key pages to restore into, {pages.shape[1]} kept")
        for buf, kept in zip(self.index_k_with_scale_buffer, pages):
            buf[target.to(buf.device)] = kept.to(buf.device)

    def copy_index_key_pages(self, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy the indexer-key pages holding ``src_ids`` into those holding ``dst_ids`` (the same
        positions under other ids, page-aligned: in-page offsets are kept), on the device, every
        layer. Side effect: the indexer-key buffer's ``dst`` pages."""
        src = torch.unique_consecutive(src_ids.to(torch.int64) // self.page_size)
        dst = torch.unique_consecutive(dst_ids.to(torch.int64) // self.page_size)
        if src.numel() != dst.numel():
            raise ValueError(f"{src.numel()} indexer-key pages to copy into {dst.numel()}")
        for buf in self.index_k_with_scale_buffer:
            buf[dst.to(buf.device)] = buf[src.to(buf.device)]

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError("sglang-hisparse: the HiSparse device pool has no CPU copy path")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError("sglang-hisparse: the HiSparse device pool has no CPU copy path")

    def move_kv_cache(self, tgt_loc, src_loc):
        raise NotImplementedError("sglang-hisparse: KV rows of the HiSparse device pool are never moved")
