"""The device code of kernels/resolve.cuh, run on CPU threads (tests/emulation), against the
batched oracle on random cases: checks the kernel's logic without a GPU. Slow (builds a torch
C++ extension, ~1 minute the first time); skipped without a C++ compiler."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "emulation"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="needs c++ and ninja")
def test_emulated_kernel_matches_oracle():
    import run_emulation

    emu = run_emulation.build()
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
