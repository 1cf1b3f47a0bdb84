"""Exact IndexShare prefetch on CPU (tests/rig.py): follower layers (reusing their source layer's
top-k) never resolve; their copies are the source's plan replayed onto their KV, and every selected
position's row holds its true KV in every layer, with hot buffers, residency and demotion alike."""

from __future__ import annotations

import random

import pytest
import torch

from rig import PAGE, Rig, Request
from test_coordinator_lifecycle import select

from sglang_hisparse.decode.prefetch import topk_sources


def test_sources_follow_sglang_skip_rule():
    assert topk_sources([False, False, True, False, True, True]) == [0, 1, 1, 3, 3, 3]
    with pytest.raises(ValueError, match="layer 0"):
        topk_sources([True, False])


def step(rig: Rig, reqs: list, rng: random.Random, sources: list[int], overlap: float = 0.6) -> None:
    """One decode step: each source layer selects, its followers reuse the selection."""
    assert rig.decode_step(reqs)
    chosen: dict[int, list] = {}
    for layer, source in enumerate(sources):
        if source == layer:
            chosen[layer] = [select(rng, r, rig.top_k, overlap) for r in reqs]
        rig.resolve_and_check(reqs, layer, chosen[source])


@pytest.mark.parametrize("residency", [False, True])
def test_followers_read_their_true_kv_and_keep_no_tables(gloo_world, residency):
    sources = [0, 0, 2, 2]
    rig = Rig(gloo_world, layers=4, topk_sources=sources, device_rows=PAGE * 40, residency=residency,
              residency_watermark=0.0)
    rng = random.Random(2)
    reqs = [Request(uid=1, prompt_len=700), Request(uid=2, prompt_len=90), Request(uid=3, prompt_len=400)]
    for r in reqs:
        assert rig.prefill(r)
        rig.stage(r)
    rig.collect()
    for n in range(40):
        if residency and n == 15:  # pressure: the longest resident request is demoted mid-decode
            rig.coord._resident_decode.reclaim(rig.allocator.rows.room() + PAGE)
        step(rig, reqs, rng, sources)
    selected, misses = rig.coord.stats.totals()
    assert misses > 0, "some requests resolve past the fast path"
    assert residency == (rig.coord.residency is not None and rig.coord.residency.demotions_total > 0)
    hot = rig.coord.hot
    for follower in (1, 3):  # never resolved: their tables are as opened
        idx = reqs[0].req_pool_idx
        assert torch.equal(hot.recency[follower, idx], torch.arange(rig.B, dtype=torch.int16)) or not hot.holds(idx)
    for r in reqs:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_counters_equal_resolving_every_layer(gloo_world):
    """The followers' selections and misses are counted as if they had resolved (same tables)."""
    totals = {}
    for prefetch in (True, False):
        rig = Rig(gloo_world, layers=2, topk_sources=[0, 0], indexshare_prefetch=prefetch)
        assert (rig.coord._layers.prefetch is not None) == prefetch
        rng = random.Random(9)
        req = Request(uid=5, prompt_len=500)
        assert rig.prefill(req)
        rig.stage(req)
        rig.collect()
        for _ in range(20):
            step(rig, [req], rng, [0, 0])
        totals[prefetch] = rig.coord.stats.totals()
        rig.release(req)
        assert rig.counts() == rig.initial_counts
    assert totals[True] == totals[False] and totals[True][1] > 0
