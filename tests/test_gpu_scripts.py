"""The GPU-machine helper scripts that run here too: packing a call's outputs under the device
tool's 8-file limit (scripts/gpu/pack_outputs.py) and the end-to-end script's configuration syntax
(scripts/gpu/e2e.py)."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import pack_outputs  # noqa: E402


def _outputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    out, jit, e2e = tmp_path / "out", tmp_path / "jit", tmp_path / "e2e_logs"
    out.mkdir()
    for name in ("run.log", "suite.log", "sanitizer.log", "extra.log"):
        (out / name).write_text(f"{name}\n" * 10)
    for name in ("kernel_tests.json", "kernel_bench.json", "kernel_bench.md", "kernel_bench.png"):
        (out / name).write_text("{}")
    for cache in ("tvm-ffi", "triton", "deep_gemm", "flashinfer"):
        (jit / cache / "sub").mkdir(parents=True)
        (jit / cache / "sub" / "mod.so").write_bytes(os.urandom(2000))
    e2e.mkdir()
    (e2e / "ours_B4096_g1.log").write_text("server log\n")
    return out, jit, e2e


def test_logs_and_caches_come_back_in_few_files(tmp_path):
    out, jit, e2e = _outputs(tmp_path)
    pack_outputs.pack_logs(out, e2e)
    pack_outputs.pack_jit(out, jit)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["jit.tar.xz", "kernel_bench.json", "kernel_bench.md", "kernel_bench.png",
                     "kernel_tests.json", "logs.tar.xz", "run.log"]
    with tarfile.open(out / "logs.tar.xz") as t:
        assert sorted(t.getnames()) == ["e2e_logs", "e2e_logs/ours_B4096_g1.log", "extra.log", "sanitizer.log",
                                        "suite.log"]
        assert t.extractfile("suite.log").read() == b"suite.log\n" * 10
    with tarfile.open(out / "jit.tar.xz") as t:  # one folder per cache, as run.sh restores them
        assert "tvm-ffi/sub/mod.so" in t.getnames() and "deep_gemm/sub/mod.so" in t.getnames()
        restore = tmp_path / "restore"
        t.extractall(restore)
    assert (restore / "triton" / "sub" / "mod.so").read_bytes() == (jit / "triton" / "sub" / "mod.so").read_bytes()


def test_oversized_caches_split_and_too_large_ones_are_left_out(tmp_path):
    out, jit, _ = _outputs(tmp_path)
    (jit / "tvm-ffi" / "big.so").write_bytes(os.urandom(60_000))  # incompressible
    notes = pack_outputs.pack_jit(out, jit, max_bytes=30_000)
    names = sorted(p.name for p in out.glob("jit*"))
    assert names == ["jit-deep_gemm.tar.xz", "jit-flashinfer.tar.xz", "jit-triton.tar.xz"]
    assert any("tvm-ffi" in n and "left out" in n for n in notes)


def test_nothing_to_pack_writes_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.log").write_text("x")
    assert pack_outputs.pack_logs(out, tmp_path / "missing") == []
    assert pack_outputs.pack_jit(out, tmp_path / "missing") == []
    assert sorted(p.name for p in out.iterdir()) == ["run.log"]


def test_e2e_config_syntax():
    import e2e

    assert e2e.parse_config("ours:4096:F18:arrival", "arrival") == ("ours", 4096, "F18", "arrival")
    assert e2e.parse_config("upstream:2048:0", "lockstep") == ("upstream", 2048, "0", "lockstep")
    assert e2e.parse_graph("1") == (True, None) and e2e.parse_graph("0") == (False, None)
    assert e2e.parse_graph("F24") == (True, 24)
    fixed = e2e.flags(True, 524288, 18, graph_bs=18)
    assert fixed[fixed.index("--cuda-graph-bs") + 1] == "18" and "--disable-cuda-graph" not in fixed
    assert "--disable-cuda-graph" in e2e.flags(False, 524288, 18)
    for bad, message in (("ours:4096:2", "graph mode"), ("ours:4096:F", "graph mode"), ("mine:4096:1", "impl"),
                         ("ours:4096:1:racing", "workload"), ("ours:4096", "impl:B:graph")):
        with pytest.raises(ValueError, match=message):
            e2e.parse_config(bad, "arrival")
