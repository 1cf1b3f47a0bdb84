"""Plugin activation, observed from fresh interpreters as SGLang's processes see it.

Each fresh interpreter and launcher run is registered with ``fresh.runs_first``: the module's runs
start together, two at a time, and each test checks its own results."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from fresh import runs_first, snippet

VERSION_MESSAGE = "sglang-hisparse supports SGLang 0.5.17; found 0.5.23"

# A stand-in scheduler: just what Scheduler.init_hisparse_coordinator touches.
FAKE_SCHEDULER = """
from types import SimpleNamespace
def fake_scheduler(coordinator, allocator, enable=True):
    runner = SimpleNamespace(hisparse_coordinator=coordinator)
    return SimpleNamespace(
        enable_hisparse=enable,
        tp_worker=SimpleNamespace(model_runner=runner),
        forward_stream=None,
        token_to_kv_pool_allocator=allocator,
    )
class FakeCoordinator:
    def set_decode_producer_stream(self, stream):
        self.stream = stream
"""


def with_fake_scheduler(snippet: str) -> str:
    return FAKE_SCHEDULER + textwrap.dedent(snippet)


def test_entry_point_is_discovered(run_fresh_python):
    result = run_fresh_python(
        """
        from importlib.metadata import entry_points
        eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
        print(eps.get("hisparse"))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "sglang_hisparse.serving.plugin:register"


@runs_first(snippet(
    """
    from types import SimpleNamespace
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang.srt.arg_groups.hisparse_hook as hook
    import sglang.srt.mem_cache.sparsity as sparsity
    import sglang.srt.mem_cache.sparsity.factory as factory
    from sglang_hisparse.config import HiSparseConfigError
    def no_model():
        raise AssertionError("model config read while HiSparse is disabled")
    off = SimpleNamespace(enable_hisparse=False, get_model_config=no_model)
    print(hook.validate_hisparse(off))
    on = SimpleNamespace(enable_hisparse=True, hisparse_config='{"bogus": 1}',
                         get_model_config=lambda: SimpleNamespace(hf_config=None))
    try:
        hook.validate_hisparse(on)
    except HiSparseConfigError as e:
        print("ours:", str(e)[:40])
    print(factory.parse_hisparse_config is sparsity.parse_hisparse_config,
          factory.parse_hisparse_config.__wrapped__.__module__)
    from sglang.srt.managers.scheduler import Scheduler
    print(Scheduler.init_hisparse_coordinator.__wrapped__.__qualname__)
    """
))
def test_load_plugins_patches_our_function_targets(prefetched):
    """After SGLang's own load_plugins(), validate_hisparse runs our checks, the config parser is
    ours both in its module and in the package re-export, and the self-check wraps the scheduler."""
    (result,) = prefetched
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "None",
        "ours: --hisparse-config: unknown key(s) bogus;",
        "True sglang.srt.mem_cache.sparsity.factory",
        "Scheduler.init_hisparse_coordinator",
    ]


@runs_first(snippet(
    """
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from types import SimpleNamespace
    import sglang.srt.mem_cache.sparsity as sparsity
    model = SimpleNamespace(hf_text_config=SimpleNamespace(index_topk=64))
    args = SimpleNamespace(hisparse_config='{"host_to_device_ratio": 3}',
                           get_model_config=lambda: model)
    cfg = sparsity.parse_hisparse_config(args)
    print(cfg.top_k, cfg.device_buffer_size, cfg.host_to_device_ratio, cfg.sparse_extra_config)
    args.hisparse_config = '{"bogus": 1}'
    try:
        sparsity.parse_hisparse_config(args)
    except ValueError as e:
        print("refused:", e)
    """
))
def test_replaced_functions_run_our_code(prefetched):
    (result,) = prefetched
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "64 128 3 {'resolver': 'auto', 'skip_io': False}"
    assert out[1].startswith("refused: --hisparse-config: unknown key(s) bogus")


