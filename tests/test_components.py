"""The coordinator's components on CPU: start-up refusals, the idle report rule, the host pool's
refusal of SGLang's own HiSparse helpers, the copy lane's fences, and the page allocator's decode
fast path."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rig import PAGE, Rig, Request
from tier import examples

from sglang_hisparse.memory.admission import Capacity, refusal
from sglang_hisparse.memory.copy_lane import CopyLane
from sglang_hisparse.decode.coordinator import HiSparseCoordinator
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.host_pool import BLOCKED_MIXIN_MEMBERS, HiSparseHostPool
from sglang_hisparse.memory.paging import PageAllocator


def test_a_hot_buffer_that_cannot_fit_the_device_pool_is_refused_at_start(gloo_world):
    """B=128 needs 192 rows (3 pages) per decoding request; a 3-page pool leaves no page for a
    prefill: the coordinator refuses with the numbers and the largest B that fits."""
    with pytest.raises(HiSparsePluginError) as info:
        Rig(gloo_world, device_rows=PAGE * 3, device_buffer_size=128)
    message = str(info.value)
    assert message.startswith("sglang-hisparse: invalid device_buffer_size=128:")
    assert "holds 192 device rows" in message and "has 192 rows" in message
    assert "use device_buffer_size <= 127" in message and "\n" not in message
    Rig(gloo_world, device_rows=PAGE * 4, device_buffer_size=128)  # one page left: accepted


def test_the_coordinator_never_rebuilds_a_config_without_the_servers(gloo_world):
    """Built by SGLang (no ``config``), the coordinator reads the published server arguments; with
    none published it refuses instead of guessing the keys SGLang does not pass."""
    rig = Rig(gloo_world)
    with pytest.raises(HiSparsePluginError, match="needs SGLang's published server arguments"):
        HiSparseCoordinator(rig.req_to_token_pool, rig.allocator, 32, 128, "cpu", gloo_world, 2, 256)


def test_idle_reports_come_after_fast_path_only_work(gloo_world):
    """A request that never leaves the fast path counts no selections; the server still reports
    once when it goes idle (and only once)."""
    rig = Rig(gloo_world)
    assert rig.coord.stats.idle_report() is None  # nothing happened since start
    req = Request(uid=1, prompt_len=20)
    assert rig.prefill(req)
    rig.stage(req)
    assert rig.collect() == [req]
    for _ in range(10):
        assert rig.decode_step([req])
        rig.resolve_and_check([req], 0, [[0, 5, req.seq_len - 1]])
    rig.release(req)
    assert rig.coord.stats.totals() == (0, 0)
    line = rig.coord.stats.idle_report()
    assert line is not None and "leak=no" in line and "selected=0" in line
    assert rig.coord.stats.idle_report() is None


def test_idle_reports_give_our_host_time_per_decode_step(gloo_world):
    """The idle line carries the steps since the last report and our host time per step, by
    part; each report covers only the steps since the previous one."""
    rig = Rig(gloo_world)
    req = Request(uid=3, prompt_len=20)
    assert rig.prefill(req)
    rig.stage(req)
    assert rig.collect() == [req]
    for _ in range(7):
        assert rig.decode_step([req])
    line = rig.coord.stats.idle_report()
    m = re.search(r"steps=(\d+) host_us_per_step=([\d.]+) \(check ([\d.]+) alloc ([\d.]+) map ([\d.]+) "
                  r"wait ([\d.]+) ready ([\d.]+)\)", line)
    assert m, line
    parts = [float(x) for x in m.groups()[2:]]
    assert int(m.group(1)) == 7
    assert all(parts[i] > 0 for i in range(4)), line  # every step ran the check, alloc, map and wait
    # each printed number is rounded to 0.1 us: the total and its parts may differ by 0.05 per number
    assert abs(float(m.group(2)) - sum(parts)) <= 0.05 * (len(parts) + 1) + 1e-9, line
    for _ in range(3):
        assert rig.decode_step([req])
    assert "steps=3 " in rig.coord.stats.idle_report()
    rig.release(req)
    line = rig.coord.stats.idle_report()  # activity without decode steps: no host time part
    assert line is not None and "host_us_per_step" not in line


def test_a_leak_is_reported_as_such(gloo_world, caplog):
    rig = Rig(gloo_world)
    req = Request(uid=2, prompt_len=100)
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    caplog.set_level("INFO")
    line = rig.coord.stats.idle_report()  # the request still holds its rows
    assert "leak=yes" in line and any(r.levelname == "ERROR" for r in caplog.records)
    rig.release(req)


def test_the_host_pool_inherits_no_hisparse_helper_of_sglang():
    """Every member of SGLang's HiSparse host-pool mixin is either ours (the PD protocol method)
    or refused; none of the mixin's code is reachable through our pool."""
    from sglang.srt.mem_cache.pool_host.hisparse import HiSparseHostPoolMixin

    members = [n for n, m in vars(HiSparseHostPoolMixin).items() if callable(m) and not n.startswith("__")]
    assert members and set(BLOCKED_MIXIN_MEMBERS) | {"alloc_paged_token_slots"} == set(members)
    for name in members:
        assert getattr(HiSparseHostPool, name) is not getattr(HiSparseHostPoolMixin, name), name
    with pytest.raises(NotImplementedError, match="does not use"):
        getattr(HiSparseHostPool, BLOCKED_MIXIN_MEMBERS[0])(object())


