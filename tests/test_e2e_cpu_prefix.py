"""End to end on CPU: prefix reuse, ours with SGLang's radix cache on, against the server without
HiSparse with the radix cache on.

* Multi-turn conversations (each turn re-sends the whole conversation plus a new message), turn by
  turn: greedy outputs identical, and each later turn served from the cache as much as the
  baseline's (SGLang's ``cached_tokens``, > 0).
* Many requests sharing a long system prefix (one first, then the rest in one batch): identical
  outputs and cached tokens.
* ``/flush_cache``: afterwards the idle report shows nothing cached and every pool at its initial
  count.

Ours runs with the default configuration (``{}``, residency on), with hot buffers only on a small
pool (``residency: false``, B below the contexts: matched prefixes loaded into device rows, then
decoded from a hot buffer that misses; cached prefixes evicted to make room; aborts), and in the
full tier with hot buffers on the large pool. All servers run the deterministic configuration of test_e2e_cpu.py
(no overlap schedule, one prefill batch per step), so ours and the baseline run identical batches.
"""

from __future__ import annotations

import random
import urllib.request

import pytest

from serving import converse, settle, start_all, stop_soon
from sglang_hisparse.serving.launcher import wait_for_idle_report

pytestmark = pytest.mark.slow

HOT_BUFFERS = '{"device_buffer_size": 128, "host_to_device_ratio": 2, "residency": false}'
COMMON = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
          "--max-running-requests", "8"]
NEW_TOKENS = 24


PRESSURE_TOTAL = 4096  # device rows; 8192 logical ids and host rows: three cached groups do not fit beside the running ones


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_cpu_prefix")


def prefix_spec(name: str, config, logs, max_total_tokens: int = 32768) -> dict:
    return dict(name=name, hisparse_config=config, extra_args=COMMON, max_total_tokens=max_total_tokens,
                radix_cache=True, log_dir=logs)


@pytest.fixture(scope="module")
def servers(logs):
    """Side by side: the baseline (radix cache, no HiSparse), ours with the default configuration,
    ours with hot buffers on a small pool (the pressure test)."""
    started = start_all(prefix_spec("baseline_radix", None, logs), prefix_spec("ours_radix_default", "{}", logs),
                        prefix_spec("ours_radix_pressure", HOT_BUFFERS, logs, PRESSURE_TOTAL))
    yield dict(zip(("base", "default", "pressure"), started))
    stop_soon(started)


@pytest.fixture(scope="module")
def hot(servers, logs):
    """Ours with hot buffers only on the large pool (full tier)."""
    started = start_all(prefix_spec("ours_radix_hot", HOT_BUFFERS, logs))
    yield started[0]
    stop_soon(started)


