"""Seam (CPU platform only): DSA models on the CPU engine get the torch sparse-MLA backend.

Upstream targets (SGLang 0.5.17):
* ``sglang.srt.model_executor.model_runner_components.attention_backend_setup.
  _build_full_attention_backend_from_str`` (AROUND): for a DSA model and the backend SGLang picks
  on CPU (``torch_native``), build :class:`sglang_hisparse.cpu.dsa_torch.TorchDSABackend`
  instead; anything else is built by the original.
* ``sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.
  get_handler`` (AROUND): for ``torch_native``, DSA attention layers run absorbed MLA for every
  batch (upstream falls back to the Triton handler, which picks dense MHA for prefill).
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.cpu.dsa_torch import TorchDSABackend, attention_method_for

BUILD_TARGET = (
    "sglang.srt.model_executor.model_runner_components.attention_backend_setup."
    "_build_full_attention_backend_from_str"
)
HANDLER_TARGET = (
    "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler"
)
CHECKED_AGAINST = "0.5.17"


def build_backend(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.configs.model_config import is_deepseek_dsa

    runner = kwargs.get("model_runner")
    if kwargs.get("backend_str") == "torch_native" and runner is not None and is_deepseek_dsa(runner.model_config.hf_config):
        runner.init_new_workspace = kwargs.get("init_new_workspace", False)
        return TorchDSABackend(runner)
    return original(*args, **kwargs)


def get_handler(original: Callable[..., Any], registry_cls: Any, backend_name: str) -> Any:
    handler = original(registry_cls, backend_name)
    if backend_name != "torch_native":
        return handler
    return lambda attn, forward_batch: attention_method_for(attn, forward_batch, handler)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(BUILD_TARGET, build_backend, HookType.AROUND)
    registry.register(HANDLER_TARGET, get_handler, HookType.AROUND)
