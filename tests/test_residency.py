"""Pressure-driven residency on CPU with real SGLang objects (tests/rig.py): resident requests
resolve to their own rows with no copy; under pressure (a prefill, a hot buffer, or resident growth
that would cross the watermark) the longest resident requests are demoted to hot buffers and stay
exact; every pool comes back when all requests are gone."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rig import PAGE, Rig, Request, true_row
from tier import examples
from test_coordinator_lifecycle import run_random_lifecycle, select

from sglang_hisparse.memory.residency import ResidencyPolicy


def decode(rig: Rig, reqs: list, rng: random.Random, steps: int, overlap: float = 0.6) -> None:
    for _ in range(steps):
        assert rig.decode_step(reqs)
        for layer in range(rig.layers):
            rig.resolve_and_check(reqs, layer, [select(rng, r, rig.top_k, overlap) for r in reqs])


def own_rows(rig: Rig, req: Request) -> torch.Tensor:
    logical = rig.req_to_token_pool.req_to_token[req.req_pool_idx, : req.seq_len].to(torch.int64)
    return rig.allocator.logical_to_device[logical]


def test_a_resident_request_reads_its_own_rows_and_copies_nothing(gloo_world):
    rig = Rig(gloo_world, residency=True)
    rng = random.Random(3)
    req = Request(uid=1, prompt_len=300)  # longer than B = 128: a hot buffer would miss
    assert rig.prefill(req)
    rig.stage(req)
    assert rig.collect() == [req]
    assert rig.coord.residency.holds(req.req_pool_idx) and not rig.coord.hot.holds(req.req_pool_idx)
    decode(rig, [req], rng, steps=70)  # crosses a page boundary: new rows from the free pages
    rows = own_rows(rig, req)
    assert bool((rows > 0).all()) and rows.unique().numel() == req.seq_len
    out = rig.coord.swap_in_selected_pages(torch.tensor([req.req_pool_idx]), torch.tensor([req.seq_len]),
                                           torch.tensor([[5, req.seq_len - 1] + [-1] * (rig.top_k - 2)],
                                                        dtype=torch.int32), 0)
    assert out[0, :2].tolist() == [int(rows[5]), int(rows[-1])]
    assert rig.coord.stats.totals() == (0, 0), "a resident request is not counted and never misses"
    rig.release(req)
    assert rig.counts() == rig.initial_counts
    assert rig.coord.residency.count() == 0 and rig.coord.residency.admitted_total == 1


def test_a_resident_step_refuses_ids_the_allocator_did_not_hand_out_for_it(gloo_world):
    """The resident step maps the new pages the allocator's last ``alloc_decode`` took: mapping a
    batch whose lengths differ from that call's is refused, with nothing changed."""
    from sglang_hisparse.errors import HiSparsePluginError

    rig = Rig(gloo_world, residency=True)
    req = Request(uid=1, prompt_len=100)
    assert rig.prefill(req)
    rig.stage(req)
    assert rig.collect() == [req]
    idx = torch.tensor([req.req_pool_idx])
    seq = torch.tensor([req.seq_len + 1])
    last_loc = rig.req_to_token_pool.req_to_token[idx, seq - 2].to(torch.int64)
    out = rig.allocator.alloc_decode(seq, seq, last_loc)
    before = rig.coord.residency.length.clone()
    with pytest.raises(HiSparsePluginError, match="alloc_decode"):
        rig.coord.map_last_loc_to_buffer(seq + 1, out, idx, seq + 1, idx)
    assert torch.equal(rig.coord.residency.length, before)


