"""Seam: every SGLang reader of ``--hisparse-config`` sees values of our typed config.

Upstream target: ``sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config`` (REPLACE;
the registry also rebinds the re-export in ``sglang.srt.mem_cache.sparsity``).
Checked against: SGLang 0.5.17, where the pool configurator (indexer sizing), the KV-cache
configurator (allocator and device pool) and the model runner (coordinator arguments) call it.

Returns upstream's ``SparseConfig`` filled from :class:`sglang_hisparse.config.HiSparseConfig`
so that, e.g., the default ``device_buffer_size`` is 2 x the model's ``index_topk`` everywhere.
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.config import config_from_server_args

TARGET = "sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config"
CHECKED_AGAINST = "0.5.17"


def parse_hisparse_config(server_args: Any) -> Any:
    """REPLACE body: upstream's return type, our values."""
    from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig

    config = config_from_server_args(server_args)
    return SparseConfig(
        top_k=config.top_k,
        device_buffer_size=config.device_buffer_size,
        host_to_device_ratio=config.host_to_device_ratio,
        swap_in_block_size=config.swap_in_block_size,
        sparse_extra_config={"resolver": config.resolver, "skip_io": config.skip_io},
    )


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, parse_hisparse_config, HookType.REPLACE)
