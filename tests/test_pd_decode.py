"""PD decode on CPU with real SGLang objects: what SGLang's disaggregation path reads off the
HiSparse allocator, and retraction by offload (KV out of the host pool and back) being exact."""

from __future__ import annotations

import random

import pytest
import torch

from rig import PAGE, Rig, Request
from test_coordinator_lifecycle import select

from sglang_hisparse.serving.pd import offload_request, restore_request


def test_pd_budgets_are_net_of_host_rows_and_held_device_rows(gloo_world):
    """``logical_attn_allocator.available_size()`` is the decode room (logical ids net of host
    rows); ``hisparse_attn_allocator.available_size()`` counts the free device rows, so SGLang's
    ``// padded_buffer_size`` is the number of full hot buffers it may promise. A short request
    holds only its own pages."""
    rig = Rig(gloo_world, device_rows=PAGE * 12, host_ratio=0.5)
    allocator, padded = rig.allocator, rig.coord.padded_buffer_size
    assert allocator.logical_attn_allocator.available_size() == allocator.decode_available_size()
    assert allocator.logical_attn_allocator.available_size() < allocator.logical.available_tokens()  # host binds
    before = allocator.hisparse_attn_allocator.available_size()
    assert before == PAGE * 12
    short = Request(uid=1, prompt_len=70)  # keeps 2 pages; its later pages come when it reaches them
    assert rig.admit_direct(short)
    assert allocator.hisparse_attn_allocator.available_size() == before - 2 * PAGE
    long = Request(uid=2, prompt_len=150)  # longer than B: a full hot buffer of fresh rows (its KV is on host)
    assert rig.admit_direct(long)
    assert allocator.hisparse_attn_allocator.available_size() == before - 2 * PAGE - padded
    rig.release(long)
    assert allocator.logical_attn_allocator.available_size() == allocator.decode_available_size()
    rig.release(short)
    assert allocator.hisparse_attn_allocator.available_size() == before
    assert rig.counts() == rig.initial_counts


def index_keys_of(rig, req) -> torch.Tensor:
    """The bytes of the request's positions in every layer's indexer-key buffer (by logical id:
    page, then the position's FP8 key bytes and its scale bytes within the page)."""
    ids = rig.req_to_token_pool.req_to_token[req.req_pool_idx, :req.seq_len].long()
    page, offset = ids // PAGE, ids % PAGE
    out = []
    for buf in rig.pool.index_k_with_scale_buffer:
        keys = buf[:, : PAGE * 128].view(-1, PAGE, 128)[page, offset]
        scales = buf[:, PAGE * 128:].view(-1, PAGE, 4)[page, offset]
        out.append(torch.cat([keys, scales], dim=1))
    return torch.stack(out)


def write_index_keys(rig, req, seed: int) -> torch.Tensor:
    """Random indexer-key bytes for the request's positions (as its forwards would have written);
    returns them as :func:`index_keys_of` reads them."""
    ids = rig.req_to_token_pool.req_to_token[req.req_pool_idx, :req.seq_len].long()
    page, offset = ids // PAGE, ids % PAGE
    gen = torch.Generator().manual_seed(seed)
    for buf in rig.pool.index_k_with_scale_buffer:
        buf[:, : PAGE * 128].view(-1, PAGE, 128)[page, offset] = torch.randint(
            0, 256, (len(ids), 128), generator=gen, dtype=torch.uint8)
        buf[:, PAGE * 128:].view(-1, PAGE, 4)[page, offset] = torch.randint(
            0, 256, (len(ids), 4), generator=gen, dtype=torch.uint8)
    return index_keys_of(rig, req)


@pytest.mark.parametrize("residency", [False, True])
@pytest.mark.parametrize("prompt_len, steps_before", [(300, 20), (60, 30), (60, 100)])
def test_a_retracted_request_resumes_with_exactly_its_kv(gloo_world, prompt_len, steps_before, residency):
    """Offload (the last token written through, positions 0..seqlen-2 copied out with their
    indexer keys, every row freed), SGLang's release and re-preallocation (new slot, logical ids
    and host rows), restore: the indexer keys are at the new ids and every later selection still
    resolves to the true KV. Covers a long request, a short one still
    on the fast path and a short one that grew past B; with residency, a resident request."""
    rig = Rig(gloo_world, residency=residency)
    rng = random.Random(prompt_len + steps_before)
    req = Request(uid=7, prompt_len=prompt_len)
    assert rig.admit_direct(req)
    for _ in range(steps_before):
        assert rig.decode_step([req])
        rig.resolve_and_check([req], rng.randrange(rig.layers), [select(rng, req, rig.top_k, 0.6)])
    assert rig.coord.hot.holds(req.req_pool_idx) != residency
    keys_before = write_index_keys(rig, req, seed=prompt_len)
    snapshot = offload_request(rig.coord, req)
    assert snapshot.kv.shape[:2] == (rig.layers, req.seq_len)
    rig.release(req, retract=True)  # SGLang's release_req: retract_req (after our offload), then the free of its ids
    assert rig.counts() == rig.initial_counts  # a retracted request holds nothing here
    other = Request(uid=8, prompt_len=200)  # its rows may reuse the freed ones
    assert rig.admit_direct(other)
    assert rig.pd_prealloc(req, req.seq_len)
    write_index_keys(rig, req, seed=99)  # the new ids' pages hold someone else's keys until restored
    restore_request(rig.coord, req, snapshot)
    assert torch.equal(index_keys_of(rig, req), keys_before), "the indexer keys did not follow the request"
    req.state = "decoding"
    for _ in range(25):
        assert rig.decode_step([req, other])
        for layer in range(rig.layers):
            rig.resolve_and_check([req, other], layer, [select(rng, r, rig.top_k, 0.6) for r in (req, other)])
    rig.release(req)
    rig.release(other)
    assert rig.counts() == rig.initial_counts


def test_pd_hot_buffer_demotes_a_resident_request_when_the_free_rows_are_short(gloo_world):
    """The default configuration (residency on): SGLang's PD budget (``hisparse_attn_allocator``)
    counts the rows demoting resident requests frees, so a transfer whose hot buffer does not fit
    the free rows demotes one instead of failing (it raised "no device rows for the hot buffer"
    before); both decode exact from their KV, and everything comes back."""
    rig = Rig(gloo_world, device_rows=PAGE * 16, residency=True)
    rng = random.Random(12)
    resident = Request(uid=1, prompt_len=12 * PAGE)
    assert rig.admit_direct(resident)
    assert rig.coord.residency.holds(resident.req_pool_idx)
    taken = rig.allocator.rows.pages.alloc_pages(rig.allocator.rows.room() // PAGE - 1)  # one free page left
    long = Request(uid=2, prompt_len=4 * PAGE)  # longer than B: a full hot buffer of 3 pages
    assert rig.allocator.hisparse_attn_allocator.available_size() >= rig.coord.padded_buffer_size
    assert rig.admit_direct(long)
    assert rig.coord.hot.holds(long.req_pool_idx) and not rig.coord.residency.holds(resident.req_pool_idx)
    for _ in range(20):
        assert rig.decode_step([resident, long])
        for layer in range(rig.layers):
            rig.resolve_and_check([resident, long], layer, [select(rng, r, rig.top_k, 0.6) for r in (resident, long)])
    rig.allocator.rows.pages.free_pages_(taken)
    for r in (resident, long):
        rig.release(r)
    assert rig.counts() == rig.initial_counts
