"""End to end on CPU: a PD pair moving real KV (mooncake's transfer engine over TCP on 127.0.0.1).

A prefill instance without HiSparse writes each request's KV (and its indexer keys) into a decode
instance's pinned host pool; two decode instances with our HiSparse share that prefill instance,
both retracting a request every third step (``SGLANG_TEST_RETRACT``: a retracted request's KV
leaves the host pool and comes back when it resumes):

* ``default``: the default configuration (``{}``: residency on; every request decodes from rows
  of its own, loaded from the host pool);
* ``hot``: hot buffers only (B=128, residency off): short requests preloaded, long ones miss.

Greedy outputs through each pair are compared with a colocated server without HiSparse, token for
token. Every server runs one prefill request per batch (``--prefill-max-requests 1``), so a
request's prefill is computed alike whether it arrives alone or with others, colocated or in PD.
Also: two requests aborted mid-decode, a request sent to a decode instance without bootstrap
fields (refused alone, HTTP 400; the server keeps serving), and a transfer that never comes (the
request ends with a reason after ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``). After each, every
pool of the decode instance is back at its initial count (``leak=no``).

Needs the non-CUDA build of mooncake's transfer engine (``mooncake-transfer-engine-non-cuda``, a
test dependency) and ``libibverbs.so.1`` (scripts/venv.sh installs Debian's libibverbs1 when it
is missing).
"""

from __future__ import annotations

import random
import time
import urllib.error
from types import SimpleNamespace

import pytest

from serving import settle, start_all, stop_soon
from sglang_hisparse_testkit.pd import PD_ENV, RoutedPair, decode_args, prefill_args, unpaired_request
from sglang_hisparse.serving.launcher import abort_two_mid_decode, free_port, post_json, wait_for_idle_report

pytestmark = pytest.mark.slow

COMMON = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
          "--max-running-requests", "8", "--prefill-max-requests", "1"]
CONTEXTS = [200, 500, 900, 1300, 1700, 2100, 2600, 3000]
NEW_TOKENS = 48
WAITING_TIMEOUT_S = 40
DECODES = {
    "default": ("{}", {"SGLANG_TEST_RETRACT": "1"}),
    "hot": ('{"device_buffer_size": 128, "residency": false}',
            {"SGLANG_TEST_RETRACT": "1", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S)}),
}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 2000) for _ in range(n)] for n in CONTEXTS]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (pip install .[test])",
                        exc_type=ImportError)
    logs = tmp_path_factory.mktemp("pd_mooncake")
    bootstrap_port = free_port()
    specs = [dict(name="baseline", extra_args=COMMON, log_dir=logs),
             dict(name="prefill", extra_args=COMMON + prefill_args(bootstrap_port), env=PD_ENV, log_dir=logs)]
    specs += [dict(name=f"decode_{name}", hisparse_config=config, extra_args=COMMON + decode_args(),
                   env={**PD_ENV, "SGLANG_HISPARSE_TRAP_UPSTREAM": "1", **env}, log_dir=logs)
              for name, (config, env) in DECODES.items()]
    started = start_all(*specs, workers=4)
    base, prefill, *decodes = started
    pairs = {name: RoutedPair(prefill, decode, bootstrap_port) for name, decode in zip(DECODES, decodes)}
    yield SimpleNamespace(base=base, prefill=prefill, pairs=pairs, bootstrap_port=bootstrap_port)
    for pair in pairs.values():
        pair.close()
    stop_soon(started)


@pytest.fixture(scope="module")
def baseline_outputs(servers):
    return [o["output_ids"] for o in servers.base.generate(prompts(), NEW_TOKENS)]


def assert_back_to_initial(report: dict) -> None:
    assert not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)


@pytest.mark.parametrize("decode", list(DECODES))
def test_a_pd_pair_with_a_real_transfer_matches_the_colocated_server(servers, baseline_outputs, decode):
    pair = servers.pairs[decode]
    before = settle(pair.decode)
    outputs = [o["output_ids"] for o in pair.generate(prompts(), NEW_TOKENS)]
    first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                   for x, y in zip(baseline_outputs, outputs)]
    assert outputs == baseline_outputs, f"first differing token per request: {first_diffs}"
    assert all(len(set(o)) > NEW_TOKENS // 4 for o in outputs), "degenerate outputs prove nothing"
    report = wait_for_idle_report(pair.decode, after=before)
    assert_back_to_initial(report)
    log = pair.decode.log()
    assert "Testing retraction" in log, "no request was retracted: the resume path was not exercised"
    assert "trap: sglang." not in log and "trap: installed on" in log
    if decode == "default":
        assert report["admitted_resident"] >= len(CONTEXTS) and report["misses"] == 0, report
    else:
        assert report["misses"] > 0, "the long requests never missed: nothing came from host rows"


def test_aborts_through_the_pair_leave_every_pool_at_its_initial_count(servers):
    pair = servers.pairs["default"]
    before = settle(pair.decode)
    client = SimpleNamespace(generate=pair.generate, abort=pair.abort, log=pair.decode.log)
    outcome = abort_two_mid_decode(client, [100, 700, 1500, 300], 240, seed=3)
    assert set(outcome["aborted"]) <= {"abort"} and all(outcome["finished"]), outcome
    assert_back_to_initial(wait_for_idle_report(pair.decode, after=before))


@pytest.mark.parametrize("fields, reason", [
    ({"bootstrap_room": 12345}, "without bootstrap_host; send requests to the PD router"),  # ours (SGLang's scheduler died)
    ({}, "without bootstrap room id"),  # SGLang's own check, in the tokenizer manager
])
def test_a_request_without_bootstrap_fields_is_refused_alone_and_the_server_keeps_serving(
        servers, baseline_outputs, fields, reason):
    pair = servers.pairs["default"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_json(f"{pair.decode.url}/generate", unpaired_request(prompts()[0], 8, **fields), 60)
    assert refused.value.code == 400
    message = refused.value.read().decode()
    assert reason in message, message
    assert pair.decode.process.poll() is None, "the decode instance died"
    assert pair.generate(prompts()[1], NEW_TOKENS)["output_ids"] == baseline_outputs[1]


def test_a_transfer_that_never_comes_ends_the_request_with_a_reason_and_frees_its_rows(servers):
    """Only the decode half of a pair is sent: the decode instance preallocates logical ids and
    host rows, waits for KV that the prefill instance never sends, and fails the request after
    ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``; its rows come back."""
    pair = servers.pairs["hot"]
    before = settle(pair.decode)
    body = unpaired_request(prompts()[2], 8, bootstrap_host="127.0.0.1", bootstrap_port=servers.bootstrap_port,
                            bootstrap_room=random.Random(7).getrandbits(62))
    started = time.time()
    try:
        out = post_json(f"{pair.decode.url}/generate", body, 4 * WAITING_TIMEOUT_S)
        reason = out["meta_info"]["finish_reason"]
    except urllib.error.HTTPError as e:  # SGLang answers an aborted request with its status code
        reason = e.read().decode()
    assert time.time() - started >= WAITING_TIMEOUT_S * 0.9
    assert "timed out" in str(reason), reason
    assert_back_to_initial(wait_for_idle_report(pair.decode, after=before))
