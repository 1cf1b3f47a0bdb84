"""The capacity planner: its accounting, its refusals, and the line it shares with the server."""

from __future__ import annotations

import json
import re

import pytest

from sglang_hisparse.memory.admission import Capacity, capacity_line
from sglang_hisparse.tools.plan import GIB, ModelDims, PlanError, main, make_plan
from sglang_hisparse.serving.launcher import MODELS_DIR

DEEPSEEK_V32 = {  # DeepSeek-V3.2's published dimensions (FP8 weights)
    "architectures": ["DeepseekV32ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
    "vocab_size": 129280, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "quantization_config": {"quant_method": "fp8"},
}
H200_HOST = dict(tp=8, dp=8, dp_attention=True, gpu_mem_gib=141, context=32768, device_buffer_size=4096, ratio=8)


@pytest.fixture
def v32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    return tmp_path


def test_row_sizes_match_sglangs_layouts(v32):
    dims = ModelDims.from_config(v32)
    assert dims.kv_row_bytes("bfloat16") == 1152 and dims.kv_row_bytes("fp8_e4m3") == 656
    assert dims.index_row_bytes() == 132
    total = dims.weight_params_attention + dims.weight_params_other
    assert 650e9 < total < 700e9, total  # ~671B parameters, read off the config


def test_an_8xh200_plan_holds_more_requests_with_hisparse(v32):
    plan = make_plan(ModelDims.from_config(v32), host_mem_gib=2000, **H200_HOST)
    c = plan.capacity
    assert c.logical_ids == c.host_rows == 8 * c.device_rows and c.device_rows % 64 == 0
    assert c.hot_buffer_rows == 4160
    # each device row also carries the indexer rows of 8 logical ids: fewer rows than without HiSparse
    assert c.device_rows < plan.tokens_without_hisparse
    assert plan.decoding_with == 8 * min(c.device_rows // 4160, c.host_rows // 32768)
    assert plan.decoding_without == 8 * (plan.tokens_without_hisparse // 32768)
    assert plan.decoding_with > 3 * plan.decoding_without
    assert plan.pinned_host_bytes_per_rank == c.host_rows * 61 * 1152


def test_a_plan_beyond_the_hosts_memory_is_refused(v32):
    with pytest.raises(PlanError, match=r"pinned host memory .* exceeds the host's 500 GiB: lower host_to_device_ratio"):
        make_plan(ModelDims.from_config(v32), host_mem_gib=500, **H200_HOST)
    with pytest.raises(PlanError, match="dp must divide tp"):
        make_plan(ModelDims.from_config(v32), host_mem_gib=2000, **{**H200_HOST, "dp": 3})
    with pytest.raises(PlanError, match="leave no KV memory"):
        make_plan(ModelDims.from_config(v32), host_mem_gib=2000, **{**H200_HOST, "dp_attention": False, "tp": 1, "dp": 1})


def test_the_cli_prints_the_servers_capacity_line_and_refuses_with_exit_2(v32, capsys):
    args = ["--model-config", str(v32), "--tp", "8", "--dp", "8", "--dp-attention", "--context", "32768",
            "--device-buffer-size", "4096", "--ratio", "8"]
    assert main(args + ["--host-mem-gib", "2000"]) == 0
    out = capsys.readouterr().out.splitlines()
    plan = make_plan(ModelDims.from_config(v32), host_mem_gib=2000, **H200_HOST)
    assert out[0] == capacity_line(plan.capacity)
    assert re.match(r"per host: 8 ranks, pinned host memory [\d.]+ GiB of 2000 GiB", out[1])
    assert out[2].startswith(f"requests of 32768 tokens decoding at once: {plan.decoding_with} with HiSparse")
    assert main(args + ["--host-mem-gib", "500"]) == 2
    assert capsys.readouterr().err.startswith("sglang-hisparse plan refused: pinned host memory")


def test_the_capacity_line_states_the_servers_numbers():
    line = capacity_line(Capacity(device_rows=8192, hot_buffer_rows=192, page_size=64, logical_ids=16384,
                                  host_rows=16448, device_buffer_size=128, host_row_bytes=2 * GIB // 16448))
    assert line == ("sglang-hisparse capacity: device rows 8192 (a request holds its own rows, in a hot buffer at "
                    "most 192: 42 long requests at once), "
                    "host rows 16448 (pinned 2.00 GiB per rank), logical ids 16384; admission room when idle 8192 tokens")


def test_the_tiny_models_plan_with_given_weights():
    """Our bundled tiny model reads like a real one (the GPU suite's servers use it)."""
    dims = ModelDims.from_config(MODELS_DIR / "tiny-dsa")
    plan = make_plan(dims, tp=1, dp=1, dp_attention=False, gpu_mem_gib=141, host_mem_gib=400, context=32768,
                     device_buffer_size=4096, ratio=2, weights_gib=1.0)
    assert plan.request_groups == 1 and plan.decoding_with > plan.decoding_without > 0
