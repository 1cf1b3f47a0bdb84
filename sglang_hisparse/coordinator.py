"""The HiSparse coordinator: request lifecycle, hot buffers, write-through and per-layer resolve.

Replaces SGLang's ``HiSparseCoordinator`` and implements every member of the SGLang 0.5.17
coordinator protocol (methods ``set_decode_producer_stream``, ``destroy``, ``get_token_stats``,
``admit_request_into_staging``, ``admit_request_direct``, ``request_finished``, ``retract_req``,
``collect_ready_reqs``, ``has_ongoing_staging``, ``host_token_len``, ``map_last_loc_to_buffer``,
``wait_for_pending_backup``, ``swap_in_selected_pages``; attributes ``num_real_reqs``,
``mem_pool_host``, ``req_to_host_pool``, ``req_to_host_pool_allocated_len``,
``padded_buffer_size``, ``raw_indices_buffer``).

Lifecycle of a request (mixed deployment): prefill writes device rows -> staging copies all
layers to host on a side stream -> when the copy is done (all TP ranks agree) the request's
first device rows become its hot buffer -> each decode step backs up the previous token to host,
grows short buffers, maps the new token to the newest slot, and resolves every layer's top-k
-> finish, retract or abort frees everything (idempotent). PD decode admits a request whose KV
is already in host (``admit_request_direct``).

Owns (per request slot, preallocated so CUDA graphs see fixed addresses): the hot-buffer row
table ``hot_locs``, each layer's slot table and LRU order, the position -> host row table, the
resolver output, ``num_real_reqs``, the hit/miss counters, the staging queue, the streams and
events. The allocator owns ids, rows and the mapping; the host pool owns host rows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional

import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.host_pool import HiSparseHostPool
from sglang_hisparse.resolver.dispatch import make_resolver

logger = logging.getLogger(__name__)


FAULT_ENV = "SGLANG_HISPARSE_TEST_FAULT"
"""Test-only fault switch: ``wrong_row`` makes every resolve return one wrong device row per
request (the first selection points at the newest token's row), so end-to-end tests can prove
they detect a broken resolver."""


class HiSparseTokenStats(NamedTuple):
    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


@dataclass
class _StagingTicket:
    start_event: Any
    finish_event: Any
    req: Any
    device_rows: torch.Tensor
    host_rows: torch.Tensor


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HiSparseCoordinator:
    """See the module docstring. Constructor matches SGLang's (keyword ``config`` is ours)."""

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
    ):
        self.config = config or _config_from_server_args(
            top_k, device_buffer_size, host_to_device_ratio, swap_in_block_size
        )
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.device_pool = self.allocator.get_kvcache()
        self.device = torch.device(device)
        self.device_module = torch.get_device_module(self.device)
        self.top_k = top_k
        self.device_buffer_size = B = device_buffer_size
        self.page_size = P = self.allocator.page_size
        self.padded_buffer_size = _round_up(B + 1, P)
        self.layer_num = self.device_pool.layer_num
        self.tp_group = tp_group
        self.tp_world_size = torch.distributed.get_world_size(group=tp_group)

        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        host_ratio = host_to_device_ratio if host_to_device_ratio_override is None else host_to_device_ratio_override
        self.mem_pool_host = HiSparseHostPool(self.device_pool, host_ratio, P, pin_memory)
        self.allocator.configure(self.padded_buffer_size, self.mem_pool_host.capacity_tokens)

        max_reqs = req_to_token_pool.req_to_token.shape[0]
        max_context = req_to_token_pool.max_context_len
        dev = self.device
        self.hot_locs = torch.zeros((max_reqs, self.padded_buffer_size), dtype=torch.int32, device=dev)
        self.hot_capacity = [0] * max_reqs
        self.hot_reserved = [0] * max_reqs
        self.slot_tokens = torch.full((self.layer_num, max_reqs, B), -1, dtype=torch.int32, device=dev)
        self._lru_init = torch.arange(B, dtype=torch.int16, device=dev)
        self.lru = self._lru_init.repeat(self.layer_num, max_reqs, 1).contiguous()
        self._slot_positions = torch.arange(B, dtype=torch.int32, device=dev)
        self.req_to_host_pool = torch.full((max_reqs, max_context + P), -1, dtype=torch.int64, device=dev)
        self.req_to_host_pool_allocated_len = torch.zeros(max_reqs, dtype=torch.int64)
        self.top_k_device_locs_buffer = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=dev)
        self.raw_indices_buffer = torch.full((max_reqs, top_k), -1, dtype=torch.int32, device=dev)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(2, dtype=torch.int64, device=dev)  # selected, misses

        self.write_staging_stream = self.device_module.Stream()
        self.decode_backup_stream = self.device_module.Stream()
        self.decode_producer_stream = None
        self._backup_done_event = self.device_module.Event()
        self._has_pending_backup = False
        self._staging: List[_StagingTicket] = []
        self._skip_first_backup = [False] * max_reqs
        self._waiting_for_device = False

        self._fault = os.environ.get(FAULT_ENV, "")
        if self._fault not in ("", "wrong_row"):
            raise ValueError(f"{FAULT_ENV}={self._fault!r}: allowed values are wrong_row or unset")
        if self._fault:
            logger.warning("sglang-hisparse: test fault %s is ON: outputs will be wrong", self._fault)
        self._decode_steps = 0
        self._last_counters = (0, 0)
        self._initial_free = None
        self._last_idle_report: Optional[tuple] = None

        self._resolve = make_resolver(self.config, dev, max_reqs, top_k)
        self._resolve.warmup(self.device_pool.row_bytes, B, top_k)
        self._initial_free = self.free_counts()
        logger.info(
            "sglang-hisparse coordinator: B=%d (+ newest, %d rows per request), top_k=%d, "
            "layers=%d, host rows=%d, resolver=%s",
            B, self.padded_buffer_size, top_k, self.layer_num,
            self.mem_pool_host.capacity_tokens, self._resolve.name,
        )

    # --- small protocol members --------------------------------------------------------------
    def set_decode_producer_stream(self, stream) -> None:
        self.decode_producer_stream = stream

    def has_ongoing_staging(self) -> bool:
        return len(self._staging) > 0

    def host_token_len(self, kv_allocated_len: int) -> int:
        return kv_allocated_len

    def get_token_stats(self) -> HiSparseTokenStats:
        device_total = self.allocator.device_size
        device_used = device_total - self.allocator.physical.available_tokens()
        host_total = self.mem_pool_host.capacity_tokens
        host_used = host_total - self.mem_pool_host.available_size()
        return HiSparseTokenStats(
            device_tokens=device_used,
            device_token_usage=device_used / device_total if device_total else 0.0,
            host_tokens=host_used,
            host_token_usage=host_used / host_total if host_total else 0.0,
        )

    def destroy(self) -> None:
        """Drain side streams and release the host pool (idempotent)."""
        _synchronize(self.write_staging_stream)
        _synchronize(self.decode_backup_stream)
        self.mem_pool_host.destroy()

    # --- admission ---------------------------------------------------------------------------
    def admit_request_into_staging(self, req) -> None:
        """After prefill: copy all layers of the request's KV to host on the staging stream."""
        req.hisparse_staging = True
        n = req.extend_range.end
        idx = req.req_pool_idx
        logical = self.req_to_token_pool.req_to_token[idx, :n].to(torch.int64)
        device_rows = self.allocator.device_rows_of(logical)
        host_rows = self.mem_pool_host.alloc_paged_token_slots(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx, 0, n
        )
        start, finish = self.device_module.Event(), self.device_module.Event()
        start.record()
        with self.device_module.stream(self.write_staging_stream):
            start.wait(self.write_staging_stream)
            self.mem_pool_host.write_back(self.device_pool, device_rows, host_rows)
            finish.record(self.write_staging_stream)
        self._staging.append(_StagingTicket(start, finish, req, device_rows, host_rows))

    def collect_ready_reqs(self) -> List[Any]:
        """Requests whose staging finished on every TP rank and whose hot buffer fits, in order.

        A request whose hot buffer does not fit yet stays in staging (it and the ones behind
        it wait for device rows to be freed); this is logged once per episode. With
        ``wait_for_staging`` the host blocks here until every staging copy has finished, so
        that every staged request is offered a hot buffer now.
        """
        if not self._staging:
            return []
        if self.config.wait_for_staging:
            for ticket in self._staging:
                ticket.finish_event.synchronize()
        done = 0
        for ticket in self._staging:
            if not ticket.finish_event.query():
                break
            done += 1
        if self.tp_world_size > 1:
            agreed = torch.tensor(done, dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
            done = int(agreed)
        ready = []
        for ticket in self._staging[:done]:
            if not self._take_hot_buffer(ticket.req, preload=False):
                if not self._waiting_for_device:
                    logger.info(
                        "sglang-hisparse: request %s waits in staging for device rows (%s)",
                        ticket.req.rid, self.allocator.debug_print(),
                    )
                self._waiting_for_device = True
                break
            self._waiting_for_device = False
            ticket.req.hisparse_staging = False
            self._skip_first_backup[ticket.req.req_pool_idx] = True
            ready.append(ticket.req)
        del self._staging[: len(ready)]
        return ready

    def admit_request_direct(self, req) -> None:
        """PD decode: the request's KV is already in host rows; give it a hot buffer."""
        if not self._take_hot_buffer(req, preload=True):
            raise RuntimeError(
                f"sglang-hisparse: no device rows for the hot buffer of request {req.rid} "
                f"({self.allocator.debug_print()}); the PD admission budget should prevent this"
            )
        req.hisparse_staging = False
        self._skip_first_backup[req.req_pool_idx] = True

    def _take_hot_buffer(self, req, preload: bool) -> bool:
        idx = req.req_pool_idx
        n = req.kv.kv_allocated_len
        keep = min(_round_up(n, self.page_size), self.padded_buffer_size)
        logical = self.req_to_token_pool.req_to_token[idx, :n].to(torch.int64)
        rows = self.allocator.take_hot_buffer(logical, keep)
        if rows is None:
            return False
        self.hot_locs[idx, :keep] = rows.to(torch.int32)
        self.hot_capacity[idx] = keep
        self.hot_reserved[idx] = self.padded_buffer_size - keep
        self.lru[:, idx, :] = self._lru_init
        if preload and n > self.device_buffer_size:
            # Long PD request: nothing is on device yet; every first selection misses.
            self.slot_tokens[:, idx, :] = -1
        else:
            self.slot_tokens[:, idx, :] = self._slot_positions
            if preload:
                host_rows = self.req_to_host_pool[idx, :n]
                self.mem_pool_host.load_rows(self.device_pool, host_rows, rows[:n])
        return True

    # --- decode steps ------------------------------------------------------------------------
    def map_last_loc_to_buffer(
        self,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices_cpu: torch.Tensor,
    ) -> None:
        """Before a decode step (``seq_lens`` already count the new token): back up the previous
        token to host, grow short hot buffers, and map the new token to its hot-buffer row."""
        lens = seq_lens_cpu.tolist()
        idxs = req_pool_indices_cpu.tolist()
        self._log_step_stats(len(lens))
        self._backup_previous_tokens(lens, idxs)
        self._grow_short_buffers(lens, idxs)
        newest_slot = (seq_lens.to(torch.int64) - 1).clamp(max=self.device_buffer_size)
        rows = self.hot_locs[req_pool_indices, newest_slot]
        self.allocator.map_logical(out_cache_loc, rows)

    def _backup_previous_tokens(self, lens: list[int], idxs: list[int]) -> None:
        """Write-through: the token decoded last step (position seq_len - 2) goes to host."""
        reqs, positions = [], []
        for seq_len, idx in zip(lens, idxs):
            if self._skip_first_backup[idx]:
                self._skip_first_backup[idx] = False
                continue
            position = seq_len - 2
            self.mem_pool_host.ensure_allocated(
                self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx, position + 1
            )
            reqs.append(idx)
            positions.append(position)
        if not reqs:
            return
        req_t = torch.tensor(reqs, dtype=torch.int64).to(self.device, non_blocking=True)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        host_rows_t = self.req_to_host_pool[req_t, pos_t]
        device_rows_t = self.hot_locs[req_t, pos_t.clamp(max=self.device_buffer_size)].to(torch.int64)
        self.wait_for_pending_backup()
        schedule_stream = self.device_module.current_stream()
        with self.device_module.stream(self.decode_backup_stream):
            self.decode_backup_stream.wait_stream(schedule_stream)
            if self.decode_producer_stream is not None:
                self.decode_backup_stream.wait_stream(self.decode_producer_stream)
            self.mem_pool_host.write_back(self.device_pool, device_rows_t, host_rows_t)
            self._backup_done_event.record(self.decode_backup_stream)
        if device_rows_t.is_cuda:
            device_rows_t.record_stream(self.decode_backup_stream)
            host_rows_t.record_stream(self.decode_backup_stream)
        self._has_pending_backup = True

    def _grow_short_buffers(self, lens: list[int], idxs: list[int]) -> None:
        """A request with seq_len <= B + 1 needs slot seq_len - 1; grow by pages from its
        reservation (made when it entered decode, so this never fails)."""
        for seq_len, idx in zip(lens, idxs):
            needed = min(seq_len, self.device_buffer_size + 1)
            capacity = self.hot_capacity[idx]
            if needed <= capacity:
                continue
            new_capacity = _round_up(needed, self.page_size)
            rows = self.allocator.grow_hot_buffer(new_capacity - capacity)
            self.hot_locs[idx, capacity:new_capacity] = rows.to(torch.int32)
            self.hot_reserved[idx] -= new_capacity - capacity
            self.hot_capacity[idx] = new_capacity

    def wait_for_pending_backup(self) -> None:
        """Make the current stream wait for the last write-through (before a forward reuses the
        newest slot)."""
        if not self._has_pending_backup:
            return
        self._backup_done_event.wait(self.device_module.current_stream())
        self._has_pending_backup = False

    def swap_in_selected_pages(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k_result: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """Resolve one layer's selection to device rows (int32 [num_reqs, top_k]).

        Graph safe: reads ``num_real_reqs`` on device, writes the preallocated output buffer.
        """
        num_reqs = req_pool_indices.shape[0]
        out = self.top_k_device_locs_buffer[:num_reqs]
        self._resolve(
            top_k_positions=top_k_result,
            seq_lens=seq_lens,
            req_pool_indices=req_pool_indices,
            hot_locs=self.hot_locs,
            slot_tokens=self.slot_tokens[layer_id],
            lru=self.lru[layer_id],
            host_locs=self.req_to_host_pool,
            host_kv=self.mem_pool_host.kv_buffer[layer_id],
            device_kv=self.device_pool.kv_buffer[layer_id],
            out=out,
            num_real_reqs=self.num_real_reqs,
            device_buffer_size=self.device_buffer_size,
            skip_io=self.config.skip_io,
            counters=self.counters,
        )
        if self._fault == "wrong_row":
            newest_slot = (seq_lens.to(torch.int64) - 1).clamp(max=self.device_buffer_size)
            newest_rows = self.hot_locs[req_pool_indices, newest_slot]
            out[:, 0] = torch.where(out[:, 0] >= 0, newest_rows, out[:, 0])
        return out

    # --- leaving -----------------------------------------------------------------------------
    def request_finished(self, req) -> None:
        """Free the request's hot buffer, host rows and mapping. Idempotent."""
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
            return
        if self.decode_producer_stream is not None:
            self.device_module.current_stream().wait_stream(self.decode_producer_stream)
        self.wait_for_pending_backup()
        idx = req.req_pool_idx
        if idx is None:
            return
        capacity = self.hot_capacity[idx]
        if capacity:
            rows = self.hot_locs[idx, :capacity].to(torch.int64)
            self.allocator.release_hot_buffer(rows, self.hot_reserved[idx])
        if req.kv is not None:
            self.allocator.unmap_logical(
                self.req_to_token_pool.req_to_token[idx, : req.kv.kv_allocated_len].to(torch.int64)
            )
        self.mem_pool_host.free_request_slots(self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx)
        self._reset_slot(idx)

    def abort_staging_request(self, req) -> None:
        """A request still in staging leaves: drop its ticket, wait for its copy, free its
        prefill rows and host rows. Idempotent."""
        self._staging = [t for t in self._staging if t.req is not req]
        _synchronize(self.write_staging_stream)
        idx = req.req_pool_idx
        n = req.extend_range.end
        self.allocator.free_prefill_rows(self.req_to_token_pool.req_to_token[idx, :n].to(torch.int64))
        self.mem_pool_host.free_request_slots(self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx)
        self._reset_slot(idx)
        req.hisparse_staging = False

    def retract_req(self, req) -> None:
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        else:
            self.request_finished(req)

    def _reset_slot(self, idx: int) -> None:
        self.hot_locs[idx].zero_()
        self.hot_capacity[idx] = 0
        self.hot_reserved[idx] = 0
        self.slot_tokens[:, idx, :] = -1
        self.lru[:, idx, :] = self._lru_init
        self._skip_first_backup[idx] = False

    # --- observability -----------------------------------------------------------------------
    def _log_step_stats(self, batch_size: int) -> None:
        """Every ``stats_log_interval`` decode steps, log what the resolver did since the last
        line (reads device counters: a synchronization, so it is off by default)."""
        self._decode_steps += 1
        interval = self.config.stats_log_interval
        if not interval or self._decode_steps % interval:
            return
        selected, misses = self.counter_values()
        d_sel, d_miss = selected - self._last_counters[0], misses - self._last_counters[1]
        self._last_counters = (selected, misses)
        logger.info(
            "sglang-hisparse step %d: batch %d, selected rows %d, hits %d, misses %d "
            "(hit rate %.1f%%), bytes copied %d",
            self._decode_steps, batch_size, d_sel, d_sel - d_miss, d_miss,
            100.0 * (d_sel - d_miss) / d_sel if d_sel else 100.0, d_miss * self.device_pool.row_bytes,
        )

    def report_idle(self) -> Optional[str]:
        """Once per busy -> idle transition: a log line with every pool's free count against its
        initial value (``leak=no`` when all equal) and the lifetime resolver counters."""
        counts = self.free_counts()
        selected, misses = self.counter_values()
        key = (tuple(counts.values()), selected, misses)
        if key == self._last_idle_report:
            return None
        self._last_idle_report = key
        leak = counts != self._initial_free
        parts = " ".join(f"{k}={v}/{self._initial_free[k]}" for k, v in counts.items())
        line = (
            f"sglang-hisparse idle: {parts} leak={'yes' if leak else 'no'} "
            f"selected={selected} misses={misses} "
            f"miss_rate={misses / selected if selected else 0.0:.4f} row_bytes={self.device_pool.row_bytes}"
        )
        (logger.error if leak else logger.info)(line)
        return line

    def counter_values(self) -> tuple[int, int]:
        """(selected, misses) over the server's life. Synchronizes with the device."""
        selected, misses = self.counters.tolist()
        return int(selected), int(misses)

    def free_counts(self) -> dict[str, int]:
        """Free rows of every pool (equal to their initial values when no request is live)."""
        return {
            "logical_free": self.allocator.logical.available_tokens(),
            "device_free": self.allocator.physical.available_tokens(),
            "device_reserved": self.allocator.device_reserved,
            "host_free": self.mem_pool_host.available_size(),
        }


def _synchronize(stream) -> None:
    sync = getattr(stream, "synchronize", None)
    if sync is not None:  # CPU streams have none: their work is already done
        sync()


def _config_from_server_args(top_k, device_buffer_size, ratio, block_size) -> HiSparseConfig:
    """The server's typed config (through SGLang's published server args), checked against the
    values SGLang passed; without published server args, a config from those values."""
    try:
        from sglang.srt.runtime_context import get_server_args

        from sglang_hisparse.config import config_from_server_args

        config = config_from_server_args(get_server_args())
    except (ValueError, AttributeError, AssertionError):
        return HiSparseConfig(
            top_k=top_k, device_buffer_size=device_buffer_size,
            host_to_device_ratio=ratio, swap_in_block_size=block_size,
        )
    passed = (top_k, device_buffer_size, ratio, block_size)
    ours = (config.top_k, config.device_buffer_size, config.host_to_device_ratio, config.swap_in_block_size)
    if passed != ours:
        raise AssertionError(f"sglang-hisparse: SGLang passed {passed}, the typed config says {ours}")
    return config
