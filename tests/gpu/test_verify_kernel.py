"""The verify-step resolver (N query rows per request, sglang_hisparse/resolver/verify.py) with
the fused kernel as its one-row resolver, against the same resolver over the loop reference, on
fresh random multi-row batches. Skips without CUDA.

The union of a request's N rows is resolved by the kernel module built for top_k = N x k (k = 64,
N in {2, 4}; B in {N k, 2 N k}), LRU and the reuse-table policy. A second test runs the servers'
size, k = 2048 with N = 3 and 4 (B from N k to (N + 2) k), where the planner spills its top-k-sized
arrays to global memory. Every case poisons the outputs and the device KV on both sides and
compares the per-row outputs, the slot tables, LRU, history, the device KV bytes, the miss plan
and the counters.

Env: HISPARSE_VERIFY_CASES (default 300; the spilled test runs a tenth), HISPARSE_VERIFY_SECONDS
(time cap per test, default 90; hitting it before 50 cases (spilled: 10) fails the test).
"""

from __future__ import annotations

import functools
import os
import random
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang_hisparse.resolver.reuse import history_table, reuse_levels  # noqa: E402
from sglang_hisparse.resolver import cuda as rcuda  # noqa: E402
from sglang_hisparse.resolver import jit  # noqa: E402
from sglang_hisparse_testkit.resolver_cases import (  # noqa: E402
    random_history, random_slot_map, verify_rows, verify_slot_positions,
)
from sglang_hisparse.resolver.reference import MissPlan, resolve_reference  # noqa: E402
from sglang_hisparse.resolver.verify import resolve_verify  # noqa: E402

pytestmark = pytest.mark.gpu

ITEM = 1152  # bf16 MLA rows: 576 elements
K = 64
CONFIGS = [(N, N * K * m) for N in (2, 4) for m in (1, 2)]  # (query rows, B)
MAX_R = 8
SERVER_K = 2048  # DeepSeek-V3.2's top-k
SPILLED_CONFIGS = [(3, 3 * SERVER_K), (3, 4 * SERVER_K), (4, 4 * SERVER_K), (4, 6 * SERVER_K)]
SPILLED_MAX_R = 3
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def built() -> None:
    jit.build_all([lambda b=b, n=n, r=r: jit.resolve_module(ITEM, b, n * K, reuse=r)
                   for n, b in CONFIGS for r in (False, True)])


@pytest.fixture(scope="module")
def built_spilled() -> None:
    assert all(rcuda.planner_spills(b, n * SERVER_K) for n, b in SPILLED_CONFIGS)
    jit.build_all([lambda b=b, n=n, r=r: jit.resolve_module(ITEM, b, n * SERVER_K, reuse=r)
                   for n, b in SPILLED_CONFIGS for r in (False, True)])