def test_resident_write_through_is_deferred_then_complete_before_a_demotion(gloo_world):
    """A resident request's decoded tokens are not copied at each step: every
    ``DEFERRED_FLUSH_STEPS`` decode steps all of them are, in one copy, and a demotion copies the
    rest first. The host rows then hold the true KV of every position."""
    from sglang_hisparse.memory.host_mirror import DEFERRED_FLUSH_STEPS

    rig = Rig(gloo_world, residency=True)
    rng = random.Random(8)
    reqs = [Request(uid=1, prompt_len=150), Request(uid=2, prompt_len=70)]
    for req in reqs:
        assert rig.prefill(req)
        rig.stage(req)
    assert rig.collect() == reqs
    mirror, host = rig.coord.mirror, rig.coord.mem_pool_host

    def host_holds_true_kv(req, n):
        rows = rig.coord.req_to_host_pool[req.req_pool_idx, :n]
        for layer in range(rig.layers):
            want = torch.stack([true_row(req.uid, layer, p) for p in range(n)])
            assert torch.equal(host.kv_buffer[layer][rows, 0], want), (req.uid, layer)

    decode(rig, reqs, rng, steps=DEFERRED_FLUSH_STEPS - 1)
    assert [int(mirror.mirrored_len[r.req_pool_idx]) for r in reqs] == [150, 70]  # nothing copied yet
    decode(rig, reqs, rng, steps=1)  # the flush: positions up to the previous token
    for req in reqs:
        assert int(mirror.mirrored_len[req.req_pool_idx]) == req.seq_len - 1
        host_holds_true_kv(req, req.seq_len - 1)
    decode(rig, reqs, rng, steps=20)
    long_req = reqs[0]
    rig.coord._resident_decode.demote(long_req.req_pool_idx)
    assert rig.coord.hot.holds(long_req.req_pool_idx)
    assert int(mirror.mirrored_len[long_req.req_pool_idx]) == long_req.seq_len
    host_holds_true_kv(long_req, long_req.seq_len)
    decode(rig, reqs, rng, steps=30)  # the demoted request misses from host and stays exact
    for req in reqs:
        rig.release(req)
    assert rig.counts() == rig.initial_counts


@pytest.mark.parametrize("replacement", ["lru", "reuse"])
def test_a_prefill_under_pressure_demotes_the_longest_resident_request(gloo_world, replacement):
    rig = Rig(gloo_world, device_rows=PAGE * 24, residency=True, residency_watermark=0.0, replacement=replacement)
    rng = random.Random(4)
    long_req, short_req = Request(uid=1, prompt_len=700), Request(uid=2, prompt_len=400)
    for r in (long_req, short_req):
        assert rig.prefill(r)
        rig.stage(r)
    assert rig.collect() == [long_req, short_req]
    assert rig.coord.residency.count() == 2
    decode(rig, [long_req, short_req], rng, steps=3)
    history = rig.coord.hot.history
    if history is not None:  # stale history (a resident request leaves it alone) is reset by demotion
        history[:, long_req.req_pool_idx] = 0x0305
    newcomer = Request(uid=3, prompt_len=500)  # 8 pages; 6 are free
    assert rig.prefill(newcomer), "rows that demotion frees count as admission room"
    residency = rig.coord.residency
    assert not residency.holds(long_req.req_pool_idx) and rig.coord.hot.holds(long_req.req_pool_idx)
    assert history is None or history[:, long_req.req_pool_idx].eq(0).all()
    assert residency.holds(short_req.req_pool_idx) and residency.demotions_total == 1
    rig.stage(newcomer)
    rig.collect()
    decode(rig, [long_req, short_req, newcomer], rng, steps=30)  # the demoted request now misses, exactly
    selected, misses = rig.coord.stats.totals()
    assert selected > 0 and misses > 0
    for r in (long_req, short_req, newcomer):
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_resident_growth_below_the_watermark_demotes_before_the_step(gloo_world):
    # 16 pages, two requests of 5 pages, watermark 308 rows (0.3): the first step takes a 6th page
    # for one (384 -> 320 free rows); the second would leave 256 < 308 for the other, so the
    # longest resident request is demoted before it (192 of its 384 rows freed).
    rig = Rig(gloo_world, device_rows=PAGE * 16, device_buffer_size=128, residency=True, residency_watermark=0.3)
    rng = random.Random(5)
    reqs = [Request(uid=1, prompt_len=5 * PAGE), Request(uid=2, prompt_len=5 * PAGE - 1)]
    for r in reqs:
        assert rig.prefill(r)
        rig.stage(r)
    rig.collect()
    assert rig.coord.residency.count() == 2
    decode(rig, reqs, rng, steps=3)
    residency = rig.coord.residency
    assert residency.demotions_total == 1 and residency.count() == 1
    assert not residency.holds(reqs[0].req_pool_idx), "the longest request is demoted first"
    assert rig.allocator.rows.room() >= residency.policy.watermark_rows
    decode(rig, reqs, rng, steps=20)
    for r in reqs:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


