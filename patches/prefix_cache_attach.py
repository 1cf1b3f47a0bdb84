"""Seam: our radix cache and our coordinator meet.

Upstream target: ``sglang.srt.managers.scheduler.Scheduler.init_hisparse_coordinator`` (AFTER).
Checked against: SGLang 0.5.17, where the tree cache (``scheduler.tree_cache``) is built before the
coordinator. When the tree is a :class:`~sglang_hisparse.prefix.host_tree.HostPrefixCache`, the
coordinator hands finishing requests' host rows to it and the tree loads matched prefixes through
the coordinator's pools (``HiSparseCoordinator.attach_prefix_cache``). Nothing happens otherwise.
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.prefix.host_tree import HostPrefixCache

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_hisparse_coordinator"
CHECKED_AGAINST = "0.5.17"


def attach_prefix_cache(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    tree = getattr(scheduler, "tree_cache", None)
    coordinator = getattr(scheduler, "hisparse_coordinator", None)
    if isinstance(tree, HostPrefixCache) and coordinator is not None:
        coordinator.attach_prefix_cache(tree)
    return None


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, attach_prefix_cache, HookType.AFTER)
