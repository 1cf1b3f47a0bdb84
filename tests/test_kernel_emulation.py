"""The device code of kernels/resolve.cuh, run on CPU threads (tests/emulation), against the
batched oracle on random cases: checks the kernel's logic without a GPU. Slow (builds a torch
C++ extension, ~1 minute the first time, once per run: the ``emu`` fixture); skipped without a
C++ compiler. The full tier adds 400 more random cases."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "emulation"))


@pytest.fixture(scope="module")
def emu():
    """The emulator extension, built (or loaded from its build directory) once for the module."""
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("needs c++ and ninja")
    import run_emulation

    return run_emulation.build()


@pytest.mark.slow
def test_emulated_kernel_matches_oracle(emu):
    import run_emulation

    cases = int(os.environ.get("HISPARSE_EMU_CASES", "40"))
    failures, reports = run_emulation.run_cases(emu, cases, seed=int(os.environ.get("HISPARSE_EMU_SEED", "11")))
    assert failures == 0, "\n\n".join(reports)
    # the Python mirrors of the planner's layouts (used by check_supported, the launch checks and
    # make_workspace) are the kernel's, spilled ones included
    from sglang_hisparse.resolver.cuda import planner_smem_bytes, planner_spill_bytes, planner_spills

    for B, K in ((256, 64), (64, 32), (13, 5), (4096, 2048), (8192, 2048), (17000, 2048), (9108, 4096),
                 (12000, 4096), (8192, 6144), (10240, 8192)):
        for reuse in (False, True):
            assert emu.planner_layout(B, K, reuse) == (planner_smem_bytes(B, K, reuse), planner_spills(B, K, reuse)), \
                (B, K, reuse)
    spills = [emu.planner_layout(B, K)[1] for B, K in ((8192, 2048), (17000, 2048), (9108, 4096), (12000, 4096),
                                                         (8192, 6144), (10240, 8192))]
    assert spills == [False, True, False, True, True, True]
    for K in (16, 2048, 6144, 8192):
        assert emu.planner_spill_bytes(K) == planner_spill_bytes(K), K


@pytest.mark.slow
def test_emulated_kernel_on_deepseek_v4_c4_rows(emu):
    """DeepSeek-V4's C4 layers: 584-byte rows in 37440-byte FlashMLA pages (the 8-byte scale chunk
    apart from the value), positions that are entries of 4 tokens (the resident path reads
    req_to_token at each entry's last token). Kernel and oracle agree on every output, the device
    pages byte for byte (padding included: both start from the same poison)."""
    import run_emulation

    failures, reports = run_emulation.run_cases(emu, 30, seed=42, item_bytes=584)
    assert failures == 0, "\n\n".join(reports)


@pytest.mark.slow
@pytest.mark.full
def test_emulated_kernel_matches_oracle_on_many_cases(emu):
    """The exhaustive run: 400 more random cases (another seed)."""
    import run_emulation

    failures, reports = run_emulation.run_cases(emu, 400, seed=12)
    assert failures == 0, "\n\n".join(reports)


def small_cases_bench(seed: int):
    """(device, host pool, kernel and oracle device buffers, workspace) for hand-built CPU cases of
    up to 10 requests at B <= 256, top_k <= 64."""
    import torch
    from sglang_hisparse.resolver import cuda as rcuda
    from sglang_hisparse_testkit.resolver_cases import HostPool

    dev = torch.device("cpu")
    bufs = (torch.empty(4 << 20, dtype=torch.uint8), torch.empty(4 << 20, dtype=torch.uint8))
    return dev, HostPool(8 << 20, dev, pin=False, seed=seed), *bufs, rcuda.make_workspace(24, dev, top_k=64, spill=True)


@pytest.mark.slow
def test_emulated_kernel_keeps_the_slot_map_across_steps(emu):
    """With the position -> slot map, the kernel writes each miss's entry, so a second and third
    launch with the same selections find every position through the map (no misses), exactly as
    the oracle (which looks positions up in the slot table) does. Three planner layouts: slot
    tokens staged in the hash region, read in global memory (hash region < B), spilled."""
    import run_emulation
    from sglang_hisparse.resolver.batched import resolve_batched
    from sglang_hisparse_testkit.resolver_cases import CaseSpec, differences, make_case

    dev, pool, kbuf, rbuf, ws = small_cases_bench(seed=1)
    for B, K in ((256, 64), (64, 8), (96, 48)):
        spec = CaseSpec(item_bytes=656, B=B, top_k=K, num_reqs=6, num_real=6, max_reqs=8, seed=B, hit_mode="fixed",
                        hit_rate=0.5, short_frac=0.0, pad_prob=0.0, plan=True, counters=True, block_size=64,
                        slot_map=True)
        case = make_case(spec, pool, kbuf, rbuf, dev)
        for step in range(3):
            before = int(case.ref["counters"][1])
            run_emulation.emulate(emu, case, ws, 64, concurrent=step == 1)
            resolve_batched(**case.ref_kwargs())
            assert differences(case) == [], (B, K, step)
            misses = int(case.ref["counters"][1]) - before
            assert (misses > 0) if step == 0 else (misses == 0), (B, K, step, misses)


@pytest.mark.slow
def test_emulated_kernel_honours_per_request_buffer_sizes(emu):
    """With ``buffer_sizes`` (each request's slots in use, here most below B): the kernel agrees
    with the oracle on every output, with the hash table and with the position -> slot map, over
    three planner layouts; and the same launch without the sizes differs from the oracle with them
    (the sizes decide the outcome of these cases, so the comparison can fail)."""
    import run_emulation
    from sglang_hisparse.resolver.batched import resolve_batched
    from sglang_hisparse_testkit.resolver_cases import CaseSpec, differences, make_case

    dev, pool, kbuf, rbuf, ws = small_cases_bench(seed=2)
    for B, K in ((256, 64), (64, 8), (96, 48)):
        for slot_map in (False, True):
            spec = CaseSpec(item_bytes=656, B=B, top_k=K, num_reqs=8, num_real=8, max_reqs=10, seed=B + slot_map,
                            hit_mode="uniform", short_frac=0.5, pad_prob=0.0, plan=True, counters=True,
                            block_size=64, slot_map=slot_map, buffer_sizes=True)
            case = make_case(spec, pool, kbuf, rbuf, dev)
            sizes = case.inputs["buffer_sizes"]
            assert bool((sizes < B).any()), "the case has no request smaller than B"
            run_emulation.emulate(emu, case, ws, 64, concurrent=slot_map)
            resolve_batched(**case.ref_kwargs())
            assert differences(case) == [], (B, K, slot_map)

            unsized = make_case(spec, pool, kbuf, rbuf, dev)
            del unsized.inputs["buffer_sizes"]
            run_emulation.emulate(emu, unsized, ws, 64, concurrent=False)
            unsized.inputs["buffer_sizes"] = sizes
            resolve_batched(**unsized.ref_kwargs())
            assert differences(unsized) != [], (B, K, slot_map)