@pytest.mark.parametrize("slot_map", [False, True])
def test_a_demoted_request_keeps_the_pages_its_last_step_selected(gloo_world, slot_map):
    rig = Rig(gloo_world, device_rows=PAGE * 24, residency=True, residency_watermark=0.0, top_k=32, slot_map=slot_map)
    req = Request(uid=1, prompt_len=10 * PAGE)
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    assert rig.decode_step([req])
    favourite = list(range(2 * PAGE, 2 * PAGE + 31))  # page 2 only
    for layer in range(rig.layers):
        rig.resolve_and_check([req], layer, [favourite])
    rows_before = own_rows(rig, req)
    rig.coord._resident_decode.reclaim(rig.allocator.rows.room() + PAGE)  # pressure: demote
    idx = req.req_pool_idx
    assert rig.coord.hot.holds(idx)
    slot_rows = rig.coord.hot.slot_rows[idx].to(torch.int64)
    assert set(rows_before[2 * PAGE : 3 * PAGE].tolist()) <= set(slot_rows.tolist())
    rig.check_slot_map()  # the demotion's writer (open_with_rows) named every held position's slot
    for layer in range(rig.layers):  # page 2 is held: selecting it again copies nothing
        before = rig.coord.stats.totals()[1]
        rig.resolve_and_check([req], layer, [favourite])
        assert rig.coord.stats.totals()[1] == before
    rig.release(req)
    assert rig.counts() == rig.initial_counts


@pytest.mark.parametrize("prompt_len", [50, 300])
def test_pd_direct_admission_loads_a_resident_request_from_host(gloo_world, prompt_len):
    rig = Rig(gloo_world, residency=True)
    rng = random.Random(6)
    req = Request(uid=9, prompt_len=prompt_len)
    assert rig.admit_direct(req)
    assert rig.coord.residency.holds(req.req_pool_idx)
    decode(rig, [req], rng, steps=20)
    assert rig.coord.stats.totals() == (0, 0)
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def test_a_demoted_request_is_promoted_back_when_rows_free_up_and_stays_exact(gloo_world):
    """Demoted by hand (pressure), then rows are free: at the next promotion check (every step
    here) the request takes rows of its own again, loaded from host; it reads its own rows from
    then on (no more misses), every selection checked against the true KV, and all comes back."""
    rig = Rig(gloo_world, device_rows=PAGE * 16, residency=True, residency_watermark=0.0, promotion_interval=1)
    rng = random.Random(21)
    req, short = Request(uid=1, prompt_len=5 * PAGE), Request(uid=2, prompt_len=40)
    for r in (req, short):
        assert rig.prefill(r)
        rig.stage(r)
    rig.collect()
    driver, residency, idx = rig.coord._resident_decode, rig.coord.residency, req.req_pool_idx
    decode(rig, [req, short], rng, steps=3)
    driver.demote(idx)
    assert rig.coord.hot.holds(idx) and not residency.holds(idx)
    decode(rig, [req, short], rng, steps=1)  # the check before this step promotes it
    assert residency.holds(idx) and not rig.coord.hot.holds(idx) and residency.promotions_total == 1
    misses = rig.coord.stats.totals()[1]
    decode(rig, [req, short], rng, steps=70)  # through a page start, as a resident request
    assert rig.coord.stats.totals()[1] == misses, "a promoted request reads its own rows"
    assert bool((own_rows(rig, req)[: req.seq_len - 1] > 0).all())
    for r in (req, short):
        rig.release(r)
    assert rig.counts() == rig.initial_counts


