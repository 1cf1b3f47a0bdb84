"""The tiny MTP model variants for speculative decoding tests (#18, docs/speculative.md): each is
its base tiny DSA config with one NextN layer, and SGLang 0.5.17 reads it as a DSA target whose
draft model is the NextN architecture."""

from __future__ import annotations

import json

import pytest

from sglang_hisparse.serving.launcher import MODELS_DIR


@pytest.mark.parametrize("base", ["tiny-dsa", "tiny-dsa-cpu", "ds32-width"])
def test_mtp_variant_is_its_base_with_one_nextn_layer(base):
    config = json.loads((MODELS_DIR / base / "config.json").read_text())
    mtp = json.loads((MODELS_DIR / f"{base}-mtp" / "config.json").read_text())
    assert config.get("num_nextn_predict_layers", 0) == 0 and mtp["num_nextn_predict_layers"] == 1
    assert {k: v for k, v in mtp.items() if k != "num_nextn_predict_layers"} == \
        {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}


def test_sglang_reads_the_mtp_variant_as_a_dsa_target_with_a_nextn_draft():
    from sglang.srt.configs.model_config import ModelConfig, is_deepseek_dsa

    path = str(MODELS_DIR / "tiny-dsa-cpu-mtp")
    target = ModelConfig(model_path=path)
    draft = ModelConfig(model_path=path, is_draft_model=True)
    assert target.hf_config.architectures == ["DeepseekV32ForCausalLM"]
    assert draft.hf_config.architectures == ["DeepseekV3ForCausalLMNextN"]
    assert is_deepseek_dsa(target.hf_config) and is_deepseek_dsa(draft.hf_config)
