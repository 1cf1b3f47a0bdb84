"""End to end on CPU: a PD decode instance with our HiSparse and its radix cache on
(``--disaggregation-decode-enable-radix-cache``) asks the prefill instance only for what it does
not hold (``prefix/pd_prefix.py``), against SGLang's own decode radix cache without HiSparse.

One prefill instance (mooncake over TCP on 127.0.0.1, its radix cache off, so that it computes
every request the same way whichever decode instance it serves) and two decode instances, both
with the decode radix cache: SGLang's without HiSparse (the baseline: a cached prefix on the
device) and ours with the default configuration (``{}``: a cached prefix in host rows, lent to
the request; the prefill sends only the rest). Both decode instances hold the KV of the replies
they decoded, so a later turn's prefix is their own decode's KV in both.

* Multi-turn conversations (each turn re-sends the whole conversation plus a new message) and
  requests sharing a long system prefix: greedy outputs identical to the baseline, the same
  ``cached_tokens``, and ours' idle report says the prefill did not send those tokens
  (``not_sent=``) — the count fails if the decode asks for everything.
* Two requests aborted mid-decode while they borrow a cached prefix's host rows, and a request
  whose transfer never comes (only the decode half is sent; it fails after
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``) with a cached prefix lent: every pool back
  (``leak=no``), the prefix still cached.
* ``/flush_cache`` on ours: nothing cached, every pool at its initial count (``leak=no``).
"""

from __future__ import annotations

import random
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from serving import converse, settle, start_all, stop_soon
from sglang_hisparse.serving.launcher import abort_two_mid_decode, free_port, post_json, wait_for_idle_report
from sglang_hisparse_testkit.pd import PD_ENV, RoutedPair, decode_args, prefill_args, unpaired_request

pytestmark = pytest.mark.slow

COMMON = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
          "--max-running-requests", "8", "--prefill-max-requests", "1"]
DECODE_RADIX = ["--disaggregation-decode-enable-radix-cache"]
NEW_TOKENS = 24
WAITING_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (pip install .[test])",
                        exc_type=ImportError)
    logs = tmp_path_factory.mktemp("pd_prefix")
    bootstrap_port = free_port()
    specs = [dict(name="prefill", extra_args=COMMON + prefill_args(bootstrap_port), env=PD_ENV, log_dir=logs),
             dict(name="decode_base_radix", extra_args=COMMON + decode_args() + DECODE_RADIX, radix_cache=True,
                  env=PD_ENV, log_dir=logs),
             dict(name="decode_ours_radix", hisparse_config="{}", extra_args=COMMON + decode_args() + DECODE_RADIX,
                  radix_cache=True, log_dir=logs,
                  env={**PD_ENV, "SGLANG_HISPARSE_TRAP_UPSTREAM": "1",
                       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S)}),
             dict(name="decode_ours_radix_retract", hisparse_config="{}", radix_cache=True, log_dir=logs,
                  extra_args=COMMON + decode_args() + DECODE_RADIX, env={**PD_ENV, "SGLANG_TEST_RETRACT": "1"})]
    started = start_all(*specs, workers=4)
    prefill, *decodes = started
    routed = {name: RoutedPair(prefill, decode, bootstrap_port) for name, decode in zip(("base", "ours", "retract"), decodes)}
    yield SimpleNamespace(pairs=routed, bootstrap_port=bootstrap_port)
    for pair in routed.values():
        pair.close()
    stop_soon(started)


def run(pair, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    outs = pair.generate(prompts, NEW_TOKENS)
    outs = outs if isinstance(outs, list) else [outs]
    return [(o["output_ids"], int(o["meta_info"]["cached_tokens"])) for o in outs]


def multi_turn(pair, seed: int) -> list[tuple[list[int], int]]:
    """Two conversations of three turns, alternating; every turn sends the history plus a message."""
    rng = random.Random(seed)
    convs = [[[rng.randrange(2, 2000) for _ in range(n)] for n in lengths] for lengths in ([700, 150, 260], [420, 333, 90])]
    return converse(lambda prompt: run(pair, [prompt])[0], convs, turns=3)


def system_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 2000) for _ in range(1100)]


def shared_prefix(pair, seed: int) -> list[tuple[list[int], int]]:
    """A 1100-token system prompt: one request first, then four more one after another."""
    rng = random.Random(seed + 1)
    system = system_prompt(seed)
    users = [[rng.randrange(2, 2000) for _ in range(n)] for n in (120, 40, 300, 75, 210)]
    return [result for user in users for result in run(pair, [system + user])]


