"""CPU test harness: what SGLang objects need to be built on a machine without a GPU.

* ``gloo_world``: a torch.distributed process group of one (gloo), which the coordinator's
  tensor-parallel all-reduce needs.
* ``sglang_parallel``: SGLang's parallel-width overrides (attention TP/DCP of one).
* ``run_fresh_python``: run code in a fresh interpreter, so plugin loading and class
  replacement are observed from a clean process, as SGLang's spawned schedulers see them;
  ``prefetched``: the results of a test's ``fresh.runs_first`` runs, which start with the
  module's other tests' runs, two at a time.
* ``pool`` and ``bufs``: the host pool and the two flat device KV buffers of random resolve
  cases (``sglang_hisparse_testkit/resolver_cases.py``), on CPU, one of each per test module.

Pinned memory is never requested on CPU: our host pool takes ``pin_memory`` as an argument.

Two tiers (README, "The two commands"): the default run deselects tests marked ``full`` (the long
soak and the exhaustive cases); ``--full`` (``bash scripts/test.sh --full``) runs everything and
multiplies the hypothesis budgets (``tier.examples``). Servers the tests stopped in the background
(``serving.stop_soon``) are waited for before the session ends.
"""

from __future__ import annotations

import socket
from typing import Iterator

import pytest
import torch

from sglang_hisparse_testkit.resolver_cases import HostPool
from fresh import FreshPython, start_runs
from serving import wait_for_stops
import tier


def pytest_addoption(parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the full tier: tests marked full (the long soak, the exhaustive cases) "
                          "and larger hypothesis budgets")


def pytest_configure(config) -> None:
    tier.set_full(config.getoption("--full"))


def pytest_report_header(config) -> str:
    if tier.full():
        return "tier: full (every test; hypothesis budgets x%d)" % tier.FULL_FACTOR
    return "tier: default (tests marked full are deselected; bash scripts/test.sh --full runs them)"


def pytest_collection_modifyitems(config, items) -> None:
    if tier.full():
        return
    deselected = [item for item in items if item.get_closest_marker("full")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("full")]


def pytest_sessionfinish(session, exitstatus) -> None:
    wait_for_stops()


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


@pytest.fixture
def run_fresh_python() -> FreshPython:
    return FreshPython()


@pytest.fixture(scope="module")
def _module_runs(request):
    """The runs (``fresh.runs_first``) of every selected test of this module, started together."""
    tests = {item.function for item in request.session.items
             if getattr(item, "module", None) is request.module and hasattr(getattr(item, "function", None), "_fresh_runs")}
    pool, futures = start_runs(sorted(tests, key=lambda t: t.__code__.co_firstlineno))
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.fixture
def prefetched(_module_runs, request) -> list:
    """The results of this test's ``fresh.runs_first`` runs, in order."""
    return [f.result() for f in _module_runs[request.function.__name__]]


@pytest.fixture(scope="module")
def pool() -> HostPool:
    """Host pool of random resolve cases (4 MiB, not pinned)."""
    return HostPool(4 << 20, torch.device("cpu"), pin=False, seed=7)


@pytest.fixture(scope="module")
def bufs() -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel-side and reference-side flat device KV buffers of random resolve cases."""
    return torch.empty(16 << 20, dtype=torch.uint8), torch.empty(16 << 20, dtype=torch.uint8)
