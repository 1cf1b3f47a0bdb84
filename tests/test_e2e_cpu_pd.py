"""End to end on CPU: a PD decode instance with our HiSparse and SGLang's ``fake`` transfer backend.

The fake backend moves no KV (the prompt's host rows keep whatever they held), so outputs mean
nothing here; what is checked is the decode instance's life cycle under retraction
(``SGLANG_TEST_RETRACT``: a retraction every third step): start-up (SGLang reads the allocator's
PD budgets), preallocation of logical ids and host rows, direct admission, decode, and retracted
requests leaving the host pool and coming back. Two decode instances run side by side:

* the **default configuration** (``{}``: residency on): requests are admitted resident, a
  retracted resident request gives its device rows back (this leaked before: its ids were
  unmapped by a second ``request_finished``, so SGLang's free could not release its rows);
* **hot buffers only** (residency off, B=128): short requests preloaded, long ones start empty
  and miss.

Afterwards every pool is at its initial count and no function of SGLang's own HiSparse ran (trap
on). Outputs with a real transfer are compared in tests/test_e2e_cpu_pd_mooncake.py; the
exactness of offload and restore is shown in tests/test_pd_decode.py, where the true KV of every
position is known.
"""

from __future__ import annotations

import re

import pytest

from serving import settle, start_all, stop_soon
from sglang_hisparse.serving.launcher import post_json, wait_for_idle_report

pytestmark = pytest.mark.slow

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST
PD_DECODE = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--max-running-requests", "8",
             "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake"]
CONTEXTS = [100, 300, 700, 1500]  # B=128: with hot buffers the first is preloaded, the others start empty
NEW_TOKENS = 40
CONFIGS = {"default": "{}", "hot_buffers": '{"device_buffer_size": 128, "residency": false}'}


@pytest.fixture(scope="module")
def decode_servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    started = start_all(*(dict(hisparse_config=config, extra_args=PD_DECODE, log_dir=logs, name=f"pd_decode_{name}",
                               max_total_tokens=16384,
                               env={"SGLANG_TEST_RETRACT": "1", "SGLANG_HISPARSE_TRAP_UPSTREAM": "1"})
                          for name, config in CONFIGS.items()))
    yield dict(zip(CONFIGS, started))
    stop_soon(started)


def fake_transfer_request(prompts: list[list[int]], rooms: list[int]) -> dict:
    """A /generate body a PD router would send to the decode instance, with SGLang's fake
    bootstrap host (what its own warm-up sends to a fake-backend decode server)."""
    return {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
        "bootstrap_host": [FAKE_BOOTSTRAP_HOST] * len(prompts),
        "bootstrap_room": rooms,
    }


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_pd_decode_instance_serves_retracts_and_resumes_and_frees_everything(decode_servers, config):
    server = decode_servers[config]
    before = settle(server)
    prompts = [[5 + (i * 7) % 1900 for i in range(n)] for n in CONTEXTS]
    outs = post_json(f"{server.url}/generate", fake_transfer_request(prompts, [11, 12, 13, 14]), 600)
    assert [len(o["output_ids"]) for o in outs] == [NEW_TOKENS] * len(CONTEXTS)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    log = server.log()
    retracted = [int(n) for n in re.findall(r"Testing retraction\. #retracted_reqs: (\d+)", log)]
    assert sum(retracted) > 0, "no request was retracted: the test exercised nothing"
    report = wait_for_idle_report(server, after=before)
    assert not report["leak"], report
    for name, (now, initial) in report["counts"].items():
        assert now == initial, (name, now, initial)
    if config == "default":
        # every admission (the first ones and each resume after a retraction) is resident
        assert report["admitted_resident"] > len(CONTEXTS) and report["resident"] == 0, report
    else:
        assert report["misses"] > 0, "the long requests never missed: nothing came from host rows"
    assert "trap: sglang." not in log and "trap: installed on" in log
