"""The DeepSeek-V4 test models under sglang_hisparse/models load through SGLang 0.5.17's own config
path as V4 models, within the constraints its V4 code asserts (docs/deepseek_v4/upstream-contract.md),
and v4-width has the attention widths of DeepSeek-V4-Flash (docs/deepseek_v4/README.md)."""

from __future__ import annotations

import json

import pytest

from sglang_hisparse.serving.launcher import MODELS_DIR

V4_MODELS = ["tiny-dsv4", "v4-width"]

FLASH_ATTENTION = {"hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
                   "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
                   "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128}
"""DeepSeek-V4-Flash's attention and indexer widths (its published config)."""


@pytest.mark.parametrize("name", V4_MODELS)
def test_a_v4_model_loads_as_sglangs_v4_within_its_asserted_constraints(name):
    from sglang.srt.configs.model_config import ModelConfig

    config = ModelConfig(model_path=str(MODELS_DIR / name))
    hf = config.hf_config
    assert hf.architectures == ["DeepseekV4ForCausalLM"]
    ratios = list(hf.compress_ratios)
    assert len(ratios) == hf.num_hidden_layers and set(ratios) <= {0, 4, 128} and 4 in ratios
    assert hf.head_dim == 512 and hf.head_dim - hf.qk_rope_head_dim == 448  # the 584-byte FP8 row
    assert hf.index_head_dim == 128 and hf.index_topk in (512, 1024)
    assert hf.num_key_value_heads == 1 and hf.num_attention_heads % hf.o_groups == 0
    rope = json.loads((MODELS_DIR / name / "config.json").read_text())["rope_scaling"]
    assert rope["factor"] * rope["original_max_position_embeddings"] == hf.max_position_embeddings
    assert config.context_len == hf.max_position_embeddings


def test_v4_width_has_the_flash_attention_widths_and_its_leading_layer_pattern():
    config = json.loads((MODELS_DIR / "v4-width" / "config.json").read_text())
    assert {key: config[key] for key in FLASH_ATTENTION} == FLASH_ATTENTION
    assert config["compress_ratios"] == [0, 0] + [4, 128] * 3  # Flash's first 8 of 43 layers
    assert config["num_hash_layers"] == 3 and config["hc_mult"] == 4
    assert config["moe_intermediate_size"] == 2048 and config["num_experts_per_tok"] == 6  # Flash's expert size and fan-out
    assert config["max_position_embeddings"] >= 65536  # the 1k-60k token prompts
