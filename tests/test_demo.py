"""The demo (``bash scripts/demo.sh``, ``python -m sglang_hisparse.tools.demo``): the flags both of its
servers share, and (full tier) the demo itself at a small size on CPU, ending with ``outputs
identical``. The comparison it shows is the default tier's tests/test_e2e_cpu.py."""

from __future__ import annotations

import pytest

from sglang_hisparse.tools import demo


def test_both_servers_run_every_prompt_in_one_prefill_batch():
    assert demo.one_prefill_chunk([1500, 2500]) == 16384
    assert demo.one_prefill_chunk([9000, 9000]) == 18048 and 18048 % demo.PAGE_SIZE == 0
    flags, env = demo.server_flags([1500, 2500, 3000, 3500], cpu=True)
    assert flags[flags.index("--chunked-prefill-size") + 1] == "16384"
    assert flags[flags.index("--max-running-requests") + 1] == "4" and "--disable-overlap-schedule" in flags
    assert env == {"SGLANG_HISPARSE_DUMMY_LOCALITY": "realistic"}
    gpu_flags, gpu_env = demo.server_flags([8000, 30000], cpu=False)
    assert gpu_flags[gpu_flags.index("--dsa-decode-backend") + 1] == "flashmla_sparse"
    assert gpu_env["SGLANG_DSA_FUSE_TOPK"] == "0"


@pytest.mark.slow
@pytest.mark.full
def test_the_demo_ends_with_identical_outputs(tmp_path, monkeypatch, capsys):
    from serving import start

    monkeypatch.setattr(demo, "start_server", start)
    assert demo.main(["--contexts", "700,1500", "--new-tokens", "16", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[demo] outputs identical: 2/2 requests, 16 greedy tokens each" in out
    assert "leak: no" in out and "sglang-hisparse step" in out
