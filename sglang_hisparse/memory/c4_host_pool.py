"""Host pool of DeepSeek-V4's C4 attention KV: every C4 layer's entries in (pinned) host DRAM.

SGLang 0.5.17 offloads only the C4 attention KV of a V4 model (layers with ``compress_ratio == 4``;
a layer's index here is SGLang's ``compress_layer_id`` among them). One row is one compressed
entry (4 tokens), 584 bytes, stored in FlashMLA's paged layout: 64 entries per 37440-byte page
(``resolver/c4_rows.py`` defines the addressing; this module never repeats it). The host buffers
have the device pool's page layout, so a whole page is one contiguous 37440-byte item (what the PD
direct-to-host transfer writes, :meth:`C4HostPool.get_contiguous_buf_infos`).

:class:`C4HostPool` offers the interface the host mirror (``memory/host_mirror.py``) drives on the
DSA host pool (``HiSparseHostPool``): ``capacity_tokens``, ``row_bytes``, ``page_size``,
``layer_num``, ``kv_buffer``, ``alloc`` / ``free`` / ``available_size``, the per-request rows
(:class:`RequestRowRecord`: ``alloc_paged_token_slots``, ``grow_request_rows``, ``grow_rows``,
``free_request_rows``, ``rows_of``) and the copies ``write_back`` / ``load_rows``. Besides,
``read_entries`` / ``write_entries`` give every layer's bytes of some rows (a PD retraction's copy
to ordinary memory; the DSA mirror indexes its linear ``kv_buffer`` directly for that).

A plain class, not a subclass of SGLang's ``DeepSeekV4PagedHostPool`` or ``HostKVCache``: no SGLang
code checks the coordinator's host pool with ``isinstance`` on the HiSparse paths (PD decode reads
``mem_pool_host.get_contiguous_buf_infos()``, ``.layer_num`` and ``.alloc_paged_token_slots``
only; the HiCache controller, which type-checks host pools, is not built with HiSparse), and
inheriting would bring SGLang's own HiSparse helpers and whole-page copy shortcut with it.

Owns: the host rows' free list (a :class:`~sglang_hisparse.memory.paging.PageAllocator` of 64-row
pages on the CPU; page 0 is never handed out, so host row 0 never holds an entry), each request
slot's rows (CPU chunks, :class:`RequestRowRecord`) and the host bytes. Pinning uses
``cudaHostRegister`` on an ordinary allocation rather than torch's pinned allocator, which rounds
every block up to a power of two (a 70 GB pool would pin 128 GB).

Copies move each row as two items, its 576-byte value and its 8-byte scale, whose item indices
``resolver/c4_rows.py`` computes for both sides at once (``c4_copy_items``). On CUDA they run
SGLang's generic KV transfer kernels (``sgl_kernel.kvcacheio``, HiCache's I/O ops: a warp per item,
8-byte words, reading and writing the pinned host buffer directly): two launches for every layer
at once, on the current stream, with the row indices on the device, so the host never waits for
the device (the host mirror's copy lanes order them). Elsewhere :func:`copy_items` does the same
with torch indexing: it is the kernels' twin, which the CPU tests drive through the same item
indices.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from sglang_hisparse.memory.host_rows import RequestRowRecord
from sglang_hisparse.memory.paging import PageAllocator
from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES, C4_PAGE_BYTES, C4_PAGE_ENTRIES, C4PagedRows, c4_copy_items


def copy_items(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], src_items: torch.Tensor,
               dst_items: torch.Tensor, item_bytes: int) -> None:
    """Torch twin of SGLang's ``transfer_kv_all_layer_mla``: in every layer pair, copy the
    ``item_bytes``-byte items ``src_items`` of the source buffer (as flat bytes) into items
    ``dst_items`` of the destination (distinct). Side effect: the destination buffers only."""
    for src, dst in zip(src_layers, dst_layers):
        src_view, dst_view = src.view(-1).view(-1, item_bytes), dst.view(-1).view(-1, item_bytes)
        dst_view[dst_items.to(dst.device)] = src_view[src_items.to(src.device)].to(dst.device)


def _device_addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' base addresses as a uint64 tensor on ``device``, copied from pinned memory
    without the host waiting (a table built during a decode step must not sync it)."""
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64).pin_memory()
    return addresses.to(device, non_blocking=True)


