"""Elastic hot buffers (``max_device_buffer_size``, issue 44) on CPU with real SGLang objects
(tests/rig.py): a long hot-buffer request grows into spare rows and stays exact, gives them back
before a prefill that needs them demotes or is refused anything, and random lifecycles with
growth and shrinking leak nothing."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rig import PAGE, Rig, Request
from tier import examples
from test_coordinator_lifecycle import run_random_lifecycle
from test_residency import decode

from sglang_hisparse.config import HiSparseConfigError, parse_hisparse_config
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.buffer_sizes import BufferSizes


def long_hot_request(rig: Rig) -> Request:
    """A 14-page request entered resident, then demoted by hand to a hot buffer (its opening size)."""
    req = Request(uid=1, prompt_len=14 * PAGE)
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    rig.coord._resident_decode.demote(req.req_pool_idx)
    assert rig.coord.hot.holds(req.req_pool_idx) and rig.coord.hot.sizes.of(req.req_pool_idx) == rig.B
    return req


def test_a_long_hot_buffer_grows_into_spare_rows_then_gives_them_back_to_a_prefill(gloo_world):
    """16 pages: after the demotion the request cannot be promoted (its 15 pages and one more hot
    buffer do not fit) but its buffer grows from 2 pages to the largest size (6) at the next check,
    every selection still checked against the true KV. A 12-page prefill then needs more than the
    free rows: grown rows come back first, only the 3 pages it lacks (the buffer keeps 3 of its 6),
    both decode exact, and everything comes back at the end."""
    rig = Rig(gloo_world, device_rows=PAGE * 16, residency=True, residency_watermark=0.0, promotion_interval=1,
              max_device_buffer_size=6 * PAGE)
    hot, rng = rig.coord.hot, random.Random(5)
    req = long_hot_request(rig)
    idx = req.req_pool_idx
    free_before = rig.allocator.rows.room()
    decode(rig, [req], rng, steps=2)
    assert hot.sizes.of(idx) == 6 * PAGE and rig.allocator.rows.room() == free_before - 4 * PAGE
    assert int(hot.sizes.device[idx]) == 6 * PAGE, "the resolver reads the grown size"
    assert rig.coord.residency.promotions_total == 0
    decode(rig, [req], rng, steps=40, overlap=0.9)
    other = Request(uid=2, prompt_len=12 * PAGE)
    assert rig.allocator.rows.room() < other.prompt_len
    assert rig.prefill(other), "the grown rows are given back before the prefill is refused"
    assert hot.sizes.of(idx) == 3 * PAGE and int(hot.sizes.device[idx]) == 3 * PAGE
    rig.stage(other)
    rig.collect()
    decode(rig, [req, other], rng, steps=20)
    for r in (req, other):
        rig.release(r)
    assert rig.counts() == rig.initial_counts
    assert hot.sizes.host.tolist() == [rig.B] * len(hot.capacity)


def grown_rig(gloo_world) -> tuple[Rig, Request]:
    """16 pages, a 2-page watermark: a 14-page request demoted to a hot buffer that then grows
    from 2 pages to 6 (9 pages free, 4 lent)."""
    rig = Rig(gloo_world, device_rows=PAGE * 16, residency=True, residency_watermark=0.125, promotion_interval=1,
              max_device_buffer_size=6 * PAGE)
    req = long_hot_request(rig)
    decode(rig, [req], random.Random(7), steps=2)
    assert rig.coord.hot.sizes.of(req.req_pool_idx) == 6 * PAGE and rig.allocator.rows.room() == 9 * PAGE
    return rig, req


def test_a_request_entering_decode_stays_resident_as_it_would_without_grown_buffers(gloo_world):
    """An 8-page prefill leaves 1 free page, under the 2-page watermark: without elastic buffers 5
    would be free and it would stay resident, so the grown buffer gives back one page (not more)
    and it does; both decode exact and everything comes back."""
    rig, req = grown_rig(gloo_world)
    other = Request(uid=2, prompt_len=8 * PAGE)
    assert rig.prefill(other)
    assert rig.allocator.rows.room() == PAGE
    rig.stage(other)
    rig.collect()
    assert rig.coord.residency.holds(other.req_pool_idx), "admission did not see the lent rows"
    assert rig.coord.hot.sizes.of(req.req_pool_idx) == 5 * PAGE
    decode(rig, [req, other], random.Random(8), steps=20)
    for r in (req, other):
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_pd_direct_admission_takes_back_lent_rows_for_residency_and_for_a_hot_buffer(gloo_world):
    """PD decode, grown buffer as above: an 8-page transfer stays resident (8 pages + the
    watermark need one lent page back); then, with the free rows taken by hand down to one page,
    a 4-page transfer (a long one: a full hot buffer of 3 pages) gets the rows SGLang's PD budget
    counted as reclaimable instead of an error. All decode exact from their host KV."""
    rig, req = grown_rig(gloo_world)
    resident = Request(uid=2, prompt_len=8 * PAGE)
    assert rig.admit_direct(resident)
    assert rig.coord.residency.holds(resident.req_pool_idx) and rig.coord.hot.sizes.of(req.req_pool_idx) == 5 * PAGE
    rig.release(resident)
    rig.coord.hot.resize(req.req_pool_idx, 6 * PAGE)
    taken = rig.allocator.rows.pages.alloc_pages(rig.allocator.rows.room() // PAGE - 1)
    hot = Request(uid=3, prompt_len=4 * PAGE)
    assert rig.admit_direct(hot)
    assert rig.coord.hot.holds(hot.req_pool_idx) and rig.coord.hot.sizes.of(req.req_pool_idx) == 4 * PAGE
    decode(rig, [req, hot], random.Random(9), steps=20)
    rig.allocator.rows.pages.free_pages_(taken)
    for r in (req, hot):
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def hot_and_resident(rig: Rig, hot_pages: list[int], resident_pages: int) -> tuple[list[Request], Request]:
    """Requests of ``hot_pages`` pages each, entered resident and demoted by hand to hot buffers,
    then one of ``resident_pages`` pages that stays resident."""
    hot = []
    for uid, pages in enumerate(hot_pages, start=1):
        req = Request(uid=uid, prompt_len=pages * PAGE)
        assert rig.prefill(req)
        rig.stage(req)
        rig.collect()
        rig.coord._resident_decode.demote(req.req_pool_idx)
        hot.append(req)
    resident = Request(uid=9, prompt_len=resident_pages * PAGE)
    assert rig.prefill(resident)
    rig.stage(resident)
    rig.collect()
    assert rig.coord.residency.holds(resident.req_pool_idx)
    return hot, resident


def test_a_long_resident_request_is_traded_for_two_full_growths(gloo_world):
    """26 pages, no watermark: two 14-page hot buffers at 2 pages want 4 more each and no row is
    spare (a 17-page resident request holds the rest but one hot buffer's 3). The resident
    request's 14 reclaimable pages, less its own growth, grow both fully: the first check demotes
    it and grows both to 6 pages, the next grows its buffer too; all exact, everything back."""
    rig = Rig(gloo_world, device_rows=PAGE * 26, residency=True, residency_watermark=0.0, promotion_interval=1,
              max_device_buffer_size=6 * PAGE, max_context=24 * PAGE)
    hot, resident = hot_and_resident(rig, [14, 14], 17)
    sizes, rng = rig.coord.hot.sizes, random.Random(10)
    decode(rig, [*hot, resident], rng, steps=1)
    assert not rig.coord.residency.holds(resident.req_pool_idx)
    assert [sizes.of(r.req_pool_idx) for r in hot] == [6 * PAGE, 6 * PAGE]
    decode(rig, [*hot, resident], rng, steps=1)
    assert sizes.of(resident.req_pool_idx) == 6 * PAGE and rig.coord._resident_decode.elastic.residents.demotions_total == 1
    decode(rig, [*hot, resident], rng, steps=30, overlap=0.8)
    for r in (*hot, resident):
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_a_resident_request_is_not_traded_for_one_growth(gloo_world):
    """The same with one hot buffer (23 pages): demoting the resident request would grow only it
    and one other buffer, which does not pay; it stays resident and nothing grows."""
    rig = Rig(gloo_world, device_rows=PAGE * 23, residency=True, residency_watermark=0.0, promotion_interval=1,
              max_device_buffer_size=6 * PAGE, max_context=24 * PAGE)
    hot, resident = hot_and_resident(rig, [14], 17)
    decode(rig, [*hot, resident], random.Random(11), steps=3)
    assert rig.coord.residency.holds(resident.req_pool_idx) and rig.coord.hot.sizes.of(hot[0].req_pool_idx) == rig.B
    for r in (*hot, resident):
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_growth_keeps_the_watermark_and_one_hot_buffer_free_and_off_by_default(gloo_world):
    """With only one more hot buffer free beyond the watermark nothing grows; without
    ``max_device_buffer_size`` the sizes never change and the resolver gets no size table."""
    rig = Rig(gloo_world, device_rows=PAGE * 16, residency=True, residency_watermark=0.0, promotion_interval=1,
              max_device_buffer_size=6 * PAGE)
    req = long_hot_request(rig)
    taken = rig.allocator.rows.pages.alloc_pages(rig.allocator.rows.room() // PAGE - 3)  # 3 pages left: one buffer
    decode(rig, [req], random.Random(6), steps=3)
    assert rig.coord.hot.sizes.of(req.req_pool_idx) == rig.B
    rig.allocator.rows.pages.free_pages_(taken)
    rig.release(req)
    assert rig.counts() == rig.initial_counts
    plain = Rig(gloo_world, device_rows=PAGE * 24, residency=True)
    assert not plain.coord.hot.sizes.elastic and plain.coord.hot.buffer_size == plain.B


@pytest.mark.parametrize("raw, message", [
    ({"device_buffer_size": 128, "max_device_buffer_size": 64}, "in \\[device_buffer_size=128"),
    ({"device_buffer_size": 128, "max_device_buffer_size": 256, "residency": False}, "needs residency"),
])
def test_bad_elastic_settings_are_refused_naming_the_key(raw, message):
    with pytest.raises(HiSparseConfigError, match="max_device_buffer_size.*" + message):
        parse_hisparse_config(json.dumps(raw), model_index_topk=32)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), overlap=st.floats(0.0, 1.0), watermark=st.sampled_from([0.0, 0.05]),
       promotion_interval=st.sampled_from([1, 4]))
def test_random_lifecycles_with_elastic_buffers_stay_exact_and_leak_nothing(gloo_world, seed, overlap, watermark,
                                                                           promotion_interval):
    rig = Rig(gloo_world, device_rows=PAGE * 30, max_reqs=10, top_k=24, residency=True, residency_watermark=watermark,
              promotion_interval=promotion_interval, max_device_buffer_size=5 * PAGE)
    run_random_lifecycle(rig, random.Random(seed), overlap, lengths=[10, 64, 100, 129, 200, 350, 600, 900],
                         finish_after=1000)
    assert rig.counts() == rig.initial_counts
    assert bool((torch.from_numpy(rig.coord.hot.sizes.host) == rig.B).all())


def test_growth_at_a_page_boundary_leaves_the_pending_previous_token_in_the_window(gloo_world):
    """The growth check (every 32 steps with ``promotion_interval`` 0) falls on the step whose new
    token is at position 896 = 14 pages: the previous token (895), still to be written through
    from the window, must not get a slot of its own, so the buffer grows to 13 pages, not 14; a
    later miss of position 895 reads its true KV from host (growing to 14 pages failed here:
    "pos 895: row ... holds 0.0")."""
    rig = Rig(gloo_world, device_rows=PAGE * 40, residency=True, residency_watermark=0.0, promotion_interval=0,
              max_device_buffer_size=15 * PAGE)
    req = Request(uid=1, prompt_len=14 * PAGE - 31)
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    rig.coord._resident_decode.demote(req.req_pool_idx)
    rng = random.Random(1)
    decode(rig, [req], rng, steps=32, overlap=0.0)
    assert rig.coord.hot.sizes.of(req.req_pool_idx) == 13 * PAGE
    decode(rig, [req], rng, steps=100, overlap=0.0)
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def slots_of(sizes: BufferSizes, idx: int, first: int, count: int) -> list[int]:
    """The slots of ``sizes.runs``, one by one."""
    return [slot for start, length in sizes.runs(idx, first, count) for slot in range(start, start + length)]


def test_virtual_slots_sit_below_the_size_then_in_the_window():
    """Virtual slot k is slot k below the request's size S and window slot B + k - S from S on;
    one-token steps put a position below S in its own slot, any other in slot B."""
    sizes = BufferSizes(max_reqs=2, open_size=128, table_size=256, page=64, device=torch.device("cpu"))
    assert slots_of(sizes, 0, 120, 12) == [*range(120, 128), *range(256, 260)]
    sizes.set(0, 192)
    assert slots_of(sizes, 0, 120, 12) == list(range(120, 132))
    assert (sizes.step_slots(0, 100), sizes.step_slots(0, 500), sizes.step_slots(1, 500)) == (100, 193, 129)
    assert sizes.newest_slots(torch.tensor([0, 1]), torch.tensor([150, 150])).tolist() == [150, 256]
    assert sizes.device.tolist() == [192, 128] and sizes.host.tolist() == [192, 128]
    with pytest.raises(ValueError, match="outside"):
        sizes.set(1, 320)
    fixed = BufferSizes(max_reqs=2, open_size=100, table_size=100, page=64, device=torch.device("cpu"))
    assert not fixed.elastic and fixed.newest_slots(torch.tensor([1]), torch.tensor([150])).tolist() == [100]
    with pytest.raises(HiSparsePluginError, match="multiples of the page size"):
        BufferSizes(max_reqs=2, open_size=100, table_size=256, page=64, device=torch.device("cpu"))


@settings(max_examples=examples(60), deadline=None)
@given(size_pages=st.integers(2, 4), first=st.integers(0, 300), count=st.integers(0, 100))
def test_runs_are_the_virtual_slots_and_place_writes_them_without_an_index_tensor(size_pages, first, count):
    """``runs`` lists the virtual slots' slots (k below the size S, else ``B + k - S``) as at most
    two runs, and ``place`` / ``rows_held`` write and read them with slices only: an index tensor
    built on the host would be a pageable copy to the device, which waits for the forward in
    flight (it cost ~125 ms per request entering decode on the GPU, gpu_run88)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes = BufferSizes(max_reqs=1, open_size=128, table_size=256, page=64, device=torch.device("cpu"))
    sizes.set(0, size_pages * 64)
    count = max(0, min(count, size_pages * 64 + 64 - first))  # virtual slots: the size, then the window
    slots = slots_of(sizes, 0, first, count)
    size = size_pages * 64
    assert slots == [k if k < size else 256 + k - size for k in range(first, first + count)]
    assert len(sizes.runs(0, first, count)) <= 2

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    table = torch.full((1, 256 + 64), -1, dtype=torch.int32)
    rows = torch.arange(1000, 1000 + count)
    with Ops():
        sizes.place(table, 0, first, rows)
        back = sizes.rows_held(table, 0, first, count)
    assert not [op for op in Ops.seen if "index" in op], Ops.seen
    assert back.tolist() == rows.tolist()
    assert table[0, slots].tolist() == rows.tolist()
