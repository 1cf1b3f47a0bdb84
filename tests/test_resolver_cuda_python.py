"""The CUDA resolver's Python side, on CPU: the batched oracle against the loop reference,
the case generator, argument validation, workspace shapes, dispatch rules and the JIT wiring
(the kernel itself runs in tests/gpu)."""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import logging
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
import torch

from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.resolver import cuda, dispatch, jit
from sglang_hisparse.resolver.batched import replay_plan_batched, resolve_batched
from sglang_hisparse_testkit.resolver_cases import (
    CaseSpec,
    differences,
    make_case,
    random_spec,
)
from sglang_hisparse.resolver.reference import MissPlan, replay_plan_reference, resolve_reference

CPU = torch.device("cpu")


def _loop_vs_batched(case) -> list[str]:
    """Run the loop reference on the case's 'kernel' copy and the batched one on its 'ref' copy."""
    kw = case.kernel_kwargs()
    kw["num_real_reqs"] = case.spec.num_real
    resolve_reference(**kw)
    resolve_batched(**case.ref_kwargs())
    return differences(case)


def test_batched_matches_loop_reference_on_random_cases(pool, bufs):
    rng = random.Random(1234)
    for seed in range(250):
        K = rng.choice([1, 3, 8, 16, 32])
        B = K * rng.choice([1, 2, 4]) + rng.choice([0, 0, 3])
        spec = random_spec(rng, item_bytes=rng.choice([1152, 656, 32]), B=B, top_k=K, block_size=64,
                           max_batch=12, seed=seed)
        case = make_case(spec, pool, *bufs, CPU)
        bad = _loop_vs_batched(case)
        assert not bad, f"seed {seed}: {bad} differ ({spec.describe()})"


@pytest.mark.parametrize("resident_prob", [0.3, 0.7, 1.0])
def test_batched_matches_loop_reference_on_mixed_resident_batches(pool, bufs, resident_prob):
    """Batches where some requests (short and long) are resident: their rows come from the
    residency tables, the others resolve as usual, and the resident ones' tables, plan rows and
    counters are left alone by both oracles alike."""
    rng = random.Random(int(resident_prob * 100))
    resident_rows = 0
    for seed in range(40):
        K = rng.choice([1, 3, 8, 16])
        B = K * rng.choice([1, 2, 4]) + rng.choice([0, 3])
        spec = dataclasses.replace(
            random_spec(rng, item_bytes=rng.choice([1152, 656, 32]), B=B, top_k=K, block_size=64, max_batch=12,
                        seed=seed),
            residency=True, resident_prob=resident_prob, resident_dtype=rng.choice([torch.uint8, torch.bool]),
            rtt_row_pad=rng.choice([0, 5]), short_frac=0.3)
        case = make_case(spec, pool, *bufs, CPU)
        r = case.inputs["req_pool_indices"][: spec.num_real].long()
        resident_rows += int((case.inputs["resident"][r] != 0).sum())
        bad = _loop_vs_batched(case)
        assert not bad, f"seed {seed}: {bad} differ ({spec.describe()})"
    assert resident_rows > 20


def test_batched_resident_rows_change_no_table(pool, bufs):
    """With every request resident, the batched oracle writes out rows from the residency tables
    only: slot tables, LRU, device KV and plan rows keep their poison, plan counts are 0 and the
    counters do not move."""
    spec = CaseSpec(item_bytes=656, B=32, top_k=16, num_reqs=5, num_real=4, max_reqs=7, seed=2, short_frac=0.3,
                    plan=True, counters=True, residency=True, resident_prob=1.0)
    case = make_case(spec, pool, *bufs, CPU)
    before = {name: t.clone() for name, t in (("tok", case.slot_tokens_all["ref"]), ("lru", case.lru_all["ref"]),
                                               ("kv", case.ref_kv), ("plan_host", case.ref["plan"].host_rows),
                                               ("counters", case.ref["counters"]))}
    resolve_batched(**case.ref_kwargs())
    assert torch.equal(case.slot_tokens_all["ref"], before["tok"]) and torch.equal(case.lru_all["ref"], before["lru"])
    assert torch.equal(case.ref_kv, before["kv"]) and torch.equal(case.ref["plan"].host_rows, before["plan_host"])
    assert torch.equal(case.ref["counters"], before["counters"])
    assert case.ref["plan"].counts[:4].tolist() == [0] * 4
    pos = case.inputs["top_k_positions"][:4].long()
    r = case.inputs["req_pool_indices"][:4].long()
    ids = case.inputs["req_to_token"][r].gather(1, pos.clamp(min=0)).long()
    want = torch.where(pos >= 0, case.inputs["logical_to_device"][ids], -1)
    assert torch.equal(case.ref["out"][:4].long(), want)


@pytest.mark.parametrize("missing", ["resident", "req_to_token", "logical_to_device"])
def test_batched_refuses_a_partial_residency_set(pool, bufs, missing):
    spec = CaseSpec(item_bytes=656, B=32, top_k=16, num_reqs=2, num_real=2, max_reqs=3, seed=4, residency=True)
    case = make_case(spec, pool, *bufs, CPU)
    kw = case.ref_kwargs()
    del kw[missing]
    with pytest.raises(ValueError, match="together"):
        resolve_batched(**kw)


@pytest.mark.parametrize("hit_mode", ["zero", "one", "fixed"])
def test_batched_matches_loop_reference_at_hit_extremes(pool, bufs, hit_mode):
    for seed in range(20):
        spec = CaseSpec(item_bytes=1152, B=32, top_k=16, num_reqs=6, num_real=5, max_reqs=9, seed=seed,
                        hit_mode=hit_mode, hit_rate=0.5, short_frac=0.0, plan=True, counters=True)
        case = make_case(spec, pool, *bufs, CPU)
        assert not _loop_vs_batched(case), spec.describe()