def test_fences_of_one_lane_are_ordered():
    lane = CopyLane(torch.device("cpu"))
    seen = []
    first = lane.submit(lambda: seen.append(1))
    second = lane.submit(lambda: seen.append(2))
    assert seen == [1, 2] and first.seq < second.seq and first.done() and second.done()


CAPACITY = Capacity(device_rows=8192, hot_buffer_rows=192, page_size=64, logical_ids=16384, host_rows=16384,
                    device_buffer_size=128)


@pytest.mark.parametrize(
    "prompt, max_new, ignore_eos, refused",
    [
        (8128, 4, True, False),  # 8128 + 4 + reserve 1 < 8192
        (8129, 4, True, True),  # 8192 rows after rounding leave nothing for the new tokens
        (3000, 5181, True, False),  # 3008 + 5181 + 1 = 8190
        (3000, 5183, True, True),  # every new token of an ignore_eos request counts, unclipped
        (7000, 1100, False, False),  # 7000 + 1100 + 64 < 8192
        (7000, 1200, False, True),  # 8264 >= 8192
        (3000, 100000, False, False),  # the estimate is clipped: 3000 + 4096 + 64 = 7160
        (4100, 100000, False, True),  # 4100 + 4096 + 64 = 8260
    ],
)
def test_the_refusal_rule_mirrors_sglangs_idle_admission(prompt, max_new, ignore_eos, refused):
    """The idle room is the whole device pool: no hot buffer is set aside for a request."""
    assert CAPACITY.idle_room == 8192
    problem = refusal(CAPACITY, prompt_len=prompt, max_new_tokens=max_new, ignore_eos=ignore_eos,
                      clip_new_tokens=4096, ignore_eos_reserve=1)
    assert (problem is not None) == refused
    if refused:
        assert "never has more than 8192" in problem and "device pool 8192 rows, logical ids 16384" in problem


@settings(max_examples=examples(60), deadline=None)
@given(lens=st.lists(st.integers(2, 400), min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_decode_ids_are_the_ids_extend_hands_out(lens, seed):
    """``PageAllocator.decode`` (a decode step's fast path) gives each request the id ``extend``
    would give its position ``seq_len - 1``: the next id of its page, or a new page's first id."""
    torch.manual_seed(seed)
    fast, generic = PageAllocator(64, 64, "cpu"), PageAllocator(64, 64, "cpu")
    order = torch.randperm(64) + 1  # both free lists in the same shuffled order
    fast.free_pages, generic.free_pages = order.clone(), order.clone()
    seq = torch.tensor(lens)
    last_loc = torch.randint(1, 64, (len(lens),)) * 64 + (seq - 2) % 64  # the previous position's id
    step = fast.decode(seq.tolist(), last_loc.to(torch.int32))  # SGLang reads last_loc off its int32 table
    assert step.ids.dtype == torch.int64
    assert torch.equal(step.ids, generic.extend(seq - 1, seq, last_loc))
    assert step.starts == [b for b, n in enumerate(lens) if (n - 1) % 64 == 0]
    assert step.pages is None if not step.starts else torch.equal(step.ids[step.starts], step.pages * 64)
    assert torch.equal(fast.free_pages, generic.free_pages)
    full = PageAllocator(1, 64, "cpu")
    full.alloc_pages(1)
    starts_a_page = torch.tensor([65])
    assert full.decode(starts_a_page.tolist(), torch.tensor([127])) is None and full.available_pages() == 0


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 300)), min_size=1, max_size=6),
                      min_size=1, max_size=5))
