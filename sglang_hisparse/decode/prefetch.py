"""Exact IndexShare prefetch: layers that reuse an earlier layer's top-k get their copies early.

In an IndexShare model (``index_topk_freq`` / ``index_topk_pattern``, as GLM-5.2) a *follower*
layer attends to exactly the positions its *source* layer selected. With prefetch on, a follower
never resolves: its hot-buffer slots hold, in its own KV, the same positions as the source's slots,
because every copy the source's resolve makes is replayed onto every follower's KV (the resolver's
miss plan and copy-only replay). The follower's device rows are then the source's output, and its
copies run on a side stream right after the source's resolve, overlapped with the source layer's
attention and MLP; the follower waits for them (on the device) before its attention.

Invariant (per decoding request and follower ``f`` of source ``s``): hot-buffer slot ``q`` holds in
layer ``f`` the position it holds in layer ``s``. It holds when a buffer opens (filled: slot p holds
p in every layer; empty; demotion: the same rows for all layers) and each step keeps it: the
source's copies are replayed onto ``f`` before ``f``'s attention, and the newest token's slot is
written for every layer by the forward. The follower's own slot tables are not used.

Owned state: the source's miss plan (preallocated, fixed addresses), the counter snapshot that
turns one resolve's (selected, misses) into the followers' too, and the side stream.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sglang_hisparse.resolver.reference import MissPlan


def topk_sources(skips_topk: list[bool]) -> list[int]:
    """Per layer, the layer whose top-k it uses: itself, or for a layer that skips its indexer
    the nearest earlier layer that runs one (SGLang passes that layer's top-k along)."""
    sources: list[int] = []
    for layer, skips in enumerate(skips_topk):
        if skips and layer == 0:
            raise ValueError("layer 0 cannot reuse an earlier layer's top-k")
        sources.append(sources[layer - 1] if skips else layer)
    return sources


def model_topk_sources(layers: int) -> list[int]:
    """The top-k sources of the served model's ``layers`` layers, from SGLang's server arguments
    and its ``dsa_layer_skips_topk`` rule."""
    from sglang.srt.configs.model_config import dsa_layer_skips_topk
    from sglang.srt.runtime_context import get_server_args

    model = get_server_args().get_model_config()
    hf = next(c for c in (getattr(model, "hf_text_config", None), model.hf_config)
              if c is not None and getattr(c, "index_topk", None) is not None)
    return topk_sources([dsa_layer_skips_topk(hf, layer) for layer in range(layers)])


class IndexSharePrefetch:
    """Follower layers of one server (see the module docstring).

    ``replay(plan, layer)`` copies a plan's host rows into ``layer``'s device rows (the
    resolver's copy-only replay); it is launched on the side stream.
    """

    def __init__(self, sources: list[int], *, max_reqs: int, top_k: int, device: torch.device,
                 replay: Callable[[MissPlan, int], None]):
        self.followers: dict[int, list[int]] = {}
        for layer, source in enumerate(sources):
            if source != layer:
                self.followers.setdefault(source, []).append(layer)
        self._is_follower = [source != layer for layer, source in enumerate(sources)]
        self.plan = MissPlan(
            host_rows=torch.zeros((max_reqs, top_k), dtype=torch.int64, device=device),
            device_rows=torch.zeros((max_reqs, top_k), dtype=torch.int32, device=device),
            counts=torch.zeros(max_reqs, dtype=torch.int32, device=device),
        )
        self._snapshot = torch.zeros(2, dtype=torch.int64, device=device)
        self._replay = replay
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def active(self) -> bool:
        return bool(self.followers)

    def is_follower(self, layer: int) -> bool:
        return self._is_follower[layer]

    def plan_for(self, layer: int) -> Optional[MissPlan]:
        """The plan a source layer's resolve records (None for a layer without followers)."""
        return self.plan if layer in self.followers else None

    def before_source(self, counters: torch.Tensor) -> None:
        """Remember the resolver's counters before a source layer resolves."""
        self._snapshot.copy_(counters)

    def after_source(self, layer: int, counters: torch.Tensor, *, copy: bool) -> None:
        """After a source layer resolved: count its selections and misses once more per follower,
        and (``copy``; not with ``skip_io``) launch the replay of its plan onto every follower on
        the side stream, ordered after everything issued so far on the current stream."""
        followers = self.followers[layer]
        counters.add_(counters - self._snapshot, alpha=len(followers))
        if not copy:
            return
        if self._stream is None:
            for follower in followers:
                self._replay(self.plan, follower)
            return
        current = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for follower in followers:
                self._replay(self.plan, follower)

    def join(self) -> None:
        """Before a follower's attention: the current stream waits (on the device) for the
        replays launched so far."""
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
