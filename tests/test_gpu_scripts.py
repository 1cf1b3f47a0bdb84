"""The GPU-machine helper scripts that run here too: packing a call's outputs under the device
tool's 8-file limit (scripts/gpu/pack_outputs.py), the end-to-end script's configuration syntax
(scripts/gpu/e2e.py), decode throughput from server logs (scripts/gpu/decode_log.py), the
per-step breakdown of a decode profile (scripts/gpu/profile_summary.py), the DeepSeek-V4 probe
(scripts/gpu/v4_probe.py: its options, abort selection, streamed batches and comparisons) and the
prefix-reuse driver (scripts/gpu/prefix_bench.py: options, workloads, TTFT and tok/s arithmetic,
exactness, summary, and the whole driver against stand-in servers)."""

from __future__ import annotations

import json
import os
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import decode_log  # noqa: E402
import pack_outputs  # noqa: E402
import profile_summary  # noqa: E402


def _outputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    out, jit, e2e = tmp_path / "out", tmp_path / "jit", tmp_path / "e2e_logs"
    out.mkdir()
    for name in ("run.log", "suite.log", "sanitizer.log", "extra.log"):
        (out / name).write_text(f"{name}\n" * 10)
    for name in ("kernel_tests.json", "kernel_bench.json", "kernel_bench.md", "kernel_bench.png"):
        (out / name).write_text("{}")
    for cache in ("tvm-ffi", "triton", "deep_gemm", "flashinfer"):
        (jit / cache / "sub").mkdir(parents=True)
        (jit / cache / "sub" / "mod.so").write_bytes(os.urandom(2000))
    e2e.mkdir()
    (e2e / "ours_B4096_g1.log").write_text("server log\n")
    return out, jit, e2e


def test_logs_and_caches_come_back_in_few_files(tmp_path):
    out, jit, e2e = _outputs(tmp_path)
    pack_outputs.pack_logs(out, e2e)
    pack_outputs.pack_jit(out, jit)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["jit.tar.xz", "kernel_bench.json", "kernel_bench.md", "kernel_bench.png",
                     "kernel_tests.json", "logs.tar.xz", "run.log"]
    with tarfile.open(out / "logs.tar.xz") as t:
        assert sorted(t.getnames()) == ["e2e_logs", "e2e_logs/ours_B4096_g1.log", "extra.log", "sanitizer.log",
                                        "suite.log"]
        assert t.extractfile("suite.log").read() == b"suite.log\n" * 10
    with tarfile.open(out / "jit.tar.xz") as t:  # one folder per cache, as run.sh restores them
        assert "tvm-ffi/sub/mod.so" in t.getnames() and "deep_gemm/sub/mod.so" in t.getnames()
        restore = tmp_path / "restore"
        t.extractall(restore)
    assert (restore / "triton" / "sub" / "mod.so").read_bytes() == (jit / "triton" / "sub" / "mod.so").read_bytes()


def test_oversized_caches_split_and_too_large_ones_are_left_out(tmp_path):
    out, jit, _ = _outputs(tmp_path)
    (jit / "tvm-ffi" / "big.so").write_bytes(os.urandom(60_000))  # incompressible
    notes = pack_outputs.pack_jit(out, jit, max_bytes=30_000)
    names = sorted(p.name for p in out.glob("jit*"))
    assert names == ["jit-deep_gemm.tar.xz", "jit-flashinfer.tar.xz", "jit-triton.tar.xz"]
    assert any("tvm-ffi" in n and "left out" in n for n in notes)


def test_nothing_to_pack_writes_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.log").write_text("x")
    assert pack_outputs.pack_logs(out, tmp_path / "missing") == []
    assert pack_outputs.pack_jit(out, tmp_path / "missing") == []
    assert sorted(p.name for p in out.iterdir()) == ["run.log"]


def test_e2e_config_syntax():
    import e2e

    assert e2e.parse_config("ours:4096:F18:arrival", "arrival") == ("ours", 4096, "F18", "arrival")
    assert e2e.parse_config("upstream:2048:0", "lockstep") == ("upstream", 2048, "0", "lockstep")
    assert e2e.parse_config("ours_resident:4096:1", "arrival") == ("ours_resident", 4096, "1", "arrival")
    resident = json.loads(e2e.hisparse_config("ours_resident", 4096, 8))
    assert resident["residency"] is True and resident["residency_watermark"] == e2e.RESIDENCY_WATERMARK
    assert "residency" not in json.loads(e2e.hisparse_config("ours", 4096, 8))  # the default: residency on
    assert json.loads(e2e.hisparse_config("ours_hot", 4096, 8))["residency"] is False
    assert json.loads(e2e.hisparse_config("ours_nopromo", 4096, 8))["promotion_interval"] == 0
    assert json.loads(e2e.hisparse_config("ours_elastic", 4096, 8))["max_device_buffer_size"] == 8192
    assert "max_device_buffer_size" not in json.loads(e2e.hisparse_config("ours", 4096, 8))  # the default: off
    assert "promotion_interval" not in json.loads(e2e.hisparse_config("ours", 4096, 8))  # the default: on
    for variant in ("ours_noio", "ours_reuse", "ours_map", "ours_noprefetch"):  # hot-buffer A/B points
        assert json.loads(e2e.hisparse_config(variant, 4096, 8))["residency"] is False, variant
    assert json.loads(e2e.hisparse_config("ours_reuse", 4096, 8))["replacement"] == "reuse"
    assert "replacement" not in json.loads(e2e.hisparse_config("ours", 4096, 8))
    assert json.loads(e2e.hisparse_config("ours_map", 4096, 8))["slot_map"] is True
    assert "slot_map" not in json.loads(e2e.hisparse_config("ours", 4096, 8))
    with pytest.raises(ValueError, match="ours_resident"):
        e2e.parse_config("mine:4096:1", "arrival")
    assert e2e.parse_graph("1") == (True, None) and e2e.parse_graph("0") == (False, None)
    assert e2e.parse_graph("F24") == (True, 24)
    fixed = e2e.flags(True, 524288, 18, graph_bs=18)
    assert fixed[fixed.index("--cuda-graph-bs") + 1] == "18" and "--disable-cuda-graph" not in fixed
    assert "--disable-cuda-graph" in e2e.flags(False, 524288, 18)
    fp8 = e2e.flags(True, 524288, 18, kv_dtype="fp8_e4m3")
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert fp8[fp8.index("--dsa-decode-backend") + 1] == fp8[fp8.index("--dsa-prefill-backend") + 1] == "flashmla_kv"
    with pytest.raises(ValueError, match="bfloat16, fp8_e4m3"):
        e2e.flags(True, 524288, 18, kv_dtype="fp8_e5m2")
    args = e2e.build_parser().parse_args(["exactness", "--kv-dtype", "fp8_e4m3", "--out", "x.json"])
    assert args.kv_dtype == "fp8_e4m3"
    for bad, message in (("ours:4096:2", "graph mode"), ("ours:4096:F", "graph mode"), ("mine:4096:1", "impl"),
                         ("ours:4096:1:racing", "workload"), ("ours:4096", "impl:B:graph")):
        with pytest.raises(ValueError, match=message):
            e2e.parse_config(bad, "arrival")


# --- decode_log: lines in SGLang 0.5.17's format (docs/results/gpu_run12/logs.tar.xz) ------------
def _prefill(new_tokens: int, running: int = 0) -> str:
    return (f"[2026-11-30 09:02:06] Prefill batch, #new-seq: 1, #new-token: {new_tokens}, #cached-token: 0, "
            f"token usage: 0.06, #running-req: {running}, #queue-req: 0, #pending-token: 0, cuda graph: False, "
            "input throughput (token/s): 4955.87")


def _decode(running: int, rate: float) -> str:
    return (f"[2026-11-30 09:02:02] Decode batch, #running-req: {running}, #token: 64, token usage: 0.00, "
            f"cuda graph: True, gen throughput (token/s): {rate:.2f}, #queue-req: 0")


def test_decode_stats_count_only_steps_after_a_decode_step():
    log = "\n".join(["server starting", _prefill(100), _decode(4, 1.0),  # covers the prefill: left out
                      _decode(4, 400.0), _decode(4, 400.0), _decode(2, 100.0), "INFO other line"])
    batches = decode_log.parse_batches(log)
    assert [b.decode for b in batches] == [False, True, True, True, True]
    stats = decode_log.decode_stats(batches)
    # steps: 4 tokens in 10 ms, 4 in 10 ms, 2 in 20 ms -> 10 tokens in 40 ms
    assert stats["decode_tok_s"] == pytest.approx(250.0)
    assert stats["tpot_ms"] == pytest.approx(10.0) and stats["decode_steps"] == 3 and stats["max_running"] == 4
    assert stats["step_ms_by_running"] == {"2": [1, pytest.approx(20.0)], "4": [2, pytest.approx(10.0)]}
    with pytest.raises(ValueError, match="no decode step"):
        decode_log.decode_stats(decode_log.parse_batches(_prefill(8) + "\n" + _decode(1, 5.0)))


def test_decode_trace_is_run_length_of_batch_sizes():
    log = "\n".join([_decode(1, 1.0), _prefill(8), _decode(17, 9.0), _decode(17, 9.0), _decode(1, 9.0)])
    assert decode_log.decode_trace(decode_log.parse_batches(log)) == "1x1 17x2 1x1"


def test_the_decode_trace_is_read_after_a_one_token_request_settles_the_log():
    """SGLang answers a decode step before it logs the step: the trace is read only after a
    one-token request (a prefill, no decode step) was answered, which the scheduler runs after
    logging every step already answered."""
    import e2e

    events = []

    class Server:
        def generate(self, input_ids, max_new_tokens, **kw):
            events.append(("generate", len(input_ids), max_new_tokens))
            return {"output_ids": [7]}

        def log(self):
            events.append(("log",))
            return "Decode batch, #running-req: 3, gen throughput (token/s): 9.0\n"

    text = e2e.settled_log(Server())
    assert events == [("generate", 4, 1), ("log",)]
    assert decode_log.decode_trace(decode_log.parse_batches(text)) == "3x1"


def test_throughput_run_splits_into_levels_by_prefilled_tokens():
    context = 10
    warmup = [_prefill(4), _decode(1, 10.0), _decode(1, 10.0)]
    level1 = [_prefill(10), _decode(1, 1.0),  # 1-token probe
              _prefill(10), _decode(1, 1.0), _decode(1, 100.0), _decode(1, 100.0)]
    level3 = [_prefill(8), _prefill(8), _prefill(8), _prefill(6),  # probe: 30 tokens in chunks
              _prefill(20), _decode(2, 1.0), _decode(2, 200.0),  # full call, wave 1 of 2 requests
              _prefill(10), _decode(1, 1.0), _decode(1, 50.0)]  # wave 2
    batches = decode_log.parse_batches("\n".join(warmup + level1 + level3))
    parts = decode_log.split_throughput_run(batches, [1, 3], context)
    assert decode_log.decode_stats(parts[1]) == {"decode_tok_s": pytest.approx(100.0), "tpot_ms": pytest.approx(10.0),
                                                 "decode_steps": 2, "max_running": 1,
                                                 "step_ms_by_running": {"1": [2, pytest.approx(10.0)]}}
    stats3 = decode_log.decode_stats(parts[3])
    assert stats3["decode_steps"] == 2 and stats3["max_running"] == 2  # the wave-2 step after its prefill is left out
    assert stats3["decode_tok_s"] == pytest.approx(3 / (0.01 + 0.02))
    with pytest.raises(ValueError, match="overshoot"):
        decode_log.split_throughput_run(batches, [1, 3], 12)
    with pytest.raises(ValueError, match="log ends"):
        decode_log.split_throughput_run(batches, [1, 3, 8], context)


