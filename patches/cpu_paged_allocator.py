"""Seam (CPU platform only): SGLang's paged allocator without its Triton kernels.

Upstream targets: ``sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend``
and ``.alloc_decode`` (AROUND). Checked against: SGLang 0.5.17, where both launch Triton kernels
that need a GPU driver. DSA models require page size 64, so even a server without HiSparse uses
this allocator. On a CPU device the hooks compute the same token ids in torch
(:func:`sglang_hisparse.memory.paging.paged_token_ids`) over the allocator's own free list; on any
other device they call the original.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.memory.paging import paged_token_ids

CLASS = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
TARGETS = (f"{CLASS}.alloc_extend", f"{CLASS}.alloc_decode")
CHECKED_AGAINST = "0.5.17"


def _on_cpu(allocator: Any) -> bool:
    return str(allocator.device).startswith("cpu")


def _take(allocator: Any, prefix_lens_cpu, seq_lens_cpu, last_loc):
    p = allocator.page_size
    needed = sum(-(-s // p) - (-(-q // p)) for q, s in zip(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()))
    if allocator.need_sort and needed > len(allocator.free_pages):
        allocator.merge_and_sort_free()
    if needed > len(allocator.free_pages):
        return None
    pages, allocator.free_pages = allocator.free_pages[:needed], allocator.free_pages[needed:]
    return paged_token_ids(pages, p, prefix_lens_cpu, seq_lens_cpu, last_loc)


def alloc_extend(original: Callable[..., Any], allocator: Any, prefix_lens, prefix_lens_cpu, seq_lens,
                 seq_lens_cpu, last_loc, extend_num_tokens, *args: Any, **kwargs: Any):
    if not _on_cpu(allocator):
        return original(allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                        extend_num_tokens, *args, **kwargs)
    return _take(allocator, prefix_lens_cpu, seq_lens_cpu, last_loc)


def alloc_decode(original: Callable[..., Any], allocator: Any, seq_lens, seq_lens_cpu, last_loc, *args: Any, **kwargs: Any):
    if not _on_cpu(allocator):
        return original(allocator, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs)
    return _take(allocator, seq_lens_cpu - 1, seq_lens_cpu, last_loc)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGETS[0], alloc_extend, HookType.AROUND)
    registry.register(TARGETS[1], alloc_decode, HookType.AROUND)
