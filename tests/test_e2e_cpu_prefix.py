"""End to end on CPU: prefix reuse, ours with SGLang's radix cache on, against the server without
HiSparse with the radix cache on.

* Multi-turn conversations (each turn re-sends the whole conversation plus a new message), turn by
  turn: greedy outputs identical, and each later turn served from the cache as much as the
  baseline's (SGLang's ``cached_tokens``, > 0).
* Many requests sharing a long system prefix (one first, then the rest in one batch): identical
  outputs and cached tokens.
* ``/flush_cache``: afterwards the idle report shows nothing cached and every pool at its initial
  count.

Ours runs twice: with the default configuration (``{}``, residency on) and with hot buffers only
(``residency: false``, B below the contexts: matched prefixes loaded into device rows, then decoded
from a hot buffer that misses). All servers run the deterministic configuration of test_e2e_cpu.py
(no overlap schedule, one prefill batch per step), so ours and the baseline run identical batches.
"""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

from serving import settle, start_all, stop_soon
from sglang_hisparse.serving.launcher import wait_for_idle_report

pytestmark = pytest.mark.slow

HOT_BUFFERS = '{"device_buffer_size": 128, "host_to_device_ratio": 2, "residency": false}'
COMMON = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
          "--max-running-requests", "8"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("e2e_cpu_prefix")
    specs = [dict(name=name, hisparse_config=config, extra_args=COMMON, max_total_tokens=32768, radix_cache=True,
                  log_dir=logs)
             for name, config in (("baseline_radix", None), ("ours_radix_default", "{}"), ("ours_radix_hot", HOT_BUFFERS))]
    started = start_all(*specs)
    yield dict(zip(("base", "default", "hot"), started))
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
    """Each conversation turn by turn (the two conversations alternating): every turn sends the
    history (messages and replies so far) plus the next message."""
    history = [[], []]
    results = []
    convs = conversations(seed)
    for turn in range(4):
        for c, conv in enumerate(convs):
            prompt = history[c] + conv[turn]
            ((output, cached),) = run(server, [prompt])
            history[c] = prompt + output
            results.append((output, cached))
    return results


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


@pytest.mark.parametrize("which", ["default", "hot"])
def test_multi_turn_and_shared_prefix_reuse_the_cache_and_match_the_baseline(servers, which):
    base, ours = servers["base"], servers[which]
    base_turns, base_shared = multi_turn(base, 1), shared_prefix(base, 2)
    before = settle(ours)
    ours_turns, ours_shared = multi_turn(ours, 1), shared_prefix(ours, 2)
    assert_same(ours_turns, base_turns)
    assert_same(ours_shared, base_shared)
    assert all(c > 0 for _, c in ours_turns[2:]), "every later turn starts from the cache"
    assert all(c >= 1024 for _, c in ours_shared[1:]), "the shared system prefix comes from the cache"
    report = wait_for_idle_report(ours, after=before)
    assert not report["leak"] and report["cached"] > 0, report

    before = settle(ours)
    flush(ours)
    flush(base)  # the next parametrization starts from empty caches on both
    report = wait_for_idle_report(ours, after=before)  # the flush counts as activity: one report follows
    assert report["cached"] == 0 and not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)