def test_exactness_rows_carry_output_digests():
    import e2e

    a = {"x": {"output_ids": [1, 2, 3]}, "y": {"error": "boom"}}
    b = {"x": {"output_ids": [1, 2, 3]}, "y": {"output_ids": [4]}}
    da, db = e2e.digests(a), e2e.digests(b)
    assert da["x"] == db["x"] and len(da["x"]) == 12 and da["y"] is None and db["y"] is not None
    assert e2e.digests({"x": {"output_ids": [1, 2, 4]}})["x"] != da["x"]


def test_real_throughput_logs_split_into_every_level():
    """gpu_run12's server logs (SGLang 0.5.17 on the H200): each level's 256-token call is found
    and its decode steps counted; the server without HiSparse held 7 of the 32k requests at once."""
    import collect

    rows = json.loads((collect.RESULTS / "gpu_run12" / "tput.json").read_text())["throughput"]
    recomputed = collect.server_side_throughput("gpu_run12", rows)
    assert len(recomputed) == 12
    held = {(r["impl"], r["concurrency"]): r["max_running"] for r in recomputed}
    assert held[("none", 1)] == 1 and all(held[("none", c)] == 7 for c in (8, 32, 64))
    assert held[("ours", 32)] == 32 and held[("upstream", 32)] == 32
    # every request decodes 255 tokens after its first: at least 255 pure steps per wave
    assert all(r["decode_steps"] >= 250 and r["decode_tok_s"] > 0 for r in recomputed)


def test_v4_concurrent_rows_agree_with_the_probes_own_comparison():
    """gpu_v4probe6 (the V4 concurrent phase on the H200): the rows collect.py derives from the
    raw outputs give the first differences the probe recorded itself, aborted requests left out,
    and ours at B=4096 against ours at B=2048."""
    import collect

    data = json.loads((collect.RESULTS / "gpu_v4probe6" / "v4probe.json").read_text())
    rows = {(r["impl"], r["B"]): r for r in collect.v4_concurrent_rows("gpu_v4probe6")}
    for name, row in (("ours", rows[("ours", 2048)]), ("ours@4096", rows[("ours", 4096)]),
                      ("upstream", rows[("upstream", 2048)])):
        recorded = data["compare_concurrent"]["against"][name]
        assert row["first_diff"] == [r["first_diff"] for r in recorded["per_request"]]
        assert row["identical"] == recorded["identical_count"] and row["sequences"] == recorded["compared"]
    assert rows[("ours", 4096)]["identical_to"] == {"impl": "ours", "identical": 9, "sequences": 9}
    assert rows[("ours", 2048)]["pools_back_to_initial"] and rows[("ours", 2048)]["miss_rate"] > 0.05


def test_v4_concurrent_rows_without_aborts_compare_every_request():
    """gpu_v4probe7 (the same batch, none aborted): every request is compared, and the rows agree
    with the probe's own comparison (12 / 12 for ours at both B)."""
    import collect

    data = json.loads((collect.RESULTS / "gpu_v4probe7" / "v4probe.json").read_text())
    rows = {(r["impl"], r["B"]): r for r in collect.v4_concurrent_rows("gpu_v4probe7")}
    for name, row in (("ours", rows[("ours", 2048)]), ("ours@4096", rows[("ours", 4096)]),
                      ("upstream", rows[("upstream", 2048)])):
        recorded = data["compare_concurrent"]["against"][name]
        assert row["sequences"] == recorded["compared"] == 12
        assert row["identical"] == recorded["identical_count"]
        assert "none aborted" in row["workload"]
    assert rows[("ours", 2048)]["identical"] == 12 and rows[("ours", 4096)]["identical_to"]["identical"] == 12


def test_perf_report_pools_runs_of_one_point_from_several_calls(tmp_path):
    """scripts/gpu/perf_report.py: the same (model, impl, locality, concurrency) measured in two
    calls becomes one row with both repeats, their median and spread; relabelled calls stay apart;
    a fragment's levels can be limited; the points and parse errors of the sweep name the allowed values."""
    import perf_report
    import sweep

    def run(rate, miss=None):
        return {"decode_tok_s": rate, "tpot_ms": 1000 / rate, "max_running": 4, "miss_rate": miss}

    def fragment(call, rows, kv_dtype=None):
        (tmp_path / call).mkdir()
        data = {"model": "m", "layers": 2, "context": 100, "rows": [sweep.summarize(*r) for r in rows],
                "layer_timing": [{"concurrency": 1, "tpot_ms": 2.0, "per_layer_ms": 1.0}]}
        if kv_dtype:  # fragments written before the option have no kv_dtype: they are bf16
            data["kv_dtype"] = kv_dtype
        (tmp_path / call / "s.json").write_text(json.dumps(data))
        return (f"{call}/s.json", f"command of {call}")

    fragments = [fragment("gpu_runA", [("ours", "realistic", 4, [run(100.0, 0.2), run(110.0, 0.1)])]),
                 fragment("gpu_runB", [("ours", "realistic", 4, [run(90.0, 0.3)]), ("none", "none", 4, [run(50.0)])]),
                 fragment("gpu_runC", [("ours", "realistic", 4, [run(10.0, 0.9)])]),
                 fragment("gpu_runD", [("ours", "realistic", 4, [run(200.0, 0.2)])], kv_dtype="fp8_e4m3")]
    perf_report.LOCALITY_LABELS["gpu_runC"] = {"realistic": "old"}
    try:
        perf = perf_report.merge(fragments, results=tmp_path)
    finally:
        del perf_report.LOCALITY_LABELS["gpu_runC"]
    fp8 = [r for r in perf["rows"] if r["kv_dtype"] == "fp8_e4m3"]
    assert [(r["impl"], r["decode_tok_s"], r["runs_from"]) for r in fp8] == [("ours", 200.0, ["gpu_runD"])]
    rows = {(r["impl"], r["locality"]): r for r in perf["rows"] if r["kv_dtype"] == "bfloat16"}
    assert sorted(rows) == [("none", "none"), ("ours", "old"), ("ours", "realistic")]
    pooled = rows[("ours", "realistic")]
    assert (pooled["repeats"], pooled["decode_tok_s"], pooled["decode_tok_s_spread"]) == (3, 100.0, [90.0, 110.0])
    assert pooled["miss_rate"] == 0.2 and pooled["runs_from"] == ["gpu_runA", "gpu_runB"]
    assert rows[("none", "none")]["miss_rate"] is None and rows[("ours", "old")]["decode_tok_s"] == 10.0
    assert perf["commands"] == [f"command of gpu_run{c}" for c in "ABCD"]
    grouped = perf_report.panels(perf["rows"])  # the plot: an FP8 point is its own panel, not on a bf16 line
    assert list(grouped) == [("m", "bfloat16", True), ("m", "fp8_e4m3", True)]
    assert [r["runs_from"] for r in grouped[("m", "fp8_e4m3", True)][("ours", "realistic")]] == [["gpu_runD"]]
    assert grouped[("m", "bfloat16", True)][("ours", "realistic")][0]["repeats"] == 3
    # calls before residency became the default measured hot buffers as "ours"; a no-pressure
    # fragment's rows are kept apart from 32k-token ones
    assert perf_report.impl_label("gpu_run55", "ours") == "ours_hot" and perf_report.impl_label("gpu_run59", "ours") == "ours"
    assert perf_report.impl_label("gpu_run12", "ours_noio") == "ours_noio"
    assert len(perf["layer_timing"]) == 4 and perf["layer_timing"][0]["run"] == "gpu_runA"
    # a fragment limited to other levels (measured again on later code) contributes none of its rows
    only_a = perf_report.merge(fragments[:2], results=tmp_path, levels_taken={"gpu_runB/s.json": (8,)})
    assert [(r["impl"], r["repeats"], r["runs_from"]) for r in only_a["rows"]] == [("ours", 2, ["gpu_runA"])]
    assert sweep.parse_points("ours_noio:realistic,none") == [("ours_noio", "realistic"), ("none", "none")]
    with pytest.raises(ValueError, match="none, upstream, ours, ours_hot, ours_noio"):
        sweep.parse_points("mine:realistic")
    with pytest.raises(ValueError, match="allowed values are none, medium, realistic"):
        sweep.parse_points("ours:high")


def test_exactness_models_match_the_workload_constants():
    """Every model the exactness command accepts has the top_k and vocabulary its prompts and
    upstream's config assume (a ds32-width IndexShare run needs no other change)."""
    import e2e

    from sglang_hisparse.serving.launcher import MODELS_DIR

    for model in e2e.EXACTNESS_MODELS:
        config = json.loads((MODELS_DIR / model / "config.json").read_text())
        assert config["index_topk"] == e2e.TOP_K and config["vocab_size"] == e2e.VOCAB, model
    args = e2e.build_parser().parse_args(["exactness", "--model", "ds32-width-indexshare", "--out", "x.json"])
    assert args.model == "ds32-width-indexshare"


def test_speculative_exactness_runs_linear_mtp_without_the_overlap_scheduler():
    import e2e

    assert e2e.spec_flags(0) == []
    flags = e2e.spec_flags(3)
    assert flags[flags.index("--speculative-num-steps") + 1] == "3"
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "4"
    assert flags[flags.index("--speculative-eagle-topk") + 1] == "1"
    args = e2e.build_parser().parse_args(["exactness", "--model", "tiny-dsa-mtp", "--spec-steps", "3", "--out", "x.json"])
    with pytest.raises(SystemExit, match="--spec-steps needs --no-overlap"):
        e2e.exactness(args)
    args = e2e.build_parser().parse_args(["exactness", "--no-overlap", "--accept-all", "--out", "x.json"])
    with pytest.raises(SystemExit, match="--accept-all needs --spec-steps"):
        e2e.exactness(args)
    assert e2e.accept_all_env(3) == {"SGLANG_SIMULATE_ACC_LEN": "4", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}
    outputs = {"a": {"meta_info": {"spec_accept_length": 1.5}}, "b": {"meta_info": {"spec_accept_length": 2.5}},
               "c": RuntimeError("aborted")}
    assert e2e.accept_length(outputs) == 2.0
    import sweep

    assert sweep.spec_server_flags(0) == ()
    assert sweep.spec_server_flags(2)[-1] == "--disable-overlap-schedule"
    assert sweep.build_parser().parse_args(["--spec-steps", "1", "--out", "x"]).spec_steps == 1


