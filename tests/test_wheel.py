"""The built wheel carries the core, the seams (patches/) and the CUDA sources (kernels/)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_kernels_and_patches(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = tmp_path.glob("sglang_hisparse-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    for seam in sorted((ROOT / "patches").glob("*.py")):
        assert f"sglang_hisparse/patches/{seam.name}" in names
    for source in sorted((ROOT / "kernels").iterdir()):
        if source.suffix in {".py", ".cu", ".cuh", ".h"}:
            assert f"sglang_hisparse/kernels/{source.name}" in names
    for module in sorted((ROOT / "sglang_hisparse").rglob("*.py")):
        rel = module.relative_to(ROOT).as_posix()
        assert rel in names, rel
    assert "sglang_hisparse/resolver/reuse_history_table.json" in names  # replacement: "reuse"
    assert "sglang_hisparse/models/tiny-dsa-cpu/config.json" in names  # the README's CPU launch
    for package in ("sglang_hisparse_testkit", "sglang_hisparse_analysis"):  # the GPU machine's tests use them
        for module in sorted((ROOT / package).glob("*.py")):
            assert module.relative_to(ROOT).as_posix() in names
    # Nothing lands at the top level of site-packages except our three packages and their metadata.
    dist_info = wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"sglang_hisparse", "sglang_hisparse_testkit",
                                                "sglang_hisparse_analysis", dist_info}
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[sglang.srt.plugins]" in text
    assert "hisparse = sglang_hisparse.serving.plugin:register" in text
