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
and, with residency on, :class:`~sglang_hisparse.decode.pressure.ResidentDecode`. With linear
speculative decoding (``config.query_rows`` N > 1) decode steps are verify steps of N tokens per
request: :meth:`HiSparseCoordinator.begin_verify_step` replaces ``map_last_loc_to_buffer`` and
:meth:`HiSparseCoordinator.resolve_verify` replaces ``swap_in_selected_pages`` (both called by our
seams, ``patches/verify_step.py`` and the verify attention: ``patches/verify_attention.py`` on
CUDA, the torch backend on CPU). The allocator (ids,
rows, mapping) and the device pool are SGLang's objects of our classes, passed in. This class
holds only the per-step buffers SGLang reads or that two components share (``num_real_reqs``,
``raw_indices_buffer``, the resolver output).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, List, Optional

import torch

from sglang_hisparse.memory.admission import capacity_line, capacity_of, check_startup
from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.host_mirror import HostMirror
from sglang_hisparse.memory.hot_buffers import HotBuffers
from sglang_hisparse.decode.layers import LayerResolve
from sglang_hisparse.decode.prefetch import model_topk_sources
from sglang_hisparse.decode.pressure import ResidentDecode
from sglang_hisparse.resolver.reuse import history_table, reuse_levels
from sglang_hisparse.memory.residency import Residency
from sglang_hisparse.resolver.dispatch import make_resolver
from sglang_hisparse.resolver.jit import decode_module
from sglang_hisparse.stats import HiSparseTokenStats, ResolveStats, pool_free_counts, timed, token_stats

logger = logging.getLogger(__name__)