def test_cases_satisfy_the_preconditions(pool, bufs):
    rng = random.Random(99)
    seen_long = seen_short = seen_hits = seen_misses = 0
    for seed in range(60):
        spec = random_spec(rng, item_bytes=1152, B=64, top_k=32, block_size=64, max_batch=10, seed=seed)
        case = make_case(spec, pool, *bufs, CPU)
        n = spec.num_real
        pos = case.inputs["top_k_positions"][:n]
        L = case.inputs["seq_lens"][:n].long()
        r = case.inputs["req_pool_indices"][:n].long()
        assert torch.unique(r).numel() == n
        tokens = case.slot_tokens_all["ref"][spec.layer]
        lru = case.lru_all["ref"][spec.layer]
        for i in range(n):
            sel = [p for p in pos[i].tolist() if p >= 0]
            assert len(sel) == len(set(sel)) and all(p < L[i] for p in sel)
            row = tokens[r[i]].tolist()
            assert sorted(lru[r[i]].tolist()) == list(range(spec.B))
            if L[i] > spec.B:
                seen_long += 1
                held = [t for t in row if t >= 0]
                assert len(held) == len(set(held)) and all(t < L[i] - 1 for t in held)
                chosen = [p for p in sel if p != L[i] - 1]
                hits = sum(1 for p in chosen if p in set(held))
                seen_hits += hits
                seen_misses += len(chosen) - hits
            else:
                seen_short += 1
                assert row == list(range(spec.B))
    assert seen_long and seen_short and seen_hits and seen_misses


def test_residency_cases_map_positions_to_distinct_device_rows(pool, bufs):
    """The generator's residency tables: distinct logical ids per table, distinct device rows
    (beyond the hot buffers') for the ids in use, -1 for the spare ones; flags of both dtypes;
    random_spec turns residency on for some specs, and the tables are drawn after everything else
    (the rest of a case is the same with residency on or off)."""
    rng = random.Random(5)
    specs = [random_spec(rng, item_bytes=1152, B=64, top_k=32, block_size=64, max_batch=10, seed=s)
             for s in range(60)]
    on = [s for s in specs if s.residency]
    assert 10 < len(on) < 40 and {s.resident_dtype for s in on} == {torch.uint8, torch.bool}
    for spec in on[:8]:
        case = make_case(spec, pool, *bufs, CPU)
        plain = make_case(dataclasses.replace(spec, residency=False), pool, *bufs, CPU)
        assert torch.equal(case.inputs["top_k_positions"], plain.inputs["top_k_positions"])  # drawn last
        rtt = case.inputs["req_to_token"]
        l2d = case.inputs["logical_to_device"]
        assert rtt.dtype == torch.int32 and rtt.shape[1] >= case.inputs["host_locs"].shape[1]
        assert torch.unique(rtt).numel() == rtt.numel()
        used = l2d[rtt.reshape(-1).long()]
        assert torch.unique(used).numel() == used.numel() and bool((used >= case.device_rows).all())
        spare = torch.ones(l2d.numel(), dtype=torch.bool)
        spare[rtt.reshape(-1).long()] = False
        assert bool((l2d[spare] == -1).all())
        flags = case.inputs["resident"]
        assert flags.dtype == spec.resident_dtype and flags.shape[0] == spec.max_reqs


@pytest.mark.parametrize("target", ["out", "slot_tokens", "lru", "device_kv", "plan", "counters"])
def test_comparison_detects_one_wrong_element(pool, bufs, target):
    spec = CaseSpec(item_bytes=656, B=32, top_k=16, num_reqs=4, num_real=4, max_reqs=6, seed=5,
                    hit_mode="fixed", hit_rate=0.5, short_frac=0.0, plan=True, counters=True)
    case = make_case(spec, pool, *bufs, CPU)
    assert not _loop_vs_batched(case)
    k = case.kernel
    if target == "out":
        k["out"][0, 0] += 1
    elif target == "slot_tokens":
        case.slot_tokens_all["kernel"][0, 0, 0] += 1
    elif target == "lru":
        case.lru_all["kernel"][spec.layer, 0, [0, 1]] = case.lru_all["kernel"][spec.layer, 0, [1, 0]]
    elif target == "device_kv":
        case.kernel_kv.view(torch.uint8)[3, 0, 100] ^= 1
    elif target == "plan":
        k["plan"].host_rows[0, 0] += 1
    else:
        k["counters"][1] += 1
    assert differences(case)


def test_replay_batched_matches_reference(pool):
    host_kv, _ = pool.views(656)
    plan = MissPlan(
        host_rows=torch.randint(0, host_kv.shape[0], (5, 8)),
        device_rows=torch.randperm(64)[:40].view(5, 8).to(torch.int32),
        counts=torch.tensor([3, 0, 8, 1, 9], dtype=torch.int32),
    )
    a = torch.zeros(64, 1, 656, dtype=torch.uint8)
    b = torch.zeros(64, 1, 656, dtype=torch.uint8)
    replay_plan_reference(plan=plan, num_real_reqs=4, host_kv=host_kv, device_kv=a)
    replay_plan_batched(plan=plan, num_real_reqs=torch.tensor([4], dtype=torch.int32), host_kv=host_kv, device_kv=b)
    assert torch.equal(a, b) and int(a.sum()) > 0


# ---- workspace, validation, configuration ----


def test_make_workspace_shapes():
    ws = cuda.make_workspace(7, "cpu", top_k=64)
    assert ws.state.shape == (cuda.STATE_WORDS,) and ws.state.dtype == torch.int32 and int(ws.state.abs().sum()) == 0
    assert ws.flat_host_rows.shape == (7 * 64,) and ws.flat_host_rows.dtype == torch.int64
    assert ws.flat_device_rows.shape == (7 * 64,) and ws.flat_device_rows.dtype == torch.int32
    assert ws.errors.shape == (1,) and ws.errors.data_ptr() == ws.state[cuda.STATE_ERRORS:].data_ptr()
    assert ws.resolve_num_real.data_ptr() != ws.replay_num_real.data_ptr()
    assert ws.max_reqs == 7 and ws.top_k == 64 and ws.device == CPU
    assert ws.planner_spill.numel() == 0 and ws.planner_spill.dtype == torch.uint8  # no spill buffer by default
    spilled = cuda.make_workspace(7, "cpu", top_k=64, spill=True)
    assert spilled.planner_spill.shape == (7 * cuda.planner_spill_bytes(64),)
    with pytest.raises(ValueError):
        cuda.make_workspace(0, "cpu")


