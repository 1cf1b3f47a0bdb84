"""Seam: DeepSeek-V4's sparse prefill gathers C4 entries at their device rows.

Upstream target: ``sglang.srt.layers.attention.dsv4.sparse_prefill_utils.SparsePrefillChunkCache.ensure_c4``
(AROUND). Checked against: SGLang 0.5.17, where the FlashMLA sparse prefill path (every extend
above 11673 query tokens, and every extend by default: ``SGLANG_OPT_FLASHMLA_SPARSE_PREFILL``)
gathers each request's C4 entries from the C4 pool's buffer at ``page * 64 + offset`` of its
logical page table: logical compressed ids. With HiSparse the C4 pool holds device rows, not
logical ids, so the gathered ids are translated through our mapping (a prefill's entries are all
mapped to their rows; ids no request holds map to row 0, the dummy row). Without our C4 pool
(HiSparse off, or not a V4 model) the original runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sglang_hisparse.memory.c4_device_pool import active_c4_mapping

TARGET = "sglang.srt.layers.attention.dsv4.sparse_prefill_utils.SparsePrefillChunkCache.ensure_c4"
CHECKED_AGAINST = "0.5.17"


def ensure_c4(original: Callable[..., Any], cache: Any, page_table: torch.Tensor, c4_page_size: int,
              *args: Any, **kwargs: Any) -> Any:
    fresh = cache.c4_flat_token_ids is None
    result = original(cache, page_table, c4_page_size, *args, **kwargs)
    mapping = active_c4_mapping()
    if fresh and mapping is not None and cache.c4_flat_token_ids is not None:
        ids = cache.c4_flat_token_ids
        cache.c4_flat_token_ids = mapping.index_select(0, ids.to(torch.int64)).to(ids.dtype)
    return result


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, ensure_c4, HookType.AROUND)