def _case(rng: random.Random, N: int, B: int, policy: str, k: int = K, max_r: int = MAX_R,
          slot_map: bool = False) -> dict:
    """Tables of R request slots (long requests hold B distinct positions below L, some empty), N
    overlapping rows per request with window positions L .. L + j in row j, -1 padding; with
    ``slot_map``, the tables' position -> slot map (compared after the step like the tables)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    R = rng.randint(1, max_r)
    n = rng.randint(1, R)
    lens = [rng.choice([rng.randrange(1, B), rng.randrange(B, 3 * B)]) for _ in range(R)]
    ctx, W = 3 * B + N + 2, B + N + 2
    tokens = verify_slot_positions(g, lens, B)
    order = torch.randperm(R, generator=g)[:n]
    rows = verify_rows(rng, tokens[order], [lens[r] for r in order.tolist()], N, k)
    state = dict(
        hot_locs=torch.randperm(R * W, generator=g).view(R, W).to(torch.int32),
        slot_tokens=tokens,
        lru=torch.stack([torch.randperm(B, generator=g) for _ in range(R)]).to(torch.int16),
        host_locs=torch.randperm(R * ctx, generator=g).view(R, ctx),
    )
    if policy == "reuse":
        state["slot_history"] = random_history(g, (R, B))
    if slot_map:  # the position -> slot map of these tables, garbage elsewhere
        state["slot_map"] = random_slot_map(g, tokens, ctx, B)
    return dict(R=R, n=n, k=k, state=state, order=order, seq=torch.tensor([lens[r] for r in order.tolist()]),
                rows=rows,
                host_kv=torch.randn(R * ctx, ITEM // 2, generator=g).to(torch.bfloat16))


def _run(resolver, case: dict, N: int, B: int, device: torch.device, host_kv: torch.Tensor, poison: int,
         extra: dict) -> dict:
    R, n, k = case["R"], case["n"], case["k"]
    tables = {k: v.clone().to(device) for k, v in case["state"].items()}
    W = tables["hot_locs"].shape[1]
    device_kv = torch.empty(R * W, ITEM // 2, dtype=torch.bfloat16, device=device)
    device_kv.view(torch.uint8).fill_(poison)
    out = torch.full((n * N + 2, k), -9, dtype=torch.int32, device=device)
    counters = torch.zeros(2, dtype=torch.int64, device=device)
    plan = MissPlan(torch.full((R, N * k), -5, dtype=torch.int64, device=device),
                    torch.full((R, N * k), -5, dtype=torch.int32, device=device),
                    torch.full((R,), -5, dtype=torch.int32, device=device))
    resolve_verify(resolver, top_k_positions=case["rows"].to(device), seq_lens=case["seq"].to(device),
                   req_pool_indices=case["order"].to(device), out=out, num_real_reqs=n, device_buffer_size=B,
                   query_rows=N, counters=counters, plan=plan, host_kv=host_kv, device_kv=device_kv,
                   **tables, **extra)
    result = dict(out=out, counters=counters, plan_counts=plan.counts, device_kv=device_kv.view(torch.uint8), **tables)
    for i in range(n):  # plan rows are defined up to each request's miss count
        m = int(plan.counts[i])
        result[f"plan_host_{i}"] = plan.host_rows[i, :m]
        result[f"plan_dev_{i}"] = plan.device_rows[i, :m]
    return {k: v.cpu() for k, v in result.items()}


def test_kernel_verify_equals_the_reference_on_random_multi_row_batches(built):
    _compare(CONFIGS, K, MAX_R, rcuda.make_workspace(MAX_R, CUDA, top_k=4 * K),
             int(os.environ.get("HISPARSE_VERIFY_CASES", "300")), min_cases=50, label="verify-kernel")


def test_spilled_kernel_verify_equals_the_reference_at_the_servers_top_k(built_spilled):
    """N = 3 and 4 rows of 2048 (3 and 4 draft tokens' verify): the planner's union of up to 8192
    positions keeps its top-k-sized arrays in the workspace spill slices."""
    ws = rcuda.make_workspace(SPILLED_MAX_R, CUDA, top_k=4 * SERVER_K, spill=True)
    _compare(SPILLED_CONFIGS, SERVER_K, SPILLED_MAX_R, ws,
             max(10, int(os.environ.get("HISPARSE_VERIFY_CASES", "300")) // 10), min_cases=10,
             label="verify-kernel-spilled")


def _compare(configs: list, k: int, max_r: int, ws, cases: int, min_cases: int, label: str) -> None:
    """``cases`` random cases of ``configs`` through the kernel and the loop reference (at most
    HISPARSE_VERIFY_SECONDS); fails on any difference or workspace error, or on fewer than
    ``min_cases`` cases in the time."""
    seconds = float(os.environ.get("HISPARSE_VERIFY_SECONDS", "90"))
    rng = random.Random(int(os.environ.get("HISPARSE_VERIFY_SEED", "20261201")))
    levels = reuse_levels(history_table().table)
    start, done, failures = time.time(), 0, []
    for c in range(cases):
        if time.time() - start > seconds:
            break
        N, B = rng.choice(configs)
        policy = rng.choice(["lru", "reuse"])
        case = _case(rng, N, B, policy, k=k, max_r=max_r, slot_map=c % 2 == 1)
        poison = rng.randrange(256)
        pinned = case["host_kv"].pin_memory()
        kernel = functools.partial(rcuda.resolve_cuda, workspace=ws, block_size=rng.choice([64, 256, 512, 1024]))
        got = _run(kernel, case, N, B, CUDA, pinned, poison,
                   dict(reuse_levels=levels.to(CUDA)) if policy == "reuse" else {})
        want = _run(resolve_reference, case, N, B, torch.device("cpu"), case["host_kv"], poison,
                    dict(reuse_levels=levels) if policy == "reuse" else {})
        bad = [name for name in want if not torch.equal(got[name], want[name])]
        if int(ws.errors.item()) != 0:
            bad.append("workspace errors")
        if bad:
            failures.append(f"case {c} (N={N}, B={B}, {policy}, map={c % 2 == 1}, {case['n']}/{case['R']} requests): "
                            f"{', '.join(bad)}")
        done += 1
    print(f"[{label}] {done} cases in {time.time() - start:.1f}s, {len(failures)} failures")
    assert not failures, "\n".join(failures[:10])
    assert done >= min(cases, min_cases), f"only {done} cases ran within {seconds}s"
