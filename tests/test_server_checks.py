"""Server settings HiSparse cannot serve are refused with one line naming the flag."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sglang_hisparse.config import HiSparseConfigError
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.serving.server_checks import ServerSettings, check_server_settings

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
    check_server_settings(dataclasses.replace(GOOD, disable_radix_cache=False))  # prefix reuse
    # a PD decode instance with --disaggregation-decode-enable-radix-cache (the prefill skips a held prefix)
    check_server_settings(dataclasses.replace(GOOD, disable_radix_cache=False, disaggregation_mode="decode"))
    check_server_settings(dataclasses.replace(GOOD, kv_cache_dtype="fp8_e4m3",
                                              dsa_prefill_backend="flashmla_kv",
                                              dsa_decode_backend=None))


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(is_dsa_model=False, architecture="Qwen2ForCausalLM"), "Qwen2ForCausalLM has no DSA indexer"),
        (dict(disable_radix_cache=False, speculative_algorithm="EAGLE", speculative_eagle_topk=1,
              disable_overlap_schedule=True), "radix cache on (prefix reuse) does not support --speculative-algorithm=EAGLE"),
        (dict(disable_radix_cache=False, disaggregation_mode="prefill"),
         "radix cache on (prefix reuse) does not support --disaggregation-mode=prefill (allowed: null, decode)"),
        (dict(disable_radix_cache=False, enable_hierarchical_cache=True), "does not support --enable-hierarchical-cache"),
        (dict(kv_cache_dtype="fp8_e5m2"), "invalid --kv-cache-dtype=fp8_e5m2"),
        (dict(dsa_decode_backend="tilelang"), "invalid --dsa-decode-backend=tilelang"),
        (dict(kv_cache_dtype="fp8_e4m3"), "invalid --dsa-prefill-backend=flashmla_sparse"),
        (dict(enable_mixed_chunk=True), "--enable-mixed-chunk is not supported"),
        (dict(pp_size=2), "--pp-size=2"),
    ],
)
def test_unsupported_settings_are_refused(change, fragment):
    with pytest.raises(HiSparseConfigError) as info:
        check_server_settings(dataclasses.replace(GOOD, **change))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


V4 = dataclasses.replace(GOOD, architecture="DeepseekV4ForCausalLM", is_deepseek_v4=True, is_dsa_model=False,
                         kv_cache_dtype="fp8_e4m3", dsa_prefill_backend=None, dsa_decode_backend=None)


def test_deepseek_v4_is_served_colocated_and_on_a_mooncake_pd_decode_instance():
    check_server_settings(V4)
    for backend in ("mooncake", "mooncake_tcp", "fake"):
        check_server_settings(dataclasses.replace(V4, disaggregation_mode="decode", disaggregation_transfer_backend=backend))


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(disable_radix_cache=False), "requires --disable-radix-cache"),
        (dict(enable_mixed_chunk=True), "--enable-mixed-chunk is not supported"),
        (dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1),
         "--speculative-algorithm=EAGLE with DeepSeek-V4 is not supported"),
        (dict(disaggregation_mode="decode", disaggregation_transfer_backend="nixl"),
         "--disaggregation-transfer-backend=nixl is not supported (allowed: mooncake, mooncake_tcp, fake"),
        (dict(disaggregation_mode="decode", test_retract=True), "SGLANG_TEST_RETRACT is not supported"),
        (dict(disaggregation_mode="prefill"), "--disaggregation-mode=prefill is not supported"),
        (dict(pp_size=2), "--pp-size=2"),
        (dict(dcp_size=2), "--dcp-size=2"),
    ],
)
def test_deepseek_v4_settings_ours_cannot_serve_are_refused(change, fragment):
    with pytest.raises(HiSparseConfigError) as info:
        check_server_settings(dataclasses.replace(V4, **change))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


LINEAR_EAGLE = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                    disable_overlap_schedule=True)


def test_linear_speculation_without_the_overlap_scheduler_passes():
    check_server_settings(dataclasses.replace(GOOD, **LINEAR_EAGLE))
    check_server_settings(dataclasses.replace(GOOD, **dict(LINEAR_EAGLE, speculative_algorithm="NEXTN")))


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm=NGRAM is not supported by sglang-hisparse "
                                              "(allowed: EAGLE or NEXTN with --speculative-eagle-topk 1)"),
        (dict(speculative_algorithm="EAGLE3"), "--speculative-algorithm=EAGLE3 is not supported"),
        (dict(speculative_eagle_topk=4), "--speculative-eagle-topk=4 is not supported by sglang-hisparse "
                                         "(linear speculation only: --speculative-eagle-topk 1)"),
        (dict(speculative_adaptive=True), "--speculative-adaptive is not supported"),
        (dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle is not supported"),
        (dict(disable_overlap_schedule=False), "needs --disable-overlap-schedule"),
        (dict(disaggregation_mode="decode"), "with --disaggregation-mode=decode is not supported"),
    ],
)
def test_speculation_beyond_linear_is_refused_in_one_line(change, fragment):
    with pytest.raises(HiSparseConfigError) as info:
        check_server_settings(dataclasses.replace(GOOD, **dict(LINEAR_EAGLE, **change)))
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(dcp_size=2), "--dcp-size=2 is not supported"),
        (dict(attn_cp_size=2), "--attn-cp-size=2 is not supported"),
        (dict(enable_prefill_cp=True), "--enable-prefill-cp is not supported"),
        (dict(disaggregation_mode="prefill"), "--disaggregation-mode=prefill is not supported"),
        (dict(enable_unified_memory=True), "--enable-unified-memory is not supported"),
    ],
)
def test_parallel_layouts_not_run_are_refused(change, fragment):
    with pytest.raises(HiSparseConfigError) as info:
        check_server_settings(dataclasses.replace(GOOD, **change))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_the_kernel_buffer_limit_follows_its_shared_memory_layout():
    """The limit is the largest B whose planner layout fits the block's shared memory, with the
    top-k-sized arrays spilled to global memory past 16011 slots at top_k 2048."""
    from sglang_hisparse.resolver.cuda import MAX_SMEM_BYTES, largest_buffer_size, planner_smem_bytes, planner_spills

    for top_k in (64, 2048, 3 * 2048, 4 * 2048):
        limit = largest_buffer_size(top_k)
        assert planner_smem_bytes(limit, top_k) <= MAX_SMEM_BYTES < planner_smem_bytes(limit + 1, top_k)
    assert largest_buffer_size(2048) == 19135
    assert not planner_spills(16011, 2048) and planner_spills(16012, 2048)
    assert largest_buffer_size(2048, reuse=True) == 15056


def test_a_hot_buffer_beyond_the_kernel_limit_is_refused_with_the_allowed_range():
    from sglang_hisparse.config import HiSparseConfig
    from sglang_hisparse.serving.server_checks import check_kernel_buffer_size

    check_kernel_buffer_size(HiSparseConfig(top_k=2048, device_buffer_size=19135))
    with pytest.raises(HiSparseConfigError) as info:
        check_kernel_buffer_size(HiSparseConfig(top_k=2048, device_buffer_size=19136))
    message = str(info.value)
    assert message.startswith("--hisparse-config: invalid device_buffer_size=19136:")
    assert "allowed: [2048, 19135]" in message and "\n" not in message
    check_kernel_buffer_size(HiSparseConfig(top_k=2048, device_buffer_size=15056, replacement="reuse"))
    with pytest.raises(HiSparseConfigError, match=r"holds at most 15056 slots for top_k=2048 with "
                                                 r"replacement=reuse; allowed: \[2048, 15056\]"):
        check_kernel_buffer_size(HiSparseConfig(top_k=2048, device_buffer_size=15057, replacement="reuse"))


def _launcher_view(config: str, **overrides):
    """What SGLang's launcher hands validate_hisparse: resolved server arguments."""

    hf_config = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
    model = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config)
    values = dict(
        enable_hisparse=True, hisparse_config=config, disable_radix_cache=True, kv_cache_dtype="bfloat16",
        dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="flashmla_sparse", enable_mixed_chunk=False,
        speculative_algorithm=None, pp_size=1, device="cuda", base_gpu_id=0, dcp_size=1, attn_cp_size=1,
        enable_prefill_cp=False, disaggregation_mode="null", enable_unified_memory=False,
        speculative_eagle_topk=None, speculative_num_draft_tokens=None, speculative_adaptive=False,
        enable_multi_layer_eagle=False, disable_overlap_schedule=False, enable_hierarchical_cache=False,
        disaggregation_transfer_backend="mooncake",
        get_model_config=lambda: model,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.mark.parametrize(
    "platform, config, fragment",
    [
        (("cuda", False, (9, 0)), '{"device_buffer_size": 20000}', "invalid device_buffer_size=20000"),
        (("cuda", False, (8, 0)), "{}", "resolver=auto: the fused kernel runs on NVIDIA sm_90"),
        (("cuda", True, None), '{"resolver": "cuda"}', "resolver=cuda: the fused kernel runs on NVIDIA sm_90"),
    ],
)
def test_the_launcher_refuses_what_the_gpu_cannot_run(monkeypatch, platform, config, fragment):
    """validate_hisparse (the launcher seam) checks the GPU and the kernel's limit before any
    model loads; an explicit resolver=reference is accepted on any GPU."""
    from sglang_hisparse.errors import HiSparsePluginError
    from sglang_hisparse.patches import validation
    from sglang_hisparse.resolver.dispatch import Platform

    device_type, rocm, capability = platform
    monkeypatch.setattr(validation, "platform_of", lambda device: Platform(device_type, rocm, capability))
    with pytest.raises((HiSparseConfigError, HiSparsePluginError)) as info:
        validation.validate_hisparse(_launcher_view(config))
    assert fragment in str(info.value) and "\n" not in str(info.value)
    validation.validate_hisparse(_launcher_view('{"resolver": "reference", "device_buffer_size": 20000}'))


SPEC_ARGS = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                 disable_overlap_schedule=True)
ONE_DRAFT = dict(SPEC_ARGS, speculative_num_draft_tokens=2)
TEN_ROWS = dict(SPEC_ARGS, speculative_num_draft_tokens=10)


