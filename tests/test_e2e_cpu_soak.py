"""End to end on CPU, a small server under pressure: refusals, fast-path idle reports, a soak.

One HiSparse server with a tight device pool (``--max-total-tokens 8192``, B=128: a request whose
budget reaches 8192 tokens is never admissible) and SGLang's own HiSparse trapped (a call to any of
it would log a trap line and fail), next to a server without HiSparse for the output comparison.

* A request that can never be admitted is refused at once with our reason, and a request sent
  after it is served (before: the first waited forever and stalled everything behind it).
* A server whose requests stay on the fast path (no selection counted) still reports idle.
* A bounded soak (full tier): rounds of concurrent requests of mixed lengths with client aborts,
  client disconnects mid-generation and refused requests; afterwards every pool is back to its
  initial count.
* A batch both servers run identically gives identical greedy outputs (in the full tier: after
  the soak).
* A hot buffer that cannot fit the device pool makes the server refuse to start, with the numbers
  (that server starts while the other two do).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from serving import settle, start_all, start_in_background, stop_soon
from sglang_hisparse.serving.launcher import scrape_metrics, wait_for_idle_report

pytestmark = pytest.mark.slow

B = 128
POOL = 8192
ROOM = POOL  # a request holds only its own rows: the whole device pool when idle (logical ids and host rows: 2x)
HISPARSE = f'{{"device_buffer_size": {B}, "host_to_device_ratio": 2, "wait_for_staging": true, "residency": false}}'
COMMON = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
          "--max-running-requests", "8"]
TRAP = {"SGLANG_HISPARSE_TRAP_UPSTREAM": "1"}
LOCALITY = {"SGLANG_HISPARSE_DUMMY_LOCALITY": "realistic"}  # selections overlap as a trained model's do
COMPARED = [300, 900, 1500, 2200]  # one prefill batch on both servers: identical batches


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_cpu_soak")


@pytest.fixture(scope="module")
def too_big(logs):
    """The start of a server whose hot buffer cannot fit its device pool (a Future), begun before
    the module's servers so that they start side by side."""
    return start_in_background(hisparse_config='{"device_buffer_size": 30000}', extra_args=COMMON, log_dir=logs,
                               name="too_big", max_total_tokens=16384, ready_timeout=300)


@pytest.fixture(scope="module")
def servers(logs, too_big):
    started = start_all(
        dict(hisparse_config=HISPARSE, extra_args=COMMON + ["--enable-metrics"], log_dir=logs, name="hisparse_small",
             max_total_tokens=POOL, env={**TRAP, **LOCALITY}),
        dict(extra_args=COMMON, log_dir=logs, name="baseline_small", max_total_tokens=POOL, env=LOCALITY))
    yield started[1], started[0]
    stop_soon(started)


def refused_message(server, prompt: list[int], max_new_tokens: int) -> str:
    """The error body of a request the server answers with HTTP 400."""
    with pytest.raises(urllib.error.HTTPError) as info:
        server.generate(prompt, max_new_tokens, timeout=60)
    assert info.value.code == 400
    return info.value.read().decode()


def test_an_unadmittable_request_is_refused_at_once_and_the_next_is_served(servers):
    _, ours = servers
    assert f"admission room when idle {ROOM} tokens" in ours.log() and "sglang-hisparse capacity: device rows 8192" in ours.log()
    rng = random.Random(0)
    start = time.time()
    message = refused_message(ours, ids(rng, 8150), 16)
    # SGLang clips this request's max_new_tokens to 0 first (the context is 8192 tokens): 8192 rows
    # (8150 rounded to pages) + 0 + a reserve of 1
    assert "sglang-hisparse: this request needs 8193 tokens of admission room" in message
    assert f"never has more than {ROOM}" in message
    served = ours.generate(ids(rng, 200), 16, timeout=120)
    assert len(served["output_ids"]) == 16
    assert time.time() - start < 90
    # the boundary (new tokens clipped to 0 from here): 8128 tokens are 8128 rows and with the
    # reserve of 1 fit the room of 8192; 8129 round to 8192 rows and do not
    assert "needs 8193 tokens" in refused_message(ours, ids(rng, 8129), 4)
    assert ours.generate(ids(rng, 8128), 4, timeout=600)["meta_info"]["finish_reason"]["type"] == "length"
    # a long request with new tokens: 7936 + 4 + a reserve of 1
    assert len(ours.generate(ids(rng, 7936), 4, timeout=600)["output_ids"]) == 4


def test_idle_is_reported_when_every_request_stayed_on_the_fast_path(servers):
    _, ours = servers
    count = settle(ours)  # every earlier request is in a report
    before = ours.idle_reports()[-1]
    out = ours.generate(ids(random.Random(1), 50), 20)  # 70 positions < B: fast path only
    assert len(out["output_ids"]) == 20
    report = wait_for_idle_report(ours, after=count)
    assert report["selected"] == before["selected"], "the request left the fast path"
    assert not report["leak"], report