def run(server, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """One /generate of ``prompts`` (a batch): each output's ids and cached tokens."""
    outs = server.generate(prompts, NEW_TOKENS)
    return [(o["output_ids"], int(o["meta_info"]["cached_tokens"])) for o in outs]


def conversations(seed: int) -> list[list[list[int]]]:
    """Two conversations of four user messages each (token ids)."""
    rng = random.Random(seed)
    return [[[rng.randrange(2, 2000) for _ in range(n)] for n in lengths]
            for lengths in ([700, 150, 260, 90], [420, 333, 64, 500])]


def multi_turn(server, seed: int) -> list[tuple[list[int], int]]:
    """The two conversations of :func:`conversations`, four turns each, alternating."""
    return converse(lambda prompt: run(server, [prompt])[0], conversations(seed), turns=4)


def shared_prefix(server, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    system = [rng.randrange(2, 2000) for _ in range(1100)]
    users = [[rng.randrange(2, 2000) for _ in range(n)] for n in (120, 40, 300, 75, 210, 64)]
    first = run(server, [system + users[0]])
    return first + run(server, [system + u for u in users[1:]])


def flush(server) -> None:
    with urllib.request.urlopen(f"{server.url}/flush_cache", timeout=60) as response:
        response.read()


def assert_same(ours: list, base: list) -> None:
    outputs, cached = [o for o, _ in ours], [c for _, c in ours]
    base_outputs, base_cached = [o for o, _ in base], [c for _, c in base]
    first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(base_outputs, outputs)]
    assert outputs == base_outputs, f"first differing token per request: {first_diffs}"
    assert cached == base_cached, (cached, base_cached)
    assert all(len(set(o)) > NEW_TOKENS // 4 for o in outputs), "degenerate outputs prove nothing"


def test_multi_turn_and_shared_prefix_reuse_the_cache_and_match_the_baseline(servers):
    check_multi_turn_and_shared_prefix(servers["base"], servers["default"])


@pytest.mark.full
def test_with_hot_buffers_only_the_same_holds(servers, hot):
    check_multi_turn_and_shared_prefix(servers["base"], hot)


def check_multi_turn_and_shared_prefix(base, ours) -> None:
    base_turns, base_shared = multi_turn(base, 1), shared_prefix(base, 2)
    before = settle(ours)
    ours_turns, ours_shared = multi_turn(ours, 1), shared_prefix(ours, 2)
    assert_same(ours_turns, base_turns)
    assert_same(ours_shared, base_shared)
    assert all(c > 0 for _, c in ours_turns[2:]), "every later turn starts from the cache"
    assert all(c >= 1024 for _, c in ours_shared[1:]), "the shared system prefix comes from the cache"
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"] and report["cached"] > 0, report
    assert 0 < report["lent"] <= report["loaded"], report  # matched prefixes' host rows borrowed, not copied again
    assert report["shared"] > 0, report  # running requests' prompts went into the tree as they started decoding

    before = settle(ours)
    flush(ours)
    flush(base)  # the next test starts from empty caches on both
    report = wait_for_idle_report(ours, after=before)  # the flush counts as activity: one report follows
    assert report["cached"] == 0 and not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)


def while_one_decodes(server, seed: int) -> tuple[list[int], list[tuple[list[int], int]]]:
    """One request with a long system prompt decodes 160 tokens; once it has decoded (a decode
    line after its start), five requests sharing its system prompt come in one batch. Returns the
    first one's output and the five's outputs and cached tokens."""
    import threading
    import time

    rng = random.Random(seed)
    system = [rng.randrange(2, 2000) for _ in range(1300)]
    users = [[rng.randrange(2, 2000) for _ in range(n)] for n in (90, 30, 250, 64, 170, 120)]
    first: dict = {}
    decode_lines = server.log().count("Decode batch")
    thread = threading.Thread(target=lambda: first.update(out=server.generate(system + users[0], 160)))
    thread.start()
    deadline = time.time() + 300
    while server.log().count("Decode batch") <= decode_lines + 2 and time.time() < deadline:
        time.sleep(0.2)
    rest = run(server, [system + u for u in users[1:]])
    thread.join(timeout=900)
    return first["out"]["output_ids"], rest


def test_a_running_requests_prompt_serves_requests_that_arrive_while_it_decodes(servers):
    """A running request's prompt is in the tree once it decodes (``share_running``): requests
    sharing its system prompt load it instead of prefilling it, as SGLang's radix cache serves
    them from the running request; outputs and cached tokens as the baseline's."""
    base, ours = servers["base"], servers["default"]
    base_first, base_rest = while_one_decodes(base, 7)
    before = settle(ours)
    ours_first, ours_rest = while_one_decodes(ours, 7)
    assert ours_first == base_first
    assert_same(ours_rest, base_rest)
    assert all(c >= 1280 for _, c in ours_rest), "the running request's page-aligned system prompt came from the tree"
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"] and report["shared"] > 0 and report["lent"] >= 5 * 1280, report


# --- pressure: the cache must give way ---------------------------------------------------------
def groups(seed: int) -> list[list[list[int]]]:
    """Three system prefixes of 1500 tokens, four users each."""
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        system = [rng.randrange(2, 2000) for _ in range(1500)]
        out.append([system + [rng.randrange(2, 2000) for _ in range(n)] for n in (90, 160, 40, 210)])
    return out


def serve_groups(server, seed: int) -> list[list[int]]:
    """Each group: its first request alone, then the other three in one batch; twice over, so the
    second round finds what the first left (or what eviction left of it)."""
    outputs = []
    for _ in range(2):
        for group in groups(seed):
            outputs += [o for o, _ in run(server, group[:1])]
            outputs += [o for o, _ in run(server, group[1:])]
    return outputs


def abort_two_sharing_a_prefix(server, prompts: list[list[int]], new_tokens: int) -> dict:
    """Send ``prompts`` at once with their own rids, abort the first and the third once a new decode
    step ran, wait for all; returns the finish types of the aborted ones and whether the others
    returned."""
    import threading
    import time
    import uuid

    rids = [f"prefix-abort-{i}-{uuid.uuid4().hex[:8]}" for i in range(len(prompts))]
    results: dict = {}

    def send(rid, ids):
        try:
            results[rid] = server.generate(ids, new_tokens, rid=rid, timeout=900)
        except Exception as e:  # noqa: BLE001 - an aborted request may end with an error status
            results[rid] = e

    decode_lines = server.log().count("Decode batch")
    threads = [threading.Thread(target=send, args=(rid, p)) for rid, p in zip(rids, prompts)]
    for t in threads:
        t.start()
    deadline = time.time() + 300
    while server.log().count("Decode batch") <= decode_lines and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    for rid in (rids[0], rids[2]):
        server.abort(rid)
    for t in threads:
        t.join(timeout=900)
    return {"aborted": [results[r]["meta_info"]["finish_reason"]["type"] for r in (rids[0], rids[2])
                        if isinstance(results.get(r), dict)],
            "finished": [isinstance(results.get(r), dict) for r in rids if r not in (rids[0], rids[2])]}


def test_under_pressure_the_cache_evicts_outputs_stay_identical_and_aborts_leave_pools_consistent(servers):
    """A small pool (4096 device rows): three groups sharing 1500-token prefixes, served twice, do
    not all stay cached; the cache evicts (its ids and host rows), outputs stay identical to the
    baseline's; aborting two of four requests that share a cached prefix mid-decode, and then a
    flush, leave every pool at its initial count."""
    base, ours = servers["base"], servers["pressure"]
    flush(base)
    expected = serve_groups(base, 3)
    before = settle(ours)
    got = serve_groups(ours, 3)
    first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(expected, got)]
    assert got == expected, f"first differing token per request: {first_diffs}"
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"], report
    assert report["evicted"] > 0 and report["loaded"] > 0, report  # the cache gave way, and still served hits

    before = settle(ours)
    outcome = abort_two_sharing_a_prefix(ours, groups(3)[0], 200)
    assert set(outcome["aborted"]) <= {"abort"} and all(outcome["finished"]), outcome
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"], report

    before = settle(ours)
    flush(ours)
    report = wait_for_idle_report(ours, after=before)
    assert report["cached"] == 0 and not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)
