"""The row views the resolver copies through: DeepSeek-V4's paged C4 rows and linear DSA rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hisparse.resolver.c4_rows import (
    C4_ITEM_BYTES,
    C4_PAGE_BYTES,
    C4_PAGE_ENTRIES,
    C4_SCALE_OFFSET,
    C4PagedRows,
    LinearRows,
    c4_copy_items,
    completed_entry_ids,
    copy_rows,
    prefix_entry_ids,
    row_view,
)


def test_page_geometry_is_flashmla_s():
    # 64 entries of 576 value bytes, then 64 x 8 scale bytes, padded to a multiple of 576
    assert (C4_ITEM_BYTES, C4_SCALE_OFFSET, C4_PAGE_BYTES) == (584, 36864, 37440)


def test_entry_bytes_sit_where_flashmla_reads_them():
    pages = torch.zeros(3, C4_PAGE_BYTES, dtype=torch.uint8)
    rows = C4PagedRows(pages)
    data = torch.randint(1, 256, (1, C4_ITEM_BYTES), dtype=torch.uint8)
    rows.write(torch.tensor([C4_PAGE_ENTRIES + 5]), data)  # page 1, offset 5
    assert torch.equal(pages[1, 5 * 576: 6 * 576], data[0, :576])
    assert torch.equal(pages[1, C4_SCALE_OFFSET + 5 * 8: C4_SCALE_OFFSET + 6 * 8], data[0, 576:])
    assert int(pages.count_nonzero()) == int(data.count_nonzero())  # nothing else written


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_paged_copy_moves_exactly_the_named_rows(data):
    n_src, n_dst = 3 * C4_PAGE_ENTRIES, 2 * C4_PAGE_ENTRIES
    count = data.draw(st.integers(0, 40))
    src_rows = data.draw(st.lists(st.integers(0, n_src - 1), min_size=count, max_size=count))
    dst_rows = data.draw(st.lists(st.integers(0, n_dst - 1), min_size=count, max_size=count, unique=True))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    src = C4PagedRows(torch.randint(0, 256, (3, C4_PAGE_BYTES), dtype=torch.uint8, generator=g))
    dst_pages = torch.randint(0, 256, (2, C4_PAGE_BYTES), dtype=torch.uint8, generator=g)
    before = dst_pages.clone()
    dst = C4PagedRows(dst_pages)
    copied = copy_rows(src, torch.tensor(src_rows, dtype=torch.int64), dst, torch.tensor(dst_rows, dtype=torch.int64))
    assert copied == count * C4_ITEM_BYTES
    expect = C4PagedRows(before.clone())
    for s, d in zip(src_rows, dst_rows):  # one row at a time: the definition
        expect.write(torch.tensor([d]), src.read(torch.tensor([s])))
    assert torch.equal(dst_pages, expect.pages)
    assert torch.equal(dst_pages[:, C4_SCALE_OFFSET + 512:], before[:, C4_SCALE_OFFSET + 512:])  # padding kept


def test_linear_rows_round_trip_any_dtype():
    kv = torch.randn(10, 3, 4, dtype=torch.bfloat16)
    view = row_view(kv)
    assert isinstance(view, LinearRows) and view.row_bytes == 24 and view.num_rows == 10
    other = LinearRows(torch.zeros_like(kv))
    copy_rows(view, torch.tensor([7, 2]), other, torch.tensor([0, 9]))
    assert torch.equal(other.kv[0], kv[7]) and torch.equal(other.kv[9], kv[2])
    assert int(other.kv[1:9].count_nonzero()) == 0


def test_bad_buffers_and_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="uint8 \\[pages, 37440\\]"):
        C4PagedRows(torch.zeros(2, 584, dtype=torch.uint8))
    with pytest.raises(ValueError, match="584 B cannot be copied into rows of 24 B"):
        copy_rows(C4PagedRows(torch.zeros(1, C4_PAGE_BYTES, dtype=torch.uint8)), torch.tensor([0]),
                  LinearRows(torch.zeros(2, 24, dtype=torch.uint8)), torch.tensor([1]))


def test_the_kernel_wrapper_takes_c4_views_only_with_their_ratio():
    from sglang_hisparse.resolver.cuda import check_supported, kv_buffers

    host = C4PagedRows(torch.zeros(4, C4_PAGE_BYTES, dtype=torch.uint8))
    dev = C4PagedRows(torch.zeros(2, C4_PAGE_BYTES, dtype=torch.uint8))
    h, d, item = kv_buffers(host, dev, compress_ratio=4)
    assert h is host.pages and d is dev.pages and item == C4_ITEM_BYTES
    check_supported(item, 1024, 512)  # the 584-byte layout is a supported row size
    lin = torch.zeros(8, 656, dtype=torch.uint8)
    assert kv_buffers(lin, LinearRows(lin))[2] == 656
    with pytest.raises(ValueError, match="compress_ratio must be 4"):
        kv_buffers(host, dev)
    with pytest.raises(ValueError, match="both be C4PagedRows views or both be tensors"):
        kv_buffers(host, lin, compress_ratio=4)
    with pytest.raises(ValueError, match="compress_ratio 4 needs C4PagedRows"):
        kv_buffers(lin, lin, compress_ratio=4)
    with pytest.raises(ValueError, match="power of two"):
        kv_buffers(lin, lin, compress_ratio=3)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        check_supported(580, 1024, 512)


def test_reference_resident_path_reads_each_entry_at_its_last_token():
    """A resident request's entry q is found through req_to_token[r, 4q + 3] // 4: the token ids
    of the other three tokens of the entry are never read."""
    from sglang_hisparse.resolver.reference import resolve_reference

    L = 5  # entries
    req_to_token = torch.full((1, 4 * L + 4), -7, dtype=torch.int32)
    entries = torch.tensor([9, 2, 6, 4, 7])  # logical compressed ids of entries 0..4
    req_to_token[0, 3:4 * L:4] = (entries * 4 + 3).to(torch.int32)
    logical_to_device = torch.full((16,), -1, dtype=torch.int64)
    logical_to_device[entries] = torch.tensor([100, 101, 102, 103, 104])
    out = torch.full((1, 3), -5, dtype=torch.int32)
    pages = torch.zeros(1, C4_PAGE_BYTES, dtype=torch.uint8)
    resolve_reference(
        top_k_positions=torch.tensor([[4, 0, -1]], dtype=torch.int32), seq_lens=torch.tensor([L]),
        req_pool_indices=torch.tensor([0]), hot_locs=torch.zeros(1, 3, dtype=torch.int32),
        slot_tokens=torch.full((1, 2), -1, dtype=torch.int32), lru=torch.zeros(1, 2, dtype=torch.int16),
        host_locs=torch.zeros(1, L, dtype=torch.int64), host_kv=C4PagedRows(pages), device_kv=C4PagedRows(pages.clone()),
        out=out, num_real_reqs=1, device_buffer_size=2, resident=torch.ones(1, dtype=torch.uint8),
        req_to_token=req_to_token, logical_to_device=logical_to_device, compress_ratio=4)
    assert out.tolist() == [[104, 100, -1]]


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(0, 64 * 50 - 1), min_size=2, max_size=40, unique=True))
def test_copy_items_address_each_rows_value_and_scale_bytes_on_both_sides(rows):
    """The copies move a row as two whole items (c4_copy_items, both sides at once): on each side,
    item index x item bytes must be the first byte of the row's value and of its scale, and the
    item must cover exactly the row's bytes of that part (the layout's definition: byte_index);
    the items are int64 and contiguous, as the transfer kernels read them."""
    half = len(rows) // 2
    src, dst = torch.tensor(rows[:half]), torch.tensor(rows[half:2 * half])
    layout = C4PagedRows(torch.zeros(50, C4_PAGE_BYTES, dtype=torch.uint8))
    start = 0
    for item_bytes, src_items, dst_items in c4_copy_items(src.to(torch.int32), dst):
        for items, side in ((src_items, src), (dst_items, dst)):
            assert items.dtype == torch.int64 and items.is_contiguous()
            got = items.reshape(-1, 1) * item_bytes + torch.arange(item_bytes)
            assert torch.equal(got, layout.byte_index(side)[:, start:start + item_bytes])
        start += item_bytes
    assert start == C4_ITEM_BYTES


@settings(max_examples=60, deadline=None)
@given(pages=st.permutations(range(12)), tokens=st.integers(0, 12 * 16))
def test_prefix_entry_ids_are_the_entries_completed_in_the_prefix(pages, tokens):
    """The strided slice (no wait for the device) names the same entries as the masked selection,
    on a req_to_token row of shuffled 16-token pages (token ids keep their offset mod 4)."""
    row = (torch.tensor(pages) * 16).repeat_interleave(16) + torch.arange(16).repeat(12)
    row = row.to(torch.int32)
    assert torch.equal(prefix_entry_ids(row, tokens), completed_entry_ids(row[:tokens]))
