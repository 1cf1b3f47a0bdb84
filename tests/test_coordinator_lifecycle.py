"""Coordinator lifecycle on CPU with real SGLang objects: prefill -> staging -> ready -> decode
-> finish, with aborts and retractions at every stage. After every swap-in, each selected
position's device row holds that position's true KV; when all requests are gone, every pool is
back to its initial free count."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rig import PAGE, Rig, Request
from tier import examples

from sglang_hisparse.memory.copy_lane import Fence


def select(rng: random.Random, req: Request, top_k: int, overlap: float) -> list[int]:
    """A realistic selection: some of last step's positions, fresh ones, often the newest."""
    newest = req.seq_len - 1
    keep = [p for p in req.last_selection if p < newest and rng.random() < overlap]
    fresh = rng.sample(range(newest), k=min(newest, top_k))
    chosen = list(dict.fromkeys(keep + fresh))[: top_k - 1]
    if rng.random() < 0.8:
        chosen.append(newest)
    rng.shuffle(chosen)
    req.last_selection = chosen
    return chosen


def run_to_decode(rig: Rig, reqs: list) -> None:
    for r in reqs:
        assert rig.prefill(r)
        rig.stage(r)
    ready = rig.collect()
    assert ready == reqs


def decode_one_long_request(rig: Rig, steps: int = 40) -> Request:
    """A 300-token request through prefill and ``steps`` decode steps, every layer resolved and
    checked exactly each step (70% of the selections from earlier ones); returns the request."""
    rng = random.Random(0)
    req = Request(uid=1, prompt_len=300)
    run_to_decode(rig, [req])
    for _ in range(steps):
        assert rig.decode_step([req])
        for layer in range(rig.layers):
            rig.resolve_and_check([req], layer, [select(rng, req, rig.top_k, 0.7)])
    return req


def test_long_request_resolves_exactly_over_many_steps(gloo_world):
    rig = Rig(gloo_world)
    req = decode_one_long_request(rig)
    selected, misses = rig.coord.stats.totals()
    assert selected > 0 and 0 < misses < selected
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def test_long_request_with_the_slot_map(gloo_world, caplog):
    """slot_map on: the map's size is logged, the request resolves exactly with the same misses
    as without the map (the same selections), and after every layer call the map names the slot
    of every held position (Rig.check_slot_map; the writers here: open with filled slots, and the
    resolver)."""
    with caplog.at_level(logging.INFO, logger="sglang_hisparse.decode.coordinator"):
        rig = Rig(gloo_world, slot_map=True)
    slot_map = rig.coord.hot.slot_map
    layers, reqs, cols = slot_map.shape
    assert (layers, cols, slot_map.dtype) == (2, rig.coord.mirror.row_table.shape[1], torch.int16)
    assert f"position -> slot map: 2 layers x {reqs} requests x {cols} positions" in caplog.text
    req = decode_one_long_request(rig)
    plain = Rig(gloo_world)
    decode_one_long_request(plain)
    assert rig.coord.stats.totals() == plain.coord.stats.totals()
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def assert_tables_reset(rig: Rig) -> None:
    """Every request slot without a hot buffer has its per-layer tables at their reset values:
    no positions, recency in slot order, history (reuse policy) zero."""
    hot = rig.coord.hot
    free = torch.tensor([not hot.holds(i) for i in range(len(hot.capacity))])
    assert hot.slot_positions[:, free].eq(-1).all()
    assert torch.equal(hot.recency[:, free], torch.arange(hot.buffer_size, dtype=torch.int16).expand_as(hot.recency[:, free]))
    if hot.history is not None:
        assert hot.history[:, free].eq(0).all()


def test_long_request_with_the_reuse_policy(gloo_world, caplog):
    """replacement "reuse": the packaged table is logged, every layer's history moves while the
    request decodes (and stays exact), and is zero again once it is gone."""
    with caplog.at_level(logging.INFO, logger="sglang_hisparse.decode.coordinator"):
        rig = Rig(gloo_world, replacement="reuse")
    assert "replacement policy reuse (history table: attention k=256 B=512)" in caplog.text
    assert rig.coord.hot.history is not None and Rig(gloo_world).coord.hot.history is None
    req = decode_one_long_request(rig)
    history = rig.coord.hot.history[:, req.req_pool_idx]
    assert (history >> 8).gt(1).any(dim=1).all() and (history & 0xFF).gt(0).any(dim=1).all()
    selected, misses = rig.coord.stats.totals()
    assert selected > 0 and 0 < misses < selected
    rig.release(req)
    assert_tables_reset(rig)
    assert rig.counts() == rig.initial_counts


