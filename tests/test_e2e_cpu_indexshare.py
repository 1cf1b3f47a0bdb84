"""IndexShare (GLM-5.2 style, ``index_topk_freq`` 2): a shared layer reuses the previous layer's
top-k. With IndexShare prefetch (default) the shared layer does not resolve: the source layer's
copies are replayed onto it. Outputs must be identical to the server without HiSparse."""

from __future__ import annotations

import random

import pytest

from serving import settle, start_all, stop_soon
from sglang_hisparse.serving.launcher import wait_for_idle_report

pytestmark = pytest.mark.slow

COMMON = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
          "--max-running-requests", "4"]


def test_indexshare_model_outputs_identical(tmp_path):
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 2000) for _ in range(n)] for n in (300, 900, 1600, 2400)]
    configs = {"baseline": None, "hisparse": '{"device_buffer_size": 128, "residency": false}'}
    servers = start_all(*(dict(model="tiny-dsa-cpu-indexshare", hisparse_config=config, extra_args=COMMON,
                               log_dir=tmp_path, name=name, max_total_tokens=16384) for name, config in configs.items()))
    outputs = {}
    try:
        for (name, config), server in zip(configs.items(), servers):
            before = settle(server)
            outputs[name] = [o["output_ids"] for o in server.generate(prompts, 32)]
            if config:
                report = wait_for_idle_report(server, after=before)
                assert not report["leak"] and report["misses"] > 0, report
    finally:
        stop_soon(servers)
    assert outputs["hisparse"] == outputs["baseline"]
    assert "IndexShare prefetch on: source layer -> followers {1: [2]}" in servers[1].log()