class _KernelCopies:
    """SGLang's transfer kernels over fixed layer lists (their base addresses as a device uint64
    tensor, the dtype the kernel checks; built once: the buffers never move)."""

    def __init__(self, src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], device: torch.device):
        from sgl_kernel.kvcacheio import transfer_kv_all_layer_mla

        self._transfer = transfer_kv_all_layer_mla
        self.num_layers = len(src_layers)
        self.src_ptrs = _device_addresses(src_layers, device)
        self.dst_ptrs = _device_addresses(dst_layers, device)

    def __call__(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        device = self.src_ptrs.device
        for item_bytes, src_items, dst_items in c4_copy_items(src_rows.to(device, non_blocking=True), dst_rows):
            self._transfer(self.src_ptrs, self.dst_ptrs, src_items, dst_items, item_bytes, self.num_layers)


class C4HostPool(RequestRowRecord):
    """Host rows of the C4 attention KV of every C4 layer (module docstring).

    ``kv_buffer`` is uint8 ``[layer_num, pages + 1, 37440]`` (host memory, pinned when asked):
    ``kv_buffer[layer]`` is that layer's contiguous page buffer, page 0 unused. Host row ``h`` is
    entry ``h % 64`` of page ``h // 64``."""

    row_bytes = C4_ITEM_BYTES
    page_size = C4_PAGE_ENTRIES
    pool_label = "C4 host pool"
    item_bytes = C4_PAGE_BYTES

    def __init__(self, layer_num: int, capacity: int, device: torch.device | str = "cpu", *,
                 pin_memory: bool, debug: bool = False):
        """``capacity`` entries per layer, rounded up to whole pages; ``device``: the device pool's
        device (the other end of the copies). Side effect: allocates (and pins) the host buffer;
        with ``pin_memory`` and no CUDA, RuntimeError."""
        if layer_num < 1 or capacity < 1:
            raise ValueError(f"a C4 host pool needs layers >= 1 and capacity >= 1, got {layer_num}, {capacity}")
        self._rows_of = {}
        self._borrowed_of = {}
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.num_pages = -(-capacity // C4_PAGE_ENTRIES)
        self.pages = PageAllocator(self.num_pages, C4_PAGE_ENTRIES, "cpu", debug=debug)
        self.kv_buffer = torch.empty((layer_num, self.num_pages + 1, C4_PAGE_BYTES), dtype=torch.uint8)
        if pin_memory:
            _pin(self, self.kv_buffer)
        self._views = [C4PagedRows(self.kv_buffer[layer]) for layer in range(layer_num)]
        self._kernel_copies: dict[tuple[int, str, int, int], _KernelCopies] = {}
        """(the device pool's first copied layer's address, direction, first layer, layer count) -> its
        transfer kernels."""

    @classmethod
    def from_device_pool(cls, device_pool: Any, capacity: int, *, pin_memory: bool, debug: bool = False) -> "C4HostPool":
        """For a C4 device pool (``C4DevicePool`` or any pool with ``layer_num``, ``device`` and
        ``kv_buffer`` of C4 pages): its layer count and device."""
        first = device_pool.kv_buffer[0]
        if first.dtype != torch.uint8 or first.shape[-1] != C4_PAGE_BYTES:
            raise ValueError(f"not a C4 device pool: its pages are {first.dtype} {tuple(first.shape)}")
        return cls(device_pool.layer_num, capacity, device_pool.device, pin_memory=pin_memory, debug=debug)

    # --- rows ---------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Rows this pool can hand out (whole pages)."""
        return self.num_pages * C4_PAGE_ENTRIES

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` rows (a multiple of 64, else ValueError) as whole pages, CPU int64 in page
        order; None (nothing taken) when fewer are free."""
        return self.pages.alloc_tokens(need_size)

    def free(self, rows: torch.Tensor) -> int:
        """Return the pages of ``rows`` (whole pages, as handed out) to the free list; returns the
        row count."""
        self.pages.free_tokens(rows.cpu())
        return rows.numel()

    def available_size(self) -> int:
        return self.pages.available_tokens()

    # --- bytes --------------------------------------------------------------------------------
    def read_entries(self, rows: torch.Tensor) -> torch.Tensor:
        """Every layer's bytes of host ``rows``: uint8 ``[layer_num, n, 584]``, a new CPU tensor."""
        return torch.stack([view.read(rows) for view in self._views])

    def write_entries(self, rows: torch.Tensor, data: torch.Tensor, layers: Optional[range] = None) -> None:
        """Write ``data`` (uint8 ``[len(layers), n, 584]``) into host ``rows`` (distinct) of
        ``layers`` (every layer by default). Side effect: those entries only (padding untouched)."""
        for i, layer in enumerate(layers if layers is not None else range(self.layer_num)):
            self._views[layer].write(rows, data[i])

    def write_back(self, device_pool: Any, device_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Copy device rows to host rows (distinct), every layer, on the current stream. From CUDA
        the host does not wait (module docstring). Side effect: those host entries only."""
        self._copy(device_pool, "to_host", range(self.layer_num), device_rows, host_rows)

    def load_rows(self, device_pool: Any, host_rows: torch.Tensor, device_rows: torch.Tensor,
                  layer_id: Optional[int] = None) -> None:
        """Copy host rows into device rows (distinct) for one layer, or every layer when
        ``layer_id`` is None, on the current stream. Side effect: those device entries only."""
        layers = range(self.layer_num) if layer_id is None else range(layer_id, layer_id + 1)
        self._copy(device_pool, "to_device", layers, host_rows, device_rows)

    def _copy(self, device_pool: Any, direction: str, layers: range, src_rows: torch.Tensor,
              dst_rows: torch.Tensor) -> None:
        """Copy ``src_rows`` to ``dst_rows`` of ``layers`` in ``direction`` ("to_host" or
        "to_device"). On CUDA through the transfer kernels built once per (device pool, direction,
        layers) and kept (a per-step write-back looks them up by key, nothing rebuilt); on CPU
        through their torch twin."""
        if src_rows.numel() == 0:
            return
        first = device_pool.kv_buffer[layers.start]
        if first.is_cuda:
            key = (first.data_ptr(), direction, layers.start, len(layers))
            copies = self._kernel_copies.get(key)
            if copies is None:
                copies = self._kernel_copies[key] = _KernelCopies(*self._layer_lists(device_pool, direction, layers),
                                                                  first.device)
            copies(src_rows, dst_rows)
            return
        src_layers, dst_layers = self._layer_lists(device_pool, direction, layers)
        for item_bytes, src_items, dst_items in c4_copy_items(src_rows, dst_rows):
            copy_items(src_layers, dst_layers, src_items, dst_items, item_bytes)

    def _layer_lists(self, device_pool: Any, direction: str, layers: range) -> tuple[list, list]:
        """The per-layer page buffers of ``layers``, (sources, destinations) for ``direction``."""
        device_layers = [device_pool.kv_buffer[layer] for layer in layers]
        host_layers = [self.kv_buffer[layer] for layer in layers]
        return (device_layers, host_layers) if direction == "to_host" else (host_layers, device_layers)

    # --- PD -----------------------------------------------------------------------------------
    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The PD direct-to-host destinations: per layer the page buffer's address, its bytes, and
        the item length (one 37440-byte page; SGLang sends host page ids ``row // 64``). SGLang's
        decode side marks them host DRAM itself (``kv_data_mem_kinds``) when HiSparse is on."""
        buffers = [self.kv_buffer[layer] for layer in range(self.layer_num)]
        return ([b.data_ptr() for b in buffers], [b.nbytes for b in buffers], [C4_PAGE_BYTES] * self.layer_num)


def _pin(owner: object, buffer: torch.Tensor) -> None:
    """Page-lock ``buffer`` (cudaHostRegister) for as long as ``owner`` lives. RuntimeError
    without CUDA or when the driver refuses."""
    if not torch.cuda.is_available():
        raise RuntimeError("sglang-hisparse: the C4 host pool cannot pin host memory without CUDA (pin_memory=False)")
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"sglang-hisparse: cudaHostRegister of the C4 host pool ({buffer.nbytes} bytes) "
                           f"failed: {cudart.cudaGetErrorString(rc)}")
    weakref.finalize(owner, cudart.cudaHostUnregister, buffer.data_ptr())
