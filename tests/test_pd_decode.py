"""PD decode on CPU with real SGLang objects: what SGLang's disaggregation path reads off the
HiSparse allocator, and retraction by offload (KV out of the host pool and back) being exact."""

from __future__ import annotations

import random

import pytest

from rig import PAGE, Rig, Request
from test_coordinator_lifecycle import select

from sglang_hisparse.pd import offload_request, restore_request


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


@pytest.mark.parametrize("residency", [False, True])
@pytest.mark.parametrize("prompt_len, steps_before", [(300, 20), (60, 30), (60, 100)])
def test_a_retracted_request_resumes_with_exactly_its_kv(gloo_world, prompt_len, steps_before, residency):
    """Offload (the last token written through, positions 0..seqlen-2 copied out, every row
    freed), SGLang's release and re-preallocation (new slot, logical ids and host rows), restore:
    every later selection still resolves to the true KV. Covers a long request, a short one still
    on the fast path and a short one that grew past B; with residency, a resident request."""
    rig = Rig(gloo_world, residency=residency)
    rng = random.Random(prompt_len + steps_before)
    req = Request(uid=7, prompt_len=prompt_len)
    assert rig.admit_direct(req)
    for _ in range(steps_before):
        assert rig.decode_step([req])
        rig.resolve_and_check([req], rng.randrange(rig.layers), [select(rng, req, rig.top_k, 0.6)])
    assert rig.coord.hot.holds(req.req_pool_idx) != residency
    snapshot = offload_request(rig.coord, req)
    assert snapshot.shape[:2] == (rig.layers, req.seq_len)
    rig.release(req, retract=True)  # SGLang's release_req: retract_req (after our offload), then the free of its ids
    assert rig.counts() == rig.initial_counts  # a retracted request holds nothing here
    other = Request(uid=8, prompt_len=200)  # its rows may reuse the freed ones
    assert rig.admit_direct(other)
    assert rig.pd_prealloc(req, req.seq_len)
    restore_request(rig.coord, req, snapshot)
    req.state = "decoding"
    for _ in range(25):
        assert rig.decode_step([req, other])
        for layer in range(rig.layers):
            rig.resolve_and_check([req, other], layer, [select(rng, r, rig.top_k, 0.6) for r in (req, other)])
    rig.release(req)
    rig.release(other)
    assert rig.counts() == rig.initial_counts
