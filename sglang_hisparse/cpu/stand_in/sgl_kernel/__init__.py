"""Stand-in for ``sgl_kernel`` on machines without a GPU (test and demo use only).

SGLang's CPU engine imports ``sgl_kernel``, whose PyPI build is CUDA only (it fails to load
without ``libcuda.so.1``). Put this folder first on ``PYTHONPATH`` of a CPU server: the package
reuses the real package's pure-Python submodules (its ``__path__`` includes the real folder), does
not load the compiled ops, and turns every missing name into a callable that raises
``NotImplementedError`` naming it. The only ops it computes are the seven the speculative (EAGLE /
NEXTN) worker calls on CPU, in torch (``cpu_spec_ops``).
"""

from __future__ import annotations

import os
import sys


def _real_package_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "sgl_kernel")
        if os.path.abspath(candidate) != here and os.path.isfile(os.path.join(candidate, "__init__.py")):
            return os.path.abspath(candidate)
    return None


_REAL = _real_package_dir()
__path__ = [os.path.dirname(os.path.abspath(__file__))] + ([_REAL] if _REAL else [])
__version__ = "0.0.0+cpu-stand-in"
if _REAL:
    try:
        from sgl_kernel.version import __version__  # noqa: F401,E402
    except Exception:  # pragma: no cover - the real version module is plain Python
        pass


from sgl_kernel.cpu_spec_ops import (  # noqa: E402,F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)


class _Unavailable:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{self._name} is not available in the CPU stand-in")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in for {self._name}>"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name)
