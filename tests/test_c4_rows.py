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
    copy_rows,
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
