"""End to end on CPU, retraction: SGLang's test retraction (``SGLANG_TEST_RETRACT=1``: a decode
request retracted every third step, prefilled again on resume) on the default configuration and on
hot buffers gives outputs identical to the server without HiSparse retracting the same way, and
every pool is back at its initial count.

A module of its own so that its three servers start after test_e2e_cpu's five have stopped (eight
CPU servers at once exhaust a 24 GiB machine's host memory).
"""

from __future__ import annotations

import re

import pytest

from serving import start_all, stop_soon
from test_e2e_cpu import CONTEXTS, DEFAULT, HISPARSE, NEW_TOKENS, assert_identical, generate_and_report, prompts, spec

pytestmark = pytest.mark.slow

RETRACT = {"SGLANG_TEST_RETRACT": "1"}


@pytest.fixture(scope="module")
def retracting(tmp_path_factory):
    """The server without HiSparse, ours with the default config and ours with hot buffers, each
    retracting a decode request every third step (SGLang's test retraction)."""
    logs = tmp_path_factory.mktemp("e2e_cpu_retract")
    names = ("baseline_retract", "default_retract", "hisparse_retract")
    started = start_all(*(dict(spec(name, config, env=RETRACT), log_dir=logs)
                          for name, config in zip(names, (None, DEFAULT, HISPARSE))))
    servers = dict(zip(("base", "default", "ours"), started))
    baseline = [o["output_ids"] for o in servers["base"].generate(prompts(), NEW_TOKENS)]
    assert retractions(servers["base"]) > 0, "the baseline did not retract"
    yield servers, baseline
    stop_soon(started)


def retractions(server) -> int:
    return sum(int(n) for n in re.findall(r"Testing retraction\. #retracted_reqs: (\d+)", server.log()))


@pytest.mark.parametrize("config", ["default", "ours"])
def test_colocated_retraction_resumes_exactly_and_frees_everything(retracting, config):
    """A retracted request gives back its rows (device rows of a resident one, its hot buffer and
    host rows otherwise) and is prefilled again on resume: outputs identical to the server without
    HiSparse under the same retraction (a retraction alone changes SGLang's outputs: the resumed
    request's KV comes from a prefill, not from the decode steps), pools back at their initial
    counts."""
    servers, baseline = retracting
    server = servers[config]
    outputs, report = generate_and_report(server)
    assert retractions(server) > 0, "no request was retracted: the test exercised nothing"
    assert_identical(outputs, baseline)
    assert not report["leak"] and report["resident"] == 0, report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)
    if config == "default":  # every admission, the resumes too, is resident
        assert report["admitted_resident"] > len(CONTEXTS), report
