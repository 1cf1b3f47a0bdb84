"""Page allocation over a token-id space: the mechanism under both address spaces.

A :class:`PageAllocator` hands out page ids from ``1..num_pages`` (page 0 is never handed out:
SGLang writes padded tokens' dummy KV to row 0). Token id ``t`` lives in page ``t // page_size``.
Pure torch, so it runs on CPU and GPU alike; no Triton, no host pages.

Invariant: every page id in ``1..num_pages`` is either free (in ``free_pages``) or held by exactly
one owner. ``debug=True`` keeps a per-page in-use mask and asserts it on every call (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_hisparse.resolver.jit import decode_module


class PageAllocator:
    """Free list of pages. Side effects of every method are on ``free_pages`` only."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str, debug: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PageAllocator needs pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.debug = debug
        self.clear()

    # --- state -------------------------------------------------------------------------------
    def clear(self) -> None:
        """Every page free again."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        if self.debug:
            self._in_use = torch.zeros(self.num_pages + 1, dtype=torch.bool)

    def available_pages(self) -> int:
        return int(self.free_pages.numel())

    def available_tokens(self) -> int:
        return self.available_pages() * self.page_size

    # --- pages -------------------------------------------------------------------------------
    def alloc_pages(self, n: int) -> Optional[torch.Tensor]:
        """Take ``n`` pages (int64 page ids), or None (nothing taken) if fewer are free."""
        if n > self.free_pages.numel():
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        if self.debug and n:
            ids = pages.cpu()
            assert not self._in_use[ids].any(), f"page handed out twice: {ids.tolist()}"
            self._in_use[ids] = True
        return pages

    def free_pages_(self, pages: torch.Tensor) -> None:
        """Return pages (distinct ids) to the free list."""
        if pages.numel() == 0:
            return
        if self.debug:
            ids = pages.cpu()
            assert len(set(ids.tolist())) == ids.numel(), "duplicate page ids in one free"
            assert bool((ids >= 1).all()) and bool((ids <= self.num_pages).all()), "page id out of range"
            assert self._in_use[ids].all(), f"double free of pages {ids[~self._in_use[ids]].tolist()}"
            self._in_use[ids] = False
        self.free_pages = torch.cat([pages.to(self.free_pages.device, torch.int64, non_blocking=True), self.free_pages])

    # --- tokens ------------------------------------------------------------------------------
    def page_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """All token ids of the given pages, page by page."""
        offsets = torch.arange(self.page_size, device=pages.device, dtype=torch.int64)
        return (pages.view(-1, 1) * self.page_size + offsets).reshape(-1)

    def alloc_tokens(self, n_tokens: int) -> Optional[torch.Tensor]:
        """Whole pages covering ``n_tokens`` (a multiple of the page size), as token ids."""
        if n_tokens % self.page_size:
            raise ValueError(f"alloc_tokens needs a multiple of {self.page_size}, got {n_tokens}")
        pages = self.alloc_pages(n_tokens // self.page_size)
        return None if pages is None else self.page_rows(pages)

    def free_tokens(self, token_ids: torch.Tensor) -> None:
        """Free the pages holding these token ids (every token of those pages is released)."""
        token_ids = token_ids[token_ids > 0]
        if token_ids.numel() == 0:
            return
        self.free_pages_(torch.unique(token_ids // self.page_size))

    def pages_needed(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """New pages to grow each request from prefix to seq length."""
        p = self.page_size
        return sum(-(-s // p) - (-(-q // p)) for q, s in zip(prefix_lens, seq_lens))

    def extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Token ids for positions ``prefix_len..seq_len-1`` of each request, concatenated.

        A request continues its partial last page (``last_loc + 1, ...``) and then takes new pages,
        so position ``q`` always sits at in-page offset ``q % page_size``.

        Args:
            prefix_lens, seq_lens: CPU int tensors, one entry per request.
            last_loc: token id of each request's position ``prefix_len - 1`` (any value when the
                prefix is empty), on this allocator's device.
        Returns None (nothing taken) when too few pages are free.
        """
        pages = self.alloc_pages(self.pages_needed(prefix_lens.tolist(), seq_lens.tolist()))
        if pages is None:
            return None
        return paged_token_ids(pages, self.page_size, prefix_lens, seq_lens, last_loc)

    def decode(self, seq_lens: list[int], last_loc: torch.Tensor) -> Optional[DecodeIds]:
        """One token id per request for its position ``seq_len - 1`` (``seq_lens`` a Python list,
        each at least 2; ``last_loc`` on this allocator's device, int32 or int64): ``last_loc + 1``
        inside a page, the first id of a new page where the position starts one. Returns None
        (nothing taken) when too few pages are free. The same ids as :meth:`extend` with prefix
        ``seq_len - 1``, without waiting for the device (a decode step's hot path): on CUDA one
        kernel (``kernels/decode.cuh``, ``decode_ids``), elsewhere its torch twin
        (:func:`decode_ids_torch`)."""
        p = self.page_size
        starts = [b for b, n in enumerate(seq_lens) if (n - 1) % p == 0]  # Python: a few per step
        pages = None
        if starts:
            pages = self.alloc_pages(len(starts))
            if pages is None:
                return None
        if self.device.type == "cuda":
            ids = torch.empty(last_loc.shape, dtype=torch.int64, device=last_loc.device)
            decode_module().decode_ids(last_loc, self.free_pages[:0] if pages is None else pages, ids, p)
        else:
            ids = decode_ids_torch(last_loc, starts, pages, p)
        return DecodeIds(ids, seq_lens, starts, pages)