def test_a_prefix_the_decode_instance_holds_is_not_sent_again_and_outputs_match(servers):
    pairs = servers.pairs
    ours_server = pairs["ours"].decode
    before = settle(ours_server)
    for workload in (multi_turn, shared_prefix):
        base, ours = workload(pairs["base"], 5), workload(pairs["ours"], 5)
        outputs, base_outputs = [o for o, _ in ours], [o for o, _ in base]
        first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                       for x, y in zip(base_outputs, outputs)]
        assert outputs == base_outputs, f"{workload.__name__}: first differing token per request: {first_diffs}"
        assert [c for _, c in ours] == [c for _, c in base], workload.__name__
        assert sum(c for _, c in base) > 0, "the baseline reused nothing: the workload proves nothing"
        assert all(len(set(o)) > NEW_TOKENS // 4 for o in outputs), "degenerate outputs prove nothing"
    report = wait_for_idle_report(ours_server, after=before)
    assert not report["leak"], report
    assert report["not_sent"] > 0 and report["cached"] > 0, report
    log = ours_server.log()
    assert "trap: sglang." not in log and "trap: installed on" in log


def test_requests_retracted_with_a_lent_prefix_come_back_exact(servers):
    """The same workloads through ours with a retraction every third step (``SGLANG_TEST_RETRACT``:
    a retracted request's KV leaves the host pool, the loan of the prefix ends, it resumes with rows
    of its own): outputs identical to SGLang's decode radix cache, no leak."""
    pairs, retract = servers.pairs, servers.pairs["retract"].decode
    before = settle(retract)
    for workload in (multi_turn, shared_prefix):
        base, ours = workload(pairs["base"], 7), workload(pairs["retract"], 7)
        assert [o for o, _ in ours] == [o for o, _ in base], workload.__name__
    report = wait_for_idle_report(retract, after=before)
    assert not report["leak"] and report["not_sent"] > 0, report
    assert "Testing retraction" in retract.log(), "no request was retracted"


def test_aborts_and_a_failed_transfer_with_a_lent_prefix_leave_every_pool_back(servers):
    pair = servers.pairs["ours"]
    system = system_prompt(5)
    pair.generate(system + [7, 8, 9], 4)  # the system prompt is cached (again, if an earlier test ran)
    before = settle(pair.decode)
    held = wait_for_idle_report(pair.decode)["not_sent"]
    client = SimpleNamespace(generate=pair.generate, abort=pair.abort, log=pair.decode.log)
    outcome = abort_two_mid_decode(client, [100, 700, 1500, 300], 240, seed=3, prefix=system)
    assert set(outcome["aborted"]) <= {"abort"} and all(outcome["finished"]), outcome
    report = wait_for_idle_report(pair.decode, after=before)
    assert not report["leak"] and report["not_sent"] >= held + 4 * 1024, report

    before = settle(pair.decode)
    body = unpaired_request(system + [11, 12, 13], 8, bootstrap_host="127.0.0.1", bootstrap_port=servers.bootstrap_port,
                            bootstrap_room=random.Random(11).getrandbits(62))
    started = time.time()
    try:
        reason = post_json(f"{pair.decode.url}/generate", body, 4 * WAITING_TIMEOUT_S)["meta_info"]["finish_reason"]
    except urllib.error.HTTPError as e:  # SGLang answers an aborted request with its status code
        reason = e.read().decode()
    assert time.time() - started >= WAITING_TIMEOUT_S * 0.9 and "timed out" in str(reason), reason
    report = wait_for_idle_report(pair.decode, after=before)
    assert not report["leak"] and report["cached"] >= 1024, report
    assert report["not_sent"] >= held + 5 * 1024, "the failed request did not borrow the cached prefix"
    assert pair.generate(system + [7, 8, 9], 4)["output_ids"], "the server keeps serving"


def test_flushing_the_cache_gives_every_row_back(servers):
    ours_server = servers.pairs["ours"].decode
    settled = settle(ours_server)
    with urllib.request.urlopen(f"{ours_server.url}/flush_cache", timeout=60) as response:
        response.read()
    report = wait_for_idle_report(ours_server, after=settled)
    assert not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)
    assert report["cached"] == 0, report
