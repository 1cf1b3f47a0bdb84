"""Seam (CPU platform only): DSA models on the CPU engine get the torch sparse-MLA backend.

Upstream targets (SGLang 0.5.17):
* ``sglang.srt.model_executor.model_runner_components.attention_backend_setup.
  _build_full_attention_backend_from_str`` (AROUND): for a DSA model and the backend SGLang picks
  on CPU (``torch_native``), build :class:`sglang_hisparse.cpu.dsa_torch.TorchDSABackend`
  instead; anything else is built by the original.
* ``sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.
  get_handler`` (AROUND): for ``torch_native``, DSA attention layers run absorbed MLA for every
  batch (upstream falls back to the Triton handler, which picks dense MHA for prefill).
* Speculative decoding (EAGLE / NEXTN) on the CPU engine, without HiSparse (our launch checks
  refuse speculation with it):
  ``sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend`` (AROUND):
  the draft DSA model on ``torch_native`` gets the same torch backend (upstream has no
  ``torch_native`` entry); ``...create_decode_backend`` (AROUND): the multi-step draft decode
  backend (``--speculative-num-steps`` > 1) does not exist on CPU, refused in one line;
  ``sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head`` (AROUND): the draft
  shares the target's embedding and head, then upstream calls ``torch.cuda.synchronize()``, which
  fails without a GPU driver; on CPU the call runs with that synchronize a no-op.
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
DRAFT_EXTEND_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend"
DRAFT_DECODE_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_decode_backend"
EMBED_HEAD_TARGET = "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head"
CHECKED_AGAINST = "0.5.17"


def _torch_native_dsa_draft(factory: Any, *backend_names: str) -> bool:
    """Whether the draft runner of ``factory`` is a DSA model that SGLang would run on
    ``torch_native`` for one of ``backend_names`` (server-args fields)."""
    from sglang.srt.configs.model_config import is_deepseek_dsa

    args = factory.server_args
    chosen = {factory.draft_attn_backend or getattr(args, name, None) or args.attention_backend
              for name in backend_names}
    return "torch_native" in chosen and is_deepseek_dsa(factory.draft_model_runner.model_config.hf_config)


def draft_extend_backend(original: Callable[..., Any], factory: Any) -> Any:
    if _torch_native_dsa_draft(factory, "prefill_attention_backend", "decode_attention_backend"):
        return TorchDSABackend(factory.draft_model_runner)
    return original(factory)


def draft_decode_backend(original: Callable[..., Any], factory: Any) -> Any:
    if factory.speculative_num_steps > 1 and _torch_native_dsa_draft(factory, "decode_attention_backend"):
        raise ValueError(
            f"--speculative-num-steps={factory.speculative_num_steps} needs a multi-step draft decode backend, "
            "which the CPU engine's DSA attention does not have: use --speculative-num-steps 1 on CPU")
    return original(factory)


def set_embed_and_head(original: Callable[..., Any], model: Any, embed: Any, head: Any) -> Any:
    import torch

    if torch.cuda.is_available():
        return original(model, embed, head)
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        return original(model, embed, head)
    finally:
        torch.cuda.synchronize = synchronize


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
    registry.register(DRAFT_EXTEND_TARGET, draft_extend_backend, HookType.AROUND)
    registry.register(DRAFT_DECODE_TARGET, draft_decode_backend, HookType.AROUND)
    registry.register(EMBED_HEAD_TARGET, set_embed_and_head, HookType.AROUND)
