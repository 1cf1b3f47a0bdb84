"""CUDA sources of sglang-hisparse's kernels, shipped as package data.

The JIT loader (``sglang_hisparse.resolver.cuda``) compiles them on first use; this package only
locates them, so importing it never needs CUDA.
"""

from pathlib import Path


def source_dir() -> Path:
    """The folder holding the ``.cu``/``.cuh`` sources (inside the installed package)."""
    return Path(__file__).resolve().parent
