"""End to end on CPU: real SGLang servers with a tiny DSA model, with and without our HiSparse.

* 8 concurrent requests (one batched /generate) with contexts longer than B: greedy outputs are
  identical to the server without HiSparse, and the resolver really missed (rows came from host).
* The default configuration (``{}``: residency on) with room for every request: outputs are
  identical, every request stayed resident (no selection resolved from host) and every pool is
  back at its initial count.
* Requests aborted mid-decode: afterwards every pool reports exactly its initial free count.
* Residency on, under pressure: requests start resident and are demoted mid-decode; outputs identical;
  with shorter requests finishing early, the demoted request is promoted back (default interval);
  with elastic hot buffers (``max_device_buffer_size``), the demoted request's buffer grows.
* The reuse replacement policy (``replacement: "reuse"``): outputs identical (full tier).
* A deliberately wrong resolver (test-only fault switch) changes the outputs: the comparison
  can fail.

Both servers use the same deterministic configuration (one prefill batch, no overlap schedule)
so that they run identical batches; the only difference is where attention's KV rows come from.
The server without HiSparse, ours with hot buffers and ours with the default configuration start
side by side once for the module; the pressure and fault servers start side by side when the
first of their tests needs them.
"""

from __future__ import annotations

import random
import time

import pytest

from serving import settle, start, start_all, stop_now, stop_soon
from sglang_hisparse.serving.launcher import abort_two_mid_decode, wait_for_idle_report

pytestmark = pytest.mark.slow

B = 128  # hot-buffer slots; the tiny model's index_topk is 64
HISPARSE = f'{{"device_buffer_size": {B}, "host_to_device_ratio": 2, "stats_log_interval": 16, "residency": false}}'
DEFAULT = "{}"  # every key at its default: B = 2 x top_k = 128, ratio 2, residency on
# Residency on, with a watermark (22% of the device pool) that every request clears at admission but
# that decode growth crosses (test_residency_under_pressure_stays_identical_and_demotes_mid_decode).
PRESSURE = f'{{"device_buffer_size": {B}, "host_to_device_ratio": 2, "residency": true, "residency_watermark": 0.22}}'
# The same pressure with elastic hot buffers up to 2B (issue 44): the demoted request's buffer grows
# into the rows its demotion freed beyond the watermark and one hot buffer.
ELASTIC = PRESSURE[:-1] + f', "max_device_buffer_size": {2 * B}}}'
COMMON = [
    "--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
    "--max-running-requests", "8",
]
CONTEXTS = [200, 500, 900, 1300, 1700, 2100, 2600, 3000]
NEW_TOKENS = 64


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 2000) for _ in range(n)] for n in CONTEXTS]


def spec(name: str, config, max_total_tokens: int = 32768, env=None) -> dict:
    return dict(hisparse_config=config, extra_args=COMMON, name=name, max_total_tokens=max_total_tokens, env=env)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_cpu")


@pytest.fixture(scope="module")
def servers(logs):
    """The server without HiSparse, ours with hot buffers only, ours with the default config."""
    started = start_all(*(dict(spec(name, config), log_dir=logs)
                          for name, config in (("baseline", None), ("hisparse", HISPARSE), ("hisparse_default", DEFAULT))))
    yield dict(zip(("base", "ours", "default"), started))
    stop_soon(started)


@pytest.fixture(scope="module")
def pressure_and_fault(logs, servers, baseline_outputs):
    """Ours with residency under pressure (16384 device rows), the same with elastic hot buffers,
    and ours with the wrong-row fault.
    The first three servers are stopped first: every test using them runs before these (file
    order), the baseline's outputs are kept, and five CPU servers at once left a 24 GiB CI machine
    under SGLang's 10 GiB host-memory reserve (the host pool's start-up check refused the fourth)."""
    stop_now(servers.values())
    started = start_all(dict(spec("hisparse_residency", PRESSURE, max_total_tokens=16384), log_dir=logs),
                        dict(spec("hisparse_elastic", ELASTIC, max_total_tokens=16384), log_dir=logs),
                        dict(spec("hisparse_fault", HISPARSE, env={"SGLANG_HISPARSE_TEST_FAULT": "wrong_row"}), log_dir=logs))
    yield dict(zip(("pressure", "elastic", "fault"), started))
    stop_soon(started)


@pytest.fixture(scope="module")
def baseline_outputs(servers):
    return [o["output_ids"] for o in servers["base"].generate(prompts(), NEW_TOKENS)]


def generate_and_report(server) -> tuple[list[list[int]], dict]:
    """The prompts' greedy outputs and the idle report after them."""
    before = settle(server)
    outputs = [o["output_ids"] for o in server.generate(prompts(), NEW_TOKENS)]
    return outputs, wait_for_idle_report(server, after=before)


def assert_identical(outputs, baseline_outputs) -> None:
    assert all(len(o) == NEW_TOKENS for o in outputs)
    first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(baseline_outputs, outputs)]
    assert outputs == baseline_outputs, f"first differing token per request: {first_diffs}"
    assert all(len(set(o)) > NEW_TOKENS // 4 for o in outputs), "degenerate outputs prove nothing"


def test_outputs_identical_to_the_server_without_hisparse(servers, baseline_outputs):
    start_time = time.time()
    outputs, report = generate_and_report(servers["ours"])
    print(f"hisparse generate: {time.time() - start_time:.1f}s")
    assert_identical(outputs, baseline_outputs)
    assert not report["leak"], report
    assert report["misses"] > 0 and report["selected"] > report["misses"], report


def test_the_default_config_keeps_every_request_resident_and_outputs_identical(servers, baseline_outputs):
    """``--hisparse-config '{}'`` (residency on by default) with room for every request: outputs
    identical to the server without HiSparse, every request (and the warm-up) admitted resident,
    none demoted, nothing resolved from host, every pool back at its initial count."""
    ours = servers["default"]
    assert "B=128, top_k=64, layers=2, resolver=reference, residency=on (watermark 0.05 of the device pool)" in ours.log()
    outputs, report = generate_and_report(ours)
    assert_identical(outputs, baseline_outputs)
    assert report["admitted_resident"] >= len(CONTEXTS) and report["demotions"] == 0, report
    assert report["resident"] == 0 and not report["leak"], report
    assert report["misses"] == 0, "resident requests read their own rows: nothing is copied from host"
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)


