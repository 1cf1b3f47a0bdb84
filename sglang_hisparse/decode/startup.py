"""Start-up of the coordinator: its typed config, its memory pieces and its resolver, built once.

Nothing here keeps state: each function builds (and logs) one piece and hands it to
:class:`~sglang_hisparse.decode.coordinator.HiSparseCoordinator`, which owns what it gets. Side
effects are start-up ones only: host and device allocations, the allocator's configuration, kernel
builds and warm-ups, log lines; every check that fails raises
:class:`~sglang_hisparse.errors.HiSparsePluginError` before the server serves a request.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.admission import Capacity, capacity_of, check_startup
from sglang_hisparse.memory.host_mirror import HostMirror
from sglang_hisparse.memory.hot_buffers import HotBuffers
from sglang_hisparse.resolver.dispatch import Resolver, make_resolver
from sglang_hisparse.resolver.jit import decode_module
from sglang_hisparse.resolver.reuse import history_table, reuse_levels
from sglang_hisparse.stats import ResolveStats, pool_free_counts

# The coordinator's logger: these lines were the coordinator's, and log configuration selects them
# by that name.
logger = logging.getLogger("sglang_hisparse.decode.coordinator")


@dataclass(frozen=True)
class MemoryParts:
    """The memory pieces of one server: host rows (with staging and write-through), hot buffers,
    and the capacity they give. Each piece has one owner from here on: the coordinator."""

    mirror: HostMirror
    hot: HotBuffers
    capacity: Capacity


def build_memory(config: HiSparseConfig, allocator, device_pool, req_to_token_pool, *, ratio: float,
                 buffer_size: int, device: torch.device, pin_memory: Optional[bool]) -> MemoryParts:
    """Build the host mirror of ``device_pool`` (``ratio`` x its rows, pinned on CUDA unless
    ``pin_memory`` says otherwise) and the hot buffers (``buffer_size`` rows a request, with reuse
    history and the position -> slot map as ``config`` asks), then configure ``allocator`` for
    them and check the capacity they give. Side effects: the allocations, ``allocator.configure``, a log line
    for the slot map; raises HiSparsePluginError when the capacity cannot serve a request."""
    max_reqs = req_to_token_pool.req_to_token.shape[0]
    mirror = HostMirror(device_pool, ratio, max_reqs=max_reqs, max_context=req_to_token_pool.max_context_len,
                        device=device, pin_memory=device.type == "cuda" if pin_memory is None else pin_memory)
    map_columns = mirror.row_table.shape[1] if config.slot_map else 0
    hot = HotBuffers(allocator, layers=device_pool.layer_num, max_reqs=max_reqs, buffer_size=buffer_size,
                     device=device, history=config.replacement == "reuse", window=config.query_rows,
                     map_columns=map_columns, max_buffer_size=config.max_device_buffer_size)
    if hot.slot_map is not None:
        logger.info("sglang-hisparse: position -> slot map: %d layers x %d requests x %d positions, %.1f MiB "
                    "of device memory", *hot.slot_map.shape, hot.slot_map.numel() * hot.slot_map.element_size() / 2**20)
    allocator.configure(hot.padded, mirror.pool.capacity_tokens)
    capacity = capacity_of(allocator, hot, mirror.pool)
    check_startup(capacity)
    return MemoryParts(mirror=mirror, hot=hot, capacity=capacity)


def build_stats(config: HiSparseConfig, *, device: torch.device, allocator, device_pool,
                mirror: HostMirror) -> ResolveStats:
    """The server's counters and reports (step lines every ``config.stats_log_interval`` steps,
    idle reports), counting free rows of the allocator and ``mirror``'s host pool and the
    allocator's host time. Allocates the device counters."""
    return ResolveStats(device, log_interval=config.stats_log_interval, row_bytes=device_pool.row_bytes,
                        free_counts=functools.partial(pool_free_counts, allocator, mirror.pool),
                        host_time=allocator.host_time)


def build_resolver(config: HiSparseConfig, *, device: torch.device, max_reqs: int, top_k: int, row_bytes: int,
                   buffer_size: int) -> Resolver:
    """The resolver ``config`` names, warmed up for one-row steps (and for verify steps of
    ``config.query_rows`` rows); on CUDA the decode step's id kernels (kernels/decode.cuh) are
    built too, so the first step compiles nothing."""
    resolver = make_resolver(config, device, max_reqs, top_k)
    resolver.warmup(row_bytes, buffer_size, top_k)
    if config.query_rows > 1:
        resolver.warmup(row_bytes, buffer_size, top_k * config.query_rows)
    if device.type == "cuda":
        decode_module()
    return resolver


def reuse_levels_for(device: torch.device) -> torch.Tensor:
    """The packaged history table's levels (uint8 [54]) on ``device``; logs the policy once per server."""
    table = history_table()
    logger.info("sglang-hisparse: replacement policy reuse (history table: %s)", table.describe())
    return reuse_levels(table.table).to(device)


def residency_label(config: HiSparseConfig) -> str:
    """How residency is set, for the start-up line: on (with its watermark) or off, and why."""
    if config.residency:
        return f"on (watermark {config.residency_watermark:g} of the device pool)"
    if config.query_rows > 1:
        return "off (speculative decoding)"
    return "off"


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
