"""The coordinator: SGLang's HiSparse protocol, implemented by delegating to our components.

Replaces SGLang's ``HiSparseCoordinator``. SGLang 0.5.17 calls exactly these members (the
protocol; names are SGLang's): methods ``set_decode_producer_stream``, ``destroy``,
``get_token_stats``, ``admit_request_into_staging``, ``admit_request_direct``,
``request_finished``, ``retract_req``, ``collect_ready_reqs``, ``has_ongoing_staging``,
``host_token_len``, ``map_last_loc_to_buffer``, ``wait_for_pending_backup``,
``swap_in_selected_pages``; attributes ``num_real_reqs``, ``mem_pool_host``,
``req_to_host_pool``, ``req_to_host_pool_allocated_len``, ``padded_buffer_size``,
``raw_indices_buffer``.

The work is done by components with one owner each (docs/design.md, "Ownership"):
:class:`~sglang_hisparse.memory.host_mirror.HostMirror` (host rows, staging, write-through),
:class:`~sglang_hisparse.memory.hot_buffers.HotBuffers` (hot-buffer rows and per-layer slot tables),
:class:`~sglang_hisparse.stats.ResolveStats` (counters, step lines, idle reports),
:class:`~sglang_hisparse.decode.layers.LayerResolve` (each layer's bound resolver, IndexShare prefetch)
and, with residency on, :class:`~sglang_hisparse.decode.pressure.ResidentDecode`. This class is
the facade SGLang calls: start-up is built by :mod:`sglang_hisparse.decode.startup`, the per-request
paths (staging, PD admission, finish) run in :class:`~sglang_hisparse.decode.lifecycle.RequestLifecycle`,
the host side of each step in :class:`~sglang_hisparse.decode.steps.DecodeSteps`. With linear
speculative decoding (``config.query_rows`` N > 1) decode steps are verify steps of N tokens per
request: :meth:`HiSparseCoordinator.begin_verify_step` replaces ``map_last_loc_to_buffer`` and
:meth:`HiSparseCoordinator.resolve_verify` replaces ``swap_in_selected_pages`` (both called by our
seams, ``patches/verify_step.py`` and the verify attention: ``patches/verify_attention.py`` on
CUDA, the torch backend on CPU). The allocator (ids, rows, mapping) and the device pool are
SGLang's objects of our classes, passed in. This class holds only the per-step buffers SGLang
reads or that two components share (``num_real_reqs``, ``raw_indices_buffer``, the resolver
output) and SGLang's producer stream (the overlapped forward, which ``_wait_for_producer`` orders
the current stream after).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.decode.elastic import ElasticBuffers
from sglang_hisparse.decode.layers import LayerResolve
from sglang_hisparse.decode.lifecycle import RequestLifecycle
from sglang_hisparse.decode.prefetch import model_topk_sources
from sglang_hisparse.decode.pressure import ResidentDecode
from sglang_hisparse.decode.promotion import Promotion
from sglang_hisparse.decode.startup import (build_memory, build_resolver, build_stats, published_config,
                                            residency_label, reuse_levels_for)
from sglang_hisparse.decode.steps import DecodeSteps
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.admission import capacity_line
from sglang_hisparse.memory.copy_lane import order_current_after
from sglang_hisparse.memory.residency import Residency
from sglang_hisparse.stats import HiSparseTokenStats, token_stats

logger = logging.getLogger(__name__)


class HiSparseCoordinator:
    """Constructor arguments are SGLang's; the keywords are ours: without ``config`` the typed
    config is read from SGLang's published server arguments and must agree with them, and the
    layers' top-k sources (IndexShare) are the served model's; with it, ``topk_sources`` (per
    layer, the layer whose top-k it reuses; default: every layer its own).

    A DeepSeek-V4 server (our ``C4Allocator``) gets a :class:`~sglang_hisparse.decode.c4_coordinator.C4Coordinator`."""

    def __new__(cls, req_to_token_pool=None, token_to_kv_pool_allocator=None, *args, **kwargs):
        from sglang_hisparse.memory.c4_allocator import C4Allocator

        if isinstance(token_to_kv_pool_allocator, C4Allocator):
            return build_c4_coordinator(req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        top_k: int,
        device_buffer_size: int,
        device: str,
        tp_group,
        host_to_device_ratio: int = 2,
        swap_in_block_size: int = 960,
        *,
        config: Optional[HiSparseConfig] = None,
        pin_memory: Optional[bool] = None,
        host_to_device_ratio_override: Optional[float] = None,
        topk_sources: Optional[list[int]] = None,
    ):
        if config is None:
            config = published_config((top_k, device_buffer_size, host_to_device_ratio, swap_in_block_size))
            topk_sources = model_topk_sources(token_to_kv_pool_allocator.get_kvcache().layer_num)
        self.config = config
        device = torch.device(device)
        self.req_to_token_pool, self.allocator, self.tp_group = req_to_token_pool, token_to_kv_pool_allocator, tp_group
        self.device_pool = self.allocator.get_kvcache()
        max_reqs = req_to_token_pool.req_to_token.shape[0]
        ratio = host_to_device_ratio if host_to_device_ratio_override is None else host_to_device_ratio_override
        memory = build_memory(config, self.allocator, self.device_pool, req_to_token_pool, ratio=ratio,
                              buffer_size=device_buffer_size, device=device, pin_memory=pin_memory)
        self.mirror, self.hot, self.capacity = memory.mirror, memory.hot, memory.capacity
        # protocol attributes SGLang reads: the components' objects (updated in place, never rebound)
        self.mem_pool_host, self.padded_buffer_size = self.mirror.pool, self.hot.padded
        self.req_to_host_pool, self.req_to_host_pool_allocated_len = self.mirror.row_table, self.mirror.rows_allocated
        self._producer_stream = None
        self.raw_indices_buffer = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=device)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.stats = build_stats(config, device=device, allocator=self.allocator, device_pool=self.device_pool,
                                 mirror=self.mirror)
        resolver = build_resolver(config, device=device, max_reqs=max_reqs, top_k=top_k,
                                  row_bytes=self.device_pool.row_bytes, buffer_size=self.hot.buffer_size)
        selections = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=device)
        self._resident_decode = self._build_residency(max_reqs, device, selections) if config.residency else None
        self._layers = self._bind_layers(resolver, max_reqs, top_k, device, selections, topk_sources)
        parts = dict(allocator=self.allocator, req_to_token_pool=req_to_token_pool, hot=self.hot, mirror=self.mirror,
                     stats=self.stats, resident=self._resident_decode)
        self._steps = DecodeSteps(config, **parts)
        self._requests = RequestLifecycle(config, tp_group=tp_group, device_pool=self.device_pool,
                                          quiesce=self._wait_for_producer, rows_now=self._steps.rows_now, **parts)
        logger.info("sglang-hisparse coordinator: B=%d, top_k=%d, layers=%d, resolver=%s, residency=%s; %s",
                    device_buffer_size, top_k, self.device_pool.layer_num, resolver.name, residency_label(config),
                    capacity_line(self.capacity))

    def _build_residency(self, max_reqs: int, device: torch.device, selections: torch.Tensor) -> ResidentDecode:
        """Residency on: resident pages marked, the driver (reclaim, promotion, elastic buffers), the idle reports' counts."""
        self.allocator.enable_resident_pages()
        driver = ResidentDecode.build(
            self.config, max_reqs=max_reqs, device=device, hot=self.hot, mirror=self.mirror, allocator=self.allocator,
            req_to_token=self.req_to_token_pool.req_to_token, selections=selections, quiesce=self._wait_for_producer)
        driver.promotion = Promotion.for_driver(driver, self.device_pool, self.config.promotion_interval)
        driver.elastic = ElasticBuffers.for_driver(driver, self.config)
        self.stats.residency, self.stats.elastic = driver.residency, driver.elastic
        return driver

    def _bind_layers(self, resolver, max_reqs: int, top_k: int, device: torch.device, selections: torch.Tensor,
                     topk_sources: Optional[list[int]]) -> LayerResolve:
        """Every layer's bound resolver, writing ``selections``; IndexShare prefetch as configured."""
        config, resident = self.config, self._resident_decode
        return LayerResolve(
            resolver, layers=self.device_pool.layer_num, max_reqs=max_reqs, top_k=top_k, device=device, hot=self.hot,
            mirror=self.mirror, device_pool=self.device_pool, counters=self.stats.counters,
            num_real_reqs=self.num_real_reqs, skip_io=config.skip_io, out=selections,
            topk_sources=topk_sources if config.indexshare_prefetch else None,
            residency_tables=resident.resolver_tables if resident is not None else {},
            reuse_levels=reuse_levels_for(device) if config.replacement == "reuse" else None,
            query_rows=config.query_rows)

    @property
    def residency(self) -> Optional[Residency]:
        """Resident request slots and their rows (None with residency off)."""
        return None if self._resident_decode is None else self._resident_decode.residency

    # --- small protocol members --------------------------------------------------------------
    def set_decode_producer_stream(self, stream) -> None:
        self._producer_stream = stream
        self.mirror.producer_stream = stream

    def has_ongoing_staging(self) -> bool:
        return self.mirror.staged_count() > 0

    def host_token_len(self, kv_allocated_len: int) -> int:
        return kv_allocated_len

    def get_token_stats(self) -> HiSparseTokenStats:
        return token_stats(self.allocator, self.mirror.pool)

    def destroy(self) -> None:
        """Wait for every copy in flight, then release the host pool."""
        self.mirror.drain()
        self.mirror.pool.destroy()

    # --- into decode (RequestLifecycle) ------------------------------------------------------
    def admit_request_into_staging(self, req) -> None:
        """After prefill: copy the request's KV (every layer) to host rows off the critical path."""
        self._requests.stage(req)

    def keep_draft_state(self, req_pool_idx: int, state: Any) -> None:
        """Speculation: hold a staged request's draft state (SGLang's object, opaque here) until
        it joins decode (:meth:`take_draft_state`) or leaves."""
        self._requests.keep_draft_state(req_pool_idx, state)

    def take_draft_state(self, req_pool_idx: int) -> Any:
        """The draft state kept for a request joining decode (KeyError when none was kept)."""
        return self._requests.take_draft_state(req_pool_idx)

    def collect_ready_reqs(self) -> List[Any]:
        """Staged requests, in order, whose copy finished on every rank and whose hot buffer fits
        (:meth:`RequestLifecycle.collect_ready`: a MIN all-reduce over the attention TP group)."""
        return self._requests.collect_ready()

    def admit_request_direct(self, req) -> None:
        """PD decode: the request's KV is already in its host rows; it becomes resident or gets a
        hot buffer (:meth:`RequestLifecycle.admit_direct`)."""
        self._requests.admit_direct(req)

    # --- decode steps (DecodeSteps, LayerResolve) --------------------------------------------
    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu) -> None:
        """Before a decode step: write previous tokens through to host where due, grow short
        buffers and resident requests, map the new token (:meth:`DecodeSteps.map_one_token_step`)."""
        self._steps.map_one_token_step(seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu)

    def device_rows_short(self, req_pool_indices: list[int], committed_lens: list[int]) -> int:
        """Device rows the next decode step of these requests lacks (0: it fits), after every
        demotion that could help. Read by the decode memory check before each step
        (``patches/decode_memory_check.py``): SGLang retracts requests until this is 0, as it does
        when its own pool is short. No side effects (:meth:`DecodeSteps.rows_short`)."""
        return self._steps.rows_short(req_pool_indices, committed_lens)

    def wait_for_pending_backup(self) -> None:
        """Order the forward after the last copy of a newest slot it overwrites (if any)."""
        self._steps.order_forward()

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id: int) -> torch.Tensor:
        """Resolve one layer's selection to device rows (int32 [num_reqs, top_k]). Graph safe:
        reads ``num_real_reqs`` on device and writes a preallocated output buffer."""
        return self._layers(layer_id, req_pool_indices, seq_lens, top_k_result)

    # --- speculative verify steps (N = config.query_rows tokens per request) ---------------------
    def begin_verify_step(self, req_pool_indices: torch.Tensor, req_pool_indices_cpu: list[int],
                          committed_lens: list[int]) -> None:
        """Before a verify step, after SGLang allocated its ids: write through, grow short hot
        buffers, map the window's logical ids to their slots (:meth:`DecodeSteps.map_verify_step`)."""
        self._steps.map_verify_step(req_pool_indices, req_pool_indices_cpu, committed_lens)

    def resolve_verify(self, req_pool_indices, seq_lens, top_k_result, layer_id: int) -> torch.Tensor:
        """Resolve one layer of a verify step to device rows (int32 [num_reqs * N, top_k]):
        ``top_k_result`` holds N rows per request, ``seq_lens`` the committed lengths
        (resolver/verify.py). Graph safe as ``swap_in_selected_pages``."""
        return self._layers.verify(layer_id, req_pool_indices, seq_lens, top_k_result)

    # --- leaving (RequestLifecycle) ----------------------------------------------------------
    def request_finished(self, req) -> None:
        """Free everything the request holds here: hot buffer, host rows, mapping. Idempotent; a
        request still in staging leaves staging (:meth:`RequestLifecycle.finish`)."""
        self._requests.finish(req)

    def retract_req(self, req) -> None:
        self.request_finished(req)

    def attach_prefix_cache(self, cache: Any) -> None:
        """Radix cache on: finishing requests hand their host rows to ``cache`` (HostPrefixCache)."""
        self._requests.prefix_cache = cache
        self.stats.prefix_cache = cache
        cache.attach(self)

    # --- helpers -----------------------------------------------------------------------------
    def device_rows_now(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) holding ``positions`` of decoding requests now (a resident
        request's own rows, else its newest or fast-path hot-buffer slot)."""
        return self._steps.rows_now(req_pool_idx, positions)

    def logical_ids_of(self, req, n: int) -> torch.Tensor:
        """The logical ids (int64) of the request's positions ``0..n-1``; no side effects."""
        return self._requests.logical_ids(req, n)

    def _wait_for_producer(self) -> None:
        """Order the current stream after the overlapped forward in flight (if any)."""
        order_current_after(self._producer_stream, self.num_real_reqs.device)


def build_c4_coordinator(req_to_token_pool, allocator, top_k: int, device_buffer_size: int, device: str, tp_group,
                         host_to_device_ratio: int = 2, swap_in_block_size: int = 960, *,
                         config: Optional[HiSparseConfig] = None, pin_memory: Optional[bool] = None, **_ours: Any):
    """The DeepSeek-V4 coordinator for SGLang's constructor call (the typed config read as for DSA)."""
    from sglang_hisparse.decode.c4_coordinator import C4Coordinator

    if config is None:
        config = published_config((top_k, device_buffer_size, host_to_device_ratio, swap_in_block_size))
    if config.max_device_buffer_size:
        raise HiSparsePluginError(
            f"sglang-hisparse: --hisparse-config max_device_buffer_size={config.max_device_buffer_size} is not "
            "supported with DeepSeek-V4 (its C4 hot buffers have one size): leave it 0")
    return C4Coordinator(req_to_token_pool, allocator, top_k, device_buffer_size, device, tp_group,
                         host_to_device_ratio, swap_in_block_size, config=config, pin_memory=pin_memory)
