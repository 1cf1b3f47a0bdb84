"""DeepSeek-V4's allocator (memory/c4_allocator.py) over a stand-in of SGLang's SWA allocator.

The SWA allocator (token ids, SGLang's) is replaced by a page allocator with the same calls
(``Tokens`` of tests/test_c4_coordinator.py), so
that what is ours is checked alone: completed entries get C4 rows with the same in-page offsets,
chunked prefills continue their last page, decode steps take token ids only, ``free`` gives back
exactly the rows no hot buffer owns, and admission counts C4 rows and host rows in tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.c4_allocator import C4Allocator, completed_entry_ids

from test_c4_coordinator import Tokens as TokenIds  # the SWA allocator stand-in over a C4 pool stand-in


def extend(alloc: C4Allocator, prefix: list[int], seq: list[int], last_loc: list[int]):
    p, s = torch.tensor(prefix), torch.tensor(seq)
    return alloc.alloc_extend(p, p, s, s, torch.tensor(last_loc), int((s - p).sum()))


def test_a_prefill_maps_each_completed_entry_to_a_row_at_its_offset():
    ids_alloc = TokenIds(4096, 512)
    alloc = C4Allocator(ids_alloc, debug=True)
    assert ids_alloc.c4_pool.mapping is alloc.c4.mapping.logical_to_device  # the C4 pool translates through it
    ids = extend(alloc, [0, 0], [10, 300], [-1, -1])
    per_req = ids.split([10, 300])
    for tokens in per_req:
        entries = completed_entry_ids(tokens)
        assert entries.numel() == tokens.numel() // 4
        rows = alloc.c4.mapping.rows_of(entries)
        assert bool((rows > 0).all())
        assert torch.equal(rows % 64, entries % 64)  # same in-page offsets as the compressed ids
    assert alloc.c4.rows.room() == 512 - 64 * 3  # entries 2 (1 page) + 75 (2 pages)


def test_a_chunked_prefill_continues_its_last_page():
    alloc = C4Allocator(TokenIds(4096, 512), debug=True)
    first = extend(alloc, [0], [130], [-1])  # 32 entries; token 129 is mid-entry
    second = extend(alloc, [130], [400], [int(first[-1])])
    tokens = torch.cat([first, second])
    rows = alloc.c4.mapping.rows_of(completed_entry_ids(tokens))
    assert rows.numel() == 100
    assert torch.equal(rows[1:] - rows[:-1], torch.ones(99, dtype=torch.int64))  # one page, in order
    assert alloc.c4.rows.room() == 512 - 128


def test_decode_takes_token_ids_only_and_free_returns_what_no_hot_buffer_owns():
    alloc = C4Allocator(TokenIds(4096, 512), debug=True)
    ids = extend(alloc, [0], [256], [-1])
    step = alloc.alloc_decode(torch.tensor([257]), torch.tensor([257]), ids[-1:])
    assert step.numel() == 1 and alloc.c4.rows.room() == 512 - 64
    # a hot buffer took the request's page: free must not release it
    entries = completed_entry_ids(ids)
    alloc.configure(hot_buffer_rows=128, host_capacity_entries=1000, host_entries_used=lambda: 0)
    kept = alloc.c4.take_hot_buffer(entries, 64)
    assert kept is not None and bool(alloc.c4.rows.hot_owned[kept].all())
    alloc.free(torch.cat([ids, step]))
    assert alloc.c4.rows.room() == 512 - 64
    alloc.c4.release_hot_buffer(kept)
    assert alloc.c4.rows.room() == 512
    assert alloc.logical_attn_allocator.pages.available_tokens() == 4096


def test_a_request_finishing_at_prefill_gives_its_rows_back():
    alloc = C4Allocator(TokenIds(4096, 512), debug=True)
    ids = extend(alloc, [0], [1000], [-1])
    assert alloc.c4.rows.room() == 512 - 256
    alloc.free(ids)
    assert alloc.c4.rows.room() == 512
    assert int(alloc.c4.mapping.logical_to_device[:-1].count_nonzero()) == 0


def test_admission_counts_c4_rows_and_host_rows_in_tokens():
    alloc = C4Allocator(TokenIds(4096, 256), debug=True)
    assert alloc.available_size() == min(4096, 4 * 256)
    used = [0]
    alloc.configure(hot_buffer_rows=128, host_capacity_entries=100, host_entries_used=lambda: used[0])
    assert alloc.available_size() == 400
    used[0] = 60
    assert alloc.available_size() == 160
    assert alloc.hisparse_attn_allocator.available_size() == 256
    assert extend(alloc, [0], [256 * 5], [-1]) is None  # 320 entries: 5 pages of rows, 4 free
    assert alloc.c4.rows.room() == 256 and alloc.logical_attn_allocator.pages.available_tokens() == 4096


def test_direct_token_allocation_is_refused_and_a_foreign_c4_pool_too():
    alloc = C4Allocator(TokenIds(4096, 512))
    with pytest.raises(HiSparsePluginError, match="alloc_extend / alloc_decode only"):
        alloc.alloc(4)
    ids = TokenIds(4096, 512)
    ids._kvcache.c4_kv_pool = SimpleNamespace(size=512)  # SGLang's own pool: no attach_mapping
    with pytest.raises(HiSparsePluginError, match="C4 KV pool is not ours"):
        C4Allocator(ids)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 700), st.integers(0, 2)), min_size=1, max_size=6))
def test_rows_and_ids_come_back_whatever_the_order(reqs):
    """Random prefills (chunked in up to three pieces), freed in reverse: every row and id back."""
    alloc = C4Allocator(TokenIds(1 << 14, 2048), debug=True)
    held = []
    for length, chunks in reqs:
        cuts = sorted({length * (i + 1) // (chunks + 1) for i in range(chunks)} | {length}) if chunks else [length]
        start, tokens = 0, []
        for end in cuts:
            if end == start:
                continue
            got = extend(alloc, [start], [end], [int(tokens[-1][-1]) if tokens else -1])
            assert got is not None
            tokens.append(got)
            start = end
        held.append(torch.cat(tokens))
        ent = completed_entry_ids(held[-1])
        assert ent.numel() == length // 4 and bool((alloc.c4.mapping.rows_of(ent) > 0).all())
    for tokens in reversed(held):
        alloc.free(tokens)
    assert alloc.c4.rows.room() == 2048
    assert alloc.logical_attn_allocator.pages.available_tokens() == 1 << 14
