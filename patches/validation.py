"""Seam: validate ``--enable-hisparse`` and ``--hisparse-config`` in the launcher.

Upstream target: ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse`` (REPLACE).
Checked against: SGLang 0.5.17 (called from ``arg_groups/overrides.py:_hisparse_validation``
with a resolved view of the server arguments, before any process or GPU work starts).

Parses the typed config (so a bad key fails here, in the launcher, with one line), checks the
server settings HiSparse needs and the hot buffer against ``--max-total-tokens`` when given,
chooses the resolver for the GPU (refusing a GPU the kernel does not run on unless
``resolver=reference``) and, for the kernel, the largest hot buffer its shared memory holds.
Does nothing when HiSparse is disabled. As the ``sglang.launch_server`` command a refusal is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from sglang_hisparse.config import HiSparseConfigError, config_from_server_args
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.admission import Capacity, check_startup, hot_buffer_rows
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
    from sglang.srt.environ import envs

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
        enable_hierarchical_cache=bool(server_args.enable_hierarchical_cache),
        disaggregation_transfer_backend=str(server_args.disaggregation_transfer_backend),
        test_retract=bool(envs.SGLANG_TEST_RETRACT.get()),
    )


def kv_device(server_args: Any) -> str:
    """The device the scheduler of rank 0 will put the KV cache on."""
    device = str(server_args.device)
    return f"cuda:{server_args.base_gpu_id}" if device == "cuda" else device


def validate_hisparse(server_args: Any) -> None:
    """REPLACE body. Refuses what HiSparse cannot serve with a one-line reason: as the
    ``sglang.launch_server`` command, that line on stderr and exit status 2 (no traceback, before
    any weights load); called from Python (``sglang.Engine``), ``HiSparseConfigError``."""
    if not server_args.enable_hisparse:
        return
    try:
        check_hisparse(server_args)
    except (HiSparseConfigError, HiSparsePluginError) as error:
        if not launched_as_server_command():
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def launched_as_server_command() -> bool:
    """This process is ``python -m sglang.launch_server`` (the command a refusal may end)."""
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is not None and main.__spec__.name == "sglang.launch_server"


def check_hisparse(server_args: Any) -> None:
    """Every launcher check; raises ``HiSparseConfigError`` or ``HiSparsePluginError`` (one line)."""
    config = config_from_server_args(server_args)
    settings = read_settings(server_args)
    check_server_settings(settings)
    check_speculative_config(config)
    if not settings.is_deepseek_v4:  # V4's C4 rows are sized by SGLang's V4 pool configurator, not this bound
        check_pool_bound(config, server_args)
    resolver = choose_resolver(config.resolver, platform_of(kv_device(server_args)))
    if resolver == "cuda":
        check_kernel_buffer_size(config)
    logger.info("sglang-hisparse: HiSparse config %s, resolver %s", config.to_json_dict(), resolver)


def check_pool_bound(config: Any, server_args: Any) -> None:
    """With ``--max-total-tokens`` the device KV pool has at most that many rows (whole pages):
    refuse a hot buffer that leaves no page for a prefill beside it here, as the coordinator would
    once the pool is sized (after the weights load)."""
    max_total_tokens = getattr(server_args, "max_total_tokens", None)
    if not max_total_tokens:
        return
    page = int(getattr(server_args, "page_size", None) or 1)
    rows = int(max_total_tokens) // page * page
    padded = hot_buffer_rows(config.device_buffer_size, config.query_rows, page)
    try:
        check_startup(Capacity(device_rows=rows, hot_buffer_rows=padded, page_size=page,
                               logical_ids=rows * config.host_to_device_ratio,
                               host_rows=rows * config.host_to_device_ratio,
                               device_buffer_size=config.device_buffer_size))
    except HiSparsePluginError as error:
        raise HiSparsePluginError(
            f"{error}; here --max-total-tokens {max_total_tokens} bounds the device pool") from None


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, validate_hisparse, HookType.REPLACE)