@pytest.mark.parametrize(
    "config, spec, fragment",
    [
        ('{"device_buffer_size": 6144}', SPEC_ARGS, "invalid device_buffer_size=6144: must be in [4 x top_k=8192: "
                                                    "a verify step of 4 tokens per request, 32767]"),
        ("{}", TEN_ROWS, "union of 10 x top_k=20480 positions, which the fused kernel's shared memory (227 KiB per "
                         "block) does not hold for any device_buffer_size: use --speculative-num-steps 8 or fewer, "
                         "or --hisparse-config resolver=reference"),
        ('{"device_buffer_size": 19200}', ONE_DRAFT, "slots for a verify union of 2 x top_k=4096 positions; "
                                                     "allowed: [4096, 19135]"),
        ('{"residency": true}', ONE_DRAFT, "residency=true is not supported with speculative decoding"),
    ],
)
def test_the_launcher_sizes_hot_buffers_for_the_verify_window(monkeypatch, config, spec, fragment):
    """With linear speculation (N query rows) the hot buffer must hold N x top_k positions; the
    kernel's limit is that of the verify union (none at all for N = 10, top_k 2048: 20480 > 19135);
    residency is refused."""
    from sglang_hisparse.patches import validation
    from sglang_hisparse.resolver.dispatch import Platform

    monkeypatch.setattr(validation, "platform_of", lambda device: Platform("cuda", False, (9, 0)))
    with pytest.raises(HiSparseConfigError) as info:
        validation.validate_hisparse(_launcher_view(config, **spec))
    assert fragment in str(info.value) and "\n" not in str(info.value)
    validation.validate_hisparse(_launcher_view("{}", **ONE_DRAFT))  # B = 3 x 2048 fits
    validation.validate_hisparse(_launcher_view("{}", **SPEC_ARGS))  # B = 5 x 2048: the planner spills


