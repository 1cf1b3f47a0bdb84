"""The verify-step resolver (N query rows per request, sglang_hisparse/resolver/verify.py) over the
one-row oracles: N = 1 is the one-row resolver, shared positions are copied once, the batched
oracle agrees with the loop reference, preconditions are refused. Tiny sizes, CPU."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tier import examples
from sglang_hisparse.resolver.reuse import history_table, reuse_levels
from sglang_hisparse.resolver.batched import resolve_batched
from sglang_hisparse_testkit.resolver_cases import random_history, verify_rows, verify_slot_positions
from sglang_hisparse.resolver.reference import MissPlan, resolve_reference
from sglang_hisparse.resolver.verify import VerifyStep, _union_rows, resolve_verify

ROW = 4  # elements per KV row (float32)


def _state(rng: random.Random, *, R: int, B: int, N: int, lens: list[int], ctx: int) -> dict:
    """Tables of R request slots: long requests hold B distinct positions below L (some empty)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    W = B + N + 2
    hot = torch.randperm(R * W, generator=g).view(R, W).to(torch.int32)
    tokens = verify_slot_positions(g, lens, B)
    host_locs = torch.randperm(R * ctx, generator=g).view(R, ctx)
    return dict(hot_locs=hot, slot_tokens=tokens,
                lru=torch.stack([torch.randperm(B, generator=g) for _ in range(R)]).to(torch.int16),
                host_locs=host_locs, host_kv=torch.randn(R * ctx, ROW, generator=g),
                device_kv=torch.full((R * W, ROW), -7.0))


def _clone(state: dict) -> dict:
    return {key: v.clone() for key, v in state.items()}


def _plan(n: int, width: int) -> MissPlan:
    return MissPlan(torch.full((n, width), -5, dtype=torch.int64), torch.full((n, width), -5, dtype=torch.int32),
                    torch.full((n,), -5, dtype=torch.int32))


def test_one_query_row_is_the_one_row_resolver():
    rng = random.Random(3)
    for _ in range(30):
        B, k, R = 16, 6, 5
        lens = [rng.choice([rng.randrange(1, B + 1), rng.randrange(B, 60)]) for _ in range(R)]
        state = _state(rng, R=R, B=B, N=1, lens=lens, ctx=80)
        rows = verify_rows(rng, state["slot_tokens"], lens, 1, k)
        a, b = _clone(state), _clone(state)
        out_a, out_b = torch.full((R, k), -9, dtype=torch.int32), torch.full((R, k), -9, dtype=torch.int32)
        plan_a, plan_b = _plan(R, k), _plan(R, k)
        seq = torch.tensor(lens)
        resolve_verify(resolve_reference, top_k_positions=rows, seq_lens=seq, req_pool_indices=torch.arange(R),
                       out=out_a, num_real_reqs=R, device_buffer_size=B, query_rows=1, plan=plan_a, **a)
        resolve_reference(top_k_positions=rows, seq_lens=seq + 1, req_pool_indices=torch.arange(R), out=out_b,
                          num_real_reqs=R, device_buffer_size=B, plan=plan_b, **b)
        assert torch.equal(out_a, out_b)
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert torch.equal(plan_a.counts, plan_b.counts) and torch.equal(plan_a.host_rows, plan_b.host_rows)


def test_rows_selecting_one_position_share_one_copy_and_window_rows_are_the_verify_slots():
    B, k, N, L = 8, 3, 2, 20
    state = _state(random.Random(0), R=1, B=B, N=N, lens=[L], ctx=40)
    state["slot_tokens"][0] = torch.arange(B, dtype=torch.int32)  # holds 0..7
    rows = torch.tensor([[9, 10, 3], [9, 11, L]], dtype=torch.int32)  # union 9, 10, 3, 11; window L
    out = torch.full((N, k), -9, dtype=torch.int32)
    counters = torch.zeros(2, dtype=torch.int64)
    plan = _plan(1, N * k)
    resolve_verify(resolve_reference, top_k_positions=rows, seq_lens=torch.tensor([L]), req_pool_indices=torch.tensor([0]),
                   out=out, num_real_reqs=1, device_buffer_size=B, query_rows=N, counters=counters, plan=plan, **state)
    assert counters.tolist() == [4, 3] and int(plan.counts[0]) == 3  # 9, 10 and 11 copied once each
    assert out[0, 0] == out[1, 0]  # position 9 in both rows: one device row
    assert int(out[1, 2]) == int(state["hot_locs"][0, B])  # window token 0 (position L >= B) -> slot B
    assert int(out[0, 2]) == int(state["hot_locs"][0, int((state["slot_tokens"][0] == 3).nonzero())])
    assert torch.equal(state["device_kv"][out[1, 1].long()], state["host_kv"][state["host_locs"][0, 11]])


def test_a_window_straddling_b_keeps_positions_below_b_in_their_own_slots():
    B, k, N, L = 8, 3, 3, 6  # window positions 6, 7 (slots 6, 7) and 8 (slot B + 2)
    state = _state(random.Random(2), R=1, B=B, N=N, lens=[L], ctx=20)
    rows = torch.tensor([[6, 1, -1], [7, 6, 2], [8, 7, 6]], dtype=torch.int32)
    out = torch.full((N, k), -9, dtype=torch.int32)
    before = _clone(state)
    resolve_verify(resolve_reference, top_k_positions=rows, seq_lens=torch.tensor([L]), req_pool_indices=torch.tensor([0]),
                   out=out, num_real_reqs=1, device_buffer_size=B, query_rows=N, **state)
    hot = state["hot_locs"][0]
    expect = [[hot[6], hot[1], -1], [hot[7], hot[6], hot[2]], [hot[B + 2], hot[7], hot[6]]]
    assert out.tolist() == [[int(x) for x in row] for row in expect]
    for key in state:  # the fast path: no table, LRU or KV change
        assert torch.equal(state[key], before[key]), key


