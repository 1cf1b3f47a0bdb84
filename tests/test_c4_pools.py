"""DeepSeek-V4's C4 pools on CPU: the host pool (rows by whole pages, the PD contract, copies through
the paged layout) and the device pool (SGLang's C4 pool class with translations through the mapping)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tier import examples

from sglang_hisparse.memory.c4_device_pool import C4DevicePool
from sglang_hisparse.memory.c4_host_pool import C4HostPool
from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES, C4_PAGE_BYTES, C4_PAGE_ENTRIES, C4PagedRows

P = C4_PAGE_ENTRIES
FP8 = torch.float8_e4m3fn


def device_pool(size: int = 4 * P, layers: int = 3) -> C4DevicePool:
    return C4DevicePool(size, P, FP8, 448, 64, layers, "cpu", False)


def tables(slots: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((slots, width), -1, dtype=torch.int64), torch.zeros(slots, dtype=torch.int64)


def poisoned(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def touched_bytes(pages: torch.Tensor, layer_rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """bool mask over ``pages`` ([layers, pages, 37440]): the bytes of the given rows per layer."""
    mask = torch.zeros(pages.shape, dtype=torch.bool)
    for layer, rows in layer_rows.items():
        view = C4PagedRows(mask[layer].view(torch.uint8))
        view.write(rows, torch.ones(rows.numel(), C4_ITEM_BYTES, dtype=torch.uint8))
    return mask


# --- host pool: rows ------------------------------------------------------------------------------
def test_host_pool_geometry_and_free_list():
    pool = C4HostPool(3, 100, pin_memory=False, debug=True)  # 100 entries -> 2 whole pages
    assert (pool.layer_num, pool.page_size, pool.row_bytes, pool.capacity_tokens) == (3, 64, 584, 128)
    assert pool.kv_buffer.shape == (3, 3, C4_PAGE_BYTES) and pool.kv_buffer.dtype == torch.uint8
    assert pool.kv_buffer[1].is_contiguous() and not pool.kv_buffer.is_pinned()
    rows = pool.alloc(128)
    assert rows.tolist() == list(range(P, 3 * P))  # page 0 is never handed out
    assert pool.available_size() == 0 and pool.alloc(64) is None
    assert pool.free(rows[:P]) == P and pool.available_size() == P
    with pytest.raises(ValueError, match="multiple of 64"):
        pool.alloc(10)


@settings(max_examples=examples(25), deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["one", "many", "free", "pd"]), st.integers(0, 3),
                              st.integers(0, 300)), min_size=1, max_size=25))
def test_request_rows_are_whole_pages_and_the_record_is_the_table_row(ops):
    """Any mix of single growth, batched growth, PD slot allocation and frees: each slot's record
    equals its table row up to its allocated end, which is whole pages of in-page order; no row
    is held twice; free rows plus held rows is the capacity."""
    pool = C4HostPool(1, 16 * P, pin_memory=False, debug=True)
    table, lengths = tables(4, 17 * P + 300)  # wide enough for any end the pool can grant
    for op, idx, n in ops:
        try:
            if op == "one":
                pool.grow_request_rows(table, lengths, idx, n)
            elif op == "many":
                pool.grow_rows(table, lengths, torch.tensor([idx, (idx + 1) % 4]), torch.tensor([n, n // 2]))
            elif op == "pd":
                start = int(lengths[idx])
                got = pool.alloc_paged_token_slots(table, lengths, idx, start, n)
                assert torch.equal(got, table[idx, start:start + n])
            else:
                held_rows = int(lengths[idx])
                assert pool.free_request_rows(table, lengths, idx) == held_rows
        except RuntimeError as e:
            assert "C4 host pool exhausted" in str(e)
        held = []
        for slot in range(4):
            end = int(lengths[slot])
            rows = pool.rows_of(slot)
            assert end % P == 0 and torch.equal(rows, table[slot, :end]) and bool((table[slot, end:] == -1).all())
            assert torch.equal(rows % P, torch.arange(end) % P)  # position q sits at in-page offset q % 64
            page_of = rows.view(-1, P) // P
            assert bool((page_of == page_of[:, :1]).all())  # a page's rows are one host page
            held.append(rows)
        held = torch.cat(held)
        assert held.unique().numel() == held.numel() and bool((held >= P).all())
        assert pool.available_size() + held.numel() == pool.capacity_tokens


def test_freeing_a_request_returns_its_pages_and_clears_its_row():
    pool = C4HostPool(1, 8 * P, pin_memory=False, debug=True)
    table, lengths = tables(2, 300)
    pool.grow_request_rows(table, lengths, 1, 130)
    pool.grow_rows(table, lengths, torch.tensor([1, 0]), torch.tensor([200, 5]))
    assert lengths.tolist() == [P, 4 * P] and pool.available_size() == 3 * P
    assert pool.free_request_rows(table, lengths, 1) == 4 * P
    assert pool.free_request_rows(table, lengths, 1) == 0  # idempotent
    assert bool((table[1] == -1).all()) and int(lengths[1]) == 0 and pool.rows_of(1).numel() == 0
    assert pool.available_size() == 7 * P


def test_exhaustion_names_the_rows():
    pool = C4HostPool(1, 2 * P, pin_memory=False)
    table, lengths = tables(3, 300)
    pool.grow_request_rows(table, lengths, 0, 100)
    with pytest.raises(RuntimeError, match=r"C4 host pool exhausted \(0 rows free, 64 needed\); admission"):
        pool.grow_request_rows(table, lengths, 1, 1)
    with pytest.raises(RuntimeError, match=r"C4 host pool exhausted \(0 rows free, 192 needed\)"):
        pool.grow_rows(table, lengths, torch.tensor([1, 2]), torch.tensor([65, 2]))
    assert lengths.tolist() == [2 * P, 0, 0] and bool((table[1:] == -1).all())  # nothing taken


def test_pd_slot_allocation_contract():
    """What SGLang's PD decode path does with the rows: ``rows[::64] // 64`` are host page ids
    whose pages hold positions in order; a second call continues the request's rows."""
    pool = C4HostPool(2, 8 * P, pin_memory=False)
    table, lengths = tables(3, 400)
    assert pool.alloc_paged_token_slots(table, lengths, 2, 0, 0).numel() == 0 and int(lengths[2]) == 0
    rows = pool.alloc_paged_token_slots(table, lengths, 2, 0, 150)
    assert rows.numel() == 150 and int(lengths[2]) == 3 * P
    pages = rows[::P] // P
    assert torch.equal(rows, (pages.repeat_interleave(P) * P + torch.arange(3 * P) % P)[:150])
    more = pool.alloc_paged_token_slots(table, lengths, 2, 150, 50)  # within the allocated end, then one page
    assert torch.equal(more, table[2, 150:200]) and int(lengths[2]) == 4 * P
    with pytest.raises(AssertionError, match="grow in order"):
        pool.alloc_paged_token_slots(table, lengths, 2, 4 * P + 1, 3)