@runs_first(snippet(
    with_fake_scheduler(
        """
    from types import ModuleType
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    import sglang.srt.managers.hisparse_coordinator as upstream
    from sglang_hisparse.serving import plugin

    class OurCoordinator(FakeCoordinator): pass
    class OurAllocator:
        def get_kvcache(self): return OurPool()
    class OurPool: pass

    def seam(role, target, cls):
        m = ModuleType("seam_" + role)
        m.ROLE, m.IMPLEMENTATION = role, cls
        m.register = lambda reg: reg.register(target, cls, HookType.REPLACE)
        return m

    originals = [upstream.HiSparseCoordinator]  # a list: the registry rebinds module globals
    plugin.register(HookRegistry, seams=[
        seam("coordinator", "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator", OurCoordinator),
        seam("allocator", "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator", OurAllocator),
        seam("device_pool", "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool", OurPool),
    ])
    HookRegistry.apply_hooks()
    import sglang.srt.managers.scheduler as sched_mod
    print(upstream.HiSparseCoordinator is OurCoordinator,
          sched_mod.HiSparseCoordinator is OurCoordinator,
          upstream.HiSparseCoordinator is not originals[0])
    s = fake_scheduler(OurCoordinator(), OurAllocator())
    sched_mod.Scheduler.init_hisparse_coordinator(s)
    print("accepted", s.hisparse_coordinator.stream)
    """
    )
))
def test_class_seams_replace_upstream_classes_everywhere(prefetched):
    """A class seam (here a test double) becomes what every SGLang module resolves the name to,
    and the self-check accepts a scheduler that holds our objects."""
    (result,) = prefetched
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True True True", "accepted None"]


@runs_first(snippet(
    with_fake_scheduler(
        """
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_hisparse.serving import plugin
    from sglang_hisparse.errors import HiSparsePluginError
    plugin.register(HookRegistry, seams=[])
    HookRegistry.apply_hooks()
    from sglang.srt.managers.scheduler import Scheduler
    Scheduler.init_hisparse_coordinator(fake_scheduler(None, None, enable=False))
    print("disabled: fine")
    try:
        Scheduler.init_hisparse_coordinator(fake_scheduler(FakeCoordinator(), object()))
    except HiSparsePluginError as e:
        print("refused:", e)
    """
    )
))
def test_self_check_refuses_upstream_objects(prefetched):
    """With HiSparse enabled and an object that is not ours, the scheduler refuses to start;
    with HiSparse disabled nothing happens."""
    (result,) = prefetched
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "disabled: fine"
    assert out[1].startswith("refused: --enable-hisparse: sglang-hisparse is installed but not in control")
    assert "coordinator: sglang-hisparse has no implementation yet" in out[1]
    assert "SGLANG_PLUGINS" in out[1]


@runs_first(snippet(
    """
    from types import SimpleNamespace
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_hisparse.serving import plugin
    from sglang_hisparse.errors import HiSparsePluginError
    from sglang_hisparse.patches import self_check
    hooks = plugin.register(HookRegistry)
    from sglang_hisparse.patches import verify_attention  # registered on GPUs only: resolve it here too
    verify_attention.register(plugin._Recording(HookRegistry, hooks))
    HookRegistry.apply_hooks()
    print(len(hooks) >= 15, self_check.unapplied(hooks))
    import sglang.srt.speculative.eagle_utils as eagle_utils
    eagle_utils.eagle_prepare_for_decode = eagle_utils.eagle_prepare_for_decode.__wrapped__
    print(self_check.unapplied(hooks))
    scheduler = SimpleNamespace(enable_hisparse=True, hisparse_coordinator=None, token_to_kv_pool_allocator=None)
    try:
        self_check.make_hook({}, None, hooks)(None, scheduler)
    except HiSparsePluginError as e:
        print("refused:", e)
    """
))
def test_self_check_refuses_a_function_hook_that_was_not_applied(prefetched):
    """Every hook the plugin registers runs at its target after SGLang applied them; a target left
    unhooked (as when SGLang's registry fails to apply one and logs it) is named by the self-check."""
    (result,) = prefetched
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "True []"
    assert out[1] == "['sglang.srt.speculative.eagle_utils.eagle_prepare_for_decode']"
    assert "hook not applied: sglang.srt.speculative.eagle_utils.eagle_prepare_for_decode" in out[2]


@runs_first(snippet(
    with_fake_scheduler(
        """
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_hisparse.serving import plugin
    from sglang_hisparse.errors import HiSparsePluginError
    plugin.register(HookRegistry, sglang_version="0.5.23")
    print(sorted(HookRegistry._hooks))
    HookRegistry.apply_hooks()
    from sglang.srt.managers.scheduler import Scheduler
    Scheduler.init_hisparse_coordinator(fake_scheduler(None, None, enable=False))
    print("disabled: fine")
    try:
        Scheduler.init_hisparse_coordinator(fake_scheduler(FakeCoordinator(), None))
    except HiSparsePluginError as e:
        print("refused:", e)
    """
    )
))
def test_version_guard_registers_only_the_self_check(prefetched):
    (result,) = prefetched
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "['sglang.srt.managers.scheduler.Scheduler.init_hisparse_coordinator']"
    assert out[1] == "disabled: fine"
    assert out[2] == "refused: " + VERSION_MESSAGE