def test_slot_hash_probe_builds_and_refuses_bad_options(tmp_path):
    """scripts/gpu/slot_hash_probe.cu (run.sh job `probe`): nvcc builds it for sm_90a, and it names
    the allowed options and limits before touching a GPU (exit 2)."""
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    source = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "slot_hash_probe.cu"
    binary = tmp_path / "probe"
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90a", str(source), "-o", str(binary)], check=True,
                   capture_output=True, timeout=300)
    bad = subprocess.run([str(binary), "--bogus", "1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "allowed: --B --k --reps --threads --hit" in bad.stderr
    too_big = subprocess.run([str(binary), "--k", "8192", "--B", "4096"], capture_output=True, text=True, timeout=30)
    assert too_big.returncode == 2 and "k <= B <= 32767" in too_big.stderr


def _trace_event(name: str, cat: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def synthetic_decode_trace(iterations: int = 5, step_us: float = 1000.0) -> list[dict]:
    """A scheduler loop of ``iterations`` steps: each runs run_batch (one graph replay of 300 us on
    the device, starting 50 us after its launch; inside it the model runner's forward_raw of 60 us, with
    a replay of 30 us that prepares for 8 us, and a 3 us call), then our map_last_loc_to_buffer (200 us, with a
    nested write_through of 80 us that launches one kernel of 5 us and synchronizes once for 7 us)."""
    events = [_trace_event("sglang/srt/managers/scheduler.py(1): event_loop_overlap", "python_function", 0,
                           iterations * step_us + 10)]
    for i in range(iterations):
        t = 1 + i * step_us
        events.append(_trace_event("sglang/srt/managers/scheduler.py(2): run_batch", "python_function", t, 100))
        events.append(_trace_event("sglang/srt/model_executor/model_runner.py(4): forward_raw", "python_function",
                                   t + 1, 60))
        events.append(_trace_event("sglang/srt/model_executor/cuda_graph_runner.py(5): replay", "python_function",
                                   t + 2, 30))
        events.append(_trace_event("sglang/srt/model_executor/cuda_graph_runner.py(6): replay_prepare",
                                   "python_function", t + 3, 8))
        events.append(_trace_event("sglang/srt/model_executor/model_runner.py(7): tiny", "python_function", t + 40, 3))
        events.append(_trace_event("cudaGraphLaunch", "cuda_runtime", t + 10, 5, corr=1000 + i))
        events.append(_trace_event("decode_graph_kernel", "kernel", t + 60, 300, tid=7, corr=1000 + i))
        ours = t + 200
        events.append(_trace_event("/tmp/site/sglang_hisparse/coordinator.py(9): map_last_loc_to_buffer",
                                   "python_function", ours, 200))
        events.append(_trace_event("/tmp/site/sglang_hisparse/host_mirror.py(5): write_through", "python_function",
                                   ours + 10, 80))
        events.append(_trace_event("cudaLaunchKernel", "cuda_runtime", ours + 20, 4, corr=2000 + i))
        events.append(_trace_event("index_kernel", "kernel", ours + 30, 5, tid=7, corr=2000 + i))
        events.append(_trace_event("cudaStreamSynchronize", "cuda_runtime", ours + 40, 7))
        events.append(_trace_event("sglang/srt/managers/scheduler.py(3): get_next_batch_to_run", "python_function",
                                   t + 500, 150))
    return events


def test_the_profile_summary_splits_a_step_into_ours_sglangs_and_the_devices():
    summary = profile_summary.summarize(synthetic_decode_trace(), skip=1)
    assert summary["iterations"] == 3  # 5 run_batch starts, the first skipped, the last only closes one
    assert summary["wall_us"] == 1000.0 and summary["ours_us"] == 200.0
    assert summary["ours_by_function"] == {"coordinator.map_last_loc_to_buffer": 200.0}
    assert summary["ours_detail"] == {"coordinator.map_last_loc_to_buffer": 200.0, "host_mirror.write_through": 80.0}
    assert (summary["launches"], summary["ours_launches"], summary["graph_launches"]) == (1, 1, 1)
    assert (summary["syncs"], summary["ours_syncs"], summary["sync_us"]) == (1, 1, 7.0)
    assert summary["gpu_busy_us"] == 305.0 and summary["gpu_outside_graph_us"] == 5.0
    assert summary["outside_graph_kernels"] == {"index_kernel": 5.0}
    assert summary["replay_us"] == 300.0 and summary["gpu_gap_us"] == 700.0
    assert summary["sglang_by_function"] == {"run_batch": 100.0, "map_last_loc_to_buffer": 200.0, "get_next_batch_to_run": 150.0}
    assert summary["forward_tree"] == {"replay": 30.0, "replay/replay_prepare": 8.0}  # below 5 us left out
    with pytest.raises(ValueError, match="run_batch calls"):
        profile_summary.summarize(synthetic_decode_trace(iterations=2), skip=1)


def test_v4_probe_arguments_environments_and_comparison(tmp_path):
    """scripts/gpu/v4_probe.py (the DeepSeek-V4 upstream baseline): its arguments, the server flags
    and environment of each implementation, the prompts and the token-by-token comparison; with a
    server that cannot start, the JSON still comes back with the log tail (no GPU needed)."""
    import v4_probe

    from sglang_hisparse.serving.launcher import MODELS_DIR

    args = v4_probe.parse_args(["--out", str(tmp_path / "v.json")])
    assert args.impl_list == ["none", "upstream", "ours"] and len(args.length_list) == 8
    config = json.loads((MODELS_DIR / args.model / "config.json").read_text())
    hisparse = json.loads(args.hisparse_config)
    dbs = hisparse["device_buffer_size"]
    assert dbs % 64 == 0 and dbs >= config["index_topk"] == hisparse["top_k"]
    assert any(n <= dbs * 4 for n in args.length_list) and any(n > dbs * 4 for n in args.length_list)
    assert max(args.length_list) + args.new_tokens <= config["max_position_embeddings"]
    # widths SGLang 0.5.17's V4 kernels take on sm90 (docs/deepseek_v4/gpu-probe.md)
    assert config["num_attention_heads"] % 64 == 0 and config["index_n_heads"] == 64
    assert config["num_attention_heads"] % config["o_groups"] == 0 and config["head_dim"] == 512
    assert sorted(set(config["compress_ratios"])) == [0, 4, 128]
    assert "--disable-cuda-graph" in v4_probe.server_flags(args)
    assert "--grammar-backend" in v4_probe.server_flags(args)  # the V4-slim site has no xgrammar bindings
    assert "--disable-cuda-graph" not in v4_probe.server_flags(v4_probe.parse_args(["--graph"]))
    assert v4_probe.server_env("upstream", args)["SGLANG_PLUGINS"] == "hisparse_dummy_init"
    assert "SGLANG_PLUGINS" not in v4_probe.server_env("none", args)
    assert v4_probe.server_env("none", args)["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
    extra = v4_probe.parse_args(["--extra-env", "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=0"])
    assert v4_probe.server_env("none", extra)["SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"] == "0"
    assert "SGLANG_PLUGINS" not in v4_probe.server_env("ours", args)  # ours: every plugin of ours loaded
    for bad in (["--impls", "theirs"], ["--lengths", "1k"], ["--hisparse-config", "{"], ["--extra-env", "X"]):
        with pytest.raises((SystemExit, ValueError)):
            v4_probe.parse_args(bad)
    a, b = v4_probe.prompts([5, 7], 2048, seed=1)
    assert (len(a), len(b)) == (5, 7) and min(a + b) >= 2 and max(a + b) < 2048
    assert v4_probe.prompts([5], 2048, seed=1)[0] == a
    assert v4_probe.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert v4_probe.first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert v4_probe.first_diff([1, 2], [1, 2, 3]) == 2 and v4_probe.first_diff(None, [1]) == -1
    results = {"none": {"requests": [{"output_ids": [1, 2]}, {"output_ids": [3, 4]}]},
               "upstream": {"requests": [{"output_ids": [1, 2]}, {"output_ids": [3, 9]}]}}
    cmp = v4_probe.compare(results, [10, 20])
    assert cmp["baseline"] == "none" and cmp["identical"] is False
    assert cmp["against"]["upstream"]["per_request"] == [{"prompt_len": 10, "first_diff": None},
                                                        {"prompt_len": 20, "first_diff": 1}]
    assert v4_probe.compare({"none": results["none"], "upstream": {"started": False}}, [10, 20])["identical"] is None


def test_v4_probe_reports_a_server_that_does_not_start(tmp_path, monkeypatch):
    import v4_probe

    def no_server(**kwargs):
        log = v4_probe.LOG_DIR / f"{kwargs['name']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("server_args=ServerArgs(enable_hisparse=True)\nDSV4 pool sizes: c4=1\n"
                       "Traceback (most recent call last):\nRuntimeError: boom\n")
        raise RuntimeError(f"{kwargs['name']} exited with 1:\nRuntimeError: boom")

    monkeypatch.setattr(v4_probe, "LOG_DIR", tmp_path / "logs")
    monkeypatch.setattr(v4_probe, "start_server", no_server)
    monkeypatch.setattr(v4_probe, "device_info", lambda: {"nvidia_smi": "none"})
    out = tmp_path / "v.json"
    assert v4_probe.main(["--lengths", "8,16", "--out", str(out)]) == 1
    assert v4_probe.main(["--lengths", "8,16", "--sequential", "--out", str(tmp_path / "s.json")]) == 1
    report = json.loads(out.read_text())
    assert list(report["impls"]) == ["none", "upstream", "ours"] and report["model_config"]["vocab_size"] == 2048
    assert json.loads(report["impls"]["ours"]["hisparse_config"]) == json.loads(report["impls"]["upstream"]["hisparse_config"])
    assert report["parallel"] is True
    row = report["impls"]["upstream"]
    assert row["started"] is False and "boom" in row["error"]
    assert row["env"]["SGLANG_PLUGINS"] == "hisparse_dummy_init" and json.loads(row["hisparse_config"])["top_k"] == 512
    assert row["pool_lines"] == ["DSV4 pool sizes: c4=1"] and row["log_tail"][-1] == "RuntimeError: boom"
    assert report["compare"]["identical"] is None


# --- v4_probe's concurrent phase (several requests decoding together, some aborted) ----------------
def test_v4_probe_concurrent_options_are_off_by_default_and_hold_batch_shapes_when_on(tmp_path):
    """Without --concurrent the servers get the flags and configs of the one-at-a-time probe; with it
    every decode step runs in one capture size of N rows, every server without the overlap
    scheduler, ours waiting for staging (the module docstring says why), and N + 1 running requests."""
    import v4_probe

    from sglang_hisparse.serving.launcher import MODELS_DIR

    plain = v4_probe.parse_args(["--out", str(tmp_path / "v.json")])
    assert plain.concurrent == 0 and plain.concurrent_length_list == [] and not v4_probe.holds_shapes(plain)
    flags = v4_probe.server_flags(plain)
    assert flags[flags.index("--max-running-requests") + 1] == "8" and flags[flags.index("--decode-log-interval") + 1] == "8"
    assert "--disable-cuda-graph" in flags and "--disable-overlap-schedule" not in flags
    assert not any(f.startswith("--cuda-graph") for f in flags)
    assert flags[flags.index("--swa-full-tokens-ratio") + 1] == "0.2"
    assert v4_probe.hisparse_config("ours", plain) == plain.hisparse_config == v4_probe.hisparse_config("upstream", plain)
    assert v4_probe.hisparse_config("none", plain) is None
    assert v4_probe.server_env("ours", plain)["SGLANG_TOPK_TRANSFORM_512_TORCH"] == "1"

    b2048 = '{"top_k": 512, "device_buffer_size": 2048, "host_to_device_ratio": 2}'
    args = v4_probe.parse_args(["--impls", "none,ours,ours@4096,upstream", "--concurrent", "12", "--abort", "3",
                                "--concurrent-only", "--new-tokens", "64", "--hisparse-config", b2048])
    config = json.loads((MODELS_DIR / args.model / "config.json").read_text())
    assert args.context == config["max_position_embeddings"] == 16384
    assert args.concurrent_length_list == list(v4_probe.DEFAULT_CONCURRENT_LENGTHS)
    plan = v4_probe.concurrent_plan(args)
    assert plan["abort_indices"] == [2, 6, 10] and plan["graph"] == "F12" and plan["max_running"] == 13
    assert [plan["max_new_tokens"][i] for i in (0, 2)] == [64, v4_probe.ABORT_BUDGET_FACTOR * 64]
    assert all(n + m <= args.context for n, m in zip(plan["lengths"], plan["max_new_tokens"]))
    # pressure (docs/deepseek_v4/gpu-probe.md): the 12 prompts' C4 entries exceed a HiSparse server's
    # device rows (max-total-tokens / 4 / ratio 2) and fit its host rows (max-total-tokens / 4)
    entries = sum(n // 4 for n in plan["lengths"])
    assert args.max_total_tokens // 4 // 2 < entries <= args.max_total_tokens // 4
    assert sum(n > 4 * 2048 for n in plan["lengths"]) == 5 and max(plan["lengths"]) // 4 <= 4096
    flags = v4_probe.server_flags(args)
    assert flags[flags.index("--cuda-graph-bs") + 1] == flags[flags.index("--cuda-graph-max-bs") + 1] == "12"
    assert flags[flags.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert "--disable-cuda-graph" not in flags and "--disable-overlap-schedule" in flags
    assert flags[flags.index("--max-running-requests") + 1] == "13" and flags[flags.index("--decode-log-interval") + 1] == "1"
    ours, ours4096 = json.loads(v4_probe.hisparse_config("ours", args)), json.loads(v4_probe.hisparse_config("ours@4096", args))
    assert ours == {**json.loads(b2048), "wait_for_staging": True}
    assert ours4096 == {**json.loads(b2048), "device_buffer_size": 4096, "wait_for_staging": True}
    assert json.loads(v4_probe.hisparse_config("upstream", args)) == json.loads(b2048)  # SGLang's has no such key
    assert v4_probe.server_env("upstream@4096", args)["SGLANG_PLUGINS"] == "hisparse_dummy_init"
    assert [v4_probe.log_name(s) for s in args.impl_list] == ["v4_none", "v4_ours", "v4_ours_B4096", "v4_upstream"]

    overlap = v4_probe.parse_args(["--concurrent", "4", "--overlap", "--concurrent-graph", "0"])
    assert "--disable-overlap-schedule" not in v4_probe.server_flags(overlap)
    assert "--disable-cuda-graph" in v4_probe.server_flags(overlap)
    assert "wait_for_staging" not in json.loads(v4_probe.hisparse_config("ours", overlap))
    sizes = v4_probe.server_flags(v4_probe.parse_args(["--concurrent", "4", "--concurrent-graph", "1"]))
    assert sizes[sizes.index("--cuda-graph-max-bs") + 1] == "8" and "--cuda-graph-bs" not in sizes
    assert v4_probe.parse_args(["--concurrent", "14"]).concurrent_length_list[12:] == [16000, 1000]  # cycled
    assert v4_probe.parse_args(["--concurrent", "2", "--concurrent-lengths", "100,200"]).concurrent_length_list == [100, 200]
    for bad in (["--abort", "1"], ["--concurrent-only"], ["--concurrent-graph", "F4"], ["--concurrent-lengths", "5"],
                ["--concurrent", "3", "--abort", "3"], ["--concurrent", "3", "--abort", "-1"],
                ["--concurrent", "2", "--concurrent-lengths", "100"], ["--concurrent", "2", "--concurrent-lengths", "1,x"],
                ["--concurrent", "1", "--concurrent-lengths", "16380"],  # + 48 new tokens > 16384
                ["--concurrent", "2", "--concurrent-lengths", "100,16300", "--abort", "1", "--abort-after", "84"],
                ["--concurrent", "12", "--concurrent-graph", "F8"], ["--concurrent", "12", "--concurrent-graph", "2"],
                ["--concurrent", "2", "--abort-after", "0"], ["--concurrent", "-1"],
                ["--impls", "none@2048"], ["--impls", "ours@x"], ["--impls", "ours@256"], ["--impls", "ours,ours"]):
        with pytest.raises(SystemExit):
            v4_probe.parse_args(bad)


def test_v4_probe_abort_selection_is_deterministic_and_spread():
    import v4_probe

    assert v4_probe.abort_indices(12, 3) == [2, 6, 10] and v4_probe.abort_indices(12, 2) == [3, 9]
    assert v4_probe.abort_indices(12, 0) == [] and v4_probe.abort_indices(1, 0) == []
    for n in range(1, 40):
        for k in range(n):
            chosen = v4_probe.abort_indices(n, k)
            assert chosen == sorted(set(chosen)) and len(chosen) == k and all(0 <= i < n for i in chosen), (n, k)
            gaps = [b - a for a, b in zip(chosen, chosen[1:])]
            assert all(n // k - 1 <= g <= -(-n // k) + 1 for g in gaps), (n, k, chosen)  # evenly spread
    for n, k in ((3, 3), (3, -1), (0, 0)):
        with pytest.raises(ValueError, match="abort count"):
            v4_probe.abort_indices(n, k)
    rids = v4_probe.request_ids(1200, "abc123")
    assert len(set(rids)) == 1200 and len({len(r) for r in rids}) == 1
    assert not any(a != b and b.startswith(a) for a in rids[:150] for b in rids)  # SGLang aborts by prefix
    assert v4_probe.abort_new_tokens(1000, 64, 16384) == v4_probe.ABORT_BUDGET_FACTOR * 64
    assert v4_probe.abort_new_tokens(16300, 64, 16384) == 84 and v4_probe.abort_new_tokens(16300, 64, None) == 256
    body = v4_probe.batch_body([[5, 6], [7]], [4, 9], ["r0", "r1"])
    assert body["stream"] is True and body["rid"] == ["r0", "r1"] and body["input_ids"] == [[5, 6], [7]]
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [4, 9]
    assert all(p["temperature"] == 0.0 and p["ignore_eos"] for p in body["sampling_params"])


def _chunk(index, ids, finish=None, total=None, rid=None):
    meta = {"id": rid or f"r{index}", "finish_reason": finish, "completion_tokens": len(ids) if total is None else total}
    return {"index": index, "output_ids": ids, "meta_info": meta}


def test_v4_probe_batch_tracker_aborts_once_and_keeps_every_output():
    import v4_probe

    tracker = v4_probe.BatchTracker(["r0", "r1", "r2"], abort=[1, 2], abort_after=3)
    assert tracker.update(_chunk(0, [7])) == [] and tracker.update(_chunk(1, [8, 9])) == []
    assert tracker.update(_chunk(1, [8, 9, 10])) == [1]  # the third token: abort due
    assert tracker.update(_chunk(1, [8, 9, 10, 11])) == []  # once
    assert tracker.update(_chunk(2, [1, 2, 3], finish={"type": "length"})) == []  # finished: nothing to abort
    assert tracker.update(_chunk(0, [12], total=2)) == []  # an incremental chunk is appended
    tracker.update({"output_ids": [7, 12, 13], "meta_info": {"id": "r0", "completion_tokens": 3,
                                                             "finish_reason": {"type": "length", "length": 3}}})
    tracker.update(_chunk(1, [8, 9, 10, 11, 12], finish={"type": "abort", "message": "Aborted", "status_code": None}))
    tracker.update({"error": {"message": "boom"}})
    tracker.update(_chunk(7, [1]))
    assert tracker.done() and len(tracker.errors) == 2 and "boom" in tracker.errors[0]
    rows = tracker.results([10, 20, 30], [3, 12, 12])
    assert [r["output_ids"] for r in rows] == [[7, 12, 13], [8, 9, 10, 11, 12], [1, 2, 3]]
    assert [r["abort_chosen"] for r in rows] == [False, True, True]
    assert [r["abort_sent_after_tokens"] for r in rows] == [None, 3, None]
    assert [v4_probe.finish_type(r) for r in rows] == ["length", "abort", "length"]
    assert [v4_probe.completed(r) for r in rows] == [True, False, False]  # r2 stopped short of its 12
    lines = [b"data: " + json.dumps(_chunk(0, [1])).encode() + b"\n", b"\n", b": keep-alive\n",
             "data: " + json.dumps(_chunk(0, [1, 2])) + "\n", b"data: [DONE]\n", b"data: {not json after DONE}\n"]
    assert [c["output_ids"] for c in v4_probe.sse_payloads(lines)] == [[1], [1, 2]]
    single = v4_probe.BatchTracker(["only"], abort=[], abort_after=1)
    single.update({"output_ids": [4], "meta_info": {"id": "other", "completion_tokens": 1, "finish_reason": None}})
    assert single.ids == [[4]]  # a one-request stream has no index


def _concurrent(outputs, finishes=None, max_new=3, abort=(1,), trace="3x2 2x1", pools=None):
    finishes = finishes or ["length"] * len(outputs)
    requests = [{"index": i, "prompt_len": 100 * (i + 1), "max_new_tokens": max_new if i not in abort else 50,
                 "abort_chosen": i in abort, "output_ids": ids, "finish_reason": {"type": f} if f else None}
                for i, (ids, f) in enumerate(zip(outputs, finishes))]
    return {"concurrent": {"requests": requests, "decode_trace": trace, "pools_back_to_initial": pools}}


def test_v4_probe_compares_the_concurrent_requests_and_records_the_aborted_ones():
    import v4_probe

    base = _concurrent([[1, 2, 3], [4, 5], [6, 7, 8], [9, 9, 9]], ["length", "abort", "length", "length"])
    ours = _concurrent([[1, 2, 3], [4, 5, 6, 7], [6, 7, 8], [9, 9, 9]], ["length", "abort", "length", "length"], pools=True)
    upstream = _concurrent([[1, 2, 3], [4], [6, 0, 8], [9, 9]], ["length", "length", "length", None], trace="3x3")
    cmp = v4_probe.compare_concurrent({"none": base, "ours": ours, "upstream": upstream, "skipped": {"started": False},
                                       "failed": {"concurrent": {"error": "stopped"}}})
    assert cmp["baseline"] == "none" and set(cmp["against"]) == {"ours", "upstream"} and cmp["identical"] is False
    assert cmp["not_run"] == ["skipped", "failed"]
    good = cmp["against"]["ours"]
    assert good["identical"] is True and (good["identical_count"], good["compared"]) == (3, 3)
    assert [r["index"] for r in good["per_request"]] == [0, 2, 3]  # the aborted request is not compared
    assert good["aborted"] == [{"index": 1, "prompt_len": 200, "finish": "abort", "tokens": 4, "baseline_finish": "abort",
                                "baseline_tokens": 2}]
    assert good["aborts_took_effect"] is True and good["pools_back_to_initial"] is True and good["decode_trace_equal"]
    bad = cmp["against"]["upstream"]
    assert [r["first_diff"] for r in bad["per_request"]] == [None, 1, -1]  # -1: did not complete
    assert bad["identical_count"] == 1 and bad["identical"] is False and bad["aborts_took_effect"] is False
    assert bad["pools_back_to_initial"] is None and bad["decode_trace_equal"] is False
    assert v4_probe.compare_concurrent({"none": base, "ours": {"requests": []}}) == {
        "baseline": "none", "against": {}, "identical": None, "not_run": ["ours"]}
    assert v4_probe.compare_concurrent({})["baseline"] is None
    assert v4_probe.concurrent_served(ours) and not v4_probe.concurrent_served(upstream)
    assert not v4_probe.concurrent_served({"concurrent": {"error": "x"}})


def test_v4_probe_reads_idle_lines_schedules_and_retractions_from_the_log():
    import v4_probe

    idle = ("[2026-12-06 02:40:30] sglang-hisparse idle (DeepSeek-V4 C4): token_free=131072/131072 swa_free=13056/13056 "
            "c4_rows_free=16384/16384 c4_host_free=32768/32768 leak=no selected=65465 misses=430 miss_rate=0.0066")
    leaked = idle.replace("c4_rows_free=16384/16384", "c4_rows_free=16320/16384").replace("leak=no", "leak=yes")
    reports = v4_probe.idle_reports("\n".join(["x", idle, "DSA: sglang-hisparse idle: a=1/1 leak=no selected=0 misses=0",
                                               leaked]))
    assert len(reports) == 2 and reports[0]["counts"]["c4_host_free"] == (32768, 32768)
    assert (reports[0]["selected"], reports[0]["misses"], reports[0]["leak"]) == (65465, 430, False)
    assert [v4_probe.pools_back(r) for r in reports] == [True, False] and v4_probe.pools_back(None) is None
    assert v4_probe.pools_back({"counts": {"a": (1, 2)}, "leak": False}) is False
    log = "\n".join([_prefill(8192), _prefill(8192), _prefill(3000), _decode(3, 9.0), _decode(3, 9.0), _prefill(600),
                     _decode(4, 9.0), _decode(4, 9.0), _decode(2, 9.0),
                     "[x] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 512",
                     "[x] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 256"])
    batches = decode_log.parse_batches(log)
    assert v4_probe.schedule_trace(batches) == "p8192 p8192 p3000 3x2 p600 4x2 2x1"
    assert decode_log.decode_trace(batches) == "3x2 4x2 2x1" and v4_probe.schedule_trace([]) == ""
    assert v4_probe.retractions(log) == 3 and v4_probe.retractions("Testing retraction. #retracted_reqs: 5") == 0


class _FakeV4Server:
    """A stand-in for SGLang's HTTP server with what the concurrent phase uses: a batched, streamed
    /generate (cumulative output ids per step, ``index`` per request, aborts by rid prefix as SGLang's
    scheduler does), /abort_request, /server_info, and a log with batch lines and ours' idle line."""

    def __init__(self, idle_line: bool):
        import http.server

        self.lines, self.aborted, self.idle_line = ["server up"], set(), idle_line
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/abort_request":
                    fake.aborted.add(body["rid"])
                    self.send_response(200)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                fake.stream(self.wfile, body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stream(self, wfile, body):
        rids, params = body["rid"], body["sampling_params"]
        outs, done = [[] for _ in rids], [False] * len(rids)
        self.lines.append(_prefill(sum(len(p) for p in body["input_ids"])))
        while not all(done):
            time.sleep(0.02)
            running = [i for i in range(len(rids)) if not done[i]]
            self.lines.append(_decode(len(running), 100.0))
            for i in running:
                outs[i].append(len(outs[i]) + 10 * i)
                reason = None
                if any(rids[i].startswith(a) for a in self.aborted):
                    reason = {"type": "abort", "message": "Aborted", "status_code": None}
                elif len(outs[i]) == params[i]["max_new_tokens"]:
                    reason = {"type": "length", "length": len(outs[i])}
                done[i] = reason is not None
                chunk = {"index": i, "output_ids": outs[i],
                         "meta_info": {"id": rids[i], "finish_reason": reason, "completion_tokens": len(outs[i])}}
                wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                wfile.flush()
        wfile.write(b"data: [DONE]\n\n")
        if self.idle_line:
            self.lines.append("sglang-hisparse idle (DeepSeek-V4 C4): token_free=8/8 swa_free=4/4 c4_rows_free=2/2 "
                              "c4_host_free=4/4 leak=no selected=10 misses=1 miss_rate=0.1")

    def abort(self, rid):
        from sglang_hisparse.serving.launcher import post_json

        post_json(f"{self.url}/abort_request", {"rid": rid}, 30)

    def log(self):
        return "\n".join(self.lines) + "\n"


def test_v4_probe_concurrent_phase_streams_one_batch_and_aborts_by_rid():
    """The phase against a stand-in server: one streamed batch, the chosen requests aborted once
    they have their tokens, the others complete, ours' idle line read after the phase."""
    import v4_probe

    args = v4_probe.parse_args(["--concurrent", "5", "--concurrent-lengths", "10,20,30,40,50", "--abort", "2",
                                "--abort-after", "3", "--new-tokens", "6", "--request-timeout", "30"])
    plan = v4_probe.concurrent_plan(args)
    assert plan["abort_indices"] == [1, 3] and plan["max_new_tokens"] == [6, 24, 6, 24, 6]
    for impl, idle in (("ours@4096", True), ("none", False)):
        server = _FakeV4Server(idle_line=idle)
        try:
            out = v4_probe.run_concurrent(server, impl, args, plan, v4_probe.prompts(plan["lengths"], 2048, 1),
                                          time.time() + 120)
        finally:
            server.httpd.shutdown()
        assert "error" not in out and out["errors"] == []
        rows = out["requests"]
        assert [v4_probe.finish_type(r) for r in rows] == ["length", "abort", "length", "abort", "length"]
        assert all(v4_probe.completed(r) for r in rows if not r["abort_chosen"])
        assert all(3 <= len(rows[i]["output_ids"]) < 24 and rows[i]["abort_sent_after_tokens"] == 3 for i in (1, 3))
        assert len({r["rid"] for r in rows}) == 5 and all(r["rid"] in server.aborted for r in rows if r["abort_chosen"])
        assert out["schedule"].startswith("p150 5x") and out["max_running"] == 5 and out["retracted"] == 0
        assert out["pools_back_to_initial"] is (True if idle else None)
        assert sorted(out["digests"]) == ["0", "1", "2", "3", "4"]


def test_v4_probe_main_records_the_concurrent_plan_when_no_server_starts(tmp_path, monkeypatch):
    import v4_probe

    def no_server(**kwargs):
        raise RuntimeError(f"{kwargs['name']} exited with 1")

    monkeypatch.setattr(v4_probe, "LOG_DIR", tmp_path / "logs")
    monkeypatch.setattr(v4_probe, "start_server", no_server)
    monkeypatch.setattr(v4_probe, "device_info", lambda: {"nvidia_smi": "none"})
    out = tmp_path / "v.json"
    assert v4_probe.main(["--impls", "none,ours@2048", "--concurrent", "3", "--concurrent-lengths", "8,16,24",
                          "--abort", "1", "--concurrent-only", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["lengths"] == [] and report["concurrent"]["abort_indices"] == [1]
    assert report["concurrent"]["lengths"] == [8, 16, 24] and report["compare_concurrent"]["baseline"] is None
    assert json.loads(report["impls"]["ours@2048"]["hisparse_config"])["wait_for_staging"] is True
    assert "--cuda-graph-bs" in report["server_flags"] and "--disable-overlap-schedule" in report["server_flags"]


# --- v4_probe's throughput phase (issue 42: one paired point under pressure) -------------------------
class _FakeThroughputServer:
    """A stand-in with what the throughput phase uses: a batched /generate that logs a prefill line
    and one decode line per token at this server's rate (tokens/s), ours' idle line after it;
    ``busy`` catches two servers measured at once."""

    busy: list = []
    order: list = []

    def __init__(self, name: str, rate: float, idle: bool):
        from types import SimpleNamespace

        self.name, self.rate, self.idle = name, rate, idle
        self.lines, self.args = ["server up"], ["--fake", name]
        self.process = SimpleNamespace(poll=lambda: None, returncode=None)

    def generate(self, batch, new_tokens, timeout=None):
        assert not self.busy, f"{self.name} measured while {self.busy} ran"
        self.busy.append(self.name)
        self.order.append(self.name)
        time.sleep(0.01)
        self.lines.append(_prefill(sum(len(p) for p in batch)))
        self.lines += [_decode(len(batch), self.rate)] * new_tokens
        if self.idle:
            self.lines.append("sglang-hisparse idle (DeepSeek-V4 C4): token_free=8/8 swa_free=4/4 c4_rows_free=2/2 "
                              "c4_host_free=4/4 leak=no selected=100 misses=25 miss_rate=0.25")
        self.busy.clear()
        return [{"output_ids": list(range(new_tokens))} for _ in batch]

    def settle(self, timeout=60):
        pass

    def log(self):
        return "\n".join(self.lines) + "\n"

    def stop(self):
        from types import SimpleNamespace

        self.process = SimpleNamespace(poll=lambda: 0, returncode=0)


def test_v4_probe_throughput_phase_measures_servers_one_at_a_time_and_compares_them(tmp_path, monkeypatch):
    """--throughput: SGLang's overlap scheduler and capture sizes up to N, ours without the staging
    wait; every server up first, then measured in turn, rounds alternating; decode tok/s from the
    step lines, ours' misses and pools from its idle line; the ratios between servers."""
    import v4_probe

    args = v4_probe.parse_args(["--impls", "none,ours,upstream", "--throughput", "16"])
    flags = v4_probe.server_flags(args)
    assert flags[flags.index("--cuda-graph-max-bs") + 1] == "16" and "--disable-cuda-graph" not in flags
    assert "--disable-overlap-schedule" not in flags and flags[flags.index("--max-running-requests") + 1] == "17"
    assert flags[flags.index("--decode-log-interval") + 1] == "1"
    assert "wait_for_staging" not in json.loads(v4_probe.hisparse_config("ours", args))
    assert [v4_probe.max_total_tokens(i, args) for i in ("none", "ours", "upstream@4096")] == [131072] * 3
    equal_rows = v4_probe.parse_args(["--throughput", "16", "--hisparse-max-total-tokens", "262144"])
    assert [v4_probe.max_total_tokens(i, equal_rows) for i in ("none", "ours", "upstream")] == [131072, 262144, 262144]
    for bad in (["--throughput", "4", "--concurrent", "4"], ["--throughput", "2", "--throughput-context", "16380"],
                ["--throughput", "2", "--throughput-repeats", "0"], ["--throughput", "2", "--throughput-new-tokens", "0"],
                ["--hisparse-max-total-tokens", "-1"]):
        with pytest.raises(SystemExit):
            v4_probe.parse_args(bad)

    rates = {"v4_none": 100.0, "v4_ours": 150.0, "v4_upstream": 120.0}
    monkeypatch.setattr(v4_probe, "LOG_DIR", tmp_path / "logs")
    totals = {}

    def start(**kw):
        totals[kw["name"]] = kw["max_total_tokens"]
        return _FakeThroughputServer(kw["name"], rates[kw["name"]], idle=kw["name"] == "v4_ours")

    monkeypatch.setattr(v4_probe, "start_server", start)
    monkeypatch.setattr(v4_probe, "device_info", lambda: {"nvidia_smi": "none"})
    _FakeThroughputServer.order.clear()
    out = tmp_path / "t.json"
    assert v4_probe.main(["--impls", "none,ours,upstream", "--throughput", "4", "--throughput-context", "100",
                          "--throughput-new-tokens", "5", "--throughput-repeats", "2", "--hisparse-max-total-tokens",
                          "262144", "--out", str(out)]) == 0
    assert totals == {"v4_none": 131072, "v4_ours": 262144, "v4_upstream": 262144}
    assert _FakeThroughputServer.order == ["v4_none", "v4_ours", "v4_upstream"] * 3  # a warm-up round first
    report = json.loads(out.read_text())
    assert report["throughput"] == {"n": 4, "context": 100, "new_tokens": 5, "repeats": 2, "warmup": 1}
    runs = report["impls"]["ours"]["throughput"]["runs"]
    assert [(r["round"], r.get("warmup", False)) for r in runs] == [(-1, True), (0, False), (1, False)]
    ours = report["impls"]["ours"]["throughput"]["summary"]
    assert ours["runs"] == 2 and ours["measured"] == 2 and ours["decode_tok_s"] == pytest.approx(150.0) and ours["held"] == 4
    assert ours["miss_rate"] == pytest.approx(0.25) and ours["pools_back_to_initial"] is True
    assert report["impls"]["none"]["throughput"]["summary"]["miss_rate"] is None
    assert report["compare_throughput"]["ours/none"] == pytest.approx(1.5)
    assert report["compare_throughput"]["ours/upstream"] == pytest.approx(1.25)
    assert report["compare_throughput"]["paired"]["ours/upstream"] == pytest.approx(1.25)
    assert all(r["exit_code"] == 0 for r in report["impls"].values())
    with pytest.raises(SystemExit):
        v4_probe.parse_args(["--throughput", "2", "--throughput-warmup", "-1"])


def test_v4_probe_paired_ratios_are_medians_of_per_round_ratios_without_warmups():
    """compare_throughput's ``paired``: per round a/b, the median over the rounds both measured;
    warm-up rounds and failed runs left out; the ratio of medians beside it."""
    import v4_probe

    def server(rates, warm=None):
        runs = ([{"round": -1, "warmup": True, "decode_tok_s": warm}] if warm else [])
        runs += [{"round": k, "decode_tok_s": r} if r else {"round": k, "error": "x"} for k, r in enumerate(rates)]
        return {"throughput": {"runs": runs, "summary": v4_probe.summarize_throughput(
            [dict(r, tpot_ms=1.0, max_running=1, wall_s=1.0) if "decode_tok_s" in r else r for r in runs])}}

    impls = {"ours": server([100.0, 300.0, 200.0, None], warm=1.0), "upstream": server([200.0, 100.0, 100.0, 50.0])}
    compared = v4_probe.compare_throughput(impls)
    # rounds 0-2 both measured: ratios 0.5, 3.0, 2.0 -> median 2.0; medians 200 / 100 -> 2.0 as well here
    assert compared["paired"]["ours/upstream"] == pytest.approx(2.0)
    assert compared["paired"]["upstream/ours"] == pytest.approx(0.5)
    assert impls["ours"]["throughput"]["summary"]["measured"] == 3


def test_v4_probe_step_time_weighs_each_batch_size_by_the_other_servers_steps():
    """step_time a/b: b's steps (count per batch size) timed at a's per-size medians over their
    time at b's; sizes only one server ran are left out; summarize_throughput pools the rounds."""
    import v4_probe

    runs = [{"decode_tok_s": 1.0, "tpot_ms": 1.0, "max_running": 8, "wall_s": 1.0,
             "step_ms_by_running": {"4": [10, ms4], "8": [5, 3.0]}} for ms4 in (2.0, 2.2, 2.4)]
    ours = v4_probe.summarize_throughput(runs)["step_ms_by_running"]
    assert ours == {"4": [30, pytest.approx(2.2)], "8": [15, pytest.approx(3.0)]}
    upstream = {"4": [40, 2.0], "8": [20, 4.0], "2": [7, 1.0]}
    ratios = v4_probe.step_time_ratios({"ours": ours, "upstream": upstream})
    # upstream's steps at ours' speed: 40 x 2.2 + 20 x 3.0 = 148 ms against 40 x 2 + 20 x 4 = 160 ms
    assert ratios["ours/upstream"] == pytest.approx(148 / 160)
    # ours' steps at upstream's speed: 30 x 2 + 15 x 4 = 120 against 30 x 2.2 + 15 x 3 = 111
    assert ratios["upstream/ours"] == pytest.approx(120 / 111)
    assert v4_probe.step_time_ratios({"a": {"1": [3, 1.0]}, "b": {"2": [3, 1.0]}}) == {}


# --- prefix_bench: the prefix-reuse driver (issue 43), without servers ------------------------------
def test_prefix_bench_arguments_flags_and_launch(monkeypatch):
    import prefix_bench as pb

    args = pb.parse_args([])
    assert args.server_list == ["ours_radix", "none_radix", "ours", "upstream"] and args.workload_list == ["mt", "sp"]
    assert (args.conversations, args.turns, args.max_context, args.new_tokens) == (16, 4, 16384, 64)
    assert pb.graph_size(args) == 16 and args.out.endswith("prefix.json")
    flags = pb.server_flags(args)
    assert flags[flags.index("--cuda-graph-bs") + 1] == "16" and "--disable-overlap-schedule" not in flags
    assert flags[len(flags) - 1 - flags[::-1].index("--mem-fraction-static") + 1] == "0.85"  # the last one wins
    assert flags[flags.index("--max-running-requests") + 1] == "17"
    assert pb.hisparse_config("none", args) is None
    assert "wait_for_staging" not in json.loads(pb.hisparse_config("ours", args))
    strict = pb.parse_args(["--strict", "--graph-bs", "24", "--servers", "ours_radix,upstream", "--workloads", "sp"])
    assert "--disable-overlap-schedule" in pb.server_flags(strict) and pb.graph_size(strict) == 24
    assert json.loads(pb.hisparse_config("ours", strict))["wait_for_staging"] is True
    assert "wait_for_staging" not in json.loads(pb.hisparse_config("upstream", strict))
    launched = {}

    def fake_start_server(**kw):
        launched[kw["name"]] = kw
        return object()

    monkeypatch.setattr(pb, "start_server", fake_start_server)
    for name in pb.SERVERS:
        live = pb.launch(name, args)
        assert (live.impl, live.radix) == pb.SERVERS[name]
    assert launched["prefix_ours_radix"]["radix_cache"] is True and launched["prefix_none_radix"]["radix_cache"] is True
    assert launched["prefix_ours"]["radix_cache"] is False and launched["prefix_upstream"]["radix_cache"] is False
    assert launched["prefix_upstream"]["env"]["SGLANG_PLUGINS"] == "hisparse_dummy_init"
    assert "SGLANG_PLUGINS" not in launched["prefix_ours_radix"]["env"]
    assert all(kw["env"]["SGLANG_HISPARSE_DUMMY_LOCALITY"] == "realistic" for kw in launched.values())
    assert launched["prefix_none_radix"]["hisparse_config"] is None and launched["prefix_ours"]["cpu"] is False
    for bad in (["--servers", "ours,mine"], ["--servers", "ours,ours"], ["--workloads", "mt,chat"],
                ["--turns", "10", "--max-context", "600", "--new-tokens", "64"],
                ["--shared-prefix", "65536"], ["--max-context", "70000"], ["--mem-fraction", "1.5"],
                ["--conversations", "0"], ["--together", "-1"]):
        with pytest.raises(SystemExit):
            pb.parse_args(bad)
    with pytest.raises(ValueError, match="realistic"):
        pb.parse_args(["--locality", "strong"])
    run_sh = (Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "run.sh").read_text()
    assert "#   job = prefix  -> python scripts/gpu/prefix_bench.py" in run_sh
    assert 'prefix) python3 scripts/gpu/prefix_bench.py "$@"' in run_sh


def test_prefix_bench_workloads_grow_histories_and_share_one_prefix():
    import prefix_bench as pb

    conversations, turns, max_context, new = 3, 5, 4000, 40
    messages = pb.turn_messages(conversations, turns, max_context, new, seed=1)
    assert messages == pb.turn_messages(conversations, turns, max_context, new, seed=1)  # seeded
    assert len(messages) == conversations and all(len(conv) == turns for conv in messages)
    base = max_context // turns - new
    assert all(base - base // 8 <= len(m) <= base for conv in messages for m in conv)
    assert len({tuple(conv[0]) for conv in messages}) == conversations
    for conv in messages:
        history, previous = [], []
        for t, message in enumerate(conv):
            prompt = pb.next_prompt(history, message)
            assert prompt[:len(previous)] == previous  # each turn extends the last turn's prompt and reply
            reply = list(range(100 + t, 100 + t + new))
            history, previous = prompt + reply, prompt + reply
        assert max_context * 7 // 8 - turns <= len(history) <= max_context  # grew to about L
    prompts = pb.shared_prefix_prompts(6, 500, 40, seed=2)
    assert prompts == pb.shared_prefix_prompts(6, 500, 40, seed=2) and len(prompts) == 6
    assert all(p[:500] == prompts[0][:500] for p in prompts)
    suffixes = [p[500:] for p in prompts]
    assert all(20 <= len(x) <= 40 for x in suffixes) and len({tuple(x) for x in suffixes}) == 6
    assert pb.digest([1, 2]) == pb.digest([1, 2]) != pb.digest([2, 1]) and pb.digest(None) is None


def _chunk_at(index, ids, cached=None, finish=None, rid=None):
    meta = {"id": rid or f"r{index}", "completion_tokens": len(ids), "finish_reason": finish}
    if cached is not None:
        meta.update(prompt_tokens=1000, cached_tokens=cached)
    chunk = {"output_ids": ids, "meta_info": meta}
    if index is not None:
        chunk["index"] = index
    return chunk


def test_prefix_bench_ttft_and_tok_s_from_streamed_chunks():
    import prefix_bench as pb

    length = {"type": "length", "length": 3}
    events = [(10.5, _chunk_at(1, [7], cached=960)), (10.8, _chunk_at(0, [5], cached=0)),
              (10.9, _chunk_at(0, [5, 6])), (11.0, _chunk_at(1, [7, 8])),
              (11.3, _chunk_at(0, [5, 6, 9], finish=length)), (11.5, _chunk_at(1, [7, 8, 4], finish=length)),
              (11.6, {"error": {"message": "late"}})]
    rows = pb.request_metrics(10.0, events, ["a", "b"], ["r0", "r1"])
    a, b = rows
    assert a["name"] == "a" and a["output_ids"] == [5, 6, 9] and b["output_ids"] == [7, 8, 4]
    assert a["ttft_s"] == pytest.approx(0.8) and b["ttft_s"] == pytest.approx(0.5)
    assert a["last_token_s"] == pytest.approx(1.3) and a["decode_tok_s"] == pytest.approx(2 / 0.5)
    assert b["decode_tok_s"] == pytest.approx(2 / 1.0)
    assert (a["cached_tokens"], b["cached_tokens"], b["prompt_tokens"]) == (0, 960, 1000)
    assert a["finish_reason"] == length and a["output_tokens"] == 3
    # delta chunks, one request without an index (found by its rid), a chunk without a new token
    delta = [(1.2, {"output_ids": [], "meta_info": {"id": "x-1", "completion_tokens": 0}}),
             (1.4, {"output_ids": [3], "meta_info": {"id": "x-1", "completion_tokens": 1, "cached_tokens": 64,
                                                     "prompt_tokens": 100}}),
             (1.6, {"output_ids": [4], "meta_info": {"id": "x-1", "completion_tokens": 2}})]
    (only,) = pb.request_metrics(1.0, delta, ["solo"], ["x-1"])
    assert only["output_ids"] == [3, 4] and only["ttft_s"] == pytest.approx(0.4) and only["cached_tokens"] == 64
    assert only["decode_tok_s"] == pytest.approx(1 / 0.2)
    (none,) = pb.request_metrics(1.0, [], ["lost"], ["x-2"])
    assert none["ttft_s"] is None and none["decode_tok_s"] is None and none["output_tokens"] == 0
    row = {"calls": [{"wall_s": 2.0}, {"wall_s": 3.0}],
           "requests": [dict(r, prompt_len=1000, round=k, later=k > 0) for k, r in enumerate([a, b])]}
    s = pb.summarize(row)
    assert s["output_tok_s"] == pytest.approx(6 / 5.0) and s["ttft_median_s"] == pytest.approx(0.65)
    assert s["ttft_median_first_s"] == pytest.approx(0.8) and s["ttft_median_later_s"] == pytest.approx(0.5)
    assert s["ttft_median_by_round_s"] == [pytest.approx(0.8), pytest.approx(0.5)]
    assert s["cached_tokens"] == 960 and s["cached_share"] == pytest.approx(0.48)
    assert s["ttft_max_s"] == pytest.approx(0.8)


def _request(name, out, prompt="p", cached=0):
    return {"name": name, "output_ids": out, "prompt_digest": prompt, "cached_tokens": cached}


def test_prefix_bench_exactness_compares_only_like_for_like_requests():
    import prefix_bench as pb

    base = [_request("a", [1, 2, 3]), _request("b", [1, 2, 3], cached=64), _request("c", [4, 5, 6]),
            _request("d", [1]), _request("e", [1], prompt="q"), _request("f", [9, 9], cached=128)]
    test = [_request("a", [1, 2, 3]), _request("b", [1, 2, 3], cached=64), _request("c", [4, 7, 6]),
            _request("e", [1], prompt="other"), _request("f", [9, 9], cached=64)]
    out = pb.compare(base, test)
    assert (out["compared"], out["identical"], out["first_diff"]) == (3, 2, {"c": 1})
    assert out["excluded"]["d"] == "missing" and "prompt differs" in out["excluded"]["e"]
    assert out["excluded"]["f"] == "cached_tokens 64 vs 128"
    assert pb.v4_probe.first_diff([1, 2], [1, 2, 3]) == 2 and pb.v4_probe.first_diff([1], [1]) is None


def test_prefix_bench_summary_pools_and_grouping():
    import prefix_bench as pb

    anchor = {"ttft_median_s": 0.5, "ttft_median_later_s": 0.1, "output_tok_s": 400.0}
    assert pb.ratios(anchor, {"ttft_median_s": 2.0, "ttft_median_later_s": 2.5, "output_tok_s": 100.0}) == \
        {"ttft_speedup": 4.0, "ttft_later_speedup": 25.0, "tok_s_ratio": 4.0}
    odd = pb.ratios(anchor, {"ttft_median_s": 2.2, "ttft_median_later_s": None, "output_tok_s": 0.0})
    assert odd["ttft_later_speedup"] is None and odd["tok_s_ratio"] is None

    def row(ttfts_by_round, wall_by_round, tokens=4):
        return {"requests": [{"name": f"r{k}-{i}", "round": k, "later": k > 0, "ttft_s": x, "output_tokens": tokens,
                              "prompt_len": 100, "cached_tokens": 0, "decode_tok_s": None}
                             for k, xs in enumerate(ttfts_by_round) for i, x in enumerate(xs)],
                "calls": [{"round": k, "wall_s": w} for k, w in enumerate(wall_by_round)]}

    # the other server ran two of three rounds (budget): both are compared on those two
    rows = {"ours_radix": row([[1.0, 1.0], [0.2, 0.2], [0.3, 0.3]], [2.0, 1.0, 1.0]),
            "ours": row([[1.0, 1.0], [2.0, 2.0]], [2.0, 3.0])}
    paired = pb.summary_ratios(rows)["ours"]
    assert paired["requests"] == 4 and paired["ttft_later_speedup"] == pytest.approx(10.0)
    assert paired["tok_s_ratio"] == pytest.approx((16 / 3.0) / (16 / 5.0))
    assert paired["ttft_speedup"] == pytest.approx(1.5 / 0.6)
    assert pb.summary_ratios({"ours": rows["ours"]}) == {}
    counts = {"logical_free": (100, 100), "host_free": (50, 50)}
    assert pb.pools_back({"leak": False, "cached": 0, "counts": counts}) is True
    assert pb.pools_back({"leak": False, "cached": 64, "counts": counts}) is False
    assert pb.pools_back({"leak": False, "cached": 0, "counts": {"host_free": (49, 50)}}) is False
    assert pb.pools_back({"leak": True, "cached": 0, "counts": counts}) is False and pb.pools_back(None) is None
    assert pb.how_many_fit(110_000, 31_000) == 3 and pb.how_many_fit(50_000, 31_000) == 1
    assert pb.how_many_fit(20_000, 31_000) == 0 and pb.how_many_fit(None, 31_000) == 1
    assert pb.how_many_fit(110_000, 31_000, growth_mib=6144) == 2  # the H200 run where a fourth ran out
    log = "\n".join([_prefill(900), _decode(2, 1.0), _decode(2, 200.0), _decode(2, 200.0), _prefill(100)])
    stats = pb.log_stats(log)
    assert stats["prefilled_tokens"] == 1000 and stats["decode_trace"] == "2x3" and stats["decode_steps"] == 2
    assert pb.log_stats(_prefill(5)) == {"prefilled_tokens": 5, "decode_trace": ""}


class _FakePrefixServer:
    """A stand-in for one SGLang server with what prefix_bench uses: /generate (batched; streamed or
    not; greedy outputs a function of the prompt; a radix cache of finished sequences, 16-token
    pages, reported as ``cached_tokens``; prefill time proportional to the uncached tokens),
    /flush_cache, /server_info, and a log file with batch lines and, for ours, the idle line."""

    PAGE = 16

    def __init__(self, log_path: Path, impl: str, radix: bool):
        import http.server

        self.log_path, self.impl, self.radix, self.cache = log_path, impl, radix, []
        self.lines = ["server up"]
        self.write_log()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.startswith("/flush_cache"):
                    fake.cache.clear()
                    fake.idle()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream" if body.get("stream") else "application/json")
                self.end_headers()
                fake.generate(self.wfile, body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def write_log(self):
        self.log_path.write_text("\n".join(self.lines) + "\n")

    def idle(self):
        if self.impl == "ours":
            cached = sum(len(s) for s in self.cache)
            self.lines.append(f"sglang-hisparse idle: logical_free={1000 - cached}/1000 host_free={1000 - cached}/1000 "
                              f"cached={cached} loaded=0 evicted=0 leak=no selected=10 misses=2")
        self.write_log()

    def cached_len(self, prompt):
        best = 0
        for seq in self.cache if self.radix else []:
            n = next((i for i, (x, y) in enumerate(zip(seq, prompt)) if x != y), min(len(seq), len(prompt)))
            best = max(best, n)
        return min(best, len(prompt) - 1) // self.PAGE * self.PAGE

    def generate(self, wfile, body):
        prompts, stream = body["input_ids"], body.get("stream")
        params = body["sampling_params"]
        params = params if isinstance(params, list) else [params] * len(prompts)
        cached = [self.cached_len(p) for p in prompts]
        outs = [[(sum(p) + 7 * k) % 997 + 2 for k in range(params[i]["max_new_tokens"])] for i, p in enumerate(prompts)]
        time.sleep(2e-5 * sum(len(p) - c for p, c in zip(prompts, cached)))
        self.lines.append(_prefill(sum(len(p) - c for p, c in zip(prompts, cached))))
        for k in range(max(len(o) for o in outs)):
            time.sleep(0.001)
            self.lines.append(_decode(len(prompts), 1000.0))
            for i, out in enumerate(outs):
                if stream:
                    meta = {"id": body["rid"][i], "prompt_tokens": len(prompts[i]), "cached_tokens": cached[i],
                            "completion_tokens": k + 1,
                            "finish_reason": {"type": "length"} if k + 1 == len(out) else None}
                    wfile.write(b"data: " + json.dumps({"index": i, "output_ids": out[:k + 1], "meta_info": meta})
                                .encode() + b"\n\n")
        if stream:
            wfile.write(b"data: [DONE]\n\n")
        else:
            wfile.write(json.dumps([{"output_ids": o, "meta_info": {"cached_tokens": c}} for o, c in zip(outs, cached)])
                        .encode())
        if self.radix:
            self.cache += [p + o for p, o in zip(prompts, outs)]
        self.idle()


def test_prefix_bench_main_against_stand_in_servers(tmp_path, monkeypatch, capsys):
    """The whole driver against stand-in servers: two groups (the free memory holds three), every
    workload on every server, exactness of ours_radix against none_radix, pools back after the flush,
    prefix.json and the markdown summary."""
    import itertools

    import prefix_bench as pb
    from sglang_hisparse.serving.launcher import Server

    class Exited:
        pid = 0

        def poll(self):
            return 0

    fakes = []

    def launch(name, args):
        impl, radix = pb.SERVERS[name]
        fake = _FakePrefixServer(tmp_path / f"{name}.log", impl, radix)
        fakes.append(fake)
        return pb.Live(name, impl, radix, Server(port=fake.port, process=Exited(), log_path=fake.log_path))

    free = itertools.cycle([120_000, 90_000, 10_000])  # per group: before and after the first start, then a log line
    monkeypatch.setattr(pb, "launch", launch)
    monkeypatch.setattr(pb, "gpu_free_mib", lambda: next(free))
    monkeypatch.setattr(pb, "machine", lambda: {"nvidia_smi": "Fake GPU, 1 MiB", "cpus": 2, "ram_gib": 8})
    monkeypatch.setattr(pb, "START_STAGGER_S", 0.0)
    out = tmp_path / "prefix.json"
    argv = ["--conversations", "3", "--turns", "3", "--max-context", "900", "--new-tokens", "8",
            "--shared-requests", "4", "--shared-prefix", "400", "--suffix-tokens", "24", "--out", str(out)]
    try:
        assert pb.main(argv) == 0
    finally:
        for fake in fakes:
            fake.httpd.shutdown()
    result = json.loads(out.read_text())
    assert result["command"] == "bash scripts/gpu/run.sh prefix " + " ".join(argv)
    assert result["machine"].startswith("Fake GPU") and result["skipped"] == []
    assert [result["servers"][n]["group"] for n in pb.SERVERS] == [0, 0, 0, 1] and result["groups"] == 2
    rows = {(r["server"], r["workload"]): r for r in result["rows"]}
    assert len(rows) == 8 and all("output_ids" not in q for r in result["rows"] for q in r["requests"])
    radix, plain = rows[("ours_radix", "mt")], rows[("ours", "mt")]
    assert radix["summary"]["requests"] == 9 and len(radix["calls"]) == 3
    assert all(q["cached_tokens"] > 0 for q in radix["requests"] if q["round"] > 0)
    assert all(q["cached_tokens"] == 0 for q in plain["requests"])
    lengths = {q["name"]: q["prompt_len"] for q in radix["requests"]}
    assert lengths["mt-c00-t0"] < lengths["mt-c00-t1"] < lengths["mt-c00-t2"] <= 900 - 8
    assert rows[("ours_radix", "sp")]["requests"][1]["cached_tokens"] == 400  # the system prefix, 25 pages
    assert radix["log"]["prefilled_tokens"] < plain["log"]["prefilled_tokens"]
    assert radix["pools"]["pools_back"] is True and radix["pools"]["idle"]["cached"] > 0
    assert radix["pools"]["after_flush"]["cached"] == 0 and plain["pools"]["pools_back"] is True
    assert rows[("none_radix", "mt")]["pools"] == {"flushed": True}
    exact = {x["workload"]: x for x in result["exactness"]}
    assert exact["mt"]["compared"] == exact["mt"]["identical"] == 9 and exact["mt"]["excluded"] == {}
    assert exact["sp"]["compared"] == exact["sp"]["identical"] == 4
    assert exact["mt"]["decode_trace"] == exact["mt"]["baseline_decode_trace"] == "3x24"
    summary = result["summary"]["mt"]
    assert set(summary) == {"none_radix", "ours", "upstream"}
    assert summary["ours"]["ttft_later_speedup"] > 1.5  # the stand-in prefills only what is not cached
    printed = capsys.readouterr().out
    assert "### multi-turn" in printed and "| ours_radix | 9 |" in printed and "ours_radix vs ours (9 requests)" in printed
    assert "exactness ours_radix vs none_radix: 9 / 9 identical" in printed


def test_the_mixed_point_sends_one_new_token_count_per_prompt(tmp_path, monkeypatch):
    """sweep --mixed: prompts in [context/4, context] and new tokens in [n/4, n], drawn per
    request and reproducible by seed; the launcher sends one sampling-params object per prompt; a
    mixed fragment's rows are never pooled with a uniform point's."""
    import perf_report
    import sweep

    from sglang_hisparse.serving import launcher

    args = sweep.build_parser().parse_args(["--mixed", "--context", "400", "--new-tokens", "40", "--out", "x"])
    prompts, counts = sweep.level_batch(args, 16, seed=3)
    assert len(prompts) == len(counts) == 16
    assert all(100 <= len(p) <= 400 for p in prompts) and all(10 <= n <= 40 for n in counts)
    assert len({len(p) for p in prompts}) > 8 and len(set(counts)) > 8  # really mixed
    again, counts_again = sweep.level_batch(args, 16, seed=3)
    assert again == prompts and counts_again == counts
    uniform = sweep.build_parser().parse_args(["--context", "400", "--new-tokens", "40", "--out", "x"])
    prompts_u, count_u = sweep.level_batch(uniform, 4, seed=3)
    assert [len(p) for p in prompts_u] == [400] * 4 and count_u == 40

    sent = []
    monkeypatch.setattr(launcher, "post_json", lambda url, body, timeout: sent.append(body) or [])
    server = launcher.Server(port=1, process=None, log_path=tmp_path / "log")
    server.generate([[1, 2], [3]], [5, 7], top_k=1)
    assert sent[-1]["sampling_params"] == [
        {"temperature": 0.0, "ignore_eos": True, "top_k": 1, "max_new_tokens": 5},
        {"temperature": 0.0, "ignore_eos": True, "top_k": 1, "max_new_tokens": 7}]
    server.generate([[1, 2], [3]], 9)
    assert sent[-1]["sampling_params"] == {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 9}
    with pytest.raises(ValueError, match="max_new_tokens"):
        server.generate([[1, 2], [3]], [5])

    def run(rate):
        return {"decode_tok_s": rate, "tpot_ms": 1000 / rate, "max_running": 4, "miss_rate": 0.1}

    for call, mixed in (("gpu_runU", False), ("gpu_runM", True)):
        (tmp_path / call).mkdir()
        data = {"model": "m", "layers": 2, "context": "100-400" if mixed else 400, "mixed": mixed,
                "rows": [sweep.summarize("ours", "realistic", 4, [run(100.0 if mixed else 50.0)])]}
        (tmp_path / call / "s.json").write_text(json.dumps(data))
    perf = perf_report.merge([("gpu_runU/s.json", "u"), ("gpu_runM/s.json", "m")], results=tmp_path)
    assert sorted((str(r["pressure"]), r["decode_tok_s"], r["runs_from"]) for r in perf["rows"]) == \
        [("True", 50.0, ["gpu_runU"]), ("mixed", 100.0, ["gpu_runM"])]
    assert len(perf_report.panels(perf["rows"])) == 2


def test_v4_pd_script_builds_one_prefill_and_a_decode_instance_per_entry():
    """scripts/gpu/v4_pd.py (run.sh job v4pd): the decode list names its allowed values; every
    decode instance is a Mooncake PD decode of tiny-dsv4 with its own B; upstream loads only our
    dummy-weights plugin; the prefill and the baseline run without HiSparse."""
    import v4_pd

    assert v4_pd.parse_decodes("ours,ours@4096,upstream") == [("ours", None), ("ours", 4096), ("upstream", None)]
    with pytest.raises(ValueError, match="none, upstream, ours, ours_resident"):
        v4_pd.parse_decodes("mine")
    assert json.loads(v4_pd.hisparse_config("ours_resident", None, '{"top_k": 512}')) == {"top_k": 512, "residency": True}
    assert v4_pd.hisparse_config("ours", None, '{"top_k": 512}') == '{"top_k": 512}'
    assert v4_pd.parse_args([]).decodes == "ours,ours_resident,upstream"
    args = v4_pd.parse_args(["--decodes", "ours@2048,upstream", "--out", "/tmp/x.json"])
    specs = v4_pd.server_specs(args, bootstrap_port=4321)
    assert list(specs) == ["colocated_none", "prefill", "decode_ours_B2048", "decode_upstream"]
    assert specs["colocated_none"]["hisparse_config"] is None and "--disaggregation-mode" not in specs["colocated_none"]["extra_args"]
    prefill = specs["prefill"]["extra_args"]
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill" and "4321" in prefill
    ours = specs["decode_ours_B2048"]
    assert ours["extra_args"][ours["extra_args"].index("--disaggregation-mode") + 1] == "decode"
    assert json.loads(ours["hisparse_config"])["device_buffer_size"] == 2048
    assert specs["decode_upstream"]["env"]["SGLANG_PLUGINS"] == "hisparse_dummy_init"
    assert "SGLANG_PLUGINS" not in ours["env"] and ours["env"]["SGLANG_TOPK_TRANSFORM_512_TORCH"] == "1"
    with pytest.raises(SystemExit):
        v4_pd.parse_args(["--concurrent", "2", "--abort", "3"])


def test_v4_probe_residency_variants_set_the_key_explicitly():
    """v4_probe's ``ours_hot`` / ``ours_resident`` (the A/B points of C4 residency): ours' config
    with ``"residency"`` false / true, ``@B`` still applies; the default impls stay none, upstream, ours."""
    import v4_probe

    args = v4_probe.parse_args(["--impls", "ours,ours_hot,ours_hot@4096,ours_resident"])
    assert v4_probe.hisparse_config("ours", args) == args.hisparse_config
    hot = json.loads(v4_probe.hisparse_config("ours_hot", args))
    assert hot == {**json.loads(args.hisparse_config), "residency": False}
    assert json.loads(v4_probe.hisparse_config("ours_resident", args))["residency"] is True
    assert json.loads(v4_probe.hisparse_config("ours_hot@4096", args))["device_buffer_size"] == 4096
    assert v4_probe.log_name("ours_hot@4096") == "v4_ours_hot_B4096"
    assert v4_probe.parse_args([]).impls == "none,upstream,ours"


def test_v4_throughput_and_pd_rows_name_the_servers_by_todays_defaults():
    """collect.py's V4 rows of gpu_v4probe9 and gpu_v4pd1 (the H100 calls made while C4 residency
    was V4's default): ``ours`` then is ``ours_resident`` now, ``ours_hot`` then is ``ours`` now;
    the paired ratios are the medians of the per-round ratios; PD phase 1 exact for both of ours."""
    import collect

    rows = {r["impl"]: r for r in collect.v4_throughput_rows("gpu_v4probe9")}
    assert rows["ours"]["impl_in_run"] == "ours_hot" and rows["ours"]["residency"] is False
    assert rows["ours_resident"]["impl_in_run"] == "ours" and rows["ours_resident"]["residency"] is True
    assert rows["ours"]["paired_ratio_vs"]["upstream"] == pytest.approx(0.974, abs=1e-3)
    assert rows["ours"]["decode_tok_s"] / rows["upstream"]["decode_tok_s"] == pytest.approx(1.094, abs=1e-3)
    assert all(r["pools_back_to_initial"] for name, r in rows.items() if name.startswith("ours"))
    pd = {r["impl"]: r for r in collect.v4_pd_rows("gpu_v4pd1")}
    assert (pd["ours"]["identical"], pd["ours_resident"]["identical"], pd["upstream"]["identical"]) == (6, 6, 5)
    assert pd["ours"]["pools_back_to_initial"] and pd["ours"]["pd"] and pd["ours"]["sequences"] == 6