# --- host pool: bytes -----------------------------------------------------------------------------
def stand_in_device(layers: int, pages: int, seed: int) -> SimpleNamespace:
    bufs = [poisoned((pages, C4_PAGE_BYTES), seed + layer) for layer in range(layers)]
    return SimpleNamespace(kv_buffer=bufs, layer_num=layers, device="cpu")


@settings(max_examples=examples(10), deadline=None)
@given(data=st.data())
def test_write_back_then_load_rows_round_trips_entries_through_the_paged_layout(data):
    layers, n = 3, data.draw(st.integers(1, 70))
    seed = data.draw(st.integers(0, 2**20))
    dev = stand_in_device(layers, 4, seed)
    pool = C4HostPool(layers, 6 * P, pin_memory=False)
    pool.kv_buffer.copy_(poisoned(pool.kv_buffer.shape, seed + 99))
    host_before = pool.kv_buffer.clone()
    src = torch.tensor(data.draw(st.lists(st.integers(0, 4 * P - 1), min_size=n, max_size=n, unique=True)))
    host = torch.tensor(data.draw(st.lists(st.integers(P, 7 * P - 1), min_size=n, max_size=n, unique=True)))
    entries = torch.stack([C4PagedRows(b).read(src) for b in dev.kv_buffer])

    pool.write_back(dev, src, host)
    assert torch.equal(pool.read_entries(host), entries)
    untouched = ~touched_bytes(pool.kv_buffer, {layer: host for layer in range(layers)})
    assert torch.equal(pool.kv_buffer[untouched], host_before[untouched])  # other rows and padding kept

    target = stand_in_device(layers, 4, seed + 7)
    before = torch.stack(target.kv_buffer).clone()
    dst = torch.tensor(data.draw(st.lists(st.integers(0, 4 * P - 1), min_size=n, max_size=n, unique=True)))
    pool.load_rows(target, host, dst)
    after = torch.stack(target.kv_buffer)
    assert torch.equal(torch.stack([C4PagedRows(b).read(dst) for b in target.kv_buffer]), entries)
    untouched = ~touched_bytes(after, {layer: dst for layer in range(layers)})
    assert torch.equal(after[untouched], before[untouched])


