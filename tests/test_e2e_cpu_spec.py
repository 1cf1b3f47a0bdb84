"""Speculative decoding (NEXTN, linear, one draft step) on SGLang's CPU engine, without HiSparse:
the ground the HiSparse + speculation work of #18 will stand on (docs/speculative.md).

* A CPU server of ``tiny-dsa-cpu-mtp`` (one NextN layer) with ``--speculative-algorithm NEXTN
  --speculative-num-steps 1`` serves a batch: every request runs verify steps and returns its
  tokens (the draft backend, the seven stand-in ops and the verify layout of the torch DSA
  backend all run). Random weights accept almost nothing; the test does not depend on it.
* More draft steps are refused on CPU in one line (no multi-step draft decode backend there).
* With ``--enable-hisparse`` the launch is refused in one line (not supported yet; SGLang has
  resolved NEXTN to EAGLE by then).
"""

from __future__ import annotations

import random

import pytest

from sglang_hisparse.testing.server import start_server

pytestmark = pytest.mark.slow

MODEL = "tiny-dsa-cpu-mtp"
COMMON = ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--chunked-prefill-size", "16384",
          "--max-running-requests", "8"]


def _spec(steps: int) -> list[str]:
    return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(steps + 1)]


def test_a_speculative_cpu_server_verifies_and_answers(tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 2000) for _ in range(n)] for n in (60, 300, 700)]
    server = start_server(model=MODEL, extra_args=COMMON + _spec(1), log_dir=tmp_path, name="spec")
    try:
        results = server.generate(prompts, 24)
    finally:
        server.stop()
    for r in results:
        meta = r["meta_info"]
        assert len(r["output_ids"]) == 24 and meta["finish_reason"]["type"] == "length"
        assert meta["spec_verify_ct"] >= 12  # at most 2 tokens per verify step after the prefill's first
        assert meta["spec_accept_length"] >= 1.0


def test_more_draft_steps_are_refused_on_cpu_in_one_line(tmp_path):
    with pytest.raises(RuntimeError, match="--speculative-num-steps=2 needs a multi-step draft decode backend"):
        start_server(model=MODEL, extra_args=COMMON + _spec(2), log_dir=tmp_path, name="spec2")


def test_hisparse_with_speculation_is_refused_at_launch(tmp_path):
    with pytest.raises(RuntimeError, match="--speculative-algorithm=EAGLE is not supported by sglang-hisparse yet"):
        start_server(model=MODEL, hisparse_config='{"device_buffer_size": 128}', extra_args=COMMON + _spec(1),
                     log_dir=tmp_path, name="spec_hisparse")