@runs_first(snippet(
    """
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang.srt.arg_groups.hisparse_hook as hook
    from sglang.srt.plugins.hook_registry import HookRegistry
    print(hook.validate_hisparse.__module__, hasattr(hook.validate_hisparse, "__wrapped__"),
          len(HookRegistry._hooks))
    """,
    env={"SGLANG_PLUGINS": "some_other_plugin"},
))
def test_excluding_the_plugin_gives_sglang_its_own_hisparse(prefetched):
    (result,) = prefetched
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "sglang.srt.arg_groups.hisparse_hook False 0"


def _write_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
}


def _launch(args: list[str], timeout: float = 240, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


def _launch_qwen2(config: str):
    """A run of the launcher with --enable-hisparse, ``config`` and a tiny non-DSA model."""
    def run():
        with tempfile.TemporaryDirectory(prefix="qwen2-") as d:
            model = _write_config(Path(d), TINY_QWEN2)
            return _launch(["--model-path", str(model), "--skip-tokenizer-init", "--disable-radix-cache",
                            "--device", "cpu", "--enable-hisparse", "--hisparse-config", config])
    return run


@pytest.mark.slow
@runs_first(_launch_qwen2('{"device_buffer_size": 8, "bogus": 1}'), _launch_qwen2('{"device_buffer_size": 4096}'))
def test_launcher_refuses_bad_config_before_any_process_starts(prefetched):
    """The real launcher runs our validation during argument resolution: a bad key and a
    non-DSA model each fail with our one-line message, before any scheduler is spawned."""
    bad_key, not_dsa = prefetched
    assert bad_key.returncode != 0
    assert "--hisparse-config: unknown key(s) bogus; known keys: top_k" in bad_key.stderr
    assert "Scheduler" not in bad_key.stderr.split("HiSparseConfigError")[-1]
    assert not_dsa.returncode != 0
    assert "model Qwen2ForCausalLM has no DSA indexer" in not_dsa.stderr


@pytest.mark.slow
@runs_first(lambda: _launch(["--help"]))
def test_launch_server_help_still_works(prefetched):
    (result,) = prefetched
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--enable-hisparse" in result.stdout and "--hisparse-config" in result.stdout


CANNOT_SERVE = [
    (["--hisparse-config", '{"resolver": "cuda"}'],
     "--hisparse-config resolver=cuda: the fused kernel runs on NVIDIA sm_90 GPUs (H100/H200) only; "
     "the KV cache is on a cpu device"),
    (["--hisparse-config", "{}", "--disaggregation-mode", "prefill"],
     "--enable-hisparse: --disaggregation-mode=prefill is not supported (HiSparse runs on the decode instance"),
]


def _launch_tiny_dsa(extra: list[str]):
    """A run of the launcher with --enable-hisparse and the tiny DSA model on SGLang's CPU engine."""
    from sglang_hisparse.serving.launcher import MODELS_DIR, server_env

    common = ["--model-path", str(MODELS_DIR / "tiny-dsa-cpu"), "--skip-tokenizer-init", "--disable-radix-cache",
              "--device", "cpu", "--load-format", "dummy", "--enable-hisparse"]
    return lambda: _launch(common + extra, env=server_env(cpu=True))


@pytest.mark.slow
@runs_first(*(_launch_tiny_dsa(extra) for extra, _ in CANNOT_SERVE))
def test_launcher_refuses_what_hisparse_cannot_serve_before_any_model_loads(prefetched):
    """With a DSA model on SGLang's CPU engine: resolver=cuda (the kernel cannot run here) and a
    PD prefill instance are each refused by the launcher in one line, before a scheduler starts."""
    for result, (_, message) in zip(prefetched, CANNOT_SERVE):
        assert result.returncode != 0
        assert message in result.stderr, result.stderr[-2000:]
        assert "Load weight" not in result.stderr and "scheduler" not in result.stderr.split(message)[0].lower()