def test_load_rows_of_one_layer_touches_only_that_layer():
    dev = stand_in_device(3, 2, 5)
    pool = C4HostPool(3, 2 * P, pin_memory=False)
    pool.kv_buffer.copy_(poisoned(pool.kv_buffer.shape, 6))
    before = torch.stack(dev.kv_buffer).clone()
    host, rows = torch.tensor([P + 3, 2 * P + 63]), torch.tensor([70, 1])
    pool.load_rows(dev, host, rows, layer_id=1)
    after = torch.stack(dev.kv_buffer)
    assert torch.equal(C4PagedRows(dev.kv_buffer[1]).read(rows), C4PagedRows(pool.kv_buffer[1]).read(host))
    untouched = ~touched_bytes(after, {1: rows})
    assert torch.equal(after[untouched], before[untouched]) and not torch.equal(after, before)


def test_write_entries_restores_what_read_entries_took():
    """A PD retraction's path: every layer's bytes of a request out to ordinary memory and back
    into other rows."""
    pool = C4HostPool(2, 4 * P, pin_memory=False)
    pool.kv_buffer.copy_(poisoned(pool.kv_buffer.shape, 11))
    kept = pool.read_entries(torch.tensor([P, P + 1, 3 * P + 9]))
    pool.write_entries(torch.tensor([4 * P + 2, 2 * P, 5]), kept)
    assert torch.equal(pool.read_entries(torch.tensor([4 * P + 2, 2 * P, 5])), kept)


def test_pd_buffer_infos_are_per_layer_page_rows():
    pool = C4HostPool(3, 5 * P, pin_memory=False)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert len(ptrs) == len(lens) == len(items) == 3
    assert items == [37440] * 3 and lens == [6 * 37440] * 3  # 5 pages and the unused page 0
    for layer, ptr in enumerate(ptrs):
        assert ptr == pool.kv_buffer[layer].data_ptr()
        assert pool.kv_buffer[layer, 4].data_ptr() == ptr + 4 * items[layer]  # page id p at p * item length


def test_pinning_needs_cuda():
    if torch.cuda.is_available():
        pool = C4HostPool(1, P, "cuda", pin_memory=True)
        assert pool.kv_buffer.is_pinned()
    else:
        with pytest.raises(RuntimeError, match="cannot pin host memory without CUDA"):
            C4HostPool(1, P, pin_memory=True)


def test_host_pool_from_a_device_pool():
    pool = C4HostPool.from_device_pool(device_pool(layers=2), 3 * P, pin_memory=False)
    assert (pool.layer_num, pool.capacity_tokens, pool.device.type) == (2, 3 * P, "cpu")
    with pytest.raises(ValueError, match="not a C4 device pool"):
        C4HostPool.from_device_pool(SimpleNamespace(kv_buffer=[torch.zeros(2, 656)], layer_num=1, device="cpu"),
                                    P, pin_memory=False)


# --- device pool ----------------------------------------------------------------------------------
def mapped_pool(layers: int = 2) -> tuple[C4DevicePool, torch.Tensor]:
    """A pool of 4 pages (rows 1..255; row 0 the dummy) and a mapping of 300 logical compressed ids:
    id c -> row 3 * c + 5 for c in 1..80, others none."""
    pool = device_pool(layers=layers)
    mapping = torch.zeros(300, dtype=torch.int64)
    mapping[1:81] = torch.arange(1, 81) * 3 + 5
    pool.attach_mapping(mapping)
    return pool, mapping


def test_device_pool_builds_on_cpu_as_sglangs_c4_pool():
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

    pool = device_pool(size=4 * P, layers=3)
    assert isinstance(pool, DeepSeekV4SingleKVPool)
    assert (pool.page_size, pool.compress_ratio, pool.kv_cache_total_dim, pool.layer_num) == (64, 4, 584, 3)
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(5, C4_PAGE_BYTES)] * 3  # SGLang's (size + page + 1) // page
    assert all(b.dtype == torch.uint8 for b in pool.kv_buffer)
    assert pool.get_key_buffer(2).data_ptr() == pool.kv_buffer[2].data_ptr()  # what attention reads: our pages


def test_device_pool_offers_every_method_of_sglangs_hisparse_c4_pool():
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import HiSparseC4DevicePool

    theirs = {name for name, m in vars(HiSparseC4DevicePool).items() if callable(m) and not name.startswith("__")}
    assert theirs <= set(vars(C4DevicePool)), sorted(theirs - set(vars(C4DevicePool)))
    assert not issubclass(C4DevicePool, HiSparseC4DevicePool)


def test_translations_go_through_the_mapping():
    pool, mapping = mapped_pool()
    full = torch.tensor([0, 1, 2, 3, 7, 8, 11, 258, 259, 323, 1023])
    compressed = pool.translate_loc_from_full_to_compressed(full)
    assert compressed.tolist() == [0, 1, 2, 64, 80, 255]  # tokens 3, 7, 11, 259, 323, 1023 complete an entry
    rows = pool._translate_loc_to_hisparse_device(compressed)
    assert rows.dtype == torch.int64 and rows.tolist() == [0, 8, 11, 197, 245, 0]
    as_int32 = pool.translate_loc_to_hisparse_device(compressed)
    assert as_int32.dtype == torch.int32 and as_int32.tolist() == rows.tolist()
    assert torch.equal(pool.translate_loc_from_full_to_hisparse_device(full), rows)
    mapping[64] = 17  # the pool holds the allocator's tensor, not a copy
    assert pool.translate_loc_to_hisparse_device(torch.tensor([64])).tolist() == [17]