def test_short_request_grows_through_the_fast_path_into_the_long_path(gloo_world):
    rig = Rig(gloo_world)
    rng = random.Random(1)
    req = Request(uid=2, prompt_len=20)  # keeps one page; grows page by page up to B + newest
    run_to_decode(rig, [req])
    assert rig.coord.hot.capacity[req.req_pool_idx] == PAGE
    for step in range(rig.B + 30):
        assert rig.decode_step([req])
        layer = step % rig.layers
        rig.resolve_and_check([req], layer, [select(rng, req, rig.top_k, 0.5)])
    assert rig.coord.hot.capacity[req.req_pool_idx] == rig.coord.padded_buffer_size
    assert rig.counts()["device_free"] == rig.initial_counts["device_free"] - rig.coord.padded_buffer_size
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def test_padded_rows_are_untouched_and_finish_is_idempotent(gloo_world):
    rig = Rig(gloo_world)
    rng = random.Random(2)
    reqs = [Request(uid=3, prompt_len=200), Request(uid=4, prompt_len=70)]
    run_to_decode(rig, reqs)
    assert rig.decode_step(reqs)
    buffer = rig.coord._layers.out
    buffer[2:4].fill_(-12345)
    rig.resolve_and_check(reqs, 0, [select(rng, r, rig.top_k, 0.5) for r in reqs], num_padded=2)
    assert buffer[2:4].eq(-12345).all()
    rig.coord.request_finished(reqs[0])
    rig.coord.request_finished(reqs[0])  # again: nothing more to free
    reqs[0].state = "gone-coordinator"
    rig.release(reqs[0])
    rig.release(reqs[1])
    assert rig.counts() == rig.initial_counts


@pytest.mark.parametrize("prompt_len", [90, 400])
def test_pd_direct_admission_serves_from_host(gloo_world, prompt_len):
    """PD decode: KV arrives in host rows; a short request is preloaded into its hot buffer, a
    long one starts with an empty table and misses on first use."""
    rig = Rig(gloo_world)
    rng = random.Random(prompt_len)
    req = Request(uid=7, prompt_len=prompt_len)
    assert rig.admit_direct(req)
    for _ in range(12):
        assert rig.decode_step([req])
        for layer in range(rig.layers):
            rig.resolve_and_check([req], layer, [select(rng, req, rig.top_k, 0.6)])
    rig.release(req)
    assert rig.counts() == rig.initial_counts


def test_abort_in_staging_frees_prefill_rows_and_host_rows(gloo_world):
    rig = Rig(gloo_world)
    req = Request(uid=5, prompt_len=500)
    assert rig.prefill(req)
    rig.stage(req)
    assert rig.coord.has_ongoing_staging()
    rig.release(req, retract=True)  # retract of a staging request aborts its staging
    assert not rig.coord.has_ongoing_staging()
    assert rig.counts() == rig.initial_counts


def test_a_step_whose_pages_are_not_free_is_refused_until_a_request_leaves(gloo_world):
    """Device rows: 10 pages. Four short requests hold two pages each (nothing set aside for their
    growth), so all four are admitted. At position 128 each needs a third page and two are free:
    the decode check refuses the step (SGLang retracts a request), and once one leaves the other
    three decode on, exactly."""
    rig = Rig(gloo_world, device_rows=PAGE * 10, max_reqs=8)
    rng = random.Random(3)
    reqs = [Request(uid=10 + i, prompt_len=100) for i in range(4)]
    assert all(rig.prefill(r) for r in reqs), "each is charged its own two pages"
    for r in reqs:
        rig.stage(r)
    assert rig.collect() == reqs
    while reqs[0].seq_len < 2 * PAGE:
        assert rig.decode_step(reqs)
    idxs, lens = [r.req_pool_idx for r in reqs], [r.seq_len for r in reqs]
    assert rig.coord.device_rows_short(idxs, lens) == 2 * PAGE
    assert not rig.decode_step(reqs) and rig.counts()["device_free"] == 2 * PAGE, "a refused step takes nothing"
    rig.release(reqs[3], retract=True)
    assert rig.coord.device_rows_short(idxs[:3], lens[:3]) == 0
    for _ in range(30):
        assert rig.decode_step(reqs[:3])
        for layer in range(rig.layers):
            rig.resolve_and_check(reqs[:3], layer, [select(rng, r, rig.top_k, 0.5) for r in reqs[:3]])
    for r in reqs[:3]:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


