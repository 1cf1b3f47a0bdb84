"""Speculative decoding (NEXTN, linear, one draft step: N = 2 verify tokens per request) on SGLang's
CPU engine, with and without our HiSparse (docs/speculative.md).

* HiSparse + speculation gives the same greedy tokens as the same speculative server without
  HiSparse, for requests both shorter and longer than the hot buffer (B = 192, top_k 64): with the
  model's own acceptance (random weights reject almost every draft: each verify window leaves a
  rejected draft behind, which the next window must overwrite) and with every draft accepted
  (SGLang's simulated acceptance, ``SGLANG_SIMULATE_ACC_LEN=2`` with real draft tokens: each
  window's draft position is committed from its window slot). Misses happened, and every pool is
  back at its initial free count afterwards.
* Requests aborted mid-decode (on the accept-all HiSparse server, after its comparison) leave every
  pool at its initial free count.
* More draft steps are refused on CPU in one line (no multi-step draft decode backend there).
  (SGLang's CPU engine turns the overlap scheduler off for speculation itself; our refusal of
  speculation with it on is covered by tests/test_server_checks.py.)

Each pair of servers starts side by side, the refused one next to the first pair.
"""

from __future__ import annotations

import random

import pytest

from serving import settle, start_all, start_in_background, stop_soon
from sglang_hisparse.serving.launcher import abort_two_mid_decode, wait_for_idle_report

pytestmark = pytest.mark.slow

MODEL = "tiny-dsa-cpu-mtp"
COMMON = ["--mem-fraction-static", "0.5", "--chunked-prefill-size", "16384", "--max-running-requests", "8"]
NO_OVERLAP = ["--disable-overlap-schedule"]
HISPARSE = '{"device_buffer_size": 192, "stats_log_interval": 8}'
CONTEXTS = [60, 300, 700, 1300]
NEW_TOKENS = 40
ACCEPT_ALL = {"SGLANG_SIMULATE_ACC_LEN": "2", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}


def _spec(steps: int) -> list[str]:
    return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(steps + 1)]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 2000) for _ in range(n)] for n in CONTEXTS]


def _pair(logs, name: str, env=None) -> list:
    """The speculative server without HiSparse and the same with it, started side by side."""
    return start_all(*(dict(model=MODEL, hisparse_config=config, extra_args=COMMON + NO_OVERLAP + _spec(1), env=env,
                            log_dir=logs, name=n) for n, config in ((name, None), (f"{name}_hisparse", HISPARSE))))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_cpu_spec")


@pytest.fixture(scope="module")
def two_steps(logs):
    """The start of a server asking for two draft steps (a Future), begun before the first pair so
    that they start side by side."""
    return start_in_background(model=MODEL, extra_args=COMMON + NO_OVERLAP + _spec(2), log_dir=logs, name="spec2")


@pytest.fixture(scope="module")
def own_acceptance(logs, two_steps):
    servers = _pair(logs, "spec")
    yield servers
    stop_soon(servers)


@pytest.fixture(scope="module")
def accept_all(logs):
    servers = _pair(logs, "spec_acc", env=ACCEPT_ALL)
    yield servers
    stop_soon(servers)


def _generate(server, hisparse: bool):
    """The prompts' greedy outputs, meta infos and (HiSparse) the idle report after them."""
    before = settle(server)
    results = server.generate(_prompts(), NEW_TOKENS)
    report = wait_for_idle_report(server, after=before) if hisparse else None
    return [r["output_ids"] for r in results], [r["meta_info"] for r in results], report


def _assert_identical_and_clean(base, ours) -> None:
    (base_out, _, _), (our_out, metas, report) = base, ours
    assert all(len(o) == NEW_TOKENS for o in our_out)
    first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(base_out, our_out)]
    assert our_out == base_out, f"first differing token per request: {first_diffs}"
    assert all(len(set(o)) > NEW_TOKENS // 4 for o in our_out), "degenerate outputs prove nothing"
    assert all(m["spec_verify_ct"] >= 1 for m in metas)
    assert not report["leak"], report
    assert report["misses"] > 0 and report["selected"] > report["misses"], report


def test_outputs_identical_to_speculation_without_hisparse(own_acceptance):
    base, ours = own_acceptance
    base, ours = _generate(base, hisparse=False), _generate(ours, hisparse=True)
    _assert_identical_and_clean(base, ours)
    assert all(m["spec_accept_length"] < 1.5 for m in ours[1])  # drafts rejected: stale windows exercised


def test_outputs_identical_when_every_draft_is_accepted(accept_all):
    base, ours = accept_all
    base, ours = _generate(base, hisparse=False), _generate(ours, hisparse=True)
    _assert_identical_and_clean(base, ours)
    assert all(m["spec_accept_length"] >= 1.9 for m in ours[1])  # two tokens per verify step


def test_aborts_mid_decode_leave_every_pool_at_its_initial_free_count(accept_all):
    server = accept_all[1]
    before = settle(server)
    outcome = abort_two_mid_decode(server, [100, 700, 1500, 300], 300, seed=1)
    assert set(outcome["aborted"]) <= {"abort"} and all(outcome["finished"]), outcome
    report = wait_for_idle_report(server, after=before)
    assert not report["leak"], report
    assert report["selected"] > 0, report  # the report of this workload, not the start-up one
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)


def test_more_draft_steps_are_refused_on_cpu_in_one_line(two_steps):
    try:
        server = two_steps.result(timeout=900)
    except RuntimeError as e:
        assert "--speculative-num-steps=2 needs a multi-step draft decode backend" in str(e)
    else:
        stop_soon(server)
        pytest.fail("a CPU server with two draft steps started")