def decode_ids_torch(last_loc: torch.Tensor, starts: list[int], pages: Optional[torch.Tensor], page_size: int
                     ) -> torch.Tensor:
    """The torch twin (and oracle) of the ``decode_ids`` kernel: ``last_loc + 1`` (int64), except
    at the batch positions ``starts`` (ascending), which get ``pages * page_size`` in order."""
    ids = torch.add(last_loc, 1, out=torch.empty(last_loc.shape, dtype=torch.int64, device=last_loc.device))
    if starts:
        ids[torch.tensor(starts, dtype=torch.int64).to(ids.device, non_blocking=True)] = pages * page_size
    return ids


@dataclass(frozen=True)
class DecodeIds:
    """What :meth:`PageAllocator.decode` hands out for one decode step."""

    ids: torch.Tensor
    """int64 [batch]: each request's new token id."""
    seq_lens: list[int]
    """The step's sequence lengths (the new token counted), as passed."""
    starts: list[int]
    """Batch positions (ascending) of the requests whose new token starts a page."""
    pages: Optional[torch.Tensor]
    """int64 [len(starts)]: their new pages, in that order (None when no request starts one)."""


def paged_token_ids(
    new_pages: torch.Tensor,
    page_size: int,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
) -> torch.Tensor:
    """Token ids for positions ``prefix_len..seq_len-1`` of each request, concatenated.

    Each request fills its partial last page first (``last_loc + 1, ...``), then takes its share
    of ``new_pages`` in request order (``ceil(seq/p) - ceil(prefix/p)`` pages each). Lengths are
    CPU tensors; ``new_pages`` and ``last_loc`` live on the output device. Pure function.
    """
    p = page_size
    pre, seq = prefix_lens.tolist(), seq_lens.tolist()
    pages_per_req = torch.tensor([-(-s // p) - (-(-q // p)) for q, s in zip(pre, seq)], dtype=torch.int64)
    counts = torch.tensor([s - q for q, s in zip(pre, seq)], dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(pre)), counts)
    start = torch.tensor(pre, dtype=torch.int64)[req]
    pos = start + torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    aligned_start = (start + p - 1) // p * p
    in_partial = pos < aligned_start
    first_page = (torch.cumsum(pages_per_req, 0) - pages_per_req)[req]
    page_index = (first_page + (pos - aligned_start).clamp(min=0) // p).clamp(max=max(new_pages.numel() - 1, 0))

    dev = new_pages.device
    from_partial = last_loc.to(dev, torch.int64)[req.to(dev)] + 1 + (pos - start).to(dev)
    if new_pages.numel() == 0:
        return from_partial
    from_new = new_pages[page_index.to(dev)] * p + (pos % p).to(dev)
    return torch.where(in_partial.to(dev), from_partial, from_new)
