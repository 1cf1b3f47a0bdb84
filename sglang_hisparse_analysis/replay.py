"""Replay selection traces through a resolver (the CUDA kernel or a Python oracle) and count misses.

The start state is the simulator's (:func:`~.simulator.simulate`): every cache holds positions
``0..B-1`` in slots ``0..B-1``, LRU order ``0..B-1``, history zero. Every cache (for example one per
document and layer) is one request row of a single batch; each decode step is one resolver call for
the whole batch with ``seq_lens = query_pos + 1`` (the query position is the newest token, in the
reserved slot; a trace never selects it) and the step's selection as ``top_k_positions``. Misses
per row and step come from the resolver's miss plan, the batch total also from its counters.

``bind`` creates the bound resolver from the static keywords (``hot_locs``, ``slot_tokens``,
``lru``, ``host_locs``, ``host_kv``, ``device_kv``, ``device_buffer_size``, ``num_real_reqs`` (an
int32 tensor), ``skip_io``, ``plan``, ``counters`` and, for the reuse policy, ``slot_history`` and
``reuse_levels``) and returns ``resolve(top_k_positions, seq_lens, req_pool_indices, out)``: use
:func:`bind_python` for ``resolve_reference`` / ``resolve_batched`` and :func:`bind_cuda` for the
kernel (build it first with ``cuda.warmup_build``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from sglang_hisparse.resolver.reference import MissPlan

BoundResolve = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
Bind = Callable[..., BoundResolve]
#: Called after every step with (step, state, out) (tests check the KV rows the step reads).
StepHook = Callable[[int, "ReplayState", torch.Tensor], None]


def bind_python(resolver: Callable[..., None]) -> Bind:
    """``bind`` for the Python resolvers (``resolve_reference``, ``resolve_batched``)."""

    def bind(**static: Any) -> BoundResolve:
        def resolve(top_k_positions, seq_lens, req_pool_indices, out) -> None:
            resolver(top_k_positions=top_k_positions, seq_lens=seq_lens, req_pool_indices=req_pool_indices, out=out,
                     **static)
        return resolve

    return bind


def bind_cuda(workspace: Any, top_k: int, **options: Any) -> Bind:
    """``bind`` for the kernel: :func:`~sglang_hisparse.resolver.cuda.bind_resolve_cuda` with
    ``workspace`` (``make_workspace(n_caches, device, top_k)``) and extra options such as
    ``block_size``."""
    from sglang_hisparse.resolver import cuda

    def bind(**static: Any) -> BoundResolve:
        return cuda.bind_resolve_cuda(top_k=top_k, workspace=workspace, **static, **options)

    return bind


@dataclass
class ReplayState:
    """The resolver's tables for ``n`` caches of ``B`` slots, in the simulator's start state.

    Request row ``i`` has device rows ``i * (B + 1) + s`` (slot ``s``, slot ``B`` the newest)
    and host rows ``i * L + p`` (position ``p``). With ``kv=False`` the KV buffers are one row
    each (only ``skip_io`` resolves may use them); with ``kv=True`` they are full and position
    ``p`` of request ``i`` holds the value ``i * L + p`` in every element, the staged positions
    ``0..B-1`` already on the device. (On a GPU the skip-IO device buffer has its full size, the
    host buffer one row: the kernel must not touch them.)
    """

    B: int
    hot_locs: torch.Tensor
    slot_tokens: torch.Tensor
    lru: torch.Tensor
    history: Optional[torch.Tensor]
    levels: Optional[torch.Tensor]
    host_locs: torch.Tensor
    host_kv: torch.Tensor
    device_kv: torch.Tensor
    plan: MissPlan
    counters: torch.Tensor
    num_real: torch.Tensor

    @classmethod
    def initial(cls, n: int, B: int, k: int, positions: int, *, device: Union[str, torch.device],
                levels: Optional[torch.Tensor] = None, item_bytes: int = 16, kv: bool = False) -> "ReplayState":
        """``positions``: host rows per request (> every traced position). ``levels``: uint8 [54]
        for the reuse policy (None: LRU)."""
        device = torch.device(device)
        if item_bytes % 4:
            raise ValueError(f"item_bytes must be a multiple of 4, got {item_bytes}")
        L = max(positions, B + 1)
        hot_locs = torch.arange(n * (B + 1), dtype=torch.int32, device=device).view(n, B + 1)
        host_locs = torch.arange(n * L, dtype=torch.int64, device=device).view(n, L)
        width = item_bytes // 4
        if kv:
            host_kv = torch.arange(n * L, dtype=torch.float32).view(n * L, 1).repeat(1, width)
            device_kv = torch.full((n * (B + 1), width), -1.0, device=device)
            device_kv[hot_locs[:, :B].long().flatten()] = host_kv[host_locs[:, :B].flatten().cpu()].to(device)
        else:  # skip-IO: nothing is copied; the device buffer keeps its real size on a GPU all the same
            host_kv = torch.zeros((1, width), dtype=torch.float32)
            device_kv = torch.zeros((n * (B + 1) if device.type == "cuda" else 1, width), dtype=torch.float32,
                                    device=device)
        if device.type == "cuda":
            host_kv = host_kv.pin_memory()
        return cls(
            B=B, hot_locs=hot_locs,
            slot_tokens=torch.arange(B, dtype=torch.int32, device=device).repeat(n, 1),
            lru=torch.arange(B, dtype=torch.int16, device=device).repeat(n, 1),
            history=None if levels is None else torch.zeros((n, B), dtype=torch.int16, device=device),
            levels=None if levels is None else levels.to(device=device, dtype=torch.uint8).contiguous(),
            host_locs=host_locs, host_kv=host_kv, device_kv=device_kv,
            plan=MissPlan(torch.zeros((n, k), dtype=torch.int64, device=device),
                          torch.zeros((n, k), dtype=torch.int32, device=device),
                          torch.zeros(n, dtype=torch.int32, device=device)),
            counters=torch.zeros(2, dtype=torch.int64, device=device),
            num_real=torch.full((1,), n, dtype=torch.int32, device=device),
        )

    def static_kwargs(self, *, skip_io: bool) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            hot_locs=self.hot_locs, slot_tokens=self.slot_tokens, lru=self.lru, host_locs=self.host_locs,
            host_kv=self.host_kv, device_kv=self.device_kv, device_buffer_size=self.B, num_real_reqs=self.num_real,
            skip_io=skip_io, plan=self.plan, counters=self.counters)
        if self.levels is not None:
            kw.update(slot_history=self.history, reuse_levels=self.levels)
        return kw


@dataclass(frozen=True)
class ReplayResult:
    misses: np.ndarray
    """int64 [n, steps]: misses per cache and step (the first step included)."""
    selected: int
    """Selected positions over all caches and steps (the resolver's counter)."""
    counted_misses: int
    """Misses by the resolver's counter (equals ``misses.sum()``)."""
    seconds: float
    """Wall time of the step loop (synchronised at the end)."""

    @property
    def miss_rate(self) -> float:
        return int(self.misses.sum()) / self.selected if self.selected else 0.0


def replay_selections(bind: Bind, ranked_topk: np.ndarray, query_pos: np.ndarray, B: int, *,
                      levels: Optional[torch.Tensor] = None, device: Union[str, torch.device] = "cpu",
                      item_bytes: int = 16, skip_io: bool = True,
                      on_step: Optional[StepHook] = None) -> ReplayResult:
    """Replay ``ranked_topk`` (``[n, steps, k]`` distinct positions per step, best first) through
    the resolver ``bind`` creates; ``levels`` (uint8 [54], from ``reuse.reuse_levels``) selects the
    reuse-table policy, None LRU. ``query_pos`` (``[steps]`` or ``[n, steps]``): the query position
    of each step (> every position it selects). ``skip_io=False`` allocates full KV buffers and
    copies. Raises ValueError on malformed traces, AssertionError if the resolver's counters
    disagree with its plan."""
    ranked_topk = np.asarray(ranked_topk)
    if ranked_topk.ndim != 3:
        raise ValueError(f"ranked_topk must be [n, steps, k], got shape {ranked_topk.shape}")
    n, steps, k = ranked_topk.shape
    qpos = np.broadcast_to(np.asarray(query_pos, dtype=np.int64), (n, steps))
    if k > B:
        raise ValueError(f"B={B} must be >= k={k}")
    if steps and (ranked_topk.min() < 0 or np.any(ranked_topk.max(axis=2) >= qpos)):
        raise ValueError("every selected position must lie in [0, query_pos)")
    if np.any(qpos + 1 <= B):
        raise ValueError(f"every query position must be >= B={B} (shorter requests take the resolver's fast path)")
    device = torch.device(device)
    state = ReplayState.initial(n, B, k, int(qpos.max()) + 1, device=device, levels=levels, item_bytes=item_bytes,
                                kv=not skip_io)
    resolve = bind(**state.static_kwargs(skip_io=skip_io))
    # step-major, so each step's batch tensors are contiguous (the kernel reads rows of k and n)
    sel_all = torch.from_numpy(np.ascontiguousarray(ranked_topk.transpose(1, 0, 2), dtype=np.int32)).to(device)
    lens_all = torch.from_numpy(np.ascontiguousarray((qpos + 1).T, dtype=np.int64)).to(device)
    rows = torch.arange(n, dtype=torch.int64, device=device)
    out = torch.empty((n, k), dtype=torch.int32, device=device)
    per_step = torch.zeros((steps, n), dtype=torch.int32, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for s in range(steps):
        resolve(sel_all[s], lens_all[s], rows, out)
        per_step[s].copy_(state.plan.counts)
        if on_step is not None:
            on_step(s, state, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    misses = per_step.T.long().cpu().numpy()
    selected, counted = (int(x) for x in state.counters.cpu())
    assert counted == int(misses.sum()), f"counters say {counted} misses, the plans {int(misses.sum())}"
    assert selected == n * steps * k, f"counters say {selected} selected, expected {n * steps * k}"
    return ReplayResult(misses=misses, selected=selected, counted_misses=counted, seconds=seconds)


def per_layer(misses: np.ndarray, n_layers: int, k: int) -> list[float]:
    """Miss rate per layer of ``[docs * layers, steps]`` misses (rows document-major)."""
    m = misses.reshape(-1, n_layers, misses.shape[-1])
    return (m.sum(axis=(0, 2)) / (m.shape[0] * m.shape[2] * k)).tolist()
