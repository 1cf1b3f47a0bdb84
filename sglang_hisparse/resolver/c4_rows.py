"""Row views of KV buffers: the linear DSA rows and DeepSeek-V4's paged C4 rows.

The resolver copies whole rows (one position's KV of one layer) between a host and a device
buffer. DSA buffers are linear: row ``g`` is ``kv[g]``. DeepSeek-V4 keeps its C4 attention KV
(one row per compressed entry of 4 tokens) in FlashMLA's paged layout, which SGLang 0.5.17's
``DeepSeekV4SingleKVPool`` allocates and its kernels read:

* a page holds :data:`C4_PAGE_ENTRIES` (64) entries in :data:`C4_PAGE_BYTES` (37440) bytes;
* entry ``e`` is page ``e // 64``, offset ``o = e % 64``; its value (448 B fp8 nope + 64 bf16
  rope = :data:`C4_VALUE_BYTES`, 576) sits at ``o * 576`` in the page, its scale (7 UE8M0 bytes
  and a pad byte = :data:`C4_SCALE_BYTES`, 8) at ``64 * 576 + o * 8``; the page's last 64 bytes
  are padding (never read or written here).

A row is therefore :data:`C4_ITEM_BYTES` (584) bytes wherever it is copied: value then scale.
The CUDA kernel (``kernels/resolve.cuh``, ``RowLayout<584>``) uses the same addressing; this module
is its torch twin and the views the oracles and the CPU paths copy through.

Nothing here owns state: a view wraps a buffer it does not copy (writes go into the buffer).
"""

from __future__ import annotations

from typing import Union

import torch

