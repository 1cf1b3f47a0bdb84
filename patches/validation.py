"""Seam: validate ``--enable-hisparse`` and ``--hisparse-config`` in the launcher.

Upstream target: ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse`` (REPLACE).
Checked against: SGLang 0.5.17 (called from ``arg_groups/overrides.py:_hisparse_validation``
with a resolved view of the server arguments, before any process or GPU work starts).

Parses the typed config (so a bad key fails here, in the launcher, with one line), checks the
server settings HiSparse needs, chooses the resolver for the GPU (refusing a GPU the kernel does
not run on unless ``resolver=reference``) and, for the kernel, the largest hot buffer its shared
memory holds. Does nothing when HiSparse is disabled.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_hisparse.config import config_from_server_args
from sglang_hisparse.resolver.dispatch import choose_resolver, platform_of
from sglang_hisparse.serving.server_checks import (
    ServerSettings,
    check_kernel_buffer_size,
    check_server_settings,
    check_speculative_config,
)

TARGET = "sglang.srt.arg_groups.hisparse_hook.validate_hisparse"
CHECKED_AGAINST = "0.5.17"

logger = logging.getLogger(__name__)


def read_settings(server_args: Any) -> ServerSettings:
    from sglang.srt.configs.model_config import is_deepseek_dsa, is_deepseek_v4

    hf_config = server_args.get_model_config().hf_config
    architectures = getattr(hf_config, "architectures", None) or ["?"]
    return ServerSettings(
        architecture=architectures[0],
        is_dsa_model=bool(is_deepseek_dsa(hf_config)),
        is_deepseek_v4=bool(is_deepseek_v4(hf_config)),
        disable_radix_cache=bool(server_args.disable_radix_cache),
        kv_cache_dtype=str(server_args.kv_cache_dtype),
        dsa_prefill_backend=server_args.dsa_prefill_backend,
        dsa_decode_backend=server_args.dsa_decode_backend,
        enable_mixed_chunk=bool(server_args.enable_mixed_chunk),
        speculative_algorithm=server_args.speculative_algorithm,
        pp_size=int(server_args.pp_size),
        cpu_engine=str(server_args.device) == "cpu",
        dcp_size=int(server_args.dcp_size),
        attn_cp_size=int(server_args.attn_cp_size),
        enable_prefill_cp=bool(server_args.enable_prefill_cp),
        disaggregation_mode=str(server_args.disaggregation_mode),
        enable_unified_memory=bool(server_args.enable_unified_memory),
        speculative_eagle_topk=server_args.speculative_eagle_topk,
        speculative_num_draft_tokens=server_args.speculative_num_draft_tokens,
        speculative_adaptive=bool(server_args.speculative_adaptive),
        enable_multi_layer_eagle=bool(server_args.enable_multi_layer_eagle),
        disable_overlap_schedule=bool(server_args.disable_overlap_schedule),
    )


def kv_device(server_args: Any) -> str:
    """The device the scheduler of rank 0 will put the KV cache on."""
    device = str(server_args.device)
    return f"cuda:{server_args.base_gpu_id}" if device == "cuda" else device


def validate_hisparse(server_args: Any) -> None:
    """REPLACE body. Raises ``HiSparseConfigError`` (a ValueError) with a one-line message."""
    if not server_args.enable_hisparse:
        return
    config = config_from_server_args(server_args)
    check_server_settings(read_settings(server_args))
    check_speculative_config(config)
    resolver = choose_resolver(config.resolver, platform_of(kv_device(server_args)))
    if resolver == "cuda":
        check_kernel_buffer_size(config)
    logger.info("sglang-hisparse: HiSparse config %s, resolver %s", config.to_json_dict(), resolver)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, validate_hisparse, HookType.REPLACE)