class _SlowCopyEvent:
    """The event of a staging copy that is still running until someone waits for it."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.mark.parametrize("wait", [False, True])
def test_wait_for_staging_lets_every_staged_request_join_now(gloo_world, wait):
    """Without the key, a request whose host copy is still running stays in staging (it joins
    a later step); with it, collect blocks until the copies are done and returns them all.
    The slow copy is the newest one: copies of the staging lane finish in submission order."""
    rig = Rig(gloo_world, wait_for_staging=wait)
    reqs = [Request(uid=30 + i, prompt_len=200 + 50 * i) for i in range(3)]
    for r in reqs:
        assert rig.prefill(r)
        rig.stage(r)
    slow = _SlowCopyEvent()
    staged = rig.coord.mirror._staged
    staged[2] = dataclasses.replace(staged[2], fence=Fence(staged[2].fence.seq, slow))
    ready = rig.collect()
    if wait:
        assert ready == reqs and slow.done and not rig.coord.has_ongoing_staging()
    else:
        assert ready == reqs[:2] and rig.coord.has_ongoing_staging()
        slow.done = True
        ready += rig.collect()
        assert ready == reqs
    for r in reqs:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_host_pool_exhaustion_makes_admission_wait_not_crash(gloo_world, caplog):
    """A host pool of half the logical space: admission stops when host rows would run out,
    says so in the log, and resumes after a request leaves."""
    rig = Rig(gloo_world, device_rows=PAGE * 24, ratio=2, host_ratio=0.5, max_reqs=12)
    host_rows = rig.coord.mem_pool_host.capacity_tokens
    assert host_rows < rig.allocator.logical_size
    caplog.set_level("INFO")
    live = []
    uid = 100
    while True:
        req = Request(uid=uid, prompt_len=3 * PAGE)
        uid += 1
        if not rig.prefill(req):
            break
        rig.stage(req)
        live.append(req)
        if len(live) > 20:
            pytest.fail("admission never stopped")
    assert "admission limited by the host pool" in caplog.text
    ready = rig.collect()
    assert ready == live
    # every admitted request can decode a while: host rows were counted at admission
    for _ in range(PAGE):
        if not rig.decode_step(live):
            break
    rig.release(live.pop(0))
    assert rig.can_admit(3 * PAGE)
    for r in live:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def run_random_lifecycle(rig: Rig, rng: random.Random, overlap: float, *, lengths: list[int], finish_after: int) -> None:
    """60 random scheduler actions over 10 requests of the given prompt lengths (prefill and stage,
    collect, abort or retract at any stage, decode steps with every selection checked against
    the true KV, finishing past ``finish_after`` tokens), then every live request leaves."""
    waiting = [Request(uid=1000 + i, prompt_len=rng.choice(lengths)) for i in range(10)]
    live: list[Request] = []
    for _ in range(60):
        action = rng.random()
        if waiting and action < 0.25:
            req = waiting[0]
            if rig.prefill(req):
                waiting.pop(0)
                live.append(req)
                rig.stage(req)
        elif action < 0.35:
            rig.collect()
        elif action < 0.45 and live:
            victim = rng.choice(live)  # abort or retract at whatever stage it is in
            live.remove(victim)
            rig.release(victim, retract=rng.random() < 0.5)
        else:
            decoding = [r for r in live if r.state == "decoding"]
            while len(decoding) > 1 and not rig.decode_step(decoding):  # SGLang's retract_decode
                victim = decoding.pop(rng.randrange(len(decoding)))
                live.remove(victim)
                rig.release(victim, retract=True)
            if decoding and rig.decode_step(decoding):
                for layer in range(rig.layers):
                    rig.resolve_and_check(decoding, layer, [select(rng, r, rig.top_k, overlap) for r in decoding])
                for r in list(decoding):
                    if r.seq_len > finish_after:
                        live.remove(r)
                        rig.release(r)
    for r in live:
        rig.release(r, retract=rng.random() < 0.5)
    assert_tables_reset(rig)


@pytest.mark.parametrize("replacement", ["lru", "reuse"])
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), overlap=st.floats(0.0, 1.0))
def test_random_lifecycles_stay_exact_and_leak_nothing(gloo_world, replacement, seed, overlap):
    rig = Rig(gloo_world, device_rows=PAGE * 30, max_reqs=10, top_k=24, replacement=replacement)
    run_random_lifecycle(rig, random.Random(seed), overlap, lengths=[10, 64, 100, 129, 200, 350], finish_after=420)
    assert rig.counts() == rig.initial_counts
