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

from sglang_hisparse.memory.host_rows import RequestRowRecord

logger = logging.getLogger(__name__)


def copy_rows_torch(src_layers, dst_layers, src_rows: torch.Tensor, dst_rows: torch.Tensor, layers) -> None:
    """Torch twin of the transfer kernels (CPU pools): in each of ``layers``, rows ``src_rows`` of
    ``src_layers[layer]`` into rows ``dst_rows`` of ``dst_layers[layer]``. Side effect: those
    destination rows only."""
    src, dst = src_rows.cpu(), dst_rows.cpu()
    for layer in layers:
        dst_layers[layer][dst] = src_layers[layer][src].to(dst_layers[layer].device)


class HiSparseHostPool(RequestRowRecord, MLATokenToKVPoolHost):
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
        self._borrowed_of: dict[int, int] = {}
        """Request slot -> leading rows borrowed from the prefix cache (never freed through the slot)."""

    @property
    def capacity_tokens(self) -> int:
        """Rows this pool can hand out (whole pages)."""
        return (self.logical_size // self.page_size) * self.page_size

    # --- copies ------------------------------------------------------------------------------
    def write_back(self, device_pool, device_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Copy device rows to host rows, every layer, on the current stream. On CUDA the transfer
        kernel reads both index lists on the device: host rows given on the CPU are copied there
        first, on the same stream (non-blocking: the host does not wait for the device)."""
        if device_rows.numel() == 0:
            return
        if device_rows.is_cuda:
            host_rows = host_rows.to(device_rows.device, non_blocking=True)
            self.backup_from_device_all_layer(device_pool, host_rows, device_rows, io_backend="kernel")
            return
        copy_rows_torch(device_pool.kv_buffer, self.kv_buffer, device_rows, host_rows, range(self.layer_num))

    def load_rows(self, device_pool, host_rows: torch.Tensor, device_rows: torch.Tensor, layer_id: Optional[int] = None) -> None:
        """Copy host rows into device rows for one layer, or every layer when ``layer_id`` is None,
        on the current stream. On CUDA, host rows given on the CPU (a prefix load-back's, from the
        tree's CPU table) are copied to the device first, on the same stream and non-blocking (a
        load-back runs while SGLang forms the next batch: a blocking copy would wait for the
        forward in flight): the transfer kernel takes device index lists only."""
        if device_rows.numel() == 0:
            return
        layers = range(self.layer_num) if layer_id is None else [layer_id]
        if device_rows.is_cuda:
            host_rows = host_rows.to(device_rows.device, non_blocking=True)
            for layer in layers:
                self.load_to_device_per_layer(device_pool, host_rows, device_rows, layer, io_backend="kernel")
            return
        copy_rows_torch(self.kv_buffer, device_pool.kv_buffer, host_rows, device_rows, layers)


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

    ours = [c for c in cls.__mro__ if c.__module__.startswith("sglang_hisparse.")]  # what we define wins
    names = []
    for name, member in vars(HiSparseHostPoolMixin).items():
        if callable(member) and not name.startswith("__") and not any(name in vars(c) for c in ours):
            setattr(cls, name, blocked(name))
            names.append(name)
    return names


BLOCKED_MIXIN_MEMBERS = tuple(_block_inherited_hisparse_helpers(HiSparseHostPool))
"""SGLang HiSparse mixin members our host pool refuses (all but the PD protocol method)."""