def test_planner_spill_slices_hold_the_top_k_sized_arrays():
    # PlanSpill<8192>: 32K selection map, 16K victims, 1K ballots, 128K + 64K hash (32768 entries),
    # 64K host rows -> 312320 bytes (a multiple of 128).
    assert cuda.planner_spill_bytes(8192) == 312320
    assert all(cuda.planner_spill_bytes(k) % 128 == 0 for k in (1, 5, 64, 2048, 6144))
    # a spilled layout holds only the B-sized arrays: less shared memory than the same B unspilled
    assert cuda.planner_spills(8192, 6144) and not cuda.planner_spills(8192, 2048)
    assert cuda.planner_smem_bytes(8192, 6144) < cuda.planner_smem_bytes(8192, 2048)


def test_a_spilling_planner_needs_the_workspace_spill_buffer(monkeypatch):
    """B=8192 with a 3-row verify union of 2048 (6144 positions) spills: a workspace without the
    spill buffer is refused before anything launches, naming what to allocate; with it, the
    launch receives the buffer."""
    calls = _record_skip_io_launches(monkeypatch)
    monkeypatch.setattr(cuda, "_static_checked", {})
    B, K, n, R = 8192, 6144, 2, 2
    kw = dict(_valid_kwargs(B=B, K=K, n=n, R=R), skip_io=True)
    with pytest.raises(ValueError, match=r"keeps the planner's top-k-sized arrays in global memory: the workspace "
                                         r"needs a spill buffer of 566784 B, has 0 \(make_workspace\(spill=True\)\)"):
        cuda.resolve_cuda(**kw)
    assert calls == []
    ws = cuda.make_workspace(R, "cpu", top_k=K, spill=True)
    cuda.resolve_cuda(**{**kw, "workspace": ws})
    assert len(calls) == 1 and calls[0][-4] is ws.planner_spill


def test_planner_smem_matches_the_kernel_layout():
    # PlanLayout<4096, 2048>: 8K top-k, 8K sel, 16K tokens, 16K+16 hot, 8K lru, 4K victims, 256 + 512
    # ballot words, union max(8192 * 6, 8K + 16K) = 48K, misc 416 -> 111792 bytes.
    assert cuda.planner_smem_bytes(4096, 2048) == 111792
    assert cuda.planner_smem_bytes(8192, 2048) <= cuda.MAX_SMEM_BYTES
    cuda.check_supported(1152, 8192, 2048)
    cuda.check_supported(1152, 19135, 2048)  # spilled
    cuda.check_supported(656, 64, 64)
    with pytest.raises(ValueError, match="shared memory"):
        cuda.check_supported(1152, 32767, 2048)
    with pytest.raises(ValueError, match="16 bytes"):
        cuda.check_supported(1000, 4096, 2048)
    with pytest.raises(ValueError, match="top_k"):
        cuda.check_supported(1152, 1024, 2048)


@pytest.mark.parametrize("block", [32, 64, 256, 960, 1024])
def test_every_legal_block_size_is_accepted(block):
    assert cuda.check_block_size(block) == block


@pytest.mark.parametrize("block", [0, 16, 48, 1000, 1056, 2048])
def test_illegal_block_sizes_are_refused(block):
    with pytest.raises(ValueError, match="multiple of 32"):
        cuda.check_block_size(block)