def test_the_mapping_is_attached_once_and_checked():
    pool = device_pool()
    with pytest.raises(RuntimeError, match="no mapping yet"):
        pool.translate_loc_to_hisparse_device(torch.tensor([1]))
    with pytest.raises(ValueError, match="1-D int64"):
        pool.attach_mapping(torch.zeros(10, dtype=torch.int32))
    mapping = torch.arange(10, dtype=torch.int64)
    pool.register_mapping(mapping)  # SGLang's name for the same call
    assert pool.logical_to_device is mapping


def random_pack(n: int, seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        k_nope_fp8=torch.randint(0, 256, (n, 448), dtype=torch.uint8, generator=g).view(FP8),
        k_rope_bf16=torch.randn(n, 64, generator=g).to(torch.bfloat16),
        scale_k_nope_ue8m0=torch.randint(0, 256, (n, 7), dtype=torch.uint8, generator=g),
    )


def test_set_key_buffer_writes_land_at_the_mapped_rows():
    pool, mapping = mapped_pool(layers=3)
    for layer, buf in enumerate(pool.kv_buffer):
        buf.copy_(poisoned(buf.shape, 40 + layer))
    before = torch.stack(pool.kv_buffer).clone()
    loc = torch.tensor([1, 64, 80, 2])
    pack = random_pack(4, 3)
    pool.set_key_buffer(1, loc, pack)
    rows = mapping[loc]
    got = C4PagedRows(pool.kv_buffer[1]).read(rows)
    assert torch.equal(got[:, :448], pack.k_nope_fp8.view(torch.uint8))
    assert torch.equal(got[:, 448:576].contiguous().view(torch.bfloat16), pack.k_rope_bf16)
    assert torch.equal(got[:, 576:583], pack.scale_k_nope_ue8m0)
    assert torch.equal(got[:, 583], C4PagedRows(before[1]).read(rows)[:, 583])  # each entry's pad byte kept
    after = torch.stack(pool.kv_buffer)
    written = touched_bytes(after, {1: rows})
    assert torch.equal(after[~written], before[~written])  # other rows, layers and page padding untouched


def test_set_key_buffer_places_bytes_as_sglangs_own_writer_does():
    """The same entries written by SGLang's torch writer of the base pool at the translated rows
    (the oracle for the CUDA path, which calls the base pool's writer)."""
    from sglang.kernels.ops.attention.dsv4.index_buf_accessor import NopeFp8RopeBf16Pack, SetKAndS

    pool, mapping = mapped_pool(layers=1)
    pool.kv_buffer[0].copy_(poisoned(pool.kv_buffer[0].shape, 8))
    expect = pool.kv_buffer[0].clone()
    loc = torch.tensor([5, 6, 70, 0])  # id 0 maps to the dummy row 0
    pack = random_pack(4, 9)
    pool.set_key_buffer(0, loc, pack)
    SetKAndS.torch(pool, expect, mapping[loc], NopeFp8RopeBf16Pack(pack.k_nope_fp8, pack.k_rope_bf16,
                                                                   pack.scale_k_nope_ue8m0))
    assert torch.equal(pool.kv_buffer[0], expect)


def test_device_pool_refusals_say_why():
    pool, _ = mapped_pool()
    with pytest.raises(NotImplementedError, match="fused C4 KV store .* is a CUDA kernel"):
        pool.set_key_buffer_fused(0, torch.tensor([1]), torch.zeros(1, 512, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="holds only hot rows; a request's C4 KV is in the host pool"):
        pool.get_cpu_copy(torch.tensor([1]))
    with pytest.raises(NotImplementedError, match="no CPU copy of this pool to load"):
        pool.load_cpu_copy(None, torch.tensor([1]))


def test_the_seam_names_sglangs_c4_pool():
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as upstream
    from sglang.srt.plugins.hook_registry import HookType

    from sglang_hisparse.patches import c4_device_pool as seam

    module, name = seam.TARGET.rsplit(".", 1)
    assert module == upstream.__name__ and hasattr(upstream, name)
    assert (seam.ROLE, seam.IMPLEMENTATION, seam.CHECKED_AGAINST) == ("device_pool", C4DevicePool, "0.5.17")
    calls = []
    seam.register(SimpleNamespace(register=lambda *args: calls.append(args)))
    assert calls == [(seam.TARGET, C4DevicePool, HookType.REPLACE)]
