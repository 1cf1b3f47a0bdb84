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
    # the Python mirror of the shared-memory layout (used by check_supported) is the kernel's
    from sglang_hisparse.resolver.cuda import planner_smem_bytes

    for B, K in ((256, 64), (64, 32), (13, 5), (4096, 2048), (8192, 2048)):
        assert emu.planner_smem_bytes(B, K) == planner_smem_bytes(B, K), (B, K)
        assert emu.planner_smem_bytes(B, K, True) == planner_smem_bytes(B, K, reuse=True), (B, K)
