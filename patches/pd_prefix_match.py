"""Seam: a PD decode instance's match against our radix tree, for the prefill to skip.

Upstream target: ``sglang.srt.disaggregation.decode.DecodePreallocQueue._match_prefix_and_lock``
(AROUND). Checked against: SGLang 0.5.17, where ``pop_preallocated`` calls it for each request
(``--disaggregation-decode-enable-radix-cache``, not a re-bootstrap) and sends the match's length
to the prefill instance as ``decode_prefix_len``; it matches through ``match_prefix_for_req`` and
locks ``last_device_node``.

Ours: with our tree (``HostPrefixCache`` of a PD decode instance), the match runs with the tree
reporting its cached prefix as held, and is undone when the request's own ids would not fit
(``prefix/pd_prefix.py``, :func:`match_for_transfer`). Other trees: the original, unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.prefix.host_tree import HostPrefixCache

TARGET = "sglang.srt.disaggregation.decode.DecodePreallocQueue._match_prefix_and_lock"
CHECKED_AGAINST = "0.5.17"


def match_prefix_and_lock(original: Callable[..., Any], queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    tree = getattr(queue, "tree_cache", None)
    if not isinstance(tree, HostPrefixCache) or not tree.serves_transfers or args or kwargs:
        return original(queue, req, *args, **kwargs)
    from sglang_hisparse.prefix.pd_prefix import match_for_transfer

    return match_for_transfer(original, queue, req, tree)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, match_prefix_and_lock, HookType.AROUND)