def test_the_default_hot_buffer_with_speculation_is_n_plus_one_times_top_k():
    from sglang_hisparse.config import config_from_server_args

    assert config_from_server_args(_launcher_view("{}")).device_buffer_size == 2 * 2048
    config = config_from_server_args(_launcher_view("{}", **SPEC_ARGS))
    assert (config.query_rows, config.device_buffer_size) == (4, 5 * 2048)


def test_deepseek_v4_defaults_to_hot_buffers_and_residency_is_a_key_away():
    """V4's residency default is off (measured slower than hot buffers, config.V4_RESIDENCY_DEFAULT);
    ``"residency": true`` turns it on; DSA keeps residency on by default."""
    from sglang_hisparse.config import config_from_server_args

    hf_config = SimpleNamespace(architectures=["DeepseekV4ForCausalLM"], index_topk=512)
    v4_model = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config)

    def v4_view(config: str):
        view = _launcher_view(config)
        view.get_model_config = lambda: v4_model
        return view

    assert config_from_server_args(v4_view("{}")).residency is False
    assert config_from_server_args(v4_view('{"residency": true}')).residency is True
    assert config_from_server_args(_launcher_view("{}")).residency is True


def test_a_refusal_from_python_raises_and_the_pool_bound_is_checked():
    """Called from Python (not the launch command) a refusal raises; with --max-total-tokens the
    hot buffer must leave a page of the pool for a prefill."""
    from sglang_hisparse.patches import validation

    view = _launcher_view('{"device_buffer_size": 4040}', max_total_tokens=4100, page_size=64, device="cpu")
    with pytest.raises(HiSparsePluginError, match=r"invalid device_buffer_size=4040: one decoding request holds "
                                                  r"4096 device rows .* the device KV pool has 4096 rows; use "
                                                  r"device_buffer_size <= 4031, .*; here --max-total-tokens 4100 bounds"):
        validation.validate_hisparse(view)
    validation.validate_hisparse(_launcher_view('{"device_buffer_size": 4031}', max_total_tokens=4100,
                                                page_size=64, device="cpu"))
    validation.validate_hisparse(_launcher_view('{"device_buffer_size": 4040}', max_total_tokens=None,
                                                page_size=64, device="cpu"))