C4_PAGE_ENTRIES = 64
C4_VALUE_BYTES = 576
C4_SCALE_BYTES = 8
C4_ITEM_BYTES = C4_VALUE_BYTES + C4_SCALE_BYTES
C4_SCALE_OFFSET = C4_PAGE_ENTRIES * C4_VALUE_BYTES  # 36864: where a page's scales start
C4_PAGE_BYTES = -(-(C4_ITEM_BYTES * C4_PAGE_ENTRIES) // C4_VALUE_BYTES) * C4_VALUE_BYTES  # 37440
C4_RATIO = 4
"""Tokens per C4 entry: entry ``k`` of a request is its tokens ``4k .. 4k + 3``."""
assert C4_PAGE_BYTES % C4_VALUE_BYTES == 0 and C4_SCALE_OFFSET % C4_SCALE_BYTES == 0


def c4_copy_items(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> tuple[tuple[int, torch.Tensor, torch.Tensor], ...]:
    """What a copy of rows ``src_rows[i] -> dst_rows[i]`` between two C4 buffers moves when it
    copies whole items, two per row: ``(item bytes, source items, destination items)`` for the
    values (:data:`C4_VALUE_BYTES` items: a page is 65 of them, 64 values then the scales and
    padding, so row ``r`` is item ``r + r // 64``), then for the scales (:data:`C4_SCALE_BYTES`
    items: page ``r // 64``'s scale region, offset ``r % 64``). Both sides in six small ops (the
    per-step backup launches them). int64 on ``src_rows``' device (``dst_rows`` is moved there,
    non-blocking); pure."""
    rows = torch.stack((src_rows.to(torch.int64), dst_rows.to(src_rows.device, torch.int64, non_blocking=True)))
    page = torch.div(rows, C4_PAGE_ENTRIES, rounding_mode="floor")
    value = rows + page
    scale = torch.add(torch.remainder(rows, C4_PAGE_ENTRIES), page, alpha=C4_PAGE_BYTES // C4_SCALE_BYTES)
    scale += C4_SCALE_OFFSET // C4_SCALE_BYTES
    return (C4_VALUE_BYTES, value[0], value[1]), (C4_SCALE_BYTES, scale[0], scale[1])


def completed_entry_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """Compressed logical ids (int64) of the entries these token ids complete (ids ``4c + 3``), in
    order. Token ids keep their position's offset mod 4 (SGLang's pages of 256 tokens start at
    position 0), so the tokens completing entries are exactly those with ``id % 4 == 3``. Pure (a
    CUDA tensor's result has a data-dependent size: the host waits for the device)."""
    token_ids = token_ids.to(torch.int64)
    return token_ids[token_ids % C4_RATIO == C4_RATIO - 1] // C4_RATIO


def prefix_entry_ids(token_row: torch.Tensor, tokens: int) -> torch.Tensor:
    """Compressed logical ids (int64) of the entries the first ``tokens`` tokens of a request's
    ``req_to_token`` row complete: the tokens at positions ``4e + 3`` (token ids keep their
    position's offset mod 4, :func:`completed_entry_ids`), so a strided slice: no data-dependent
    size, no wait for the device. Pure."""
    return token_row[C4_RATIO - 1 : tokens : C4_RATIO].to(torch.int64) // C4_RATIO


class LinearRows:
    """Row ``g`` is ``kv[g]`` (any trailing shape and dtype): the DSA layout."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv

    @property
    def num_rows(self) -> int:
        return self.kv.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size() if self.kv.shape[0] else 0

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows' bytes as uint8 [n, row_bytes] (a new tensor on the buffer's device)."""
        picked = self.kv.index_select(0, rows.to(self.kv.device, torch.int64))
        return picked.contiguous().view(torch.uint8).reshape(rows.numel(), -1)

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Write uint8 [n, row_bytes] into the rows (distinct rows; side effect: the buffer)."""
        values = data.to(self.kv.device).contiguous().view(self.kv.dtype).reshape((rows.numel(),) + self.kv.shape[1:])
        self.kv.index_copy_(0, rows.to(self.kv.device, torch.int64), values)


class C4PagedRows:
    """Entries of a DeepSeek-V4 C4 buffer: uint8 [pages, C4_PAGE_BYTES] (module docstring)."""

    def __init__(self, pages: torch.Tensor):
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != C4_PAGE_BYTES:
            raise ValueError(f"a C4 buffer is uint8 [pages, {C4_PAGE_BYTES}], got {pages.dtype} {tuple(pages.shape)}")
        if not pages.is_contiguous():
            raise ValueError("a C4 buffer must be contiguous")
        self.pages = pages
        self._flat = pages.view(-1)

    @property
    def num_rows(self) -> int:
        return self.pages.shape[0] * C4_PAGE_ENTRIES

    @property
    def row_bytes(self) -> int:
        return C4_ITEM_BYTES

    @property
    def device(self) -> torch.device:
        return self.pages.device

    def byte_index(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 [n, 584]: the flat byte offsets of each row (value bytes, then scale bytes)."""
        rows = rows.to(self.pages.device, torch.int64).reshape(-1, 1)
        base = (rows // C4_PAGE_ENTRIES) * C4_PAGE_BYTES
        offset = rows % C4_PAGE_ENTRIES
        value = base + offset * C4_VALUE_BYTES + torch.arange(C4_VALUE_BYTES, device=rows.device)
        scale = base + C4_SCALE_OFFSET + offset * C4_SCALE_BYTES + torch.arange(C4_SCALE_BYTES, device=rows.device)
        return torch.cat([value, scale], dim=1)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows' 584 bytes each, uint8 [n, 584] (a new tensor on the buffer's device)."""
        return self._flat[self.byte_index(rows)]

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Write uint8 [n, 584] into the rows (side effect: the buffer; padding untouched)."""
        self._flat[self.byte_index(rows)] = data.to(self.pages.device, torch.uint8).reshape(-1, C4_ITEM_BYTES)


RowView = Union[LinearRows, C4PagedRows]


def row_view(kv: Union[torch.Tensor, LinearRows, C4PagedRows]) -> RowView:
    """``kv`` as a row view: a view is returned as is, a tensor is linear rows."""
    return kv if isinstance(kv, (LinearRows, C4PagedRows)) else LinearRows(kv)


def copy_rows(src: RowView, src_rows: torch.Tensor, dst: RowView, dst_rows: torch.Tensor) -> int:
    """Copy ``src_rows`` of ``src`` into ``dst_rows`` of ``dst`` (same count, distinct targets).
    Returns the bytes copied. Side effect: ``dst``'s buffer."""
    if src_rows.numel() == 0:
        return 0
    if src.row_bytes != dst.row_bytes:
        raise ValueError(f"rows of {src.row_bytes} B cannot be copied into rows of {dst.row_bytes} B")
    dst.write(dst_rows, src.read(src_rows))
    return src_rows.numel() * src.row_bytes
