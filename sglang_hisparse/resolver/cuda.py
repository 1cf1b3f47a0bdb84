"""CUDA resolver: the fused RESOLVE kernel behind the reference resolver's call.

``resolve_cuda`` has the keywords and meaning of :func:`reference.resolve_reference`; it launches
one kernel (``kernels/resolve.cuh``) on the current CUDA stream and returns nothing (no host
sync: the per-call stats of the reference are available through ``counters``).

CUDA-graph rules: all scratch lives in a :class:`ResolveWorkspace` allocated once by
:func:`make_workspace`; a call allocates nothing, reads ``num_real_reqs`` on the device, and picks
its grid from shapes only, so a graph captured for one padded batch size replays correctly for any
``num_real_reqs``. Call :func:`warmup_build` at start-up (before capture): it compiles the kernels
(JIT, cached on disk) and sets their launch attributes.

Concurrency rule: launches that share a workspace must be ordered on one stream (the kernel keeps
inter-CTA counters in the workspace and resets them itself at the end of every launch).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from sglang_hisparse.config import DEFAULT_SWAP_IN_BLOCK_SIZE, DEFAULT_TOP_K, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from sglang_hisparse.resolver.reuse import policy_tables
from sglang_hisparse.resolver import jit
from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES, C4PagedRows, LinearRows
from sglang_hisparse.resolver.reference import MissPlan, check_compress_ratio, residency_tables

logger = logging.getLogger(__name__)

# Workspace state words (int32); mirrors kState* in kernels/resolve.cuh.
STATE_WORDS = 128
STATE_ERRORS = 96
STATE_CLOCK = 100
"""Diagnostic build only: 13 uint64 stage stamps from word 100 (``stage_clock=True``)."""
STAGE_CLOCK_STAMPS = 13
STAGE_CLOCK_STAGES = ("scalars", "stage_tables", "hash_insert", "slot_lookup", "counts", "ranks", "publish", "finish")
"""Planner stages between consecutive clock64 stamps 0-8, in order (``read_stage_clock`` keys)."""

MAX_SMEM_BYTES = 227 * 1024
"""Dynamic shared memory a Hopper block may opt into."""

MAX_SLOTS = 32767
"""Slots and top-k indices are int16 in the kernel."""

DEFAULT_REPLAY_CTAS = 8
DEFAULT_REPLAY_BLOCK = 512
DEFAULT_SPIN_TIMEOUT_S = 10.0


def _align16(x: int) -> int:
    return (x + 15) & ~15


def _hash_entries(top_k: int) -> int:
    """Entries of a planner's hash table: next_pow2(4 * top_k), load factor <= 1/4 (``kHash``)."""
    entries = 1
    while entries < 4 * top_k:
        entries <<= 1
    return entries