class HiSparseCoordinator:
    """Constructor arguments are SGLang's; the keywords are ours: without ``config`` the typed
    config is read from SGLang's published server arguments and must agree with them, and the
    layers' top-k sources (IndexShare) are the served model's; with it, ``topk_sources`` (per
    layer, the layer whose top-k it reuses; default: every layer its own)."""

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
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.device_pool = self.allocator.get_kvcache()
        self.tp_group = tp_group
        max_reqs = req_to_token_pool.req_to_token.shape[0]
        reuse = self.config.replacement == "reuse"
        ratio = host_to_device_ratio if host_to_device_ratio_override is None else host_to_device_ratio_override
        self.mirror = HostMirror(self.device_pool, ratio, max_reqs=max_reqs, max_context=req_to_token_pool.max_context_len,
                                 device=device, pin_memory=device.type == "cuda" if pin_memory is None else pin_memory)
        map_columns = self.mirror.row_table.shape[1] if self.config.slot_map else 0
        self.hot = HotBuffers(self.allocator, layers=self.device_pool.layer_num, max_reqs=max_reqs,
                              buffer_size=device_buffer_size, device=device, history=reuse,
                              window=self.config.query_rows, map_columns=map_columns)
        if self.hot.slot_map is not None:
            logger.info("sglang-hisparse: position -> slot map: %d layers x %d requests x %d positions, %.1f MiB "
                        "of device memory", *self.hot.slot_map.shape,
                        self.hot.slot_map.numel() * self.hot.slot_map.element_size() / 2**20)
        # protocol attributes SGLang reads: the components' objects (updated in place, never rebound)
        self.mem_pool_host, self.padded_buffer_size = self.mirror.pool, self.hot.padded
        self.req_to_host_pool, self.req_to_host_pool_allocated_len = self.mirror.row_table, self.mirror.rows_allocated
        self.allocator.configure(self.hot.padded, self.mirror.pool.capacity_tokens)
        self.capacity = capacity_of(self.allocator, self.hot, self.mirror.pool)
        check_startup(self.capacity)
        self._producer_stream = None
        self.raw_indices_buffer = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=device)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.host_time = self.allocator.host_time
        self.stats = ResolveStats(device, log_interval=self.config.stats_log_interval, row_bytes=self.device_pool.row_bytes,
                                  free_counts=functools.partial(pool_free_counts, self.allocator, self.mirror.pool),
                                  host_time=self.host_time)
        resolver = make_resolver(self.config, device, max_reqs, top_k)
        resolver.warmup(self.device_pool.row_bytes, device_buffer_size, top_k)
        if self.config.query_rows > 1:
            resolver.warmup(self.device_pool.row_bytes, device_buffer_size, top_k * self.config.query_rows)
        if device.type == "cuda":
            decode_module()  # the decode step's id kernels (kernels/decode.cuh), built before the first step
        selections = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=device)
        self._resident_decode: Optional[ResidentDecode] = None
        if self.config.residency:
            self._enable_residency(max_reqs, device, selections)
        self._layers = LayerResolve(
            resolver, layers=self.device_pool.layer_num, max_reqs=max_reqs, top_k=top_k, device=device, hot=self.hot,
            mirror=self.mirror, device_pool=self.device_pool, counters=self.stats.counters,
            num_real_reqs=self.num_real_reqs, skip_io=self.config.skip_io, out=selections,
            topk_sources=topk_sources if self.config.indexshare_prefetch else None,
            residency_tables=self._resident_decode.resolver_tables if self._resident_decode is not None else {},
            reuse_levels=reuse_levels_for(device) if reuse else None, query_rows=self.config.query_rows)
        self._waiting_since: Optional[str] = None
        self._draft_state: dict[int, Any] = {}
        logger.info("sglang-hisparse coordinator: B=%d, top_k=%d, layers=%d, resolver=%s, residency=%s; %s",
                    device_buffer_size, top_k, self.device_pool.layer_num, resolver.name, residency_label(self.config),
                    capacity_line(self.capacity))

    def _enable_residency(self, max_reqs: int, device: torch.device, selections: torch.Tensor) -> None:
        self.allocator.enable_resident_pages()
        self._resident_decode = ResidentDecode.build(
            self.config, max_reqs=max_reqs, device=device, hot=self.hot, mirror=self.mirror, allocator=self.allocator,
            req_to_token=self.req_to_token_pool.req_to_token, selections=selections, quiesce=self._wait_for_producer)
        self.stats.residency = self._resident_decode.residency

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

    # --- into decode -------------------------------------------------------------------------
    def admit_request_into_staging(self, req) -> None:
        """After prefill: copy the request's KV (every layer) to host rows off the critical path."""
        self.stats.note_activity()
        self.mirror.stage(req, self.allocator.device_rows_of(self._logical_ids(req, req.extend_range.end)))

    def keep_draft_state(self, req_pool_idx: int, state: Any) -> None:
        """Speculation: hold a staged request's draft state (SGLang's object, opaque here) until
        it joins decode (:meth:`take_draft_state`) or leaves."""
        self._draft_state[req_pool_idx] = state

    def take_draft_state(self, req_pool_idx: int) -> Any:
        """The draft state kept for a request joining decode (KeyError when none was kept)."""
        return self._draft_state.pop(req_pool_idx)

    def collect_ready_reqs(self) -> List[Any]:
        """Staged requests, in order, whose copy finished on every rank and whose hot buffer fits.

        The ready count is agreed with a MIN all-reduce over the attention TP group so every
        rank returns the same requests. A request whose hot buffer does not fit yet stays in
        staging with the ones behind it (logged once per episode). With ``wait_for_staging`` the
        host first waits for every staging copy.
        """
        if not self.mirror.staged_count():
            return []
        copied = self.mirror.copied_prefix(block=self.config.wait_for_staging)
        count = agreed_count(len(copied), self.tp_group)
        return self._enter_copied(copied[:count]) if count else []

    @timed("ready")
    def _enter_copied(self, copied: list) -> List[Any]:
        """Move the copied requests at the front of staging into decode, in order, until one does
        not fit; returns those that entered."""
        ready = []
        for req in copied:
            if not self._enter_decode(req):
                self._log_waiting(req)
                break
            self.mirror.pop_staged()
            ready.append(req)
        if ready:
            self._waiting_since = None
        return ready

    def _enter_decode(self, req) -> bool:
        """A staged request whose host copy is done keeps its prefill rows resident (residency on
        and room above the watermark) or moves into a hot buffer made of its first prefill pages
        (needs no free rows). False, nothing changed, when neither fits."""
        idx, n = req.req_pool_idx, req.kv.kv_allocated_len
        logical = self._logical_ids(req, n)

        def open_hot() -> bool:
            return self.hot.open(idx, logical, filled=True) is not None

        return open_hot() if self._resident_decode is None else self._resident_decode.enter(idx, logical, open_hot)

    def admit_request_direct(self, req) -> None:
        """PD decode: the request's KV is already in its host rows. With residency and room, it
        is loaded into rows of its own; otherwise it gets a hot buffer (short requests are loaded
        from host, long ones start empty and miss on first use)."""
        idx, n = req.req_pool_idx, req.kv.kv_allocated_len
        logical = self._logical_ids(req, n)
        rows = self.residency.admit_loaded(idx, logical) if self.residency is not None else None
        resident = rows is not None
        if rows is None:
            rows = self.hot.open(idx, logical, filled=n <= self.hot.buffer_size, mapped=False)
            if rows is None:
                raise HiSparsePluginError(
                    f"sglang-hisparse: no device rows for the hot buffer of request {req.rid} "
                    f"({self.allocator.debug_print()}); the PD admission budget should prevent this"
                )
            rows = rows[:n] if n <= self.hot.buffer_size else None
        if rows is not None:
            self.mirror.pool.load_rows(self.device_pool, self.mirror.row_table[idx, :n], rows)
        self.mirror.mark_complete(idx, n)
        if resident:
            self.mirror.defer(idx)
        self.stats.note_activity()

    # --- decode steps ------------------------------------------------------------------------
    @timed("map")
    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu) -> None:
        """Before a decode step (``seq_lens`` count the new token): write the previous tokens
        through to host where they are due (at once where the step overwrites their rows, a page at
        a time in a short hot buffer, every few hundred steps for resident requests:
        :meth:`HostMirror.write_through_step`, :meth:`ResidentDecode.flush_deferred`), grow short
        buffers and resident requests, and map the new token's logical id to its row. A batch of
        resident requests takes :meth:`ResidentDecode.resident_step` (Python over the batch, one
        CPU tensor op, one device launch when some request starts a page); any other batch a few
        tensor ops for the whole batch, plus Python only for requests starting a page."""
        if self.config.query_rows > 1:
            raise HiSparsePluginError("sglang-hisparse: a one-token decode step on a server whose decode steps "
                                      f"verify {self.config.query_rows} tokens (begin_verify_step maps those)")
        idxs, lens = req_pool_indices_cpu.to(torch.int64), seq_lens_cpu.to(torch.int64)
        self.stats.note_decode_step(int(lens.numel()))
        driver = self._resident_decode
        if driver is not None:
            driver.flush_deferred(idxs, lens)
            if driver.resident_step(idxs.tolist(), lens.tolist(), idxs, lens):
                return
        self.mirror.write_through_step(idxs, lens, self.device_rows_now, buffer_size=self.hot.buffer_size)
        if driver is None:
            rows = self.hot.newest_rows(idxs, lens, req_pool_indices, seq_lens)
        else:
            rows = driver.newest_rows(idxs, lens, req_pool_indices, seq_lens, out_cache_loc, self.residency.mask(idxs))
        self.allocator.map_logical(out_cache_loc, rows)

    @timed("check")
    def device_rows_short(self, req_pool_indices: list[int], committed_lens: list[int]) -> int:
        """Device rows the next decode step of these requests lacks (0: it fits), after every
        demotion of a resident request that could help. ``committed_lens``: positions with KV
        (SGLang's ``kv_committed_len``); the step writes position ``committed`` (one-token
        steps) or ``committed .. committed + N - 1`` (verify steps). Read by the decode memory
        check before each step (``patches/decode_memory_check.py``): SGLang retracts requests
        until this is 0, as it does when its own pool is short. No side effects."""
        if self.config.query_rows > 1:
            short = self.hot.window_growth(req_pool_indices, committed_lens) - self.allocator.rows.room()
            return max(0, short)
        # A one-token step takes free rows only where the position it writes (the committed length
        # c) starts a page: one pass over the batch, then work for those requests alone.
        p = self.hot.page_size
        at_page_start = [(idx, c + 1) for idx, c in zip(req_pool_indices, committed_lens) if c % p == 0]
        if self._resident_decode is not None:
            return self._resident_decode.rows_short(at_page_start)
        return max(0, sum(self.hot.step_growth([idx], [n]) for idx, n in at_page_start) - self.allocator.rows.room())

    @timed("wait")
    def wait_for_pending_backup(self) -> None:
        """Order the forward after the last copy of a newest slot it overwrites (if any)."""
        self.mirror.order_forward_after_write_through()

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id: int) -> torch.Tensor:
        """Resolve one layer's selection to device rows (int32 [num_reqs, top_k]). Graph safe:
        reads ``num_real_reqs`` on device and writes a preallocated output buffer."""
        return self._layers(layer_id, req_pool_indices, seq_lens, top_k_result)

    # --- speculative verify steps (N = config.query_rows tokens per request) ---------------------
    def begin_verify_step(self, req_pool_indices: torch.Tensor, req_pool_indices_cpu: list[int],
                          committed_lens: list[int]) -> None:
        """Before a verify step, after SGLang allocated its ids (``req_to_token[r, L .. L + N)``,
        ``L`` = the committed length): write the positions committed since the last step through
        to host, grow short hot buffers, and map the window's logical ids to their slots (the hot
        buffers' window rule). Side effects: host rows and a write-through copy (the forward
        waits for it, ``wait_for_pending_backup``), rows from the reserve, the mapping."""
        self.stats.note_decode_step(len(committed_lens))
        self.mirror.write_through(req_pool_indices_cpu, [L + 1 for L in committed_lens], self.device_rows_now)
        positions, rows = self.hot.window_rows(req_pool_indices_cpu, committed_lens, req_pool_indices)  # [bs, N]
        logical = self.req_to_token_pool.req_to_token[req_pool_indices[:, None].long(), positions]
        self.allocator.map_logical(logical.reshape(-1).long(), rows.reshape(-1))

    def resolve_verify(self, req_pool_indices, seq_lens, top_k_result, layer_id: int) -> torch.Tensor:
        """Resolve one layer of a verify step to device rows (int32 [num_reqs * N, top_k]):
        ``top_k_result`` holds N rows per request, ``seq_lens`` the committed lengths
        (resolver/verify.py). Graph safe as ``swap_in_selected_pages``."""
        return self._layers.verify(layer_id, req_pool_indices, seq_lens, top_k_result)

    # --- leaving -----------------------------------------------------------------------------
    def request_finished(self, req) -> None:
        """Free everything the request holds here: hot buffer, host rows, mapping. Idempotent
        (a PD retraction calls it twice: our offload, then SGLang's ``retract_req``); a request
        still in staging leaves staging. Only a hot buffer's ids are unmapped: a resident
        request's ids stay mapped to its own rows for SGLang's free of them, which follows, and
        a request holding neither has nothing mapped of ours (a PD request whose transfer failed)
        or is gone already."""
        idx = req.req_pool_idx
        if idx is None:
            return
        self._draft_state.pop(idx, None)
        if self.mirror.is_staged(req):
            self._leave_staging(req)
            return
        self._wait_for_producer()  # the overlapped forward may still read its rows
        self.mirror.order_after_writes()  # copies still reading its rows, or writing its host rows
        if self.residency is not None and self.residency.holds(idx):
            self.residency.release(idx)
        elif self.hot.holds(idx):
            self.allocator.unmap_logical(self._logical_ids(req, req.kv.kv_allocated_len))
        self.hot.close(idx)
        self.mirror.forget(idx)
        self.stats.note_activity()

    def retract_req(self, req) -> None:
        self.request_finished(req)

    def _leave_staging(self, req) -> None:
        """A staged request leaves: wait for its copy, free its prefill rows and host rows."""
        self.mirror.drop_staged(req)
        self.allocator.free_prefill_rows(self._logical_ids(req, req.extend_range.end))
        self.mirror.forget(req.req_pool_idx)
        self.stats.note_activity()

    def device_rows_now(self, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows (int64) holding ``positions`` of decoding requests now (a resident
        request's own rows, else its newest or fast-path hot-buffer slot)."""
        if self._resident_decode is None:
            return self.hot.rows_of_positions(req_pool_idx, positions)
        return self._resident_decode.rows_now(req_pool_idx, positions)

    # --- helpers -----------------------------------------------------------------------------
    def logical_ids_of(self, req, n: int) -> torch.Tensor:
        """The logical ids (int64) of the request's positions ``0..n-1``; no side effects."""
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)

    _logical_ids = logical_ids_of

    def _wait_for_producer(self) -> None:
        """Order the current stream after the overlapped forward in flight (if any)."""
        if self._producer_stream is not None:
            torch.get_device_module(self.num_real_reqs.device).current_stream().wait_stream(self._producer_stream)

    def _log_waiting(self, req) -> None:
        if self._waiting_since != req.rid:
            logger.info("sglang-hisparse: request %s waits in staging for device rows (%s)",
                        req.rid, self.allocator.debug_print())
            self._waiting_since = req.rid


def residency_label(config: HiSparseConfig) -> str:
    """How residency is set, for the start-up line: on (with its watermark) or off, and why."""
    if config.residency:
        return f"on (watermark {config.residency_watermark:g} of the device pool)"
    if config.query_rows > 1:
        return "off (speculative decoding)"
    return "off"


def agreed_count(count: int, group) -> int:
    """The smallest ``count`` over the ranks of ``group`` (all ranks must admit the same requests)."""
    if torch.distributed.get_world_size(group=group) == 1:
        return count
    value = torch.tensor(count, dtype=torch.int64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(value)


def reuse_levels_for(device: torch.device) -> torch.Tensor:
    """The packaged history table's levels (uint8 [54]) on ``device``; logs the policy once per server."""
    table = history_table()
    logger.info("sglang-hisparse: replacement policy reuse (history table: %s)", table.describe())
    return reuse_levels(table.table).to(device)


def published_config(passed: tuple[int, int, int, int]) -> HiSparseConfig:
    """The server's typed config, read from SGLang's published server arguments; it must agree
    with the ``(top_k, device_buffer_size, host_to_device_ratio, swap_in_block_size)`` SGLang
    passed to the constructor. Raises HiSparsePluginError otherwise (never rebuilds a config)."""
    from sglang.srt.runtime_context import get_server_args

    from sglang_hisparse.config import config_from_server_args

    try:
        server_args = get_server_args()
    except ValueError as e:
        raise HiSparsePluginError(
            f"sglang-hisparse: the coordinator needs SGLang's published server arguments ({e}); "
            "outside a server, pass config=HiSparseConfig(...)"
        ) from e
    config = config_from_server_args(server_args)
    ours = (config.top_k, config.device_buffer_size, config.host_to_device_ratio, config.swap_in_block_size)
    if passed != ours:
        raise HiSparsePluginError(f"sglang-hisparse: SGLang passed {passed}, the typed config says {ours}")
    return config
