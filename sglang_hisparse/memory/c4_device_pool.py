"""DeepSeek-V4's C4 attention KV on the device, addressed through the allocator's mapping.

With HiSparse on a V4 model, SGLang 0.5.17's ``DeepSeekV4TokenToKVPool`` builds its C4 pool (the
attention KV of the ``compress_ratio == 4`` layers, 584-byte entries in 64-entry FlashMLA pages)
from the module global ``HiSparseC4DevicePool``, looked up when the pool is built; ours replaces it
(``patches/c4_device_pool.py``) with the same constructor arguments. It subclasses
``DeepSeekV4SingleKVPool`` because SGLang treats the C4 pool as one (its buffers, page size and
``get_key_buffer`` are read as the base pool's).

SGLang hands this pool *logical compressed ids*: for the token with logical id ``t`` that completes
a compressed entry (``t % 4 == 3``), ``c = t // 4``. The mapping (attached by the allocator that
owns it, :meth:`C4DevicePool.attach_mapping`) gives each such id its device row, 0 meaning none:
row 0 (page 0) is the dummy row the compressor writes at steps where no entry completes (its
``c4_out_loc`` is 0 there, and ``mapping[0]`` stays 0). Every KV write translates its ids through
the mapping; the attention reads device rows (the resolver's output, or
:meth:`translate_loc_to_hisparse_device` of a prefill's page table).

Owns: the device page buffers (``kv_buffer``, one uint8 ``[pages, 37440]`` per C4 layer, built by
the base class). Reads, never writes: the mapping. Has no CPU-copy path (a request's C4 KV lives
in the host pool, ``memory/c4_host_pool.py``).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

from sglang_hisparse.resolver.c4_rows import (
    C4_ITEM_BYTES,
    C4_PAGE_BYTES,
    C4_PAGE_ENTRIES,
    C4_RATIO,
    C4PagedRows,
    completed_entry_ids,
)


_active: Optional["weakref.ReferenceType[C4DevicePool]"] = None
"""The pool whose mapping was attached last in this process (one served model per scheduler
process; speculative drafts are refused with DeepSeek-V4): read by the sparse-prefill seam."""


def active_c4_mapping() -> Optional[torch.Tensor]:
    """The compressed id -> device row mapping of this process's C4 pool, or None when none is
    ours (HiSparse off, or not a DeepSeek-V4 model)."""
    pool = _active() if _active is not None else None
    return None if pool is None else pool.logical_to_device


class C4DevicePool(DeepSeekV4SingleKVPool):
    """Replaces SGLang's ``HiSparseC4DevicePool`` (module docstring)."""

    compress_ratio = C4_RATIO

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, start_layer: Optional[int] = None,
                 end_layer: Optional[int] = None):
        """``size`` device rows (entries) per layer, in pages of ``page_size`` (64) entries. Side
        effect: the page buffers (zeroed, on ``device``)."""
        super().__init__(size, page_size, dtype, qk_nope_head_dim, qk_rope_head_dim, layer_num, device,
                         enable_memory_saver, start_layer, end_layer)
        if self.page_size != C4_PAGE_ENTRIES or self.bytes_per_page_padded != C4_PAGE_BYTES:
            raise ValueError(f"sglang-hisparse: a C4 pool has {C4_PAGE_ENTRIES}-entry pages of {C4_PAGE_BYTES} bytes, "
                             f"got {self.page_size} entries of {self.bytes_per_page_padded}")
        self.logical_to_device: Optional[torch.Tensor] = None
        """int64 [logical compressed ids]: device row of each (0: none); the allocator's tensor."""

    # --- the mapping ------------------------------------------------------------------------
    def attach_mapping(self, logical_to_device: torch.Tensor) -> None:
        """Hold the allocator's mapping (1-D int64 on this pool's device), written in place only by
        its owner. Called once, before any KV write. Side effect: this pool's mapping is the
        process's active one (:func:`active_c4_mapping`)."""
        if logical_to_device.dim() != 1 or logical_to_device.dtype != torch.int64:
            raise ValueError("sglang-hisparse: the C4 mapping is a 1-D int64 tensor, got "
                             f"{logical_to_device.dtype} {tuple(logical_to_device.shape)}")
        if logical_to_device.device.type != torch.device(self.device).type:
            raise ValueError(f"sglang-hisparse: the C4 mapping is on {logical_to_device.device}, the pool on {self.device}")
        self.logical_to_device = logical_to_device
        global _active
        _active = weakref.ref(self)

    register_mapping = attach_mapping
    """The name SGLang's own V4 HiSparse allocator calls (``allocator/hisparse.py``)."""

    def _mapping(self) -> torch.Tensor:
        if self.logical_to_device is None:
            raise RuntimeError("sglang-hisparse: the C4 device pool has no mapping yet "
                               "(the allocator attaches it with attach_mapping before any KV write)")
        return self.logical_to_device

    # --- translations SGLang calls ----------------------------------------------------------
    def translate_loc_from_full_to_compressed(self, full_indices: torch.Tensor) -> torch.Tensor:
        """The logical compressed ids of the tokens among ``full_indices`` (logical token ids) that
        complete an entry (``t % 4 == 3``), in order: ``t // 4``. Others are dropped (a CUDA
        tensor's result has a data-dependent size: the host waits for the device)."""
        return completed_entry_ids(full_indices).to(full_indices.dtype)

    def _translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) of logical compressed ids; 0 where none (the compressor's writes)."""
        return self._mapping()[compressed_indices]

    def translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """Device rows (int32, FlashMLA's index type) of logical compressed ids."""
        return self._translate_loc_to_hisparse_device(compressed_indices).to(torch.int32)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) of the entries the tokens ``full_indices`` complete, in order."""
        return self._translate_loc_to_hisparse_device(self.translate_loc_from_full_to_compressed(full_indices))

    # --- KV writes ----------------------------------------------------------------------------
    def set_key_buffer(self, layer_id: int, loc: torch.Tensor, cache_nope_fp8_rope_bf16_pack: Any) -> None:
        """Write packed entries (fp8 nope [n, 448], bf16 rope [n, 64], UE8M0 scales [n, 7]) of the
        logical compressed ids ``loc`` into their mapped rows of C4 layer ``layer_id``. Side
        effect: those rows' value and scale bytes (each row's pad byte and the page padding are
        untouched). CUDA: the base pool's writer; elsewhere a torch write through ``C4PagedRows``."""
        rows = self.translate_loc_to_hisparse_device(loc)
        if torch.device(self.device).type == "cuda":
            return super().set_key_buffer(layer_id, rows, cache_nope_fp8_rope_bf16_pack)
        self._write_pack_torch(layer_id, rows, cache_nope_fp8_rope_bf16_pack)

    def _write_pack_torch(self, layer_id: int, rows: torch.Tensor, pack: Any) -> None:
        """The torch write of packed entries (value = nope then rope bytes, then the 7 scale bytes)."""
        n = rows.numel()
        payload = torch.cat([
            pack.k_nope_fp8.contiguous().view(torch.uint8).reshape(n, -1),
            pack.k_rope_bf16.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, -1),
            pack.scale_k_nope_ue8m0.contiguous().view(torch.uint8).reshape(n, -1),
        ], dim=1)
        if payload.shape[1] != C4_ITEM_BYTES - 1:
            raise ValueError(f"sglang-hisparse: a packed C4 entry has {C4_ITEM_BYTES - 1} bytes, got {payload.shape[1]}")
        view = C4PagedRows(self.kv_buffer[layer_id])
        entries = view.read(rows)
        entries[:, : C4_ITEM_BYTES - 1] = payload.to(entries.device)
        view.write(rows, entries)

    def set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Quantize and store unquantized entries ``cache_k`` of the logical compressed ids ``loc``
        into their mapped rows (the base pool's fused CUDA kernel, ``fused_store_cache``)."""
        rows = self.translate_loc_to_hisparse_device(loc)
        if torch.device(self.device).type != "cuda":
            raise NotImplementedError(
                "sglang-hisparse: the fused C4 KV store (quantize and store, SGLang's fused_store_cache) is a CUDA "
                f"kernel; on {self.device} write packed entries with set_key_buffer"
            )
        return super().set_key_buffer_fused(layer_id, rows, cache_k)

    # --- refused ------------------------------------------------------------------------------
    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError(
            "sglang-hisparse: the C4 device pool holds only hot rows; a request's C4 KV is in the host pool, "
            "so there is no CPU copy of this pool (a PD retraction copies from the host pool)"
        )

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError(
            "sglang-hisparse: the C4 device pool holds only hot rows; a request's C4 KV is in the host pool, "
            "so there is no CPU copy of this pool to load (a PD resume writes into the host pool)"
        )