REFUSALS = {
    "unknown key": (['--hisparse-config', '{"device_bufer_size": 128}'], "error: --hisparse-config: unknown key(s) device_bufer_size"),
    "missing file": (['--hisparse-config', 'no/such/hisparse.json'], "error: --hisparse-config: 'no/such/hisparse.json' is neither inline JSON"),
    "radix cache with HiCache": (['--hisparse-config', '{}', '--no-disable-radix-cache', '--enable-hierarchical-cache'],
                                 "error: --enable-hisparse does not support --enable-hierarchical-cache"),
    "hot buffer above the pool": (['--hisparse-config', '{"device_buffer_size": 4040}', '--max-total-tokens', '4096'],
                                  "error: sglang-hisparse: invalid device_buffer_size=4040"),
}


@pytest.mark.slow
def test_the_launch_command_refuses_in_one_line_without_a_traceback(tmp_path):
    """``python -m sglang.launch_server`` with a bad HiSparse setting: exit status 2, the reason in
    one ``error:`` line on stderr, no traceback, before any weights load (the tiny model's dummy weights
    would log 'Load weight')."""
    from concurrent.futures import ThreadPoolExecutor

    from sglang_hisparse.serving.launcher import MODELS_DIR, server_env

    def launch(extra):
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(MODELS_DIR / "tiny-dsa-cpu"),
                "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cpu", "--page-size", "64",
                "--enable-hisparse", *extra]
        if "--no-disable-radix-cache" in args:
            args.remove("--no-disable-radix-cache")
        else:
            args.append("--disable-radix-cache")
        return subprocess.run(args, capture_output=True, text=True, env=server_env(cpu=True), cwd=tmp_path, timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(REFUSALS, pool.map(launch, [extra for extra, _ in REFUSALS.values()])))
    for name, (_, expected) in REFUSALS.items():
        result = results[name]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2, (name, result.returncode, result.stderr[-2000:])
        assert len(errors) == 1 and errors[0].startswith(expected), (name, errors)
        assert "Traceback" not in result.stderr + result.stdout and "Load weight" not in result.stderr, name
