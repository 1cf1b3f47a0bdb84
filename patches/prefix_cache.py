"""Seam: with HiSparse and the radix cache on, SGLang builds our radix cache.

Upstream target: ``sglang.srt.mem_cache.registry.create_tree_cache`` (AROUND). Checked against:
SGLang 0.5.17, where ``kv_cache_builder.build_kv_cache`` calls it once per scheduler process,
before the HiSparse coordinator exists, and its default factory builds a plain ``RadixCache`` for
a DSA model without HiCache. With ``--enable-hisparse`` and the radix cache on, a
:class:`~sglang_hisparse.prefix.host_tree.HostPrefixCache` is built instead (the coordinator
attaches itself later: ``patches/prefix_cache_attach.py``; on a PD decode instance, where SGLang
builds it only with ``--disaggregation-decode-enable-radix-cache``, it serves the prefill's skipping
of a held prefix: ``prefix/pd_prefix.py``); a setting under which SGLang would
build another cache kind is refused with one line. Otherwise the original runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.config import HiSparseConfigError

TARGET = "sglang.srt.mem_cache.registry.create_tree_cache"
CHECKED_AGAINST = "0.5.17"


def refusal(ctx: Any) -> str | None:
    """Why our radix cache cannot stand in for what SGLang would build here (None: it can)."""
    from sglang.srt.environ import envs

    args = ctx.server_args
    if args.radix_cache_backend:
        return f"--radix-cache-backend={args.radix_cache_backend} (leave it unset)"
    if ctx.enable_hierarchical_cache:
        return "--enable-hierarchical-cache (HiCache keeps its own host copy of the KV; leave it off)"
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        return "a hybrid (sliding-window or state-space) model (add --disable-radix-cache)"
    if envs.SGLANG_ENABLE_UNIFIED_RADIX_TREE.get() or envs.SGLANG_EXPERIMENTAL_CPP_RADIX_TREE.get():
        return "SGLANG_ENABLE_UNIFIED_RADIX_TREE / SGLANG_EXPERIMENTAL_CPP_RADIX_TREE (unset them)"
    if args.enable_lmcache or args.enable_flexkv:
        return "--enable-lmcache / --enable-flexkv (leave them off)"
    return None


def create_tree_cache(original: Callable[..., Any], ctx: Any, *args: Any, **kwargs: Any) -> Any:
    if not getattr(ctx.server_args, "enable_hisparse", False) or ctx.disable_radix_cache:
        return original(ctx, *args, **kwargs)
    problem = refusal(ctx)
    if problem is not None:
        raise HiSparseConfigError(f"--enable-hisparse with the radix cache on does not support {problem}")
    from sglang_hisparse.prefix.host_tree import HostPrefixCache

    return HostPrefixCache(ctx.params, serves_transfers=ctx.server_args.disaggregation_mode == "decode")


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, create_tree_cache, HookType.AROUND)