def test_the_server_form_equals_the_checked_form():
    rng = random.Random(5)
    for _ in range(15):
        N, k = rng.choice([2, 3, 4]), 4
        B, R = N * k + 4, 5
        n = rng.randint(1, R)
        lens = [rng.choice([rng.randrange(1, B), rng.randrange(B, 4 * B)]) for _ in range(R)]
        state = _state(rng, R=R, B=B, N=N, lens=lens, ctx=4 * B + 10)
        order = torch.randperm(R)[:n]
        rows = verify_rows(rng, state["slot_tokens"][order], [lens[i] for i in order], N, k)
        seq = torch.tensor([lens[i] for i in order])
        a, b = _clone(state), _clone(state)
        out_a = torch.full((n * N, k), -9, dtype=torch.int32)
        resolve_verify(resolve_reference, top_k_positions=rows, seq_lens=seq, req_pool_indices=order, out=out_a,
                       num_real_reqs=n, device_buffer_size=B, query_rows=N, **a)
        hot_locs = b.pop("hot_locs")
        step = VerifyStep(max_reqs=R, top_k=k, query_rows=N, device_buffer_size=B, hot_locs=hot_locs,
                          device=torch.device("cpu"))

        def union_resolver(union, union_lens, idx, union_out):
            resolve_reference(top_k_positions=union, seq_lens=union_lens, req_pool_indices=idx, hot_locs=hot_locs,
                              out=union_out, num_real_reqs=n, device_buffer_size=B, **b)

        out_b = step.resolve(union_resolver, rows, seq, order)
        assert torch.equal(out_a, out_b)
        for key in b:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_batched_oracle_equals_the_loop_reference_on_random_verify_batches(policy):
    rng = random.Random(11 if policy == "lru" else 12)
    levels = reuse_levels(history_table().table)
    for _ in range(25):
        N, k = rng.choice([1, 2, 3, 4]), rng.choice([2, 4, 5])
        B = N * k + rng.choice([0, 3, 8])
        R = rng.randint(1, 6)
        n = rng.randint(1, R)
        lens = [rng.choice([rng.randrange(1, B), rng.randrange(B, 4 * B + 20)]) for _ in range(R)]
        state = _state(rng, R=R, B=B, N=N, lens=lens, ctx=4 * B + 30)
        if policy == "reuse":
            state["slot_history"] = random_history(torch.Generator().manual_seed(rng.randrange(1 << 30)), (R, B))
        order = torch.randperm(R)[:n]
        rows = verify_rows(rng, state["slot_tokens"][order], [lens[i] for i in order], N, k)
        seq = torch.tensor([lens[i] for i in order])
        results = []
        for resolver in (resolve_reference, resolve_batched):
            s = _clone(state)
            out = torch.full((n * N + 2, k), -9, dtype=torch.int32)
            counters = torch.zeros(2, dtype=torch.int64)
            plan = _plan(R, N * k)
            extra = dict(reuse_levels=levels) if policy == "reuse" else {}
            resolve_verify(resolver, top_k_positions=rows, seq_lens=seq, req_pool_indices=order, out=out,
                           num_real_reqs=n, device_buffer_size=B, query_rows=N, counters=counters, plan=plan,
                           **s, **extra)
            results.append((out, counters, plan.counts, plan.host_rows, s))
        (out_a, c_a, pc_a, ph_a, s_a), (out_b, c_b, pc_b, ph_b, s_b) = results
        assert torch.equal(out_a, out_b) and torch.equal(c_a, c_b)
        assert torch.equal(pc_a, pc_b) and torch.equal(ph_a, ph_b)
        assert (out_a[n * N:] == -9).all()  # rows beyond the real ones untouched
        for key in s_a:
            assert torch.equal(s_a[key], s_b[key]), key


def test_preconditions_are_refused_in_one_line():
    B, k, N, L = 8, 2, 2, 12
    state = _state(random.Random(1), R=1, B=B, N=N, lens=[L], ctx=30)
    kw = dict(seq_lens=torch.tensor([L]), req_pool_indices=torch.tensor([0]), out=torch.empty((N, k), dtype=torch.int32),
              num_real_reqs=1, device_buffer_size=B, query_rows=N)
    with pytest.raises(ValueError, match="row 0 of request 0 selects position 13"):
        resolve_verify(resolve_reference, top_k_positions=torch.tensor([[L + 1, 1], [2, 3]], dtype=torch.int32),
                       **kw, **state)
    with pytest.raises(ValueError, match="twice"):
        resolve_verify(resolve_reference, top_k_positions=torch.tensor([[4, 4], [2, 3]], dtype=torch.int32),
                       **kw, **state)
    narrow = dict(state, hot_locs=state["hot_locs"][:, : B + 1])
    with pytest.raises(ValueError, match="B \\+ N = 10 columns"):
        resolve_verify(resolve_reference, top_k_positions=torch.tensor([[1, 2], [2, 3]], dtype=torch.int32),
                       **kw, **narrow)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.lists(st.integers(-1, 12), min_size=1, max_size=10), min_size=1, max_size=4).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
def test_union_keeps_each_position_once_in_first_occurrence_order(rows):
    got = _union_rows(torch.tensor(rows))
    for row, union in zip(rows, got.tolist()):
        want = list(dict.fromkeys(v for v in row if v >= 0))
        assert union == want + [-1] * (len(row) - len(want))
