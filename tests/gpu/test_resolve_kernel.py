"""The fused RESOLVE kernel against the batched oracle (itself checked against the loop
reference in tests/test_resolver_cuda_python.py), on fresh random cases. Skips without CUDA.

Coverage: top_k in {64, 512, 2048} x B in {k, 2k, 4k} x item sizes {1152, 656} x every block size
32..1024 step 32 (the full cross product is visited every 576 cases), batch 1..128, seq_len below
and above B, hit rates 0..100%, padded rows, -1 padding, newest included or not, int32/int64
seq_lens and req_pool_indices, plan recording + copy-only replay, skip-IO, copier CTAs automatic /
none (planners copy) / few, mixed batches of resident and hot-buffer requests (residency tables
passed in about a third of the random cases, uint8 or bool flags, strided req_to_token),
CUDA-graph capture and replay (with residency flags flipped between replays), per-request buffer
sizes (``buffer_sizes`` in about a third of the random cases: most requests below B, the slots
beyond each size holding stale positions the kernel must ignore).

Every case poisons all outputs, runs kernel and oracle on identical copies, and compares out,
slot tokens (both layers), LRU (both layers), device KV bytes, plan and counters; the workspace
must report no errors and hold zero counters after every launch.

DeepSeek-V4's C4 rows (584 B in 37440-byte FlashMLA pages, positions that are entries of 4
tokens) have their own random test over V4's top_k (index_topk 512 and 1024) and B up to 4k.

Env: HISPARSE_TEST_CASES (default 10000), HISPARSE_TEST_SECONDS (time cap, default 420; hitting
it fails the test), HISPARSE_RESULTS_DIR (write kernel_tests.json there), HISPARSE_TEST_COMMAND;
HISPARSE_C4_TEST_CASES / HISPARSE_C4_TEST_SECONDS (defaults 10000 / 300; kernel_tests_c4.json).
"""

from __future__ import annotations

import os
import random
import time
import traceback

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang_hisparse.resolver import cuda as rcuda  # noqa: E402
from sglang_hisparse.resolver import jit  # noqa: E402
from sglang_hisparse.resolver.batched import replay_plan_batched, resolve_batched  # noqa: E402
from sglang_hisparse_testkit.resolver_cases import (  # noqa: E402
    CaseSpec,
    HostPool,
    describe_difference,
    differences,
    kv_bytes,
    make_case,
    random_spec,
)
from sglang_hisparse.resolver.report import machine_description, results_dir, write_json  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOP_KS = (64, 512, 2048)
CONFIGS = [(k, k * m) for k in TOP_KS for m in (1, 2, 4)]
ITEMS = (1152, 656)
BLOCKS = tuple(range(32, 1025, 32))
MAX_BATCH = 128
MAX_REQS = MAX_BATCH + 8
POOL_BYTES = 1200 << 20
C4_ITEM = 584  # DeepSeek-V4's C4 rows (RowLayout<584>)
C4_CONFIGS = [(512, 512), (512, 1024), (512, 2048), (1024, 1024), (1024, 2048), (1024, 4096)]  # (top_k, B)