@pytest.mark.parametrize("interval, taken_pages", [(1, 12), (0, 0)])
def test_no_promotion_without_headroom_for_one_more_hot_buffer_or_when_off(gloo_world, interval, taken_pages):
    """After taking its rows the pool must keep the watermark and one hot buffer (``padded``) free:
    with only that much room left nothing is promoted; ``promotion_interval`` 0 never promotes."""
    rig = Rig(gloo_world, device_rows=PAGE * 16, residency=True, residency_watermark=0.0, promotion_interval=interval)
    rng = random.Random(22)
    req = Request(uid=1, prompt_len=5 * PAGE)
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    rig.coord._resident_decode.demote(req.req_pool_idx)  # 3 pages kept (padded), 13 free
    taken = rig.allocator.rows.pages.alloc_pages(taken_pages) if taken_pages else None
    decode(rig, [req], rng, steps=3)  # 6 pages + 3 padded would be needed beyond 1 free
    assert rig.coord.residency.promotions_total == 0 and rig.coord.hot.holds(req.req_pool_idx)
    if taken is not None:
        rig.allocator.rows.pages.free_pages_(taken)
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def test_policy_orders_victims_longest_first_and_keeps_the_most_selected_pages():
    assert ResidencyPolicy.victims({1: 64, 2: 0, 3: 128}, {1: 500, 2: 900, 3: 700}) == [3, 1]
    keep = ResidencyPolicy.pages_to_keep(torch.tensor([0.0, 5.0, 0.0, 2.0, 0.0]), 3)
    assert keep.tolist() == [4, 3, 1], "best last; ties go to the newer page"
    assert ResidencyPolicy(watermark_rows=10).admits(10) and not ResidencyPolicy(watermark_rows=10).admits(9)
    policy = ResidencyPolicy(watermark_rows=10, headroom_rows=192)
    assert policy.promotes(202) and not policy.promotes(201)
    assert ResidencyPolicy.promotion_candidate({4: 900, 7: 300, 2: 300}) == 2, "shortest first, then the lower slot"
    assert ResidencyPolicy.promotion_candidate({}) is None


@pytest.mark.parametrize("replacement, slot_map", [("lru", False), ("reuse", False), ("lru", True)])
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), overlap=st.floats(0.0, 1.0), watermark=st.sampled_from([0.0, 0.05, 0.2]),
       promotion_interval=st.sampled_from([1, 4, 32]))
def test_random_lifecycles_with_residency_stay_exact_and_leak_nothing(gloo_world, replacement, slot_map, seed, overlap,
                                                                      watermark, promotion_interval):
    rig = Rig(gloo_world, device_rows=PAGE * 30, max_reqs=10, top_k=24, residency=True, residency_watermark=watermark,
              replacement=replacement, slot_map=slot_map, promotion_interval=promotion_interval)
    run_random_lifecycle(rig, random.Random(seed), overlap, lengths=[10, 64, 100, 129, 200, 350, 600], finish_after=700)
    assert rig.counts() == rig.initial_counts


