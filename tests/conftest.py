"""CPU test harness: what SGLang objects need to be built on a machine without a GPU.

* ``gloo_world``: a torch.distributed process group of one (gloo), which the coordinator's
  tensor-parallel all-reduce needs.
* ``sglang_parallel``: SGLang's parallel-width overrides (attention TP/DCP of one).
* ``run_fresh_python``: run code in a fresh interpreter, so plugin loading and class
  replacement are observed from a clean process, as SGLang's spawned schedulers see them.
* ``pool`` and ``bufs``: the host pool and the two flat device KV buffers of random resolve
  cases (``sglang_hisparse/resolver/cases.py``), on CPU, one of each per test module.

Pinned memory is never requested on CPU: our host pool takes ``pin_memory`` as an argument.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from typing import Iterator, Optional

import pytest
import torch

from sglang_hisparse.resolver.cases import HostPool


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gloo_world() -> Iterator[object]:
    """torch.distributed initialised with gloo, world size 1; yields the WORLD group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            world_size=1,
            rank=0,
        )
    yield dist.group.WORLD


@pytest.fixture
def sglang_parallel() -> Iterator[object]:
    """SGLang's parallel context forced to a single rank for attention and TP."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(
        tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1, attn_dcp_rank=0
    ) as ctx:
        yield ctx


class FreshPython:
    """Runs a snippet in a new interpreter (the test venv's) and returns the result."""

    def __call__(
        self, code: str, env: Optional[dict[str, str]] = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        full_env = dict(os.environ)
        full_env.update(env or {})
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
        )


@pytest.fixture
def run_fresh_python() -> FreshPython:
    return FreshPython()


@pytest.fixture(scope="module")
def pool() -> HostPool:
    """Host pool of random resolve cases (4 MiB, not pinned)."""
    return HostPool(4 << 20, torch.device("cpu"), pin=False, seed=7)


@pytest.fixture(scope="module")
def bufs() -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel-side and reference-side flat device KV buffers of random resolve cases."""
    return torch.empty(16 << 20, dtype=torch.uint8), torch.empty(16 << 20, dtype=torch.uint8)
