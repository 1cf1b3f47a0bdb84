"""Server settings HiSparse cannot serve are refused with one line naming the flag."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_hisparse.config import HiSparseConfigError
from sglang_hisparse.server_checks import ServerSettings, check_server_settings

GOOD = ServerSettings(
    architecture="DeepseekV32ForCausalLM",
    is_dsa_model=True,
    is_deepseek_v4=False,
    disable_radix_cache=True,
    kv_cache_dtype="bfloat16",
    dsa_prefill_backend="flashmla_sparse",
    dsa_decode_backend="flashmla_sparse",
    enable_mixed_chunk=False,
    speculative_algorithm=None,
    pp_size=1,
)


def test_the_cpu_engine_ignores_gpu_backend_flags():
    check_server_settings(dataclasses.replace(GOOD, dsa_decode_backend="fa3", cpu_engine=True))


def test_a_supported_server_passes():
    check_server_settings(GOOD)
    check_server_settings(dataclasses.replace(GOOD, kv_cache_dtype="fp8_e4m3",
                                              dsa_prefill_backend="flashmla_kv",
                                              dsa_decode_backend=None))


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(is_deepseek_v4=True, is_dsa_model=False), "DeepSeek-V4"),
        (dict(is_dsa_model=False, architecture="Qwen2ForCausalLM"), "Qwen2ForCausalLM has no DSA indexer"),
        (dict(disable_radix_cache=False), "requires --disable-radix-cache"),
        (dict(kv_cache_dtype="fp8_e5m2"), "invalid --kv-cache-dtype=fp8_e5m2"),
        (dict(dsa_decode_backend="tilelang"), "invalid --dsa-decode-backend=tilelang"),
        (dict(kv_cache_dtype="fp8_e4m3"), "invalid --dsa-prefill-backend=flashmla_sparse"),
        (dict(enable_mixed_chunk=True), "--enable-mixed-chunk is not supported"),
        (dict(speculative_algorithm="EAGLE"), "--speculative-algorithm=EAGLE"),
        (dict(pp_size=2), "--pp-size=2"),
    ],
)
def test_unsupported_settings_are_refused(change, fragment):
    with pytest.raises(HiSparseConfigError) as info:
        check_server_settings(dataclasses.replace(GOOD, **change))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