def test_demoting_a_short_resident_request_makes_a_filled_hot_buffer_of_its_rows(gloo_world):
    """A demotion the policy never chooses (it frees nothing), asked for directly: a resident
    request shorter than a hot buffer holds only its own pages (nothing is set aside
    for it), becomes a filled hot buffer of exactly those rows, and keeps decoding exactly
    through the fast and long paths, taking its next pages from the free rows."""
    rig = Rig(gloo_world, residency=True, residency_watermark=0.0, promotion_interval=0)  # stays in its buffer
    rng = random.Random(12)
    req = Request(uid=4, prompt_len=70)  # 2 pages < padded = 192 rows
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    residency, idx = rig.coord.residency, req.req_pool_idx
    free = rig.initial_counts["device_free"]
    assert residency.holds(idx) and rig.counts()["device_free"] == free - 2 * PAGE
    decode(rig, [req], rng, steps=5)
    rig.coord._resident_decode.demote(idx)  # the policy never picks it: demote it by hand
    assert rig.coord.hot.holds(idx) and rig.coord.hot.capacity[idx] == 2 * PAGE
    assert rig.counts()["device_free"] == free - 2 * PAGE
    decode(rig, [req], rng, steps=80)  # grows past B = 128 into the long path
    assert rig.coord.stats.totals()[1] > 0 and rig.coord.hot.capacity[idx] == rig.coord.hot.padded
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def test_short_resident_requests_hold_what_they_would_without_hisparse(gloo_world):
    """With every request resident the device rows in use are exactly SGLang's (whole pages of
    each request's positions); a step whose new pages are not free is refused by the decode
    check, with demotions counted as relief, and fits again once a request leaves."""
    rig = Rig(gloo_world, device_rows=PAGE * 12, max_reqs=8, residency=True, residency_watermark=0.0)
    rng = random.Random(14)
    reqs = [Request(uid=20 + i, prompt_len=100) for i in range(5)]  # 2 pages each
    assert all(rig.prefill(r) for r in reqs)
    for r in reqs:
        rig.stage(r)
    assert rig.collect() == reqs and rig.coord.residency.count() == 5
    assert rig.allocator.available_size() == 2 * PAGE
    while reqs[0].seq_len < 2 * PAGE:
        decode(rig, reqs, rng, steps=1)
    idxs, lens = [r.req_pool_idx for r in reqs], [r.seq_len for r in reqs]
    assert rig.coord.device_rows_short(idxs, lens) == 3 * PAGE, "five new pages, two free, nothing to reclaim"
    assert not rig.decode_step(reqs)
    rig.release(reqs[4], retract=True)
    rig.release(reqs[3], retract=True)
    decode(rig, reqs[:3], rng, steps=40)
    assert rig.coord.residency.demotions_total == 0
    for r in reqs[:3]:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_a_resident_request_whose_page_cannot_fit_is_demoted_even_if_that_frees_nothing(gloo_world):
    """A resident request holding exactly ``padded`` rows (its demotion frees none) reaches a page
    boundary with no free row: it becomes a hot buffer of its own rows instead of failing."""
    rig = Rig(gloo_world, device_rows=PAGE * 12, residency=True, residency_watermark=0.0)
    rng = random.Random(13)
    req = Request(uid=6, prompt_len=191)  # 3 pages = padded (B = 128)
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    assert rig.coord.residency.holds(req.req_pool_idx)
    decode(rig, [req], rng, steps=1)  # position 191: still in its third page
    taken = rig.allocator.rows.pages.alloc_pages(rig.allocator.rows.pages.available_pages())  # no room left
    decode(rig, [req], rng, steps=1)  # position 192 needs a page
    assert rig.coord.hot.holds(req.req_pool_idx) and rig.coord.residency.demotions_total == 1
    decode(rig, [req], rng, steps=10)
    rig.allocator.rows.pages.free_pages_(taken)
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def test_resident_steps_leave_the_state_the_full_path_leaves(gloo_world):
    """A decode step of resident requests takes the lean path (``ResidentDecode.resident_step``):
    no host mapping but a new page's first id, no write-through; the device pool maps the other new
    ids on the first layer's KV write. It must leave exactly the mapping, lengths, write-through
    schedule and page marks of the full path. Two rigs in lockstep, one with the lean path off,
    through page starts, deferred write-through, a request leaving, one joining and a demotion
    under pressure; every selection is checked against the true KV."""
    from unittest import mock

    from sglang_hisparse.decode.pressure import ResidentDecode

    def state(rig):
        return (rig.allocator.logical_to_device.clone(), rig.coord.residency.length.clone(),
                rig.coord.mirror.flush_at.clone(), rig.coord.mirror.mirrored_len.clone(),
                rig.allocator.page_resident.clone())

    rigs = [Rig(gloo_world, device_rows=PAGE * 12, max_reqs=6, top_k=24, residency=True) for _ in range(2)]
    for rig in rigs:  # a deferred write-through inside the 200 steps (the default interval is longer)
        rig.coord._resident_decode.flush_every = 64
    reqs = [[Request(uid=u, prompt_len=n) for u, n in enumerate((40, 70, 130))] for _ in rigs]
    late = [Request(uid=9, prompt_len=90) for _ in rigs]
    lean_taken, all_resident = [], []
    original = ResidentDecode.resident_step

    def counting(self, *args):
        lean = original(self, *args)
        lean_taken.append(lean)
        return lean

    def admit(rig, group):
        for req in group:
            assert rig.prefill(req)
            rig.stage(req)
        assert rig.collect() == group

    for rig, group in zip(rigs, reqs):
        admit(rig, group)
    rng = [random.Random(5), random.Random(5)]
    for step in range(200):
        if step == 50:
            for rig, group in zip(rigs, reqs):
                rig.release(group.pop(0))
        if step == 80:
            for rig, group, req in zip(rigs, reqs, late):
                admit(rig, [req])
                group.append(req)
        all_resident.append(all(rigs[0].coord.residency.holds(r.req_pool_idx) for r in reqs[0]))
        for i, (rig, group) in enumerate(zip(rigs, reqs)):
            patch = (mock.patch.object(ResidentDecode, "resident_step", counting) if i == 0 else
                     mock.patch.object(ResidentDecode, "resident_step", lambda self, *a: False))
            with patch:
                assert rig.decode_step(group)
            for layer in range(rig.layers):
                rig.resolve_and_check(group, layer, [select(rng[i], r, rig.top_k, 0.6) for r in group])
        for a, b in zip(state(rigs[0]), state(rigs[1])):
            assert torch.equal(a, b), step
    demotions = rigs[0].coord.residency.demotions_total
    assert demotions == rigs[1].coord.residency.demotions_total > 0
    resident_steps = [q for q, r in zip(lean_taken, all_resident) if r]
    assert len(resident_steps) - demotions <= sum(resident_steps) < len(resident_steps)  # all but a relief's
    assert not any(q for q, r in zip(lean_taken, all_resident) if not r)  # a hot buffer in the batch: never
    mirrored = rigs[0].coord.mirror.mirrored_len
    assert all(int(mirrored[r.req_pool_idx]) > r.prompt_len for r in reqs[0])  # deferred write-through ran
    for rig, group in zip(rigs, reqs):
        for req in group:
            rig.release(req)
        assert rig.counts() == rig.initial_counts
        assert not rig.allocator.page_resident.any()  # no page is marked once every request left


def test_the_device_pool_maps_only_resident_pages_past_their_first_id(gloo_world):
    """``map_resident_writes``: an id on a marked page, not its first, gets the page's first row
    plus its offset; ids on unmarked pages and first ids keep their mapping; idempotent."""
    rig = Rig(gloo_world, residency=True)
    l2d, marks, pool = rig.allocator.logical_to_device, rig.allocator.page_resident, rig.pool
    before = l2d.clone()
    l2d[5 * PAGE] = 7 * PAGE  # a resident page's first id, mapped by the host
    l2d[6 * PAGE] = 9 * PAGE  # an unmarked page
    marks[5] = 1
    loc = torch.tensor([5 * PAGE, 5 * PAGE + 3, 5 * PAGE + PAGE - 1, 6 * PAGE + 2, 0])
    for _ in range(2):
        pool.map_resident_writes(loc)
        assert l2d[5 * PAGE + 3] == 7 * PAGE + 3 and l2d[5 * PAGE + PAGE - 1] == 7 * PAGE + PAGE - 1
        assert l2d[5 * PAGE] == 7 * PAGE and l2d[6 * PAGE + 2] == before[6 * PAGE + 2] and l2d[0] == before[0]