def _stream_then_disconnect(server, prompt: list[int], chunks: int) -> int:
    """A streaming /generate whose client closes the connection after ``chunks`` data lines."""
    body = json.dumps({"input_ids": prompt, "stream": True,
                       "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    seen = 0
    while seen < chunks:
        line = response.fp.readline()
        if not line:
            break
        seen += line.startswith(b"data:")
    conn.close()
    return seen


@pytest.mark.full
def test_soak_leaves_every_pool_at_its_initial_count(servers):
    """Three rounds of concurrent work: normal requests of mixed lengths, an abort, a client
    disconnect and a refused request per round."""
    _, ours = servers
    rng = random.Random(7)
    count = settle(ours)
    problems: list[str] = []

    def normal(prompt, new):
        out = ours.generate(prompt, new, timeout=600)
        if len(out["output_ids"]) != new:
            problems.append(f"normal request got {len(out['output_ids'])} of {new} tokens")

    def aborted(prompt, rid, delay):
        threading.Timer(delay, ours.abort, args=(rid,)).start()
        try:
            out = ours.generate(prompt, 300, rid=rid, timeout=600)
            if out["meta_info"]["finish_reason"]["type"] not in ("abort", "length"):
                problems.append(f"aborted request finished with {out['meta_info']['finish_reason']}")
        except urllib.error.HTTPError:
            pass  # an abort may also answer with an error status

    def disconnected(prompt):
        if _stream_then_disconnect(ours, prompt, chunks=3) < 3:
            problems.append("the stream ended before the client disconnected")

    def refused(prompt):
        message = refused_message(ours, prompt, 8)
        if "sglang-hisparse: this request needs" not in message:
            problems.append(f"a refused request ({len(prompt)} tokens) got another error: {message}")

    for _ in range(3):
        work = [(normal, (ids(rng, rng.randrange(50, 2500)), rng.randrange(8, 40))) for _ in range(3)]
        work += [(aborted, (ids(rng, rng.randrange(200, 2000)), f"soak-{uuid.uuid4().hex[:8]}", rng.uniform(0.5, 3.0))),
                 (disconnected, (ids(rng, rng.randrange(100, 1500)),)),
                 # 8129 and more round to the whole pool; prompt + 8 new tokens within the context (8192)
                 (refused, (ids(rng, rng.randrange(8129, 8180)),))]
        threads = [threading.Thread(target=fn, args=args) for fn, args in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert not any(t.is_alive() for t in threads), "a soak request never finished"
    assert not problems, problems
    report = wait_for_idle_report(ours, after=count)
    assert not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)


def test_outputs_equal_the_server_without_hisparse(servers):
    """Also after the soak when the full tier runs it (it comes first)."""
    base, ours = servers
    rng = random.Random(11)
    prompts = [ids(rng, n) for n in COMPARED]
    want = [o["output_ids"] for o in base.generate(prompts, 32)]
    got = [o["output_ids"] for o in ours.generate(prompts, 32)]
    assert got == want
    assert all(len(set(o)) > 8 for o in got), "degenerate outputs prove nothing"


def test_prometheus_exports_what_the_idle_report_says(servers):
    """With --enable-metrics, /metrics carries our series; at idle they equal the last report."""
    _, ours = servers
    before = settle(ours)
    ours.generate([[5 + i % 1000 for i in range(900)]], 16)  # some misses (900 > B)
    report = wait_for_idle_report(ours, after=before)  # the series are published with each report
    series = scrape_metrics(ours)
    with urllib.request.urlopen(f"{ours.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    assert series["sglang_hisparse_selected_rows_total"] == report["selected"] > 0
    assert series["sglang_hisparse_miss_rows_total"] == report["misses"] > 0
    assert series["sglang_hisparse_copied_bytes_total"] == report["misses"] * 192  # bf16 rows of 64 + 32 values
    assert series["sglang_hisparse_decode_steps_total"] >= 16
    assert series["sglang_hisparse_host_rows_capacity"] == report["counts"]["host_free"][1]
    assert series["sglang_hisparse_host_rows_used"] == 0 and series["sglang_hisparse_hot_buffers_in_use"] == 0
    assert series["sglang_hisparse_staging_requests"] == 0
    assert 'model_name="' in text and 'tp_rank="0"' in text


def test_no_upstream_hisparse_code_ran(servers):
    _, ours = servers
    log = ours.log()
    assert "sglang-hisparse trap: installed on" in log
    assert "trap: sglang." not in log, [l for l in log.splitlines() if "trap: sglang." in l][:5]


def test_a_hot_buffer_larger_than_the_device_pool_refuses_to_start(too_big):
    try:
        server = too_big.result(timeout=600)
    except RuntimeError as e:
        text = str(e)
    else:
        stop_soon(server)
        pytest.fail("a server whose hot buffer cannot fit its device pool started")
    assert "sglang-hisparse: invalid device_buffer_size=30000: one decoding request holds 30016 device rows" in text
    assert "the device KV pool has 16384 rows; use device_buffer_size <= 16319" in text
