"""What SGLang 0.5.17's scheduler admits, as the GPU exactness runs rely on it (CPU server).

Without HiSparse, a server started with ``--max-running-requests N`` decodes at most N - 1
requests together, whatever its token budget: with 18 requests and N = 18 the 18th waits until the
others finish (seen on the H200 in docs/results/gpu_run13, decode trace ``17x128 1x128``), so the
baseline runs other batch shapes than a HiSparse server that holds all 18, and eager numerics
differ. ``scripts/gpu/e2e.py exactness`` therefore defaults to ``--max-running 19``. If SGLang
changes this, the test fails and the default can follow.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from serving import start_all, stop_soon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

from decode_log import parse_batches  # noqa: E402

pytestmark = pytest.mark.slow

LENGTHS = [100, 200, 300, 400, 500, 600, 150, 250, 350, 450, 550, 650, 120, 220, 320, 420, 520, 80]


def most_decoding_together(server) -> int:
    rng = random.Random(0)
    server.generate([[rng.randrange(2, 2000) for _ in range(n)] for n in LENGTHS], 8)
    return max(b.running for b in parse_batches(server.log()) if b.decode)


def test_baseline_decodes_at_most_max_running_minus_one(tmp_path):
    assert sum(LENGTHS) + 8 * len(LENGTHS) < 32768 // 4  # tokens are never the limit here
    limits = (len(LENGTHS), len(LENGTHS) + 1)
    servers = start_all(*(dict(extra_args=["--mem-fraction-static", "0.5", "--max-running-requests", str(n),
                                           "--decode-log-interval", "1", "--chunked-prefill-size", "1024"],
                               log_dir=tmp_path, name=f"admission_{n}", max_total_tokens=32768) for n in limits))
    try:
        assert [most_decoding_together(s) for s in servers] == [len(LENGTHS) - 1, len(LENGTHS)]
    finally:
        stop_soon(servers)
