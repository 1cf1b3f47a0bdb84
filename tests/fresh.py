"""Code run in fresh interpreters (the test venv's), so that plugin loading and class replacement
are observed from a clean process, as SGLang's spawned schedulers see them.

Each such run is mostly SGLang's imports (~15 s of one core). A module whose tests run several
registers them with :func:`runs_first`: the module's runs start together, two at a time, when the
first of its tests needs one (``prefetched`` in conftest.py), and each test waits only for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

WORKERS = 2


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


def runs_first(*runs: Callable[[], object]):
    """Decorator: ``runs`` (no-argument callables, each typically one subprocess) are this test's
    work outside pytest; the ``prefetched`` fixture returns their results in order."""

    def register(test):
        test._fresh_runs = runs
        return test

    return register


def snippet(code: str, env: Optional[dict[str, str]] = None) -> Callable[[], subprocess.CompletedProcess]:
    """A run of ``code`` in a fresh interpreter, for :func:`runs_first`."""
    return lambda: FreshPython()(code, env)


def start_runs(tests) -> tuple[ThreadPoolExecutor, dict[str, list[Future]]]:
    """Submit the registered runs of ``tests`` (test functions), in order, to a pool of WORKERS."""
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="fresh")
    futures = {t.__name__: [pool.submit(run) for run in t._fresh_runs] for t in tests}
    return pool, futures
