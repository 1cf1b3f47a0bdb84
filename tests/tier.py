"""Which tier runs (conftest.py sets it from ``--full``) and the hypothesis budgets of each.

``examples(n)``: ``n`` examples in the default tier (sized for CI on a 2-core machine), ``n`` x
``FULL_FACTOR`` in the full tier. Read when a test module is imported, i.e. after conftest's
``pytest_configure``.
"""

from __future__ import annotations

import os

FULL_FACTOR = 4
_ENV = "SGLANG_HISPARSE_TEST_TIER"


def set_full(on: bool) -> None:
    os.environ[_ENV] = "full" if on else "default"


def full() -> bool:
    return os.environ.get(_ENV) == "full"


def examples(n: int) -> int:
    return n * FULL_FACTOR if full() else n