def test_batched_host_row_growth_gives_what_growth_one_request_at_a_time_gives(gloo_world, calls):
    """``HiSparseHostPool.grow_rows`` (many requests, one allocation) leaves the table, the
    allocated lengths and the free rows exactly as ``grow_request_rows`` called for each request in
    order does, including requests that need no new page; both keep the pool's host-side record of
    each slot's rows equal to its table row, and freeing from that record returns every row."""
    batched, single = (Rig(gloo_world, max_reqs=6).coord.mirror for _ in range(2))
    for call in calls:
        ends = {}
        for idx, end in call:  # one entry per request slot, as the write-through passes them
            ends[idx] = max(ends.get(idx, 0), end)
        batched.pool.grow_rows(batched.row_table, batched.rows_allocated, torch.tensor(list(ends)),
                               torch.tensor(list(ends.values())))
        for idx, end in ends.items():
            single.pool.grow_request_rows(single.row_table, single.rows_allocated, idx, end)
        assert torch.equal(batched.row_table, single.row_table)
        assert torch.equal(batched.rows_allocated, single.rows_allocated)
        assert batched.pool.available_size() == single.pool.available_size()
        for mirror in (batched, single):  # the host-side record of each slot's rows is its table row
            for idx in range(6):
                end = int(mirror.rows_allocated[idx])
                assert torch.equal(mirror.pool.rows_of(idx), mirror.row_table[idx, :end])
    free_before = batched.pool.available_size()
    held = int(batched.rows_allocated.sum())
    for idx in range(6):  # freeing from the record returns every row and clears the table row
        batched.forget(idx)
        assert batched.pool.rows_of(idx).numel() == 0 and bool((batched.row_table[idx] == -1).all())
    assert batched.pool.available_size() == free_before + held


def test_a_staged_request_borrows_lent_host_rows_copies_only_the_rest_and_never_frees_them(gloo_world):
    """``HostMirror.stage`` with lent rows (a cached prefix's, the radix tree's): they become the
    slot's rows of the first positions without being written, only the positions after them are
    copied from the device into rows of the slot's own, ``forget`` frees only its own rows, and
    ``hand_over`` returns all of them, the lent ones first."""
    from types import SimpleNamespace

    rig = Rig(gloo_world, max_reqs=4)
    mirror, device_pool = rig.coord.mirror, rig.coord.device_pool
    pool = mirror.pool
    lent = pool.alloc(2 * PAGE).to(torch.int64)  # owned elsewhere
    n = 2 * PAGE + 5
    device_rows = torch.randperm(PAGE * 8)[:n].to(torch.int64)
    generator = torch.Generator().manual_seed(3)
    for layer in range(pool.layer_num):
        pool.kv_buffer[layer][lent] = 7.0  # what the lender holds
        device_pool.kv_buffer[layer][device_rows] = torch.rand(
            device_pool.kv_buffer[layer][device_rows].shape, generator=generator)
    req = SimpleNamespace(req_pool_idx=1, rid="borrower")
    free_before = pool.available_size()

    mirror.stage(req, device_rows, lent)
    mirror.drain()
    table = mirror.row_table[1]
    assert torch.equal(table[: 2 * PAGE].cpu(), lent) and int(mirror.rows_allocated[1]) == 3 * PAGE
    assert pool.available_size() == free_before - PAGE  # one page of its own for the 5 positions after
    own = table[2 * PAGE:n].cpu()
    for layer in range(pool.layer_num):
        assert bool((pool.kv_buffer[layer][lent] == 7.0).all()), "the lent rows were written"
        assert torch.equal(pool.kv_buffer[layer][own], device_pool.kv_buffer[layer][device_rows[2 * PAGE:]])

    mirror.drop_staged(req)
    mirror.forget(1)
    assert pool.available_size() == free_before and pool.borrowed_count(1) == 0
    assert bool((mirror.row_table[1] == -1).all())

    mirror.stage(req, device_rows, lent)
    mirror.drop_staged(req)
    rows, complete = mirror.hand_over(1)
    assert complete == n and torch.equal(rows[: 2 * PAGE], lent) and pool.borrowed_count(1) == 0
    pool.free(rows[2 * PAGE:])
    assert pool.available_size() == free_before
    with pytest.raises(AssertionError, match="whole pages"):
        mirror.stage(req, device_rows, lent[:PAGE - 1])