def _combo(c: int) -> tuple[int, int, int, int]:
    """(item_bytes, top_k, B, block) of case c: the full cross product every 576 cases."""
    block = BLOCKS[c % len(BLOCKS)]
    item, (k, b) = [(i, cfg) for i in ITEMS for cfg in CONFIGS][(c // len(BLOCKS)) % (len(ITEMS) * len(CONFIGS))]
    return item, k, b, block


@pytest.fixture(scope="module")
def built() -> float:
    """Build every module the cases use (concurrently; cached on disk by the JIT)."""
    start = time.time()
    jobs = [lambda i=i, k=k, b=b, r=r: jit.resolve_module(i, b, k, reuse=r)
            for i in ITEMS for k, b in CONFIGS for r in (False, True)]
    jobs += [lambda k=k, b=b, r=r: jit.resolve_module(C4_ITEM, b, k, reuse=r) for k, b in C4_CONFIGS
             for r in (False, True)]
    jobs += [lambda i=i: jit.replay_module(i) for i in ITEMS + (C4_ITEM,)]
    jit.build_all(jobs)
    return time.time() - start


@pytest.fixture(scope="module")
def env():
    pool = HostPool(POOL_BYTES, DEVICE, pin=True, seed=20261130)
    need = max([kv_bytes(MAX_REQS * (b + 1), item) for item in ITEMS for _, b in CONFIGS]
               + [kv_bytes(MAX_REQS * (b + 1), C4_ITEM) for _, b in C4_CONFIGS])
    kernel_buf = torch.empty(need, dtype=torch.uint8, device=DEVICE)
    ref_buf = torch.empty(need, dtype=torch.uint8, device=DEVICE)
    ws = rcuda.make_workspace(MAX_REQS, DEVICE, top_k=max(TOP_KS))
    return pool, kernel_buf, ref_buf, ws


def _state_ok(ws) -> tuple[bool, list[int]]:
    words = ws.state[[0, 32, 64, 96]].tolist()
    return words == [0, 0, 0, 0], words


def _run_case(case, ws, rng: random.Random) -> list[str]:
    spec = case.spec
    rcuda.resolve_cuda(**case.kernel_kwargs(), workspace=ws, block_size=spec.block_size,
                       num_copiers=spec.num_copiers)
    resolve_batched(**case.ref_kwargs())
    bad = differences(case)
    ok, words = _state_ok(ws)
    if not ok:
        bad.append(f"workspace state {words} (planned, total_rows, exited, errors) after resolve")
    if spec.plan:  # copy-only replay of the recorded plan onto freshly poisoned buffers
        byte = rng.randrange(256)
        case.kernel_kv.view(torch.uint8).fill_(byte)
        case.ref_kv.view(torch.uint8).fill_(byte)
        kw, rkw = case.kernel_kwargs(), case.ref_kwargs()  # the buffers as row views where paged
        ratio = {k: v for k, v in kw.items() if k == "compress_ratio"}
        rcuda.replay_plan_cuda(plan=case.kernel["plan"], num_real_reqs=case.kernel["num_real_reqs"],
                               host_kv=kw["host_kv"], device_kv=kw["device_kv"], workspace=ws,
                               block_size=rng.choice(BLOCKS), num_ctas=rng.choice([1, 3, 8, 64]), **ratio)
        replay_plan_batched(plan=case.ref["plan"], num_real_reqs=spec.num_real, host_kv=rkw["host_kv"],
                            device_kv=rkw["device_kv"])
        if not torch.equal(case.kernel_kv.reshape(-1).view(torch.uint8), case.ref_kv.reshape(-1).view(torch.uint8)):
            bad.append("replay device_kv")
        ok, words = _state_ok(ws)
        if not ok:
            bad.append(f"workspace state {words} after replay")
    return bad


def _write_results(cases: int, failures: int, extra: dict, name: str = "kernel_tests.json") -> None:
    out = results_dir()
    if out is None:
        return
    path = out / name
    sanitizer = {"memcheck_errors": -1, "racecheck_hazards": -1}  # filled by scripts/gpu/sanitize_resolve.py
    if path.exists():
        import json

        try:
            sanitizer = json.loads(path.read_text()).get("sanitizer", sanitizer)
        except ValueError:
            pass
    write_json(path, {
        "machine": machine_description(),
        "command": os.environ.get("HISPARSE_TEST_COMMAND", "pytest tests/gpu/test_resolve_kernel.py"),
        "cases": cases,
        "failures": failures,
        "block_sizes": list(BLOCKS),
        "sanitizer": sanitizer,
        "details": extra,
    })


def _random_cases(env, built: float, combo, n_cases: int, budget: float, seed: int, configs: list,
                  results_name: str, max_batch: int = MAX_BATCH) -> None:
    """Run ``n_cases`` random cases (``combo(c)`` -> item_bytes, top_k, B, block) within ``budget``
    seconds against the oracle, write ``results_name`` and fail on any difference or a short run."""
    pool, kernel_buf, ref_buf, ws = env
    rng = random.Random(seed)
    start = time.time()
    done = failures = requests = 0
    reports: list[str] = []
    stats = {"skip_io": 0, "plan": 0, "padded": 0, "self_copy": 0, "copiers": 0, "residency": 0, "reuse": 0,
             "slot_map": 0, "buffer_sizes": 0}
    error = None
    try:
        for c in range(n_cases):
            if time.time() - start > budget:
                break
            item, k, b, block = combo(c)
            spec = random_spec(rng, item_bytes=item, B=b, top_k=k, block_size=block, max_batch=max_batch,
                               seed=rng.randrange(1 << 62))
            case = make_case(spec, pool, kernel_buf, ref_buf, DEVICE)
            bad = _run_case(case, ws, rng)
            done += 1
            requests += spec.num_reqs
            for key, on in (("skip_io", spec.skip_io), ("plan", spec.plan), ("padded", spec.num_real < spec.num_reqs),
                            ("self_copy", spec.num_copiers == 0),
                            ("copiers", spec.num_copiers is None or spec.num_copiers > 0),
                            ("residency", spec.residency), ("reuse", spec.reuse), ("slot_map", spec.slot_map),
                            ("buffer_sizes", spec.buffer_sizes)):
                stats[key] += bool(on)
            if bad:
                failures += 1
                if len(reports) < 5:
                    detail = [describe_difference(case, x) for x in bad if " " not in x]
                    reports.append(f"case {c}: {bad}\n  {spec.describe()}\n" + "\n".join(detail))
                    ws.state.zero_()  # keep going on a clean workspace
                if failures >= 50:
                    break
    except Exception:
        error = traceback.format_exc()
        failures += 1
        raise
    finally:
        elapsed = time.time() - start
        _write_results(done, failures, {
            "launches": done, "requests": requests, "configs": configs,
            "seconds": round(elapsed, 1), "jit_seconds": round(built, 1), "mode_counts": stats,
            "first_failures": reports, "error": error,
        }, results_name)
        print(f"\n[kernel tests {results_name}] {done} cases ({requests} requests) in {elapsed:.0f}s, {failures} "
              f"failures; JIT {built:.0f}s; {stats}")
    assert not reports, "\n\n".join(reports)
    assert done >= n_cases, f"only {done} of {n_cases} cases ran in the {budget:.0f}s budget"


def test_kernel_matches_oracle_on_random_cases(built, env):
    _random_cases(env, built, _combo, int(os.environ.get("HISPARSE_TEST_CASES", "10000")),
                  float(os.environ.get("HISPARSE_TEST_SECONDS", "420")), int(os.environ.get("HISPARSE_TEST_SEED", "1130")),
                  [[i, k, b] for i in ITEMS for k, b in CONFIGS], "kernel_tests.json")


def _c4_combo(c: int) -> tuple[int, int, int, int]:
    """(584, top_k, B, block) of C4 case c: every block size with every C4 config."""
    k, b = C4_CONFIGS[(c // len(BLOCKS)) % len(C4_CONFIGS)]
    return C4_ITEM, k, b, BLOCKS[c % len(BLOCKS)]


def test_kernel_matches_oracle_on_c4_rows(built, env):
    """DeepSeek-V4's C4 layers: 584-byte rows in 37440-byte pages (a 16-byte value chunk path and
    the 8-byte scale chunk), positions that are entries of 4 tokens (residency looks each up at
    its last token), V4's top_k 512 / 1024; batches up to 64."""
    _random_cases(env, built, _c4_combo, int(os.environ.get("HISPARSE_C4_TEST_CASES", "10000")),
                  float(os.environ.get("HISPARSE_C4_TEST_SECONDS", "300")), 2026_12_05,
                  [[C4_ITEM, k, b] for k, b in C4_CONFIGS], "kernel_tests_c4.json", max_batch=64)


@pytest.mark.parametrize("resident_dtype", [torch.uint8, torch.bool])
@pytest.mark.parametrize("num_copiers", [None, 0])
def test_mixed_resident_batches(built, env, num_copiers, resident_dtype):
    """Batches mixing resident requests (short and long) with hot-buffer ones, every output
    poisoned first: resident rows read logical_to_device[req_to_token[r, q]] and leave their
    tables, plan rows and counters alone; the others resolve as without residency."""
    pool, kernel_buf, ref_buf, ws = env
    rng = random.Random(41)
    resident_rows = 0
    for seed in range(40):
        k, b = rng.choice(CONFIGS)
        n = rng.choice([1, 2, 5, 16, 64])
        n_real = n - rng.choice([0, 0, 1]) if n > 1 else n  # at times one padded CUDA-graph row
        spec = CaseSpec(item_bytes=rng.choice(ITEMS), B=b, top_k=k, num_reqs=n, num_real=n_real, max_reqs=n + 3,
                        seed=5000 + seed, short_frac=0.3, plan=rng.random() < 0.7,
                        skip_io=rng.random() < 0.2, counters=True, block_size=rng.choice(BLOCKS),
                        num_copiers=num_copiers, residency=True, resident_prob=rng.choice([0.3, 0.5, 1.0]),
                        resident_dtype=resident_dtype, rtt_row_pad=rng.choice([0, 5]))
        case = make_case(spec, pool, kernel_buf, ref_buf, DEVICE)
        r = case.inputs["req_pool_indices"][: spec.num_real].long()
        resident_rows += int((case.inputs["resident"][r] != 0).sum())
        bad = _run_case(case, ws, rng)
        assert not bad, f"seed {seed}: {bad}\n  {spec.describe()}\n" + "\n".join(
            describe_difference(case, x) for x in bad if " " not in x)
    assert resident_rows >= 100


def test_resident_precondition_violations_are_counted(built, env):
    """A resident request selecting a position >= seq_len, or one whose logical id is outside
    logical_to_device, gets -1 there and one error each; its other entries are still resolved."""
    pool, kernel_buf, ref_buf, ws = env
    spec = CaseSpec(item_bytes=656, B=128, top_k=64, num_reqs=2, num_real=2, max_reqs=3, seed=9, short_frac=0.0,
                    pad_prob=0.0, plan=True, counters=True, block_size=128, residency=True, resident_prob=1.0)
    case = make_case(spec, pool, kernel_buf, ref_buf, DEVICE)
    kw = case.kernel_kwargs()
    topk = kw["top_k_positions"].clone()
    L0 = int(kw["seq_lens"][0])
    topk[0, 0] = L0  # beyond seq_len
    j = int((topk[1] >= 0).nonzero()[0])
    r1 = int(kw["req_pool_indices"][1])
    rtt = kw["req_to_token"].clone()
    rtt[r1, int(topk[1, j])] = kw["logical_to_device"].numel()  # logical id out of range
    kw.update(top_k_positions=topk, req_to_token=rtt)
    rcuda.resolve_cuda(**kw, workspace=ws, block_size=128, num_copiers=0)
    out = kw["out"]
    errors = int(ws.errors.item())
    ws.state.zero_()
    assert errors == 2
    assert int(out[0, 0]) == -1 and int(out[1, j]) == -1
    ids = rtt[kw["req_pool_indices"][:2].long()].gather(1, topk[:2].long().clamp(0, rtt.shape[1] - 1)).long()
    ok = (topk[:2] >= 0) & (topk[:2] < kw["seq_lens"][:2, None]) & (ids < kw["logical_to_device"].numel())
    want = torch.where(ok, kw["logical_to_device"][ids.clamp(max=kw["logical_to_device"].numel() - 1)], -1)
    assert torch.equal(out[:2].long(), want)
    assert kw["plan"].counts[:2].tolist() == [0, 0]


@pytest.mark.parametrize("residency, reuse, slot_map", [(False, False, False), (True, False, False),
                                                       (False, True, False), (False, False, True)])
@pytest.mark.parametrize("num_copiers", [None, 0])
def test_cuda_graph_capture_and_replay(built, env, num_copiers, residency, reuse, slot_map):
    """Capture one launch per batch size, replay it with fresh states and varying num_real_reqs
    (back to back, no host sync between replays): every replay must match the oracle. With
    residency, the flags and tables are rewritten in place between replays (as a server flips a
    request to resident without recapturing); with the reuse policy, the history rows and levels
    too; with the position -> slot map, the map."""
    pool, kernel_buf, ref_buf, ws = env
    rng = random.Random(7 + (num_copiers or 0))
    base = dict(item_bytes=1152, B=4096, top_k=2048, num_reqs=16, num_real=16, max_reqs=20, hit_mode="fixed",
                hit_rate=0.87, plan=True, counters=True, block_size=960, num_copiers=num_copiers,
                hot_extra_cols=7, out_extra_rows=1, seq_dtype=torch.int64, rpi_dtype=torch.int32,
                residency=residency, resident_prob=0.4, rtt_row_pad=5, reuse=reuse, reuse_levels=54,
                slot_map=slot_map)
    first = make_case(CaseSpec(seed=1, **base), pool, kernel_buf, ref_buf, DEVICE)
    static = first.kernel_kwargs()
    kw = dict(static, workspace=ws, block_size=960, num_copiers=num_copiers)
    rcuda.resolve_cuda(**kw)  # warm-up outside capture (prepares the launch attributes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            rcuda.resolve_cuda(**kw)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    mutable = ("top_k_positions", "seq_lens", "req_pool_indices", "hot_locs", "host_locs", "out")
    mutable += ("resident", "req_to_token", "logical_to_device") if residency else ()
    mutable += ("slot_history", "reuse_levels") if reuse else ()
    mutable += ("slot_map",) if slot_map else ()
    for it in range(12):
        n_real = rng.choice([16, 16, 9, 1, 0])
        case = make_case(CaseSpec(seed=100 + it, **dict(base, num_real=n_real)), pool, kernel_buf, ref_buf, DEVICE)
        src = case.kernel_kwargs()
        for name in mutable:
            static[name].copy_(src[name])
        static["slot_tokens"].copy_(src["slot_tokens"])
        static["lru"].copy_(src["lru"])
        static["num_real_reqs"].copy_(src["num_real_reqs"])
        static["counters"].copy_(src["counters"])
        for a, b in ((static["plan"].host_rows, src["plan"].host_rows), (static["plan"].device_rows, src["plan"].device_rows),
                     (static["plan"].counts, src["plan"].counts)):
            a.copy_(b)
        # the device KV buffer is shared with the case (same region of kernel_buf)
        graph.replay()
        resolve_batched(**case.ref_kwargs())
        # compare the captured tensors against the oracle
        assert torch.equal(static["out"], case.ref["out"]), f"replay {it}: out"
        assert torch.equal(static["slot_tokens"], case.ref["slot_tokens"]), f"replay {it}: slot_tokens"
        assert torch.equal(static["lru"], case.ref["lru"]), f"replay {it}: lru"
        if reuse:
            assert torch.equal(static["slot_history"], case.ref["slot_history"]), f"replay {it}: slot_history"
        if slot_map:
            assert torch.equal(static["slot_map"], case.ref["slot_map"]), f"replay {it}: slot_map"
        assert torch.equal(static["counters"], case.ref["counters"]), f"replay {it}: counters"
        assert torch.equal(static["plan"].counts, case.ref["plan"].counts), f"replay {it}: plan.counts"
        assert torch.equal(static["plan"].host_rows, case.ref["plan"].host_rows), f"replay {it}: plan.host_rows"
        assert torch.equal(static["plan"].device_rows, case.ref["plan"].device_rows), f"replay {it}: plan.device_rows"
        assert torch.equal(case.kernel_kv.reshape(-1).view(torch.uint8), case.ref_kv.reshape(-1).view(torch.uint8)), \
            f"replay {it}: device_kv"
        ok, words = _state_ok(ws)
        assert ok, f"replay {it}: workspace state {words}"


@pytest.mark.parametrize("slot_map", [False, True])
def test_back_to_back_launches_reset_the_workspace(built, env, slot_map):
    """Many copier-mode launches queued without a host sync: each must start from zeroed counters.
    With the position -> slot map, the later launches find the earlier ones' misses through the
    map entries those launches wrote."""
    pool, kernel_buf, ref_buf, ws = env
    spec = CaseSpec(item_bytes=656, B=1024, top_k=512, num_reqs=8, num_real=8, max_reqs=8, seed=3,
                    hit_mode="fixed", hit_rate=0.5, plan=False, counters=True, block_size=256, slot_map=slot_map)
    case = make_case(spec, pool, kernel_buf, ref_buf, DEVICE)
    kw = dict(case.kernel_kwargs(), workspace=ws, block_size=256, num_copiers=None)
    rkw = case.ref_kwargs()
    for _ in range(20):  # the states evolve step to step exactly as the oracle's
        rcuda.resolve_cuda(**kw)
        resolve_batched(**rkw)
    assert not differences(case)
    ok, words = _state_ok(ws)
    assert ok, words