def _layout_bytes(B: int, K: int, reuse: bool, spilled: bool) -> int:
    """``PlanLayoutOf<B, K, reuse, spilled>::kBytes`` in ``kernels/resolve.cuh``."""
    k, h = (0, 0) if spilled else (K, _hash_entries(K))  # a spilled layout holds no top-k-sized array
    off = _align16(4 * k)  # top-k positions
    off = _align16(off + 4 * k)  # selection -> slot / miss code
    off = _align16(off + 4 * B)  # slot tokens -> selection
    off = _align16(off + 4 * (B + 1))  # hot locs
    off = _align16(off + 2 * B)  # lru
    off = _align16(off + 2 * k)  # victims
    off = _align16(off + 4 * ((k + 31) // 32))  # miss ballots
    union = _align16(off + 4 * ((B + 31) // 32))  # evictable ballots
    hash_end = _align16(_align16(union + 4 * h) + 2 * h)
    phase2_end = _align16(_align16(union + 2 * B) + 8 * k)
    wsum_rows = 5 if reuse else 3
    end = _align16(max(hash_end, phase2_end) + 4 * (wsum_rows * 32 + 8))
    if reuse:  # history u16[B], levels u8[B], histogram int32[64], two ballot rows u32[B / 32]
        end = _align16(_align16(_align16(_align16(end + 2 * B) + B) + 4 * 64) + 4 * ((B + 31) // 32))
        end = _align16(end + 4 * ((B + 31) // 32))
    return end


def planner_spills(device_buffer_size: int, top_k: int, reuse: bool = False) -> bool:
    """Whether the planner of this configuration keeps its top-k-sized arrays (selection map,
    victims, hash table, host rows) in a global spill slice per request because the whole layout
    does not fit :data:`MAX_SMEM_BYTES`; mirrors ``kPlanSpills`` in ``kernels/resolve.cuh``. LRU at
    top_k 2048: one row spills above B = 16011, a verify union of 2 rows above B = 9108, a union
    of 3 rows or more at every B."""
    return _layout_bytes(device_buffer_size, top_k, reuse, spilled=False) > MAX_SMEM_BYTES


def planner_smem_bytes(device_buffer_size: int, top_k: int, reuse: bool = False) -> int:
    """Shared memory of one planner CTA (the spilled layout when :func:`planner_spills`); mirrors
    ``PlanLayout`` in ``kernels/resolve.cuh`` (``reuse``: the reuse-table policy's kernel, which
    appends its arrays)."""
    spilled = planner_spills(device_buffer_size, top_k, reuse)
    return _layout_bytes(device_buffer_size, top_k, reuse, spilled)


def planner_spill_bytes(top_k: int) -> int:
    """Bytes of one request's spill slice (``PlanSpill<top_k>::kBytes``): int32 selection map,
    int16 victims, miss ballots, int32 + int16 hash of next_pow2(4 * top_k) entries, int64 host
    rows; 128-byte aligned. 312,320 B at top_k 8192 (a 4-row verify union of 2048)."""
    hash_size = _hash_entries(top_k)
    off = _align16(4 * top_k)  # selection map
    off = _align16(off + 2 * top_k)  # victims
    off = _align16(off + 4 * ((top_k + 31) // 32))  # miss ballots
    off = _align16(off + 4 * hash_size)  # hash keys
    off = _align16(off + 2 * hash_size)  # hash values
    return (off + 8 * top_k + 127) & ~127  # host rows


def largest_buffer_size(top_k: int, reuse: bool = False) -> int:
    """The largest B whose planner fits :data:`MAX_SMEM_BYTES` for ``top_k``, spilling its
    top-k-sized arrays when it must (0 when none does; the used layout grows with B, so a binary
    search over ``[top_k, MAX_SLOTS]`` finds it)."""
    if top_k > MAX_SLOTS or planner_smem_bytes(top_k, top_k, reuse) > MAX_SMEM_BYTES:
        return 0
    low, high = top_k, MAX_SLOTS
    while low < high:
        mid = (low + high + 1) // 2
        if planner_smem_bytes(mid, top_k, reuse) <= MAX_SMEM_BYTES:
            low = mid
        else:
            high = mid - 1
    return low


def check_row_bytes(item_bytes: int) -> None:
    """Raise ValueError unless the kernel copies rows of ``item_bytes``: linear rows of a positive
    multiple of 16 bytes, or DeepSeek-V4's 584-byte paged C4 rows (``RowLayout`` in resolve.cuh)."""
    if item_bytes != C4_ITEM_BYTES and (item_bytes <= 0 or item_bytes % 16 != 0):
        raise ValueError(f"hisparse kernel: KV rows must be a positive multiple of 16 bytes (or DeepSeek-V4's "
                         f"{C4_ITEM_BYTES}-byte paged C4 rows), got {item_bytes}")


def check_supported(item_bytes: int, device_buffer_size: int, top_k: int, reuse: bool = False) -> None:
    """Raise ValueError unless the kernel (``reuse``: the reuse-table policy's) can be built for
    this configuration."""
    check_row_bytes(item_bytes)
    if not 1 <= top_k <= device_buffer_size <= MAX_SLOTS:
        raise ValueError(
            f"hisparse kernel: need 1 <= top_k ({top_k}) <= B ({device_buffer_size}) <= {MAX_SLOTS}"
        )
    smem = planner_smem_bytes(device_buffer_size, top_k, reuse)
    if smem > MAX_SMEM_BYTES:
        raise ValueError(
            f"hisparse kernel: B={device_buffer_size}, top_k={top_k}{' with replacement=reuse' if reuse else ''} "
            f"needs {smem} B of shared memory per CTA (limit {MAX_SMEM_BYTES}); use a smaller device_buffer_size "
            f"(at most {largest_buffer_size(top_k, reuse)})"
        )


def check_block_size(block_size: int) -> int:
    if block_size % 32 != 0 or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"hisparse kernel: block_size must be a multiple of 32 in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
            f"got {block_size}"
        )
    return block_size


@functools.lru_cache(maxsize=1)
def spin_timeout_ns() -> int:
    """How long a copier CTA waits for the planners before trapping (env
    ``HISPARSE_RESOLVE_SPIN_TIMEOUT_S``, default 10 s; a healthy launch waits microseconds)."""
    seconds = float(os.environ.get("HISPARSE_RESOLVE_SPIN_TIMEOUT_S", DEFAULT_SPIN_TIMEOUT_S))
    return max(1, int(seconds * 1e9))


@dataclass(frozen=True)
class ResolveWorkspace:
    """All scratch the kernels need, allocated once (fixed addresses for CUDA graphs).

    Invariants: ``state`` words other than ``errors`` are zero between launches (the kernel resets
    them); ``errors`` counts precondition violations the kernel met (it never faults on them),
    so a healthy server keeps it at 0.
    """

    max_reqs: int
    top_k: int
    device: torch.device
    state: torch.Tensor
    """int32 [128]: planned (word 0), total_rows (32), exited (64), errors (96)."""
    flat_host_rows: torch.Tensor
    """int64 [max_reqs * top_k]: this launch's misses, host rows."""
    flat_device_rows: torch.Tensor
    """int32 [max_reqs * top_k]: this launch's misses, device rows."""
    resolve_num_real: torch.Tensor
    """int32 [1]: holds ``num_real_reqs`` when resolve_cuda is given an int."""
    replay_num_real: torch.Tensor
    """int32 [1]: the same for replay_plan_cuda (it may run on another stream)."""
    planner_spill: torch.Tensor
    """uint8 [max_reqs * planner_spill_bytes(top_k)] (empty without ``spill``): the spill slices
    of planners whose top-k-sized arrays do not fit shared memory (:func:`planner_spills`)."""
    empty_i64: torch.Tensor
    empty_i32: torch.Tensor
    empty_u8: torch.Tensor
    empty_i16: torch.Tensor
    """Empty tensors passed for absent optional arguments (no plan, counters or residency)."""

    @property
    def errors(self) -> torch.Tensor:
        """int32 [1] device view of the error count (read it off the critical path)."""
        return self.state[STATE_ERRORS : STATE_ERRORS + 1]


def make_workspace(max_reqs: int, device: Union[torch.device, str], top_k: int = DEFAULT_TOP_K,
                   spill: bool = False) -> ResolveWorkspace:
    """Allocate the workspace for batches of up to ``max_reqs`` requests and ``top_k`` selections;
    ``spill``: with the spill buffer that planners of spilling configurations need
    (:func:`planner_spills`; a verify union of N >= 3 rows of 2048).

    Side effect: allocates ``12 * max_reqs * top_k`` bytes (+ 1 KB) on ``device``, plus
    ``max_reqs * planner_spill_bytes(top_k)`` with ``spill``.
    """
    if max_reqs < 1:
        raise ValueError(f"make_workspace: max_reqs must be >= 1, got {max_reqs}")
    if top_k < 1:
        raise ValueError(f"make_workspace: top_k must be >= 1, got {top_k}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # tensors report cuda:N; compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    n = max_reqs * top_k
    return ResolveWorkspace(
        max_reqs=max_reqs,
        top_k=top_k,
        device=device,
        state=torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
        flat_host_rows=torch.zeros(n, dtype=torch.int64, device=device),
        flat_device_rows=torch.zeros(n, dtype=torch.int32, device=device),
        resolve_num_real=torch.zeros(1, dtype=torch.int32, device=device),
        replay_num_real=torch.zeros(1, dtype=torch.int32, device=device),
        planner_spill=torch.empty(max_reqs * planner_spill_bytes(top_k) if spill else 0, dtype=torch.uint8,
                                  device=device),
        empty_i64=torch.empty(0, dtype=torch.int64, device=device),
        empty_i32=torch.empty(0, dtype=torch.int32, device=device),
        empty_u8=torch.empty(0, dtype=torch.uint8, device=device),
        empty_i16=torch.empty(0, dtype=torch.int16, device=device),
    )


def kv_buffers(host_kv, device_kv, compress_ratio: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A layer's two KV buffers as the kernel takes them: ``(host tensor, device tensor, row bytes)``.

    Tensors (or ``LinearRows``) are linear rows (the row bytes: a row's size; ``compress_ratio``
    1). ``C4PagedRows`` views, both, are DeepSeek-V4's paged C4 rows: their page buffers, 584-byte
    rows, ``compress_ratio`` 4 (the kernel's ``RowLayout<584>``). Raises ValueError otherwise."""
    check_compress_ratio(compress_ratio)
    paged = [isinstance(kv, C4PagedRows) for kv in (host_kv, device_kv)]
    if any(paged):
        _check(all(paged), "host_kv and device_kv must both be C4PagedRows views or both be tensors")
        _check(compress_ratio == 4, f"DeepSeek-V4's C4 rows are entries of 4 tokens: compress_ratio must be 4, "
                                    f"got {compress_ratio}")
        return host_kv.pages, device_kv.pages, C4_ITEM_BYTES
    host_kv, device_kv = (kv.kv if isinstance(kv, LinearRows) else kv for kv in (host_kv, device_kv))
    _check(compress_ratio == 1, f"compress_ratio {compress_ratio} needs C4PagedRows buffers (DeepSeek-V4's C4 rows)")
    return host_kv, device_kv, kv_item_bytes(device_kv)


def kv_item_bytes(kv: torch.Tensor) -> int:
    """Bytes per KV row of a ``[rows, ...]`` tensor (per page for a paged buffer)."""
    if kv.dim() < 1:
        raise ValueError("hisparse kernel: KV tensors need a row dimension")
    per_row = 1
    for d in kv.shape[1:]:
        per_row *= int(d)
    return per_row * kv.element_size()


_pinned_checked: set[int] = set()


def _check_host_kv(host_kv: torch.Tensor) -> None:
    if host_kv.device.type != "cpu":
        raise ValueError(f"hisparse kernel: host_kv must be a pinned CPU tensor, got device {host_kv.device}")
    ptr = host_kv.data_ptr()
    if ptr in _pinned_checked:
        return
    if not host_kv.is_pinned():
        raise ValueError("hisparse kernel: host_kv must be pinned (page-locked) so the GPU can read it")
    _pinned_checked.add(ptr)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"hisparse kernel: {message}")


def _check_rows_kv(kv: torch.Tensor, name: str) -> None:
    _check(kv.dim() >= 1 and kv.stride(-1) == 1 and kv.stride(0) * kv.element_size() == kv_item_bytes(kv),
           f"{name} rows must be contiguous")
    _check(kv.data_ptr() % 16 == 0, f"{name} must be 16-byte aligned")


def _check_table(t: torch.Tensor, dtype: torch.dtype, name: str, device: torch.device) -> None:
    _check(t.dim() == 2 and t.dtype == dtype, f"{name} must be a 2-D {dtype} tensor, got {t.dtype} {tuple(t.shape)}")
    _check(t.device == device, f"{name} must be on {device}, got {t.device}")
    _check(t.shape[1] <= 1 or t.stride(1) == 1, f"{name} rows must be contiguous")


def _num_real_tensor(num_real_reqs: Union[int, torch.Tensor], scratch: torch.Tensor) -> torch.Tensor:
    if isinstance(num_real_reqs, torch.Tensor):
        if not (num_real_reqs.dtype == torch.int32 and num_real_reqs.numel() >= 1
                and num_real_reqs.device == scratch.device):
            _check(False, f"num_real_reqs must be an int32 tensor on {scratch.device}")
        return num_real_reqs
    scratch.fill_(int(num_real_reqs))  # an int is baked into a captured graph: pass a tensor there
    return scratch


_STATIC_MEMO_SIZE = 4096
_static_checked: dict[tuple, Any] = {}
"""Signatures of arguments already validated -> what the checks produced: a bound layer
(:class:`_BoundLayer`, resolve_cuda) or the KV row bytes (replay). A caller passing the same buffers
every call (one entry per layer) runs the checks and the kernel's ``bind`` once; a tensor with the
same address, shape, strides, dtype and device as a validated one passes the same checks, and the
bound addresses stay valid because the entry holds the tensors."""


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device())


def _check_static_tables(
    B: int, top_k: int, skip_io: bool, device: torch.device, hot_locs: torch.Tensor, slot_tokens: torch.Tensor,
    lru: torch.Tensor, host_locs: torch.Tensor, host_kv: torch.Tensor, device_kv: torch.Tensor, reuse: bool = False,
    item_bytes: Optional[int] = None,
) -> int:
    """The checks of resolve_cuda's per-request tables and KV buffers (tensors: :func:`kv_buffers`;
    ``item_bytes``: its row bytes, None: linear rows); returns the KV row bytes."""
    _check_table(hot_locs, torch.int32, "hot_locs", device)
    _check_table(slot_tokens, torch.int32, "slot_tokens", device)
    _check_table(lru, torch.int16, "lru", device)
    _check_table(host_locs, torch.int64, "host_locs", device)
    _check(hot_locs.shape[1] >= B + 1, f"hot_locs needs >= B + 1 = {B + 1} columns, has {hot_locs.shape[1]}")
    _check(slot_tokens.shape[1] == B and lru.shape[1] == B, f"slot_tokens and lru need B = {B} columns")
    _check(device_kv.device == device, f"device_kv must be on {device}")
    _check(host_kv.dtype == device_kv.dtype, "host_kv and device_kv must have one dtype")
    _check(kv_item_bytes(host_kv) == kv_item_bytes(device_kv), "host_kv and device_kv rows differ in size")
    item_bytes = kv_item_bytes(device_kv) if item_bytes is None else item_bytes
    check_supported(item_bytes, B, top_k, reuse)
    if not skip_io:
        _check_host_kv(host_kv)
        _check_rows_kv(host_kv, "host_kv")
        _check_rows_kv(device_kv, "device_kv")
    return item_bytes


def _check_reuse(slot_history: torch.Tensor, reuse_levels: torch.Tensor, B: int, table_rows: int,
                 device: torch.device) -> None:
    """The checks of the reuse policy's tensors the kernel needs beyond ``policy_tables`` (which
    has checked their dtypes and the 54 levels): layout, device, rows, and the levels' values,
    which the kernel masks to [0, 64), read once, at bind time (a host sync)."""
    _check_table(slot_history, torch.int16, "slot_history", device)
    _check(slot_history.shape[0] >= table_rows and slot_history.shape[1] == B,
           f"slot_history needs >= {table_rows} rows and B = {B} columns, has {tuple(slot_history.shape)}")
    _check(reuse_levels.dim() == 1 and reuse_levels.device == device and reuse_levels.is_contiguous(),
           f"reuse_levels must be a contiguous 1-D tensor on {device}, got {tuple(reuse_levels.shape)} "
           f"on {reuse_levels.device}")
    _check(int(reuse_levels.max()) < 64, "reuse_levels values must be < 64 (the kernel's level histogram)")


def _check_slot_map(slot_map: torch.Tensor, table_rows: int, max_context: int, device: torch.device) -> None:
    """The checks of the position -> slot map (the kernel's): int16, one row per table row, a
    column per position of ``host_locs``, contiguous columns, on the tables' device."""
    _check_table(slot_map, torch.int16, "slot_map", device)
    _check(slot_map.shape[0] >= table_rows and slot_map.shape[1] >= max_context,
           f"slot_map needs >= {table_rows} rows and >= max_context = {max_context} columns, "
           f"has {tuple(slot_map.shape)}")


def _check_buffer_sizes(buffer_sizes: torch.Tensor, table_rows: int, device: torch.device) -> None:
    """The checks of the per-request buffer sizes (the kernel's): a contiguous int32 vector with an
    entry per table row, on the tables' device. Its values are not read here (no sync): the kernel
    reads them at every launch (a captured graph sees the current sizes) and counts an error for a
    size outside [0, B]."""
    _check(buffer_sizes.dim() == 1 and buffer_sizes.dtype == torch.int32 and buffer_sizes.device == device
           and buffer_sizes.shape[0] >= table_rows and (buffer_sizes.shape[0] <= 1 or buffer_sizes.stride(0) == 1),
           f"buffer_sizes must be a contiguous int32 [>= {table_rows}] tensor on {device}, got {buffer_sizes.dtype} "
           f"{tuple(buffer_sizes.shape)} on {buffer_sizes.device}")


def _check_residency(
    resident: torch.Tensor, req_to_token: torch.Tensor, logical_to_device: torch.Tensor, table_rows: int,
    device: torch.device,
) -> None:
    """The checks of resolve_cuda's residency tables (the kernel's ``check_residency``): both
    per-request tables cover the ``table_rows`` rows every other table has."""
    _check(resident.dim() == 1 and resident.dtype in (torch.uint8, torch.bool) and resident.device == device
           and resident.shape[0] >= table_rows and (resident.shape[0] <= 1 or resident.stride(0) == 1),
           f"resident must be a contiguous uint8/bool [>= {table_rows}] tensor on {device}, got {resident.dtype} "
           f"{tuple(resident.shape)} on {resident.device}")
    _check_table(req_to_token, torch.int32, "req_to_token", device)
    _check(req_to_token.shape[0] >= table_rows and req_to_token.shape[1] >= 1,
           f"req_to_token needs >= {table_rows} rows and >= 1 column, has {tuple(req_to_token.shape)}")
    _check(logical_to_device.dim() == 1 and logical_to_device.dtype == torch.int64
           and logical_to_device.device == device and logical_to_device.shape[0] >= 1
           and (logical_to_device.shape[0] <= 1 or logical_to_device.stride(0) == 1),
           f"logical_to_device must be a contiguous int64 [>= 1] tensor on {device}, got {logical_to_device.dtype} "
           f"{tuple(logical_to_device.shape)} on {logical_to_device.device}")


@dataclass(frozen=True)
class _Static:
    """A layer's validated arguments that do not change between calls: the kernel build key and
    the argument tuples around the per-call tensors (see :func:`_launch`)."""

    item_bytes: int
    skip_io: bool
    reuse: bool
    """the reuse-table policy's kernel module (else LRU's)"""
    tables: tuple
    """(hot_locs, slot_tokens, lru, host_locs, host_kv, device_kv)"""
    extras: tuple
    """(plan host rows, plan device rows, plan counts, counters, resident, req_to_token,
    logical_to_device, slot_history, reuse_levels, slot_map, buffer_sizes, workspace state, miss-list
    host rows, miss-list device rows, spill buffer, block, copiers, spin timeout)"""


def _validate_static(
    *, hot_locs, slot_tokens, lru, host_locs, host_kv, device_kv, device_buffer_size: int, top_k: int,
    workspace: ResolveWorkspace, residency: Optional[tuple] = None, reuse: Optional[tuple] = None,
    slot_map: Optional[torch.Tensor] = None, buffer_sizes: Optional[torch.Tensor] = None, skip_io: bool = False,
    plan: Optional[MissPlan] = None, counters: Optional[torch.Tensor] = None, block_size: Optional[int] = None,
    num_copiers: Optional[int] = None, compress_ratio: int = 1,
) -> _Static:
    """Every check of resolve_cuda's arguments that is not about the batch; raises ValueError."""
    B, device = int(device_buffer_size), workspace.device
    block = check_block_size(DEFAULT_SWAP_IN_BLOCK_SIZE if block_size is None else int(block_size))
    host_kv, device_kv, row_bytes = kv_buffers(host_kv, device_kv, compress_ratio)
    item_bytes = _check_static_tables(B, top_k, skip_io, device, hot_locs, slot_tokens, lru, host_locs, host_kv,
                                      device_kv, reuse is not None, row_bytes)
    table_rows = min(int(t.shape[0]) for t in (hot_locs, slot_tokens, lru, host_locs))
    if reuse is not None:
        _check_reuse(*reuse, B, table_rows, device)
    if slot_map is not None:
        _check_slot_map(slot_map, table_rows, int(host_locs.shape[1]), device)
    if buffer_sizes is not None:
        _check_buffer_sizes(buffer_sizes, table_rows, device)
    if residency is not None:
        _check_residency(*residency, table_rows, device)
    if plan is not None:
        _check_plan(plan, top_k, device)
    if counters is not None:
        _check(counters.dtype == torch.int64 and counters.numel() >= 2 and counters.device == device
               and counters.stride(0) == 1, f"counters must be a contiguous int64 [2] tensor on {device}")
    if planner_spills(B, top_k, reuse is not None):
        need = workspace.max_reqs * planner_spill_bytes(top_k)
        _check(workspace.planner_spill.numel() >= need,
               f"B={B}, top_k={top_k} keeps the planner's top-k-sized arrays in global memory: the workspace needs "
               f"a spill buffer of {need} B, has {workspace.planner_spill.numel()} (make_workspace(spill=True))")
    e64, e32 = workspace.empty_i64, workspace.empty_i32
    resident, req_to_token, logical_to_device = residency if residency is not None else (workspace.empty_u8, e32, e64)
    slot_history, levels = reuse if reuse is not None else (workspace.empty_i16, workspace.empty_u8)
    extras = (
        plan.host_rows if plan is not None else e64, plan.device_rows if plan is not None else e32,
        plan.counts if plan is not None else e32, counters if counters is not None else e64,
        resident, req_to_token, logical_to_device, slot_history, levels,
        slot_map if slot_map is not None else workspace.empty_i16,
        buffer_sizes if buffer_sizes is not None else e32, workspace.state, workspace.flat_host_rows,
        workspace.flat_device_rows, workspace.planner_spill, block, -1 if num_copiers is None else int(num_copiers),
        spin_timeout_ns(),
    )
    return _Static(item_bytes, bool(skip_io), reuse is not None, (hot_locs, slot_tokens, lru, host_locs, host_kv,
                                                                  device_kv), extras)


def _check_plan(plan: MissPlan, top_k: int, device: torch.device) -> None:
    _check(plan.host_rows.dtype == torch.int64 and plan.device_rows.dtype == torch.int32
           and plan.counts.dtype == torch.int32, "plan tensors must be int64 / int32 / int32")
    _check(plan.host_rows.device == device and plan.device_rows.device == device and plan.counts.device == device,
           f"plan tensors must be on {device}")
    _check(plan.host_rows.dim() == 2 and plan.device_rows.dim() == 2 and plan.counts.dim() == 1
           and plan.host_rows.shape[1] >= top_k and plan.device_rows.shape[1] >= top_k,
           "plan must have >= top_k columns")
    _check(plan.host_rows.stride(1) == 1 and plan.device_rows.stride(1) == 1 and plan.counts.stride(0) == 1,
           "plan rows must be contiguous")


def _check_batch(top_k_positions, seq_lens, req_pool_indices, out, workspace: ResolveWorkspace,
                 plan: Optional[MissPlan]) -> int:
    """The checks of one call's batch tensors; returns the number of rows. On the hot path of every
    layer: messages are formatted only when a check fails."""
    device = workspace.device
    if not (top_k_positions.dim() == 2 and top_k_positions.dtype == torch.int32):
        _check(False, f"top_k_positions must be int32 [num_reqs, top_k], got {top_k_positions.dtype} "
                      f"{tuple(top_k_positions.shape)}")
    if top_k_positions.device != device:
        _check(False, f"top_k_positions must be on {device}")
    num_reqs, top_k = top_k_positions.shape
    if num_reqs > workspace.max_reqs:
        _check(False, f"batch of {num_reqs} exceeds the workspace's max_reqs={workspace.max_reqs}")
    if top_k > workspace.top_k:
        _check(False, f"top_k={top_k} exceeds the workspace's top_k={workspace.top_k}")
    for name, t in (("seq_lens", seq_lens), ("req_pool_indices", req_pool_indices)):
        if not (t.dim() == 1 and t.dtype in _INDEX_DTYPES and t.shape[0] >= num_reqs and t.device == device):
            _check(False, f"{name} must be int32/int64 [>= num_reqs] on {device}")
    if not (out.dim() == 2 and out.dtype == torch.int32 and out.device == device and (out.shape[1] <= 1 or out.stride(1) == 1)
            and out.shape[0] >= num_reqs and out.shape[1] == top_k):
        _check_table(out, torch.int32, "out", device)
        _check(False, "out must be int32 [>= num_reqs, top_k]")
    if plan is not None and not (plan.host_rows.shape[0] >= num_reqs and plan.device_rows.shape[0] >= num_reqs
                                 and plan.counts.shape[0] >= num_reqs):
        _check(False, "plan must have >= num_reqs rows")
    return num_reqs


_INDEX_DTYPES = (torch.int32, torch.int64)


def _module(static: _Static, B: int, top_k: int, stage_clock: Union[bool, str] = False):
    if stage_clock:
        return jit.resolve_stage_clock_module(static.item_bytes, B, top_k, twice=stage_clock == "twice",
                                              reuse=static.reuse)
    return jit.resolve_module(static.item_bytes, B, top_k, reuse=static.reuse)


@dataclass(frozen=True)
class _BoundLayer:
    """A layer bound by the kernel's ``bind``: ``params`` (CPU bytes holding the bound tensors'
    addresses) is passed with the batch's four tensors to ``launch``. Holding ``static`` and
    ``num_real`` keeps those addresses valid for as long as this object lives."""

    static: _Static
    num_real: torch.Tensor
    params: torch.Tensor
    launch: Callable[..., None]


def _bind(static: _Static, B: int, top_k: int, num_real: torch.Tensor,
          stage_clock: Union[bool, str] = False) -> _BoundLayer:
    """Run the module's ``bind`` (the C++ checks of the same arguments) into a fresh parameter tensor.
    Looks the kernel module up (builds it on first use)."""
    module = _module(static, B, top_k, stage_clock)
    bind, launch = (module.bind_skip_io, module.launch_skip_io) if static.skip_io else (module.bind, module.launch)
    params = torch.empty(BOUND_BYTES, dtype=torch.uint8)
    _kernel_checked(bind, params, *static.tables, num_real, *static.extras)
    return _BoundLayer(static, num_real, params, launch)


def _launch_bound(layer: _BoundLayer, top_k_positions, seq_lens, req_pool_indices, out) -> None:
    _kernel_checked(layer.launch, layer.params, top_k_positions, seq_lens, req_pool_indices, out)


def resolve_cuda(
    *, top_k_positions: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
    hot_locs: torch.Tensor, slot_tokens: torch.Tensor, lru: torch.Tensor, host_locs: torch.Tensor,
    host_kv: torch.Tensor, device_kv: torch.Tensor, out: torch.Tensor,
    num_real_reqs: Union[int, torch.Tensor], device_buffer_size: int, skip_io: bool = False,
    plan: Optional[MissPlan] = None, counters: Optional[torch.Tensor] = None,
    resident: Optional[torch.Tensor] = None, req_to_token: Optional[torch.Tensor] = None,
    logical_to_device: Optional[torch.Tensor] = None,
    slot_history: Optional[torch.Tensor] = None, reuse_levels: Optional[torch.Tensor] = None,
    slot_map: Optional[torch.Tensor] = None, compress_ratio: int = 1, buffer_sizes: Optional[torch.Tensor] = None,
    workspace: ResolveWorkspace, block_size: Optional[int] = None, num_copiers: Optional[int] = None,
    stage_clock: Union[bool, str] = False,
) -> None:
    """Resolve one layer for a batch on the GPU (semantics: :func:`reference.resolve_reference`).

    Side effects (all on the current stream, asynchronous): writes ``out[:num_real]``, the victims'
    ``slot_tokens`` (and, with ``slot_map``, the misses' map entries), the ``lru`` rows of long requests, miss rows of ``device_kv`` (unless
    ``skip_io``), ``plan`` and ``counters`` when given. Rows ``>= num_real_reqs`` are untouched.
    Resident requests (``resident[r] != 0``, residency tables given) write only their ``out`` row
    (and a plan count of 0); the three tables are only read, so their contents (not their
    addresses) may change between replays of a captured graph. The first call with a set of buffers
    validates them and binds the layer through the kernel module's ``bind`` (kept in a memo keyed
    by the buffers' signatures); every call launches through ``launch``, the entry point servers
    use. A server binds once per layer itself (:func:`bind_resolve_cuda`), which also skips the
    per-call signature lookup.

    DeepSeek-V4's C4 layers pass ``C4PagedRows`` views and ``compress_ratio=4`` (:func:`kv_buffers`).

    Args beyond the reference's:
        workspace: from :func:`make_workspace` (``max_reqs >= num_reqs``, ``top_k >= top_k``).
        block_size: threads per CTA, a multiple of 32 in [32, 1024] (default: the config's
            ``swap_in_block_size``).
        num_copiers: copier CTAs; None = automatic, 0 = each planner CTA copies its own misses.
        stage_clock: use the diagnostic build that stamps stage boundaries into
            ``workspace.state`` (read them with :func:`read_stage_clock`); ``"twice"``: the build
            whose skip-IO kernel plans twice and keeps the second pass's stamps. Benchmarks only.

    Raises ValueError on bad shapes, dtypes, devices or an unsupported configuration; never syncs.
    """
    residency = residency_tables(resident, req_to_token, logical_to_device)
    reuse = policy_tables(slot_history, reuse_levels)
    B, top_k = int(device_buffer_size), int(top_k_positions.shape[-1])
    num_reqs = _check_batch(top_k_positions, seq_lens, req_pool_indices, out, workspace, plan)
    num_real = num_real_reqs if isinstance(num_real_reqs, torch.Tensor) else workspace.resolve_num_real
    host_buf, device_buf, _ = kv_buffers(host_kv, device_kv, compress_ratio)
    key = _memo_key((B, top_k, bool(skip_io), stage_clock, workspace.device, block_size, num_copiers, compress_ratio),
                    (hot_locs, slot_tokens, lru, host_locs, host_buf, device_buf), residency, reuse, slot_map, plan,
                    counters, workspace.state, num_real, buffer_sizes)
    layer = _static_checked.get(key)
    static = layer.static if layer is not None else _validate_static(
        hot_locs=hot_locs, slot_tokens=slot_tokens, lru=lru, host_locs=host_locs, host_kv=host_kv,
        device_kv=device_kv, device_buffer_size=B, top_k=top_k, skip_io=skip_io, plan=plan, counters=counters,
        residency=residency, reuse=reuse, slot_map=slot_map, buffer_sizes=buffer_sizes, workspace=workspace,
        block_size=block_size, num_copiers=num_copiers, compress_ratio=compress_ratio)
    if num_reqs == 0:
        return  # validated, nothing to launch (binding would build the kernel module)
    n_real = _num_real_tensor(num_real_reqs, workspace.resolve_num_real)  # `num_real`, checked (an int written)
    if layer is None:
        layer = _bind_memoized(key, static, B, top_k, n_real, stage_clock)
    _launch_bound(layer, top_k_positions, seq_lens, req_pool_indices, out)


def _memo_key(options: tuple, tables: tuple, residency: Optional[tuple], reuse: Optional[tuple],
              slot_map: Optional[torch.Tensor], plan: Optional[MissPlan], counters: Optional[torch.Tensor],
              state: torch.Tensor, num_real: torch.Tensor, buffer_sizes: Optional[torch.Tensor] = None) -> tuple:
    """The key of one :func:`resolve_cuda` call in ``_static_checked``: its ``options`` (B, top_k,
    skip_io, stage_clock, device, block_size, num_copiers), then the signatures of the tensors the
    layer binds (``tables``: hot_locs, slot_tokens, lru, host_locs, host_kv, device_kv; None for an
    optional group not passed), the workspace ``state`` and ``num_real``. No side effects."""
    return (*options, *(_signature(t) for t in tables),
            None if residency is None else tuple(_signature(t) for t in residency),
            None if reuse is None else tuple(_signature(t) for t in reuse),
            None if slot_map is None else _signature(slot_map),
            None if plan is None else tuple(_signature(t) for t in (plan.host_rows, plan.device_rows, plan.counts)),
            None if counters is None else _signature(counters), _signature(state), _signature(num_real),
            None if buffer_sizes is None else _signature(buffer_sizes))


def _bind_memoized(key: tuple, static: _Static, B: int, top_k: int, num_real: torch.Tensor,
                   stage_clock: Union[bool, str]) -> _BoundLayer:
    """Bind a validated layer (:func:`_bind`: builds the kernel module on first use) and remember it
    under ``key`` in ``_static_checked`` (emptied first when it holds ``_STATIC_MEMO_SIZE``)."""
    layer = _bind(static, B, top_k, num_real, stage_clock)
    if len(_static_checked) >= _STATIC_MEMO_SIZE:
        _static_checked.clear()
    _static_checked[key] = layer
    return layer


BOUND_BYTES = 512
"""Size of a bound layer's parameter tensor (``kBoundBytes`` in ``kernels/resolve.cuh``)."""


def bind_resolve_cuda(
    *, top_k: int, num_real_reqs: torch.Tensor, workspace: ResolveWorkspace, device_buffer_size: int,
    resident: Optional[torch.Tensor] = None, req_to_token: Optional[torch.Tensor] = None,
    logical_to_device: Optional[torch.Tensor] = None, slot_history: Optional[torch.Tensor] = None,
    reuse_levels: Optional[torch.Tensor] = None, **static: Any,
) -> Callable[..., None]:
    """Validate one layer's unchanging arguments once (keywords of :func:`resolve_cuda` other than
    the batch's) and return ``resolve(top_k_positions, seq_lens, req_pool_indices, out)``.

    The kernel module's ``bind`` entry point checks the same arguments again in C++ and writes the
    launch parameters into a small CPU byte tensor; each call then passes that tensor and the four
    batch tensors to ``launch``, which checks only the batch (shape, dtype, device, the workspace's
    capacity) and launches. ``num_real_reqs`` must be the int32 device tensor the caller updates
    (CUDA graphs). The bound tensors stay referenced by the returned function, so their addresses
    stay valid. The kernel module is looked up here, once: build it first (:func:`warmup_build`).
    A bad batch raises ValueError (the kernel's message, which names the tensor)."""
    residency = residency_tables(resident, req_to_token, logical_to_device)
    reuse = policy_tables(slot_history, reuse_levels)
    _check(isinstance(num_real_reqs, torch.Tensor), "a bound resolver needs num_real_reqs as a device tensor")
    n_real = _num_real_tensor(num_real_reqs, workspace.resolve_num_real)
    fixed = _validate_static(device_buffer_size=device_buffer_size, top_k=top_k, residency=residency, reuse=reuse,
                             workspace=workspace, **static)
    layer = _bind(fixed, int(device_buffer_size), top_k, n_real)
    launch, params = layer.launch, layer.params

    def resolve(top_k_positions: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                out: torch.Tensor) -> None:
        try:
            launch(params, top_k_positions, seq_lens, req_pool_indices, out)
        except Exception as e:  # noqa: BLE001 - only the kernel's own checks become ValueError
            raise _as_value_error(e) from None

    resolve.launch_params = params  # what bind wrote (read it, do not change it)
    resolve.bound_tensors = layer  # keeps the addresses written into `params` valid
    return resolve


def _kernel_checked(fn, *args) -> None:
    """Call a kernel entry point; its argument checks (messages starting ``hisparse:``) raise
    ValueError, anything else (a CUDA error) propagates unchanged."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        raise _as_value_error(e) from None


def _as_value_error(e: Exception) -> Exception:
    message = str(e)
    at = message.find("hisparse: ")
    if at < 0:
        return e
    return ValueError(message[at + len("hisparse: "):].strip().splitlines()[0])


def read_stage_clock(workspace: ResolveWorkspace) -> dict[str, float]:
    """Stage durations of CTA 0 in the last ``stage_clock=True`` launch (synchronises).

    Returns cycles between the planner's stage boundaries (``scalars`` .. ``finish``) and
    globaltimer nanoseconds from the planner's start (``copier0_*``: 0 when no copier ran).
    Side effect: zeroes the stamps, so the next launch's absent stamps read 0."""
    region = workspace.state[STATE_CLOCK : STATE_CLOCK + 2 * STAGE_CLOCK_STAMPS]
    raw = region.cpu().view(torch.int64).tolist()
    region.zero_()
    out = {f"cycles_{n}": float(raw[k + 1] - raw[k]) for k, n in enumerate(STAGE_CLOCK_STAGES)}
    out["cycles_total"] = float(raw[8] - raw[0])
    out["ns_planner"] = float(raw[11] - raw[9])
    out["ns_copier0_acquired"] = float(raw[10] - raw[9]) if raw[10] else 0.0
    out["ns_copier0_done"] = float(raw[12] - raw[9]) if raw[12] else 0.0
    return out


def replay_plan_cuda(
    *,
    plan: MissPlan,
    num_real_reqs: Union[int, torch.Tensor],
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    workspace: ResolveWorkspace,
    block_size: Optional[int] = None,
    num_ctas: Optional[int] = None,
    compress_ratio: int = 1,
) -> None:
    """Copy-only replay of a miss plan on another layer's buffers (semantics:
    :func:`reference.replay_plan_reference`). Few CTAs (default 8 of 512 threads) so that it can
    overlap compute on another stream; it shares only the error word of the workspace.

    Side effects: writes ``device_kv`` rows ``plan.device_rows[i, :counts[i]]`` for real rows.
    Buffers as for :func:`resolve_cuda` (tensors, or ``C4PagedRows`` views with ``compress_ratio=4``).
    """
    block = check_block_size(DEFAULT_REPLAY_BLOCK if block_size is None else int(block_size))
    ctas = DEFAULT_REPLAY_CTAS if num_ctas is None else int(num_ctas)
    host_kv, device_kv, row_bytes = kv_buffers(host_kv, device_kv, compress_ratio)
    key = ("replay", block, ctas, workspace.device, _signature(plan.host_rows), _signature(plan.device_rows),
           _signature(plan.counts), _signature(host_kv), _signature(device_kv))
    item_bytes = _static_checked.get(key)
    if item_bytes is None:
        item_bytes = _check_replay(plan, host_kv, device_kv, workspace.device, ctas, row_bytes)
        if len(_static_checked) >= _STATIC_MEMO_SIZE:
            _static_checked.clear()
        _static_checked[key] = item_bytes
    if plan.counts.numel() == 0:
        return
    n_real = _num_real_tensor(num_real_reqs, workspace.replay_num_real)
    jit.replay_module(item_bytes).replay(
        plan.host_rows, plan.device_rows, plan.counts, n_real, host_kv, device_kv, workspace.state, block, ctas
    )


def _check_replay(plan: MissPlan, host_kv: torch.Tensor, device_kv: torch.Tensor, device: torch.device,
                  ctas: int, item_bytes: int) -> int:
    """The checks of replay_plan_cuda's arguments (buffers and row bytes: :func:`kv_buffers`);
    returns the KV row bytes."""
    _check(1 <= ctas <= 65535, f"num_ctas must be in [1, 65535], got {ctas}")
    _check(plan.counts.device == device and plan.host_rows.device == device and plan.device_rows.device == device,
           f"plan tensors must be on {device}")
    _check(plan.host_rows.dtype == torch.int64 and plan.device_rows.dtype == torch.int32
           and plan.counts.dtype == torch.int32, "plan tensors must be int64 / int32 / int32")
    _check(device_kv.device == device, f"device_kv must be on {device}")
    _check(host_kv.dtype == device_kv.dtype, "host_kv and device_kv must have one dtype")
    _check(kv_item_bytes(host_kv) == kv_item_bytes(device_kv), "host_kv and device_kv rows differ in size")
    check_row_bytes(item_bytes)
    _check_host_kv(host_kv)
    _check_rows_kv(host_kv, "host_kv")
    _check_rows_kv(device_kv, "device_kv")
    return item_bytes


def warmup_build(item_bytes: int, device_buffer_size: int, top_k: int, block_size: int, reuse: bool = False) -> None:
    """Build (or load from the JIT cache) every kernel a server with this configuration uses:
    resolve with and without IO (``reuse``: the reuse-table policy's module, else LRU's) and the
    plan replay, concurrently; then, on a CUDA device, set their launch attributes for
    ``block_size``. Call at start-up, before CUDA-graph capture.
    """
    check_supported(item_bytes, device_buffer_size, top_k, reuse)
    check_block_size(block_size)
    logger.info(
        "sglang-hisparse: loading the resolve kernels (%d-byte rows, B=%d, top_k=%d, %s replacement); the first "
        "build on a machine runs nvcc (~20-60 s), later starts load them from the JIT cache",
        item_bytes, device_buffer_size, top_k, "reuse-table" if reuse else "LRU",
    )
    start = time.monotonic()
    resolve_mod, _ = jit.build_all(
        [
            lambda: jit.resolve_module(item_bytes, device_buffer_size, top_k, reuse=reuse),
            lambda: jit.replay_module(item_bytes),
        ]
    )
    if torch.cuda.is_available():
        resolve_mod.resolve_prepare(block_size)
    logger.info("sglang-hisparse: resolve kernels ready in %.1f s", time.monotonic() - start)
