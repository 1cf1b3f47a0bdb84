"""scripts/gpu/e2e.py's own logic on CPU servers, so that a device call does not find its bugs.

The GPU-only parts (model, FlashMLA flags) are replaced: ``launch`` starts the CPU tiny model and
the request sizes shrink. Everything else runs as on the H200: both workloads, the baseline per
(graph mode, workload), comparison, decode traces, output digests, the idle report, aborts, the
throughput levels and their decode numbers read from the server log.

The default tier runs one exactness row (a baseline and ours, flags reaching both servers and the
row); the full tier runs every workload, the throughput rows, the launch-scripts job and the sweep
(about twenty servers, started one after another as the scripts do).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from serving import QUIET, start

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import e2e  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def cpu_e2e(tmp_path, monkeypatch):
    started: list[str] = []
    asked: list[tuple] = []

    def launch(impl, *, buffer, ratio, graph, max_total_tokens, max_running, log_dir, stats_interval=0,
               graph_bs=None, tag="", overlap=True, wait_for_staging=False, model="tiny-dsa", more_flags=(),
               kv_dtype="bfloat16", more_env=None):
        # CPU servers run without CUDA graphs whatever ``graph`` asks (throughput asks for them), and
        # without overlap scheduling whatever ``overlap`` asks (``asked`` records what was asked)
        config = e2e.hisparse_config(impl, buffer, ratio, stats_interval, wait_for_staging)
        name = e2e.server_name(impl, buffer, False, tag=tag)
        started.append(name)
        asked.append((name, overlap, config))
        cpu_model = {"tiny-dsa": "tiny-dsa-cpu", "tiny-dsa-indexshare": "tiny-dsa-cpu-indexshare",
                     "tiny-dsa-mtp": "tiny-dsa-cpu-mtp"}[model]
        return start(model=cpu_model, hisparse_config=config, log_dir=log_dir, name=name, env=more_env,
                     max_total_tokens=max_total_tokens,
                     extra_args=["--mem-fraction-static", "0.5", "--disable-overlap-schedule",
                                 "--chunked-prefill-size", "16384", "--max-running-requests", str(max_running),
                                 "--decode-log-interval", "1", *more_flags])

    monkeypatch.setattr(e2e, "launch", launch)
    monkeypatch.setattr(e2e, "LOG_DIR", tmp_path / "logs")
    monkeypatch.setattr(e2e, "VOCAB", 2000)  # the CPU model's vocabulary is 2048
    monkeypatch.setattr(e2e, "FIRST_WAVE", [300, 700, 1100, 200])  # B=128: all longer than B
    monkeypatch.setattr(e2e, "SECOND_WAVE", [400, 900, 250])
    monkeypatch.setattr(e2e, "ABORTED", (1,))
    return tmp_path, started, asked


@pytest.mark.full
def test_exactness_rows_on_cpu(cpu_e2e):
    tmp_path, started, _ = cpu_e2e
    args = e2e.build_parser().parse_args([
        "exactness", "--configs", "ours_hot:128:0:lockstep,ours:128:0:arrival,none:128:0:lockstep", "--ratio", "2",
        "--budget-s", "3000", "--new-tokens", "24", "--max-total-tokens", "16384", "--max-running", "8",
        "--out", str(tmp_path / "x.json")])
    rows = e2e.exactness(args)["exactness"]
    assert [r.get("error") for r in rows] == [None, None, None], rows
    lockstep, arrival, repeat = rows
    # one baseline per (graph, workload); a repeated baseline gets its own log
    assert started == ["none_B128_g0_lockstep", "ours_hot_B128_g0_lockstep_0", "none_B128_g0_arrival",
                       "ours_B128_g0_arrival_1", "none_B128_g0_lockstep_2"]
    assert lockstep["sequences"] == 7 and arrival["sequences"] == 6  # all 7 / all but the aborted one
    assert lockstep["identical"] == 7 and repeat["identical"] == 7
    assert lockstep["digests"] == lockstep["baseline_digests"] == repeat["digests"]
    assert lockstep["decode_trace"].endswith(lockstep["baseline_decode_trace"].split(" ", 1)[1])
    assert arrival["aborted_finish"][0]["type"] == "abort"
    assert arrival["digests"]["w2-1"] is not None  # the aborted request returned its tokens so far
    hot, default = lockstep["idle_report"], arrival["idle_report"]
    assert not hot["leak"] and hot["misses"] > 0, hot  # hot buffers: selections copied from host
    assert not default["leak"] and default["admitted_resident"] >= 6 and default["misses"] == 0, default  # residency
    assert json.loads(Path(args.out).read_text())["exactness"][2]["identical"] == 7


def test_model_no_overlap_and_wait_for_staging_reach_the_servers_and_the_rows(cpu_e2e):
    tmp_path, _, asked = cpu_e2e
    args = e2e.build_parser().parse_args([
        "exactness", "--configs", "ours:128:0:lockstep", "--ratio", "2", "--new-tokens", "8",
        "--max-total-tokens", "16384", "--max-running", "8", "--no-overlap", "--wait-for-staging",
        "--model", "tiny-dsa-indexshare", "--out", str(tmp_path / "w.json")])
    (row,) = e2e.exactness(args)["exactness"]
    assert row.get("error") is None, row
    assert row["overlap_schedule"] is False and row["wait_for_staging"] is True
    assert row["model"] == "tiny-dsa-indexshare"
    assert row["kv_dtype"] == "bfloat16" and row["speculative"] is None
    (base_name, base_overlap, base_config), (name, overlap, config) = asked
    assert base_name.startswith("none") and base_config is None and base_overlap is False
    assert name.startswith("ours") and overlap is False and json.loads(config)["wait_for_staging"] is True
    assert row["identical"] == row["sequences"] == 7
    assert row["decode_trace"] == row["baseline_decode_trace"]


@pytest.mark.full
def test_throughput_rows_on_cpu(cpu_e2e):
    tmp_path, _, _ = cpu_e2e
    args = e2e.build_parser().parse_args([
        "throughput", "--impls", "none,ours_hot", "--concurrency", "1,3", "--context", "400", "--new-tokens", "12",
        "--buffer", "128", "--ratio", "2", "--max-total-tokens", "16384", "--budget-s", "3000",
        "--out", str(tmp_path / "t.json")])
    rows = e2e.throughput(args)["throughput"]
    assert [(r["impl"], r["concurrency"]) for r in rows] == [("none", 1), ("none", 3), ("ours_hot", 1), ("ours_hot", 3)]
    for r in rows:
        assert r["max_running"] == r["concurrency"] and r["decode_steps"] >= 9, r
        assert r["decode_tok_s"] > 0 and r["tpot_ms"] > 0
    assert [r["miss_rate"] is None for r in rows] == [True, True, False, False]


@pytest.mark.full
def test_launch_scripts_job_on_cpu(tmp_path, monkeypatch):
    """The GPU job that runs scripts/launch/colocated.sh and pd_decode.sh (fake transfer, test
    retractions) at tiny scale, here with the CPU engine."""
    from sglang_hisparse.serving.launcher import server_env

    for key, value in server_env(cpu=True).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(e2e, "LOG_DIR", tmp_path / "logs")
    monkeypatch.setattr(e2e, "VOCAB", 2000)
    args = e2e.build_parser().parse_args([
        "launch-scripts", "--model", "tiny-dsa-cpu", "--device", "cpu", "--contexts", "100,300,700",
        "--new-tokens", "24", "--buffer", "128", "--ratio", "2", "--max-total-tokens", "16384",
        "--server-args=--disable-overlap-schedule " + " ".join(QUIET), "--out", str(tmp_path / "ls.json")])
    rows = e2e.launch_scripts(args)["launch_scripts"]
    assert [r["script"] for r in rows] == ["colocated.sh", "pd_decode.sh"], rows
    for row in rows:
        assert "error" not in row, row
        assert row["completed"] == row["requests"] == 3 and row["pools_back_to_initial"], row
    assert rows[0]["retractions"] == 0 and rows[1]["retractions"] > 0


@pytest.mark.full
def test_sweep_on_cpu(cpu_e2e):
    """scripts/gpu/sweep.py end to end at tiny sizes: rows of perf.json's schema per point and level,
    repeats with their spread, miss rates from our Prometheus series (realistic locality at B = 2 x
    top_k lands low, no locality high), no bytes moved by the no-IO oracle, the per-layer timing."""
    import sweep

    tmp_path, started, _ = cpu_e2e
    args = sweep.build_parser().parse_args([
        "--points", "none:realistic,ours_hot:realistic,ours_noio:realistic,ours_hot:none,ours:realistic",
        "--concurrency", "1,2",
        "--context", "1500", "--new-tokens", "24", "--repeats", "2", "--buffer", "128", "--ratio", "2",
        "--max-total-tokens", "32768", "--timing-context", "300", "--timing-new-tokens", "8", "--budget-s", "3000",
        "--out", str(tmp_path / "sweep.json")])
    result = sweep.sweep(args)
    assert result["skipped"] == [], result["skipped"]
    rows = {(r["impl"], r["locality"], r["concurrency"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((i, l, c) for i, l in [("none", "realistic"), ("ours_hot", "realistic"),
                                                          ("ours_noio", "realistic"), ("ours_hot", "none"),
                                                          ("ours", "realistic")] for c in (1, 2))
    for row in rows.values():
        assert row["repeats"] == 2 and len(row["runs"]) == 2, row
        low, high = row["decode_tok_s_spread"]
        assert 0 < low <= row["decode_tok_s"] <= high and row["tpot_ms"] > 0 and row["held"] == row["concurrency"], row
    assert rows[("none", "realistic", 1)]["miss_rate"] is None and "host_us_per_step" not in rows[("none", "realistic", 1)]
    assert all(rows[(impl, "realistic", c)]["host_us_per_step"] > 0 for impl in ("ours", "ours_hot") for c in (1, 2))
    assert all(rows[("ours_hot", "realistic", c)]["miss_rate"] < 0.3 < 0.8 < rows[("ours_hot", "none", c)]["miss_rate"]
               for c in (1, 2))
    assert all(rows[("ours_hot", "realistic", c)]["io_gb_s"] > 0 == rows[("ours_noio", "realistic", c)]["io_gb_s"]
               for c in (1, 2))
    assert all(rows[("ours", "realistic", c)]["miss_rate"] is None for c in (1, 2))  # the default: resident, nothing selected
    assert [t["concurrency"] for t in result["layer_timing"]] == [1, 2]
    assert all(t["per_layer_ms"] == t["tpot_ms"] / result["layers"] > 0 for t in result["layer_timing"])
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][0]["impl"] == "none"
