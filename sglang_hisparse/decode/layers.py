"""Per-layer resolution: each layer's bound resolver, IndexShare prefetch, the output rows.

:class:`LayerResolve` is what ``swap_in_selected_pages`` delegates to. At start-up it binds every
layer's resolver once (tables, KV buffers, counters, plan and residency tables checked once; a call
checks only the batch) and, for an IndexShare model with prefetch on, wires the source layers'
plans to their followers (:mod:`sglang_hisparse.decode.prefetch`).

With a verify window of N > 1 query rows (linear speculation) each layer also gets a resolver
bound for the verify union's width ``N x top_k`` (no prefetch plan: in a verify step every layer
resolves its own rows) and :meth:`LayerResolve.verify` resolves a verify step through
:class:`~sglang_hisparse.resolver.verify.VerifyStep`.

Owned state: the bound resolvers, the prefetch and the verify step's buffers. It writes the
output rows ``out`` (int32 [max_reqs, top_k], fixed address for CUDA graphs, passed in: residency
reads a demoted request's last selections there; a follower layer returns its source's rows from it).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from sglang_hisparse.decode.prefetch import IndexSharePrefetch
from sglang_hisparse.resolver.dispatch import Resolver
from sglang_hisparse.resolver.verify import VerifyStep

logger = logging.getLogger(__name__)


class LayerResolve:
    def __init__(self, resolver: Resolver, *, layers: int, max_reqs: int, top_k: int, device: torch.device,
                 hot, mirror, device_pool, counters: torch.Tensor, num_real_reqs: torch.Tensor, skip_io: bool,
                 out: torch.Tensor, topk_sources: Optional[list[int]], residency_tables: dict,
                 reuse_levels: Optional[torch.Tensor] = None, query_rows: int = 1,
                 layer_rows: Optional[Callable[[int], tuple]] = None, compress_ratio: int = 1):
        """``layer_rows(layer)``: the layer's (host, device) KV as the resolver takes them (default:
        the pools' ``kv_buffer[layer]`` tensors; DeepSeek-V4: ``C4PagedRows`` views, with
        ``compress_ratio`` 4)."""
        self.out = out
        self._resolver = resolver
        self._mirror, self._device_pool = mirror, device_pool
        self._counters, self._num_real_reqs, self._skip_io = counters, num_real_reqs, skip_io
        self.prefetch: Optional[IndexSharePrefetch] = None
        if topk_sources is not None:
            prefetch = IndexSharePrefetch(topk_sources, max_reqs=max_reqs, top_k=top_k, device=device,
                                          replay=self._replay_onto)
            if prefetch.active():
                self.prefetch = prefetch
                logger.info("sglang-hisparse: IndexShare prefetch on: source layer -> followers %s", prefetch.followers)
        rows_of = layer_rows or (lambda layer: (mirror.pool.kv_buffer[layer], device_pool.kv_buffer[layer]))
        ratio = {} if compress_ratio == 1 else dict(compress_ratio=compress_ratio)

        def layer_tables(layer: int) -> dict:
            """One layer's keywords common to its one-row and verify resolvers."""
            host_kv, device_kv = rows_of(layer)
            return dict(hot_locs=hot.slot_rows, slot_tokens=hot.slot_positions[layer], lru=hot.recency[layer],
                        host_locs=mirror.row_table, host_kv=host_kv, device_kv=device_kv, num_real_reqs=num_real_reqs,
                        **ratio,
                        device_buffer_size=hot.buffer_size, skip_io=skip_io, counters=counters,
                        **self._policy_tables(hot, layer, reuse_levels),
                        **({} if hot.slot_map is None else dict(slot_map=hot.slot_map[layer])),
                        **(dict(buffer_sizes=hot.sizes.device) if hot.sizes.elastic else {}))

        self._layers = [resolver.bind(
            plan=self.prefetch.plan_for(layer) if self.prefetch is not None else None, **residency_tables,
            **layer_tables(layer),
        ) for layer in range(layers)]
        self._verify: Optional[VerifyStep] = None
        self._verify_layers: list = []
        if query_rows > 1:
            self._verify = VerifyStep(max_reqs=max_reqs, top_k=top_k, query_rows=query_rows,
                                      device_buffer_size=hot.buffer_size, hot_locs=hot.slot_rows, device=device)
            self._verify_layers = [resolver.bind(width=query_rows * top_k, **layer_tables(layer))
                                   for layer in range(layers)]

    @staticmethod
    def _policy_tables(hot, layer: int, reuse_levels: Optional[torch.Tensor]) -> dict:
        """The reuse policy's keywords of one layer (none for LRU)."""
        if reuse_levels is None:
            return {}
        assert hot.history is not None, "the reuse policy needs the hot buffers' history"
        return dict(slot_history=hot.history[layer], reuse_levels=reuse_levels)

    def __call__(self, layer_id: int, req_pool_indices, seq_lens, top_k_result) -> torch.Tensor:
        """Device rows (int32 [num_reqs, top_k]) of one layer's selection; a follower layer waits
        for its replayed copies and returns its source's rows. Side effects: the resolver's."""
        out = self.out[: req_pool_indices.shape[0]]
        prefetch = self.prefetch
        if prefetch is not None and prefetch.is_follower(layer_id):
            prefetch.join()
            return out
        source = prefetch is not None and prefetch.plan_for(layer_id) is not None
        if source:
            prefetch.before_source(self._counters)
        self._layers[layer_id](top_k_result, seq_lens, req_pool_indices, out)
        if source:
            prefetch.after_source(layer_id, self._counters, copy=not self._skip_io)
        return out

    def verify(self, layer_id: int, req_pool_indices, seq_lens, top_k_result) -> torch.Tensor:
        """Device rows (int32 [num_reqs * N, top_k]) of one layer's verify step: ``top_k_result``
        holds N rows per request, ``seq_lens`` the committed lengths (resolver/verify.py). Side
        effects: the layer's union resolve (tables, copies, counters)."""
        assert self._verify is not None, "verify steps need a server built with query_rows > 1"
        return self._verify.resolve(self._verify_layers[layer_id], top_k_result, seq_lens, req_pool_indices)

    def _replay_onto(self, plan, layer_id: int) -> None:
        self._resolver.replay(plan=plan, num_real_reqs=self._num_real_reqs,
                              host_kv=self._mirror.pool.kv_buffer[layer_id],
                              device_kv=self._device_pool.kv_buffer[layer_id])