def test_aborts_mid_decode_leave_every_pool_at_its_initial_free_count(servers):
    ours = servers["ours"]
    before = settle(ours)
    # 240 new tokens: the aborts come ~40 decode steps in (the first "Decode batch" line, then 2 s)
    outcome = abort_two_mid_decode(ours, [100, 700, 1500, 300], 240, seed=1)
    assert set(outcome["aborted"]) <= {"abort"} and all(outcome["finished"]), outcome
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)


@pytest.mark.full
def test_the_reuse_replacement_policy_keeps_outputs_identical(logs, baseline_outputs):
    """replacement "reuse" (the history-only reuse table, reference resolver on CPU): the policy
    is announced, outputs are identical to the server without HiSparse, and the resolver really
    missed (rows came from host). Before the pressure and fault servers start (six CPU servers at
    once exhaust a 24 GiB machine's host memory)."""
    config = f'{{"device_buffer_size": {B}, "host_to_device_ratio": 2, "replacement": "reuse", "residency": false}}'
    server = start(**spec("hisparse_reuse", config), log_dir=logs)
    try:
        outputs, report = generate_and_report(server)
    finally:
        stop_soon(server)
    assert "replacement policy reuse (history table: attention k=256 B=512)" in server.log()
    assert outputs == baseline_outputs
    assert not report["leak"], report
    assert report["misses"] > 0 and report["selected"] > report["misses"], report


def test_residency_under_pressure_stays_identical_and_demotes_mid_decode(pressure_and_fault, baseline_outputs):
    """Residency on, with a watermark (22% of the device pool) that every request clears at
    admission but that decode growth crosses: all requests start resident, the longest are
    demoted to hot buffers mid-decode, and the outputs stay identical to the server without
    HiSparse."""
    # 16384 device rows; the prompts take 12544 (whole pages), leaving 3840 >= the watermark of
    # 3605; each request needs one new page within 64 steps, and the fourth page taken (step 24)
    # would leave 3584 < 3605: the longest request (3000 tokens) is demoted then.
    server = pressure_and_fault["pressure"]
    outputs, report = generate_and_report(server)
    assert "device rows 16384 " in server.log(), "the watermark above assumes a 16384-row device pool"
    assert outputs == baseline_outputs
    assert report["admitted_resident"] == len(CONTEXTS) + 1 and report["demotions"] >= 1, report  # + warmup
    assert report["resident"] == 0 and not report["leak"], report
    assert report["misses"] > 0, "demoted requests miss and copy from host"


def test_a_demoted_request_is_promoted_back_when_shorter_requests_finish(pressure_and_fault, baseline_outputs):
    """The same pressure, with the three shortest requests stopping after 28 tokens: the longest
    request is demoted at step 24 (as above), their rows come back at step 28, and at the next
    promotion check (every 32 steps, the default) it takes rows of its own again (3072 rows, with
    the watermark and one hot buffer still free). Outputs identical to the server without HiSparse
    (their first tokens for the short requests), every pool back."""
    from sglang_hisparse.serving.launcher import post_json

    server = pressure_and_fault["pressure"]
    new_tokens = [28, 28, 28] + [NEW_TOKENS] * (len(CONTEXTS) - 3)
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in new_tokens]
    before = settle(server)
    outputs = [o["output_ids"] for o in post_json(f"{server.url}/generate",
                                                   {"input_ids": prompts(), "sampling_params": params}, 1800)]
    assert outputs == [b[:n] for b, n in zip(baseline_outputs, new_tokens)]
    report = wait_for_idle_report(server, after=before)
    assert report["demotions"] >= 1 and report["promotions"] >= 1, report
    assert report["resident"] == 0 and not report["leak"], report
    assert "promoted from its hot buffer to rows of its own" in server.log()


def test_elastic_hot_buffers_grow_under_pressure_and_stay_identical(pressure_and_fault, baseline_outputs):
    """The pressure above with ``max_device_buffer_size`` 2B: the longest request is demoted at
    step 24 and, at the next growth check (step 32), its buffer grows into the rows the demotion
    freed (the kernel reads its size); outputs identical to the server without HiSparse, every
    pool back with the sizes."""
    server = pressure_and_fault["elastic"]
    outputs, report = generate_and_report(server)
    assert outputs == baseline_outputs
    assert report["demotions"] >= 1 and report["grown"] > 0, report
    assert report["resident"] == 0 and not report["leak"], report
    assert report["misses"] > 0, "the grown buffer still misses from host"


def test_a_broken_resolver_is_detected(pressure_and_fault, baseline_outputs):
    broken = pressure_and_fault["fault"]
    outputs = [o["output_ids"] for o in broken.generate(prompts(), NEW_TOKENS)]
    assert "test fault wrong_row is ON" in broken.log()
    assert sum(a != b for a, b in zip(outputs, baseline_outputs)) >= len(CONTEXTS) // 2