def _valid_kwargs(B: int = 32, K: int = 16, n: int = 3, R: int = 4):
    ws = cuda.make_workspace(R, "cpu", top_k=K)
    kw = dict(
        top_k_positions=torch.zeros(n, K, dtype=torch.int32),
        seq_lens=torch.full((n,), 100, dtype=torch.int64),
        req_pool_indices=torch.arange(n),
        hot_locs=torch.zeros(R, B + 1, dtype=torch.int32),
        slot_tokens=torch.zeros(R, B, dtype=torch.int32),
        lru=torch.zeros(R, B, dtype=torch.int16),
        host_locs=torch.zeros(R, 200, dtype=torch.int64),
        host_kv=torch.zeros(10, 1, 576, dtype=torch.bfloat16),
        device_kv=torch.zeros(10, 1, 576, dtype=torch.bfloat16),
        out=torch.zeros(n, K, dtype=torch.int32),
        num_real_reqs=torch.tensor([n], dtype=torch.int32),
        device_buffer_size=B,
        workspace=ws,
    )
    return kw


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda kw: kw.update(top_k_positions=kw["top_k_positions"].long()), "top_k_positions"),
        (lambda kw: kw.update(seq_lens=kw["seq_lens"].float()), "seq_lens"),
        (lambda kw: kw.update(req_pool_indices=kw["req_pool_indices"][:1]), "req_pool_indices"),
        (lambda kw: kw.update(hot_locs=kw["hot_locs"][:, :32]), "B \\+ 1"),
        (lambda kw: kw.update(slot_tokens=kw["slot_tokens"][:, :31]), "B = 32"),
        (lambda kw: kw.update(lru=kw["lru"].int()), "lru"),
        (lambda kw: kw.update(host_locs=kw["host_locs"].int()), "host_locs"),
        (lambda kw: kw.update(out=kw["out"][:, :8]), "out"),
        (lambda kw: kw.update(device_kv=torch.zeros(10, 1, 328, dtype=torch.uint8)), "one dtype"),
        (lambda kw: kw.update(num_real_reqs=torch.tensor([3])), "num_real_reqs"),
        (lambda kw: kw.update(counters=torch.zeros(2, dtype=torch.int32)), "counters"),
        (lambda kw: kw.update(block_size=100), "multiple of 32"),
        (lambda kw: kw.update(workspace=cuda.make_workspace(2, "cpu", top_k=16)), "max_reqs"),
        (lambda kw: kw.update(workspace=cuda.make_workspace(4, "cpu", top_k=8)), "top_k"),
        (lambda kw: kw.update(plan=MissPlan(torch.zeros(3, 16, dtype=torch.int64),
                                            torch.zeros(3, 16, dtype=torch.int32),
                                            torch.zeros(3, dtype=torch.int64))), "plan"),
        (lambda kw: kw.update(plan=MissPlan(torch.zeros(3, 8, dtype=torch.int64),
                                            torch.zeros(3, 8, dtype=torch.int32),
                                            torch.zeros(3, dtype=torch.int32))), "plan"),
        (lambda kw: None, "pinned"),  # CPU host_kv that is not page-locked
    ],
)
def test_resolve_cuda_rejects_bad_arguments_before_building(change, message, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("validation must fail before the JIT build")

    monkeypatch.setattr(jit, "resolve_module", no_build)
    kw = _valid_kwargs()
    kw["skip_io"] = message != "pinned"  # CPU tensors are never pinned here: check IO args last
    change(kw)
    with pytest.raises(ValueError, match=message):
        cuda.resolve_cuda(**kw)


def _record_skip_io_launches(monkeypatch, policies: Optional[list] = None) -> list:
    """Replace the kernel module by one whose skip-IO entry points record their arguments: each
    ``launch_skip_io`` call is recorded as one tuple in the kernel's parameter order (29 entries:
    the batch's top-k, seq_lens and request indices, the six tables, out, then what ``bind_skip_io``
    received after the tables for the same parameter tensor). The module has no copying entry
    points, so a call that picks one fails. ``policies`` (when given) receives the ``reuse`` flag
    of every module lookup."""
    calls = []
    bound: dict = {}

    class FakeModule:
        def bind_skip_io(self, params, *args):
            assert params.dtype == torch.uint8 and params.device.type == "cpu"
            assert params.numel() == cuda.BOUND_BYTES
            bound[id(params)] = args

        def launch_skip_io(self, params, topk, seq_lens, rpi, out):
            fixed = bound[id(params)]
            calls.append((topk, seq_lens, rpi, *fixed[:6], out, *fixed[6:]))

    def module(*args, reuse: bool = False):
        if policies is not None:
            policies.append(reuse)
        return FakeModule()

    monkeypatch.setattr(jit, "resolve_module", module)
    return calls


def test_validated_tables_are_not_rechecked_but_changed_ones_are(monkeypatch):
    """The per-call fast path: tables validated once are skipped on later calls with the same
    buffers; a different (bad) table, or a bad per-call argument, is still refused."""
    calls = _record_skip_io_launches(monkeypatch)
    checked = []
    real_check = cuda._check_static_tables
    monkeypatch.setattr(cuda, "_check_static_tables", lambda *a: checked.append(1) or real_check(*a))
    binds = []
    real_bind = cuda._bind
    monkeypatch.setattr(cuda, "_bind", lambda *a, **k: binds.append(1) or real_bind(*a, **k))
    monkeypatch.setattr(cuda, "_static_checked", {})
    kw = _valid_kwargs()
    for _ in range(3):
        cuda.resolve_cuda(skip_io=True, **kw)
    assert len(calls) == 3 and len(checked) == 1 and len(binds) == 1  # checked and bound once
    for change, message in (
        (dict(lru=kw["lru"].int()), "lru"),
        (dict(slot_tokens=kw["slot_tokens"][:, :31]), "B = 32"),
        (dict(out=kw["out"].long()), "out"),
        (dict(top_k_positions=kw["top_k_positions"][:, :8]), "out"),
    ):
        with pytest.raises(ValueError, match=message):
            cuda.resolve_cuda(skip_io=True, **{**kw, **change})
    # a new KV buffer is validated again (here: it is not pinned, so the IO path refuses it)
    with pytest.raises(ValueError, match="pinned"):
        cuda.resolve_cuda(skip_io=False, **kw)
    assert len(calls) == 3


def test_warmup_build_logs_start_and_ready(monkeypatch, caplog):
    built = []
    monkeypatch.setattr(jit, "build_all", lambda jobs: built.append(len(jobs)) or [object(), object()])
    with caplog.at_level(logging.INFO, logger="sglang_hisparse.resolver.cuda"):
        cuda.warmup_build(1152, 4096, 2048, 960)
    assert built == [2]
    text = caplog.text
    assert "loading the resolve kernels (1152-byte rows, B=4096, top_k=2048, LRU replacement)" in text
    assert "resolve kernels ready in" in text
    with pytest.raises(ValueError, match="block_size"):  # checked before anything is built
        cuda.warmup_build(1152, 4096, 2048, 100)
    assert built == [2]
    requested = []
    monkeypatch.setattr(jit, "resolve_module", lambda *a, reuse=False: requested.append(reuse))
    monkeypatch.setattr(jit, "replay_module", lambda *a: None)
    monkeypatch.setattr(jit, "build_all", lambda jobs: [job() for job in jobs] and [object(), object()])
    with caplog.at_level(logging.INFO, logger="sglang_hisparse.resolver.cuda"):
        cuda.warmup_build(1152, 4096, 2048, 960, reuse=True)
    assert requested == [True] and "top_k=2048, reuse-table replacement)" in caplog.text
    limit = cuda.largest_buffer_size(2048, reuse=True)
    assert limit < cuda.largest_buffer_size(2048)  # the policy's arrays take shared memory
    with pytest.raises(ValueError, match=f"with replacement=reuse needs .* \\(at most {limit}\\)"):
        cuda.warmup_build(1152, limit + 1, 2048, 960, reuse=True)
    cuda.check_supported(1152, limit + 1, 2048)  # LRU still fits


def test_skip_io_does_not_require_pinned_host_kv(monkeypatch):
    calls = _record_skip_io_launches(monkeypatch)  # only skip-IO entry points exist
    kw = _valid_kwargs()
    cuda.resolve_cuda(skip_io=True, **kw)
    (args,) = calls
    assert len(args) == 29  # the C++ entry point's parameters
    assert args[-3] == 960 and args[-2] == -1  # default block size, automatic copiers
    assert args[-4] is kw["workspace"].planner_spill and args[-4].numel() == 0  # B=32, top_k=16 does not spill
    assert args[11].numel() == 0 and args[14].numel() == 0  # no plan, no counters
    assert [a.numel() for a in args[15:18]] == [0, 0, 0]  # no residency
    assert [a.dtype for a in args[15:18]] == [torch.uint8, torch.int32, torch.int64]
    assert [(a.numel(), a.dtype) for a in args[18:20]] == [(0, torch.int16), (0, torch.uint8)]  # LRU
    assert (args[20].numel(), args[20].dtype) == (0, torch.int16)  # no position -> slot map


def test_the_slot_map_reaches_the_kernel_in_place_and_bad_maps_are_refused(monkeypatch):
    """``slot_map`` (int16 [>= table rows, >= host_locs' columns]) is passed to the kernel's bind
    as given (a wider, strided view too); a wrong dtype, too few rows or columns, or another
    device is refused before anything is built, naming the tensor."""
    calls = _record_skip_io_launches(monkeypatch)
    kw = _valid_kwargs()
    wide = torch.zeros(4, 210, dtype=torch.int16)
    cuda.resolve_cuda(skip_io=True, slot_map=wide[:, :205], **kw)
    (args,) = calls
    assert args[20].data_ptr() == wide.data_ptr() and args[20].stride() == (210, 1)
    monkeypatch.setattr(cuda, "_static_checked", {})
    for bad, message in ((wide.int(), "slot_map"), (wide[:3], "slot_map needs >= 4 rows"),
                         (wide[:, :199], "max_context = 200"), (wide.t(), "slot_map")):
        with pytest.raises(ValueError, match=message):
            cuda.resolve_cuda(skip_io=True, slot_map=bad, **_valid_kwargs())


def test_buffer_sizes_reach_the_kernel_in_place_and_bad_ones_are_refused(monkeypatch):
    """``buffer_sizes`` (int32 [>= table rows]) is passed to the kernel's bind as given, right
    after the slot map (an empty int32 tensor without it); a wrong dtype, too few rows, a strided
    vector or another shape is refused before anything is built, naming the tensor."""
    calls = _record_skip_io_launches(monkeypatch)
    sizes = torch.full((6,), 3, dtype=torch.int32)
    cuda.resolve_cuda(skip_io=True, buffer_sizes=sizes, **_valid_kwargs())
    cuda.resolve_cuda(skip_io=True, **_valid_kwargs())
    (with_sizes, without) = calls
    assert with_sizes[21].data_ptr() == sizes.data_ptr()
    assert (without[21].numel(), without[21].dtype) == (0, torch.int32)
    monkeypatch.setattr(cuda, "_static_checked", {})
    wide = torch.zeros(4, 2, dtype=torch.int32)
    for bad in (sizes.long(), sizes[:3], wide[:, 0], wide):
        with pytest.raises(ValueError, match="buffer_sizes"):
            cuda.resolve_cuda(skip_io=True, buffer_sizes=bad, **_valid_kwargs())


def _residency_kwargs(R: int = 4, context: int = 200, flag_dtype: torch.dtype = torch.uint8):
    return dict(resident=torch.zeros(R, dtype=flag_dtype), req_to_token=torch.zeros(R, context, dtype=torch.int32),
                logical_to_device=torch.zeros(50, dtype=torch.int64))


@pytest.mark.parametrize("flag_dtype", [torch.uint8, torch.bool])
def test_residency_tables_reach_the_kernel_in_place(monkeypatch, flag_dtype):
    calls = _record_skip_io_launches(monkeypatch)
    tables = _residency_kwargs(flag_dtype=flag_dtype)
    tables["req_to_token"] = torch.zeros(4, 210, dtype=torch.int32)[:, :200]  # a strided view is fine
    cuda.resolve_cuda(skip_io=True, **_valid_kwargs(), **tables)
    (args,) = calls
    assert [a.data_ptr() for a in args[15:18]] == [tables[k].data_ptr() for k in
                                                  ("resident", "req_to_token", "logical_to_device")]
    assert args[16].stride() == (210, 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("resident"), "together"),
        (lambda t: t.pop("logical_to_device"), "together"),
        (lambda t: t.update(resident=t["resident"].int()), "resident"),
        (lambda t: t.update(resident=t["resident"][:3]), "resident"),
        (lambda t: t.update(resident=torch.zeros(8, dtype=torch.uint8)[::2]), "resident"),
        (lambda t: t.update(req_to_token=t["req_to_token"].long()), "req_to_token"),
        (lambda t: t.update(req_to_token=t["req_to_token"][:3]), "req_to_token"),
        (lambda t: t.update(req_to_token=t["req_to_token"].t()), "req_to_token"),
        (lambda t: t.update(logical_to_device=t["logical_to_device"].int()), "logical_to_device"),
        (lambda t: t.update(logical_to_device=t["logical_to_device"].view(5, 10)), "logical_to_device"),
        (lambda t: t.update(logical_to_device=torch.zeros(0, dtype=torch.int64)), "logical_to_device"),
    ],
)
def test_resolve_cuda_rejects_bad_residency_tables(change, message, monkeypatch):
    monkeypatch.setattr(jit, "resolve_module", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no build")))
    monkeypatch.setattr(cuda, "_static_checked", {})
    tables = _residency_kwargs()
    change(tables)
    with pytest.raises(ValueError, match=message):
        cuda.resolve_cuda(skip_io=True, **_valid_kwargs(), **tables)


def test_int_num_real_reqs_goes_through_the_workspace_scalar(monkeypatch):
    calls = _record_skip_io_launches(monkeypatch)
    monkeypatch.setattr(cuda, "_static_checked", {})
    kw = _valid_kwargs()
    seen = []
    for n in (2, 1):  # the second call reuses the bound layer: the scalar is rewritten, not rebound
        kw["num_real_reqs"] = n
        cuda.resolve_cuda(skip_io=True, **kw)
        seen.append(int(calls[-1][10]))
    assert calls[0][10].data_ptr() == kw["workspace"].resolve_num_real.data_ptr()
    assert seen == [2, 1]


def test_empty_batch_launches_nothing(monkeypatch):
    monkeypatch.setattr(jit, "resolve_module", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no launch")))
    kw = _valid_kwargs(n=0)
    cuda.resolve_cuda(skip_io=True, **kw)


# ---- dispatch ----


H200 = dispatch.Platform("cuda", capability=(9, 0))


def test_dispatch_rules():
    cpu = dispatch.Platform("cpu")
    assert dispatch.choose_resolver("reference", cpu) == "reference"
    assert dispatch.choose_resolver("auto", cpu) == "reference"
    with pytest.raises(HiSparsePluginError, match="resolver=cuda"):
        dispatch.choose_resolver("cuda", cpu)
    with pytest.raises(ValueError):
        dispatch.choose_resolver("fast", cpu)
    assert dispatch.choose_resolver("auto", H200) == "cuda"
    assert dispatch.choose_resolver("cuda", H200) == "cuda"
    assert dispatch.choose_resolver("reference", H200) == "reference"


@pytest.mark.parametrize(
    "platform, seen",
    [
        (dispatch.Platform("cuda", rocm=True), "a ROCm GPU"),
        (dispatch.Platform("cuda", capability=(8, 0)), "compute capability 8.0"),
        (dispatch.Platform("cuda", capability=(10, 0)), "compute capability 10.0"),
        (dispatch.Platform("xpu"), "a xpu device"),
    ],
)
def test_auto_refuses_a_gpu_the_kernel_does_not_run_on(platform, seen):
    """No silent fallback: ``auto`` on such a GPU is refused in one line naming the key and the
    allowed value; an explicit ``reference`` is accepted."""
    with pytest.raises(HiSparsePluginError) as info:
        dispatch.choose_resolver("auto", platform)
    message = str(info.value)
    assert message.startswith("--hisparse-config resolver=auto: ") and seen in message
    assert "resolver=reference" in message and "\n" not in message
    assert dispatch.choose_resolver("reference", platform) == "reference"


def test_a_bound_reuse_resolver_hands_its_tables_to_the_kernel(monkeypatch):
    """replacement "reuse" with the kernel: the layer's history rows and the 54 cell levels reach
    the launcher right after the residency tables (the kernel's order), checked once at bind; bad
    tables are refused naming the tensor; without them the launcher gets empty tensors (LRU). Each
    policy has its own kernel module."""
    policies: list = []
    calls = _record_skip_io_launches(monkeypatch, policies)
    kw = _valid_kwargs()
    kw["num_real_reqs"] = torch.tensor([3], dtype=torch.int32)
    B = kw["device_buffer_size"]
    history = torch.zeros(kw["lru"].shape[0], B, dtype=torch.int16)
    levels = torch.arange(54, dtype=torch.uint8)
    batch = ("top_k_positions", "seq_lens", "req_pool_indices", "out")
    fixed = {k: v for k, v in kw.items() if k not in batch + ("workspace", "block_size")}
    top_k = kw["top_k_positions"].shape[1]
    resolve = cuda.bind_resolve_cuda(workspace=kw["workspace"], block_size=kw.get("block_size"), skip_io=True,
                                     top_k=top_k, slot_history=history, reuse_levels=levels, **fixed)
    resolve(*(kw[k] for k in batch))
    lru_only = cuda.bind_resolve_cuda(workspace=kw["workspace"], block_size=kw.get("block_size"), skip_io=True,
                                      top_k=top_k, **fixed)
    lru_only(*(kw[k] for k in batch))
    (args,), (lru_args,) = calls[:1], calls[1:]
    at = 3 + 6 + 2 + 4 + 3  # top_k, seq_lens, rpi; tables; out, num_real; plan, counters; residency
    assert args[at] is history and args[at + 1] is levels
    assert lru_args[at].numel() == 0 and lru_args[at + 1].numel() == 0
    assert policies == [True, False]
    for bad, message in ((dict(reuse_levels=levels.to(torch.int32)), "reuse_levels must be uint8"),
                         (dict(reuse_levels=torch.full((54,), 64, dtype=torch.uint8)), "< 64"),
                         (dict(slot_history=history[:, :-1]), "slot_history"),
                         (dict(slot_history=None), "passed together")):
        with pytest.raises(ValueError, match=message):
            cuda.bind_resolve_cuda(workspace=kw["workspace"], skip_io=True, top_k=top_k,
                                   **{**dict(slot_history=history, reuse_levels=levels), **bad}, **fixed)


def test_the_platform_is_read_from_the_device():
    assert dispatch.platform_of("cpu") == dispatch.Platform("cpu")
    if torch.cuda.is_available():
        assert dispatch.platform_of("cuda:0").capability == torch.cuda.get_device_capability(0)


def test_resolve_layer_reference_path_matches_reference(pool, bufs):
    spec = CaseSpec(item_bytes=1152, B=32, top_k=16, num_reqs=3, num_real=3, max_reqs=4, seed=3, short_frac=0.0)
    case = make_case(spec, pool, *bufs, CPU)
    kw = case.kernel_kwargs()
    kw["num_real_reqs"] = 3
    dispatch.resolve_layer("reference", workspace=None, block_size=960, **kw)
    resolve_batched(**case.ref_kwargs())
    assert not differences(case)
    with pytest.raises(ValueError, match="workspace"):
        dispatch.resolve_layer("cuda", **kw)


# ---- JIT wiring ----


def test_kernel_source_ships_with_the_package():
    from sglang_hisparse.kernels import source_dir

    assert jit.kernel_source() == source_dir() / "resolve.cuh"
    text = jit.kernel_source().read_text()
    for _, fn in jit.resolve_wrappers(1152, 4096, 2048) + jit.replay_wrappers(656):
        assert fn.split("<")[0].split("::")[1] in text


def test_module_names_carry_every_template_parameter():
    wrappers = dict(jit.resolve_wrappers(656, 2048, 512))
    assert set(wrappers) == {"bind", "bind_skip_io", "launch", "launch_skip_io", "resolve_prepare"}
    assert wrappers["launch"] == "hisparse::resolve_launch<656, 2048, 512, false, false>"
    assert wrappers["bind_skip_io"] == "hisparse::resolve_bind<656, 2048, 512, true, false>"
    assert wrappers["resolve_prepare"] == "hisparse::resolve_prepare<656, 2048, 512, false>"
    assert jit.resolve_module_name(656, 2048, 512) == "hisparse_resolve_656_2048_512"
    reuse = dict(jit.resolve_wrappers(656, 2048, 512, reuse=True))  # the policy's own module
    assert reuse["bind"] == "hisparse::resolve_bind<656, 2048, 512, false, true>"
    assert reuse["resolve_prepare"] == "hisparse::resolve_prepare<656, 2048, 512, true>"
    assert jit.resolve_module_name(656, 2048, 512, reuse=True) == "hisparse_resolve_reuse_656_2048_512"
    assert dict(jit.replay_wrappers(1152))["replay"] == "hisparse::replay<1152>"


def _cuda_runtime_for_linking() -> bool:
    """Make the toolkit's libcudart linkable (``LIBRARY_PATH``) and loaded (by soname) when
    tvm-ffi's ``-L$CUDA_HOME/lib64`` does not hold it (this machine's toolkit keeps it in
    ``lib``). Returns whether a runtime library was found."""
    for lib in sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so")):
        os.environ["LIBRARY_PATH"] = os.path.dirname(lib) + os.pathsep + os.environ.get("LIBRARY_PATH", "")
        ctypes.CDLL(os.path.realpath(lib), mode=ctypes.RTLD_GLOBAL)
        return True
    return False


HOPPER_BUILDS = {"plain": (656, 128, 64), "spill": (656, 8192, 3 * 2048)}


@pytest.fixture(scope="module")
def hopper_modules(tmp_path_factory):
    """The sm_90a resolve modules built by SGLang's loader with no GPU, both at once (each build is
    one nvcc process): ``plain`` (656-byte rows, B=128, top_k=64) and ``spill``, a spilling
    planner (B=8192 with a 3-row verify union of 2048). Their entry points' checks run before any
    CUDA call, so they can be exercised here."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from sglang.kernels.jit.utils import override_jit_cuda_arch

    saved = {k: os.environ.get(k) for k in ("TVM_FFI_CACHE_DIR", "TVM_FFI_CUDA_ARCH_LIST", "LIBRARY_PATH")}
    os.environ["TVM_FFI_CACHE_DIR"] = str(tmp_path_factory.mktemp("jit"))
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = "9.0a"
    _cuda_runtime_for_linking()
    jit.resolve_module.cache_clear()
    try:
        with override_jit_cuda_arch(9, 0), ThreadPoolExecutor(max_workers=2) as pool:
            futures = {name: pool.submit(jit.resolve_module, *args) for name, args in HOPPER_BUILDS.items()}
            yield {name: f.result() for name, f in futures.items()}
    except RuntimeError as e:
        if "cannot find -lcudart" in str(e):
            pytest.skip("no CUDA runtime library to link against on this machine")
        raise
    finally:
        jit.resolve_module.cache_clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def hopper_module(hopper_modules):
    return hopper_modules["plain"]


@pytest.fixture(scope="module")
def hopper_spill_module(hopper_modules):
    return hopper_modules["spill"]


@pytest.mark.slow
def test_jit_build_for_hopper_exports_checked_entry_points(hopper_module):
    """The module exports only the split form (bind + launch) and prepare; bind's C++ checks
    raise before any CUDA call (the batch's checks at launch: the next test)."""
    module = hopper_module
    assert not hasattr(module, "resolve") and not hasattr(module, "resolve_skip_io")
    params = torch.zeros(cuda.BOUND_BYTES, dtype=torch.uint8)
    with pytest.raises(Exception, match="block size"):
        module.bind_skip_io(params, *([torch.zeros(1)] * 22), 48, -1, 0)
    tables = [torch.zeros(4, 129, dtype=torch.int32), torch.zeros(4, 128, dtype=torch.int32),
              torch.zeros(4, 128, dtype=torch.int16), torch.zeros(4, 300, dtype=torch.int64)]
    rest = [torch.zeros(1)] * 7  # host_kv .. counters: checked after the residency tables
    bad_flags = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(Exception, match="resident"):
        module.bind(params, *tables, *rest, bad_flags, torch.zeros(4, 300, dtype=torch.int32),
                    torch.zeros(9, dtype=torch.int64), torch.zeros(0, dtype=torch.int16),
                    torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.int16),
                    torch.zeros(0, dtype=torch.int32), *([torch.zeros(1)] * 4),
                    64, -1, 0)
    assert not params.any(), "a refused bind wrote its parameters"


@pytest.mark.slow
def test_a_bound_layer_through_the_real_module_checks_each_batch(hopper_module, monkeypatch):
    """bind_resolve_cuda with the compiled module (CPU tensors: every check precedes the first
    CUDA call): binding writes the parameter tensor; each call's bad batch tensor is refused with
    ValueError naming it, a batch beyond the workspace is refused, a batch that passes every
    check is stopped only by the device (CPU here), and a parameter tensor bound by the skip-IO
    entry point is refused by the copying one."""
    monkeypatch.setattr(jit, "resolve_module", lambda *a, **k: hopper_module)
    kw = _valid_kwargs(B=128, K=64, n=2, R=4)
    kw["host_kv"] = kw["device_kv"] = torch.zeros(10, 1, 328, dtype=torch.bfloat16)  # 656-byte rows
    batch = ("top_k_positions", "seq_lens", "req_pool_indices", "out")
    fixed = {k: v for k, v in kw.items() if k not in batch + ("workspace", "block_size")}
    resolve = cuda.bind_resolve_cuda(workspace=kw["workspace"], block_size=64, skip_io=True, top_k=64, **fixed)
    params = resolve.launch_params
    assert params.dtype == torch.uint8 and bool(params.any()), "bind wrote nothing"
    good = [kw[k] for k in batch]
    for at, bad, message in ((0, good[0].long(), "top_k_positions"), (1, good[1].float(), "seq_lens"),
                             (2, good[2][:1], "req_pool_indices"), (3, good[3][:, :32], "out")):
        args = list(good)
        args[at] = bad
        with pytest.raises(ValueError, match=message):
            resolve(*args)
    too_many = torch.zeros(kw["workspace"].max_reqs + 1, 64, dtype=torch.int32)
    rows = torch.zeros(too_many.shape[0], dtype=torch.int64)
    with pytest.raises(ValueError, match="exceeds the workspace"):
        resolve(too_many, rows, rows, torch.zeros_like(too_many))
    with pytest.raises(ValueError, match="CUDA device"):
        resolve(*good)
    with pytest.raises(Exception, match="another entry point"):
        hopper_module.launch(params, *good)
    with pytest.raises(Exception, match="bound parameters must be"):
        hopper_module.launch(params[:100], *good)


@pytest.mark.slow
def test_a_spilling_module_checks_its_spill_buffer(hopper_spill_module, monkeypatch):
    """The compiled spilling planner (CPU tensors: every check precedes the first CUDA call):
    its bind refuses a workspace without the spill buffer (the C++ check, reached past Python's),
    and its launch refuses a batch of more requests than the buffer has slices; a batch that
    fits is stopped only by the device."""
    monkeypatch.setattr(jit, "resolve_module", lambda *a, **k: hopper_spill_module)
    B, K = 8192, 3 * 2048
    kw = _valid_kwargs(B=B, K=K, n=2, R=4)
    kw["host_kv"] = kw["device_kv"] = torch.zeros(10, 1, 328, dtype=torch.bfloat16)  # 656-byte rows
    batch = ("top_k_positions", "seq_lens", "req_pool_indices", "out")
    fixed = {k: v for k, v in kw.items() if k not in batch + ("workspace", "block_size")}
    bare = kw["workspace"]
    monkeypatch.setattr(cuda, "planner_spill_bytes", lambda *a: 0)  # the Python check lets it through
    with pytest.raises(ValueError, match=r"B=8192, top_k=6144 keeps the planner's top-k-sized arrays in global "
                                         r"memory: the workspace needs a spill buffer of 283392 B per request, has 0 B"):
        cuda.bind_resolve_cuda(workspace=bare, block_size=64, skip_io=True, top_k=K, **fixed)
    monkeypatch.undo()
    monkeypatch.setattr(jit, "resolve_module", lambda *a, **k: hopper_spill_module)
    one_slice = cuda.make_workspace(4, "cpu", top_k=K, spill=True)
    one_slice = dataclasses.replace(one_slice, planner_spill=one_slice.planner_spill[: cuda.planner_spill_bytes(K)],
                                    max_reqs=1)
    resolve = cuda.bind_resolve_cuda(workspace=one_slice, block_size=64, skip_io=True, top_k=K, **fixed)
    good = [kw[k] for k in batch]
    with pytest.raises(ValueError, match=r"a batch of 2 rows exceeds the workspace \(spill buffer of 1 requests\)"):
        resolve(*good)
    with pytest.raises(ValueError, match="CUDA device"):
        resolve(*(t[:1] for t in good))


def test_a_bound_layer_resolver_launches_exactly_what_resolve_cuda_launches(monkeypatch):
    """bind_resolve_cuda checks the unchanging arguments once and, per call, only the batch: the
    kernel receives the same arguments (same tensors, same order) as from resolve_cuda; bad batch
    tensors are still refused, and an int num_real_reqs (baked into a graph) is refused at bind."""
    calls = _record_skip_io_launches(monkeypatch)
    kw = _valid_kwargs()
    kw["num_real_reqs"] = torch.tensor([3], dtype=torch.int32)
    tables = _residency_kwargs()
    cuda.resolve_cuda(skip_io=True, **kw, **tables)
    batch = ("top_k_positions", "seq_lens", "req_pool_indices", "out")
    fixed = {k: v for k, v in kw.items() if k not in batch + ("workspace", "block_size")}
    resolve = cuda.bind_resolve_cuda(workspace=kw["workspace"], block_size=kw.get("block_size"), skip_io=True,
                                     top_k=kw["top_k_positions"].shape[1], **fixed, **tables)
    resolve(*(kw[k] for k in batch))
    unbound, bound = calls
    assert len(bound) == len(unbound)
    assert all(a is b or a == b for a, b in zip(unbound, bound))
    with pytest.raises(ValueError, match="device tensor"):
        cuda.bind_resolve_cuda(workspace=kw["workspace"], top_k=16, **{**fixed, "num_real_reqs": 3})
    assert len(calls) == 2


def test_a_bound_resolvers_kernel_check_becomes_a_value_error(monkeypatch):
    """A failed check of the kernel's launch (a message starting "hisparse: ") reaches the caller
    as ValueError with that message; any other error (a CUDA failure) propagates unchanged."""
    raised: list = []

    class FakeModule:
        def bind_skip_io(self, params, *args):
            pass

        def launch_skip_io(self, *args):
            raise raised[-1]

    monkeypatch.setattr(jit, "resolve_module", lambda *a, **k: FakeModule())
    kw = _valid_kwargs()
    kw["num_real_reqs"] = torch.tensor([3], dtype=torch.int32)
    batch = ("top_k_positions", "seq_lens", "req_pool_indices", "out")
    fixed = {k: v for k, v in kw.items() if k not in batch + ("workspace", "block_size")}
    resolve = cuda.bind_resolve_cuda(workspace=kw["workspace"], skip_io=True, top_k=kw["top_k_positions"].shape[1],
                                     **fixed)
    raised.append(RuntimeError("PanicError: hisparse: seq_lens must be a contiguous int32/int64 tensor\nStack trace"))
    with pytest.raises(ValueError, match="^seq_lens must be a contiguous int32/int64 tensor$"):
        resolve(*(kw[k] for k in batch))
    raised.append(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        resolve(*(kw[k] for k in batch))


@pytest.mark.parametrize("query_rows, B, spills", [(1, 4096, False), (2, 6144, False), (4, 10240, True)])
def test_a_servers_resolver_allocates_the_spill_buffer_its_verify_width_needs(monkeypatch, caplog, query_rows, B,
                                                                              spills):
    """make_resolver sizes the workspace for the verify union's width and adds (and logs) the
    spill buffer exactly when that width's planner spills: 4 rows of 2048 at B = 10240 do."""
    from sglang_hisparse.config import HiSparseConfig

    monkeypatch.setattr(dispatch, "platform_of", lambda device: H200)
    config = HiSparseConfig(top_k=2048, device_buffer_size=B, query_rows=query_rows, resolver="cuda")
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        resolver = dispatch.make_resolver(config, "cpu", max_reqs=3, top_k=2048)
    workspace = resolver._replay.keywords["workspace"]
    assert workspace.top_k == query_rows * 2048
    assert workspace.planner_spill.numel() == (3 * cuda.planner_spill_bytes(query_rows * 2048) if spills else 0)
    assert ("keeps the resolve planner's top-k-sized arrays in global memory" in caplog.text) == spills
