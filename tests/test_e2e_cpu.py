"""End to end on CPU: real SGLang servers with a tiny DSA model, with and without our HiSparse.

* 8 concurrent requests (one batched /generate) with contexts longer than B: greedy outputs are
  identical to the server without HiSparse, and the resolver really missed (rows came from host).
* Requests aborted mid-decode: afterwards every pool reports exactly its initial free count.
* Residency on, under pressure: requests start resident and are demoted mid-decode; outputs identical.
* The reuse replacement policy (``replacement: "reuse"``): outputs identical.
* A deliberately wrong resolver (test-only fault switch) changes the outputs: the comparison
  can fail.

Both servers use the same deterministic configuration (one prefill batch, no overlap schedule)
so that they run identical batches; the only difference is where attention's KV rows come from.
"""

from __future__ import annotations

import random
import time

import pytest

from sglang_hisparse.testing.server import abort_two_mid_decode, start_server, wait_for_idle_report

pytestmark = pytest.mark.slow

B = 128  # hot-buffer slots; the tiny model's index_topk is 64
HISPARSE = f'{{"device_buffer_size": {B}, "host_to_device_ratio": 2, "stats_log_interval": 16, "residency": false}}'
COMMON = [
    "--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
    "--max-running-requests", "8",
]
CONTEXTS = [200, 500, 900, 1300, 1700, 2100, 2600, 3000]
NEW_TOKENS = 64


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 2000) for _ in range(n)] for n in CONTEXTS]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("e2e_cpu")
    started = []
    try:
        base = start_server(extra_args=COMMON, log_dir=logs, name="baseline", max_total_tokens=32768)
        started.append(base)
        ours = start_server(hisparse_config=HISPARSE, extra_args=COMMON, log_dir=logs, name="hisparse", max_total_tokens=32768)
        started.append(ours)
        yield base, ours
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def baseline_outputs(servers):
    base, _ = servers
    return [o["output_ids"] for o in base.generate(prompts(), NEW_TOKENS)]


def test_outputs_identical_to_the_server_without_hisparse(servers, baseline_outputs):
    _, ours = servers
    before = len(ours.idle_reports())
    start = time.time()
    outputs = [o["output_ids"] for o in ours.generate(prompts(), NEW_TOKENS)]
    print(f"hisparse generate: {time.time() - start:.1f}s")
    assert all(len(o) == NEW_TOKENS for o in outputs)
    first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(baseline_outputs, outputs)]
    assert outputs == baseline_outputs, f"first differing token per request: {first_diffs}"
    assert all(len(set(o)) > NEW_TOKENS // 4 for o in outputs), "degenerate outputs prove nothing"
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"], report
    assert report["misses"] > 0 and report["selected"] > report["misses"], report


def test_aborts_mid_decode_leave_every_pool_at_its_initial_free_count(servers):
    _, ours = servers
    before = len(ours.idle_reports())
    outcome = abort_two_mid_decode(ours, [100, 700, 1500, 300], 400, seed=1)
    assert set(outcome["aborted"]) <= {"abort"} and all(outcome["finished"]), outcome
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)


def serve_once(tmp_path, config: str, name: str, *, max_total_tokens: int):
    """Start a HiSparse server with ``config``, generate the prompts' greedy outputs, wait for the
    idle report after them, stop it: (the stopped server, its outputs, the report)."""
    server = start_server(hisparse_config=config, extra_args=COMMON, log_dir=tmp_path, name=name,
                          max_total_tokens=max_total_tokens)
    try:
        before = len(server.idle_reports())
        outputs = [o["output_ids"] for o in server.generate(prompts(), NEW_TOKENS)]
        report = wait_for_idle_report(server, after=before)
    finally:
        server.stop()
    return server, outputs, report


def test_residency_under_pressure_stays_identical_and_demotes_mid_decode(tmp_path, baseline_outputs):
    """Residency on, with a watermark (22% of the device pool) that every request clears at
    admission but that decode growth crosses: all requests start resident, the longest are
    demoted to hot buffers mid-decode, and the outputs stay identical to the server without
    HiSparse."""
    # 16384 device rows; the prompts take 12544 (whole pages), leaving 3840 >= the watermark of
    # 3605; each request needs one new page within 64 steps, and the fourth page taken (step 24)
    # would leave 3584 < 3605: the longest request (3000 tokens) is demoted then.
    config = f'{{"device_buffer_size": {B}, "host_to_device_ratio": 2, "residency": true, "residency_watermark": 0.22}}'
    server, outputs, report = serve_once(tmp_path, config, "hisparse_residency", max_total_tokens=16384)
    assert "device rows 16384 " in server.log(), "the watermark above assumes a 16384-row device pool"
    assert outputs == baseline_outputs
    assert report["admitted_resident"] == len(CONTEXTS) + 1 and report["demotions"] >= 1, report  # + warmup
    assert report["resident"] == 0 and not report["leak"], report
    assert report["misses"] > 0, "demoted requests miss and copy from host"


def test_the_reuse_replacement_policy_keeps_outputs_identical(tmp_path, baseline_outputs):
    """replacement "reuse" (the history-only reuse table, reference resolver on CPU): the policy
    is announced, outputs are identical to the server without HiSparse, and the resolver really
    missed (rows came from host)."""
    config = f'{{"device_buffer_size": {B}, "host_to_device_ratio": 2, "replacement": "reuse", "residency": false}}'
    server, outputs, report = serve_once(tmp_path, config, "hisparse_reuse", max_total_tokens=32768)
    assert "replacement policy reuse (history table: attention k=256 B=512)" in server.log()
    assert outputs == baseline_outputs
    assert not report["leak"], report
    assert report["misses"] > 0 and report["selected"] > report["misses"], report


def test_a_broken_resolver_is_detected(tmp_path, baseline_outputs):
    broken = start_server(
        hisparse_config=HISPARSE, extra_args=COMMON, log_dir=tmp_path, name="hisparse_fault",
        max_total_tokens=32768, env={"SGLANG_HISPARSE_TEST_FAULT": "wrong_row"},
    )
    try:
        outputs = [o["output_ids"] for o in broken.generate(prompts(), NEW_TOKENS)]
    finally:
        broken.stop()
    assert "test fault wrong_row is ON" in broken.log()
    assert sum(a != b for a, b in zip(outputs, baseline_outputs)) >= len(CONTEXTS) // 2
