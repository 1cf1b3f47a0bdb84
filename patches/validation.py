"""Seam: validate ``--enable-hisparse`` and ``--hisparse-config`` in the launcher.

Upstream target: ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse`` (REPLACE).
Checked against: SGLang 0.5.17 (called from ``arg_groups/overrides.py:_hisparse_validation``
with a resolved view of the server arguments, before any process or GPU work starts).

Parses the typed config (so a bad key fails here, in the launcher, with one line), then checks
the server settings HiSparse needs. Does nothing when HiSparse is disabled.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_hisparse.config import config_from_server_args
from sglang_hisparse.server_checks import ServerSettings, check_server_settings

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
    )


def validate_hisparse(server_args: Any) -> None:
    """REPLACE body. Raises ``HiSparseConfigError`` (a ValueError) with a one-line message."""
    if not server_args.enable_hisparse:
        return
    config = config_from_server_args(server_args)
    check_server_settings(read_settings(server_args))
    logger.info("sglang-hisparse: HiSparse config %s", config.to_json_dict())


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, validate_hisparse, HookType.REPLACE)
