"""Reference resolver: pure torch, any device. The oracle of the CUDA kernel.

One call resolves one layer for a batch: each request's selected logical positions become
device rows of its hot buffer, copying misses from host. Semantics (docs/design.md, "Resolver"):

For request ``i < num_real_reqs`` (rows at and beyond ``num_real_reqs`` are not touched), with
``L = seq_lens[i]``, ``r = req_pool_indices[i]`` and B = ``device_buffer_size``:

* A padding entry (``-1``) resolves to ``-1``.
* Resident request (``resident[r] != 0``; only when the residency tables are passed): its whole KV
  is on the device, position ``p`` at ``logical_to_device[req_to_token[r, p]]``. No IO, no table
  or LRU change, not counted. Checked before the fast path. With ``compress_ratio`` k > 1
  (DeepSeek-V4's C4 layers: positions are compressed entries of k tokens, ``seq_lens`` count
  entries) entry ``p``'s logical id is that of the token completing it,
  ``req_to_token[r, p * k + k - 1] // k``.
* Fast path, ``L <= B``: position ``p`` lives at slot ``p``: ``out = hot_locs[r, p]``. No IO, no
  table or LRU change.
* Otherwise the newest position ``L - 1`` resolves to the reserved newest slot B
  (``hot_locs[r, B]``); it is not in the slot table or the LRU.
* Any other selected position held by a slot ``s < B`` (``slot_tokens[r, s] == p``) is a hit:
  ``out = hot_locs[r, s]``.
* Misses, in top-k order, take the least recently used slots among those not hit this step:
  the j-th miss takes the j-th oldest such slot. Its host row ``host_locs[r, p]`` is copied into
  device row ``hot_locs[r, s]`` and ``slot_tokens[r, s] = p``.
* New LRU order (oldest first): the remaining evictable slots in their previous order, then this
  step's miss slots in top-k order, then this step's hit slots in their previous order.

Replacement policy. The above is LRU, the default. With ``slot_history`` and ``reuse_levels``
passed (both or neither) the history-only reuse table (``replacement: "reuse"``;
``sglang_hisparse/resolver/reuse.py``) chooses the victims; only long-path requests (not
resident, ``L > B``) are affected, resident and fast-path requests and padding rows are not:

* ``slot_history`` (int16 [max_reqs, B], updated in place) packs per slot ``age | (count << 8)``:
  age = low byte (0..255), count = high byte (0..127). ``reuse_levels`` (uint8 [54], any device)
  is the eviction level of each history cell ``age_bucket * 6 + count_bucket`` (lower = evicted
  first).
* Each slot's cell: ``a = (hist & 0xff) + 1`` (steps since last selected), ``c = hist >> 8``;
  ``age_bucket = searchsorted(AGE_EDGES, min(a, 129), side="left")`` (0..8), ``count_bucket =
  searchsorted(COUNT_EDGES, min(c, 32), side="left")`` (0..5); its level is
  ``reuse_levels[age_bucket * 6 + count_bucket]``.
* The evictable slots (not hit this step) are ordered by (level, position in the old LRU order);
  the first M (M = number of misses) are the victims. The m-th miss in top-k order takes the m-th
  victim in old LRU order (not in level order).
* New LRU order: the evictable slots that are not victims in their old order, then the victims in
  old LRU order (= miss order), then the hit slots in their old order.
* History update: a hit slot gets age 0 and count ``min(count + 1, 127)``; a victim slot age 0 and
  count 1; every other slot ``min(age + 1, 255)`` and its count unchanged.
* With all levels equal the result is exactly LRU's (outputs, tables, copies, plan, counters),
  plus the history update. Copies, plan and counters are as for LRU.

Position -> slot map (``slot_map``, optional; ``slot_map: true`` in the config): int16
[max_reqs, >= max_context], a hint the CUDA kernel plans with instead of a hash table of the
selections. It does not change any result above. Its invariant, kept by every writer: a slot
``s`` holding position ``p >= 0`` (``slot_tokens[r, s] == p``) has ``slot_map[r, p] == s``;
entries of positions no slot holds are stale and never read as hits (the kernel checks the
slot's token). The resolver keeps it by writing each miss's entry: ``slot_map[r, p] = s``.

Per-request buffer sizes (``buffer_sizes``, optional; int32 [max_reqs]): request slot ``r`` uses
only the slots ``s < S = buffer_sizes[r]`` (``0 <= S <= B``; without the table ``S = B`` for every
request), so that buffers of different sizes share one table layout. Everything above holds with
``S`` in place of B, except that the newest position keeps slot B (``hot_locs[r, B]``): the fast
path is ``L <= S``; a slot ``s >= S`` is neither a hit (its token is ignored) nor evictable, and
keeps its place among the hit slots in the new LRU order (hit slots and such slots, in their
previous order, after the victims). Precondition: ``S >=`` the number of non-newest selections.

Row layout. ``host_kv`` and ``device_kv`` are tensors of linear rows (row ``g`` = ``kv[g]``) or
row views (``resolver/c4_rows.py``: ``C4PagedRows`` for DeepSeek-V4's paged C4 buffers); a copy
moves a row's bytes whatever the layout.

Preconditions: selected positions of a request are distinct and in ``[-1, L)``; B >= the number
of non-newest selections. Tensors are updated in place; the function allocates only temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from sglang_hisparse.resolver.c4_rows import copy_rows, row_view
from sglang_hisparse.resolver.reuse import policy_tables, slot_levels, updated_history


@dataclass
class ResolveStats:
    """What one call did (host-side numbers; the reference computes them eagerly)."""

    selected: int = 0
    """Selected entries of long-path requests, newest excluded."""
    misses: int = 0
    copied_bytes: int = 0


@dataclass
class MissPlan:
    """The copies a resolve performed, for replay on another layer (IndexShare prefetch).

    ``host_rows[i, :counts[i]]`` were copied into ``device_rows[i, :counts[i]]`` for request i,
    in top-k order. Rows are layer independent (host row and hot-buffer device row of the
    request). Only rows ``i < num_real_reqs`` are written.
    """

    host_rows: torch.Tensor  # int64 [max_reqs, top_k]
    device_rows: torch.Tensor  # int32 [max_reqs, top_k]
    counts: torch.Tensor  # int32 [max_reqs]


def resolve_reference(
    *, top_k_positions: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
    hot_locs: torch.Tensor, slot_tokens: torch.Tensor, lru: torch.Tensor, host_locs: torch.Tensor,
    host_kv: torch.Tensor, device_kv: torch.Tensor, out: torch.Tensor,
    num_real_reqs: Union[int, torch.Tensor], device_buffer_size: int, skip_io: bool = False,
    plan: Optional[MissPlan] = None, counters: Optional[torch.Tensor] = None,
    resident: Optional[torch.Tensor] = None, req_to_token: Optional[torch.Tensor] = None,
    logical_to_device: Optional[torch.Tensor] = None,
    slot_history: Optional[torch.Tensor] = None, reuse_levels: Optional[torch.Tensor] = None,
    slot_map: Optional[torch.Tensor] = None, compress_ratio: int = 1,
    buffer_sizes: Optional[torch.Tensor] = None,
) -> ResolveStats:
    """Resolve one layer for a batch (see module docstring).

    Args:
        top_k_positions: int [num_reqs, top_k] logical positions, -1 = padding.
        seq_lens: int [num_reqs] lengths including the newest token.
        req_pool_indices: int [num_reqs] rows of the per-request tables.
        hot_locs: int [max_reqs, >= B + 1] device row of each hot-buffer slot.
        slot_tokens: int32 [max_reqs, B] this layer's position held by each slot (-1 = none).
            Updated in place.
        lru: int16 [max_reqs, B] this layer's slots, least recently used first. Updated in place.
        host_locs: int64 [max_reqs, max_context] host row of each position.
        host_kv: [host_rows, ...] this layer's host KV.
        device_kv: [device_rows, ...] this layer's device KV; miss rows are written.
        out: int32 [>= num_reqs, top_k] receives device rows; rows >= num_real_reqs untouched.
        num_real_reqs: rows of the batch that are real (CUDA-graph padding follows them); an int
            or an int32 [1] tensor.
        device_buffer_size: B.
        skip_io: plan and update tables but copy no bytes (timing oracle).
        plan: when given, records each request's copies (host row, device row) in top-k order.
        counters: when given, an int64 [2] tensor incremented by (selected, misses).
        resident: bool or uint8 [max_reqs], nonzero where the request slot is resident; with
            ``req_to_token`` (int32 [max_reqs, max_context], SGLang's position -> logical id
            table) and ``logical_to_device`` (int64, logical id -> device row). All three or none.
        slot_history: int16 [max_reqs, B] this layer's packed per-slot history (reuse policy);
            updated in place. With ``reuse_levels`` (uint8 [54]); both or neither (LRU).
        reuse_levels: uint8 [54] eviction level of each history cell (reuse policy).
        slot_map: int16 [max_reqs, >= max_context] this layer's position -> slot map (module
            docstring); each miss's entry is written.
        compress_ratio: tokens per position (1: DSA; 4: DeepSeek-V4's C4 entries; module docstring).
        buffer_sizes: int32 [max_reqs] slots each request uses (module docstring); None: B.
    """
    host_kv, device_kv = row_view(host_kv), row_view(device_kv)
    layer = _Layer.checked(hot_locs, slot_tokens, lru, host_locs, device_buffer_size,
                           residency_tables(resident, req_to_token, logical_to_device), slot_history, reuse_levels,
                           slot_map, compress_ratio, buffer_sizes)
    stats = ResolveStats()
    for i in range(real_count(num_real_reqs)):
        r, seq_len = int(req_pool_indices[i]), int(seq_lens[i])
        result, copies, selected = _resolve_one(layer, r, seq_len, top_k_positions[i].tolist())
        stats.selected += selected
        _copy_misses(i, copies, host_kv, device_kv, skip_io, plan)
        stats.misses += len(copies)
        stats.copied_bytes += 0 if skip_io else len(copies) * device_kv.row_bytes
        out[i].copy_(torch.tensor(result, dtype=out.dtype))
    if counters is not None:
        counters += torch.tensor([stats.selected, stats.misses], dtype=counters.dtype, device=counters.device)
    return stats


def real_count(num_real_reqs: Union[int, torch.Tensor]) -> int:
    """The number of real rows, given as an int or as an int32 [1] tensor (CUDA graphs)."""
    if isinstance(num_real_reqs, torch.Tensor):
        return int(num_real_reqs.reshape(-1)[0])
    return int(num_real_reqs)


def check_compress_ratio(compress_ratio: int) -> None:
    """Raise ValueError unless ``compress_ratio`` is a power of two >= 1 (the kernel shifts by it)."""
    if not isinstance(compress_ratio, int) or compress_ratio < 1 or compress_ratio & (compress_ratio - 1):
        raise ValueError(f"compress_ratio must be a power of two >= 1 (1: DSA, 4: DeepSeek-V4 C4), got {compress_ratio!r}")


def checked_buffer_sizes(buffer_sizes: torch.Tensor, B: int) -> list[int]:
    """``buffer_sizes`` as a list (reads it to the host); raises ValueError for a size outside
    ``[0, B]`` (where the kernel counts an error)."""
    sizes = buffer_sizes.tolist()
    bad = [(r, size) for r, size in enumerate(sizes) if not 0 <= size <= B]
    if bad:
        raise ValueError(f"buffer_sizes must lie in [0, B = {B}]; rows {bad[:4]} do not")
    return sizes


def entry_token_columns(positions: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """``req_to_token`` column of the token completing each position's entry: ``p * k + k - 1``
    (``p`` itself for k = 1). Pure."""
    return positions * compress_ratio + (compress_ratio - 1)


def residency_tables(resident, req_to_token, logical_to_device):
    """The residency tables, or None when none is passed (raises ValueError for a partial set)."""
    given = [t is not None for t in (resident, req_to_token, logical_to_device)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("resident, req_to_token and logical_to_device are passed together or not at all")
    return resident, req_to_token, logical_to_device


@dataclass(frozen=True)
class _Layer:
    """One call's per-layer tables (the keywords of :func:`resolve_reference`), for the per-request
    helpers. ``B``: ``device_buffer_size``; ``residency``: ``(resident, req_to_token,
    logical_to_device)`` or None; ``levels``: ``reuse_levels`` on the CPU, or None (LRU);
    ``ratio``: ``compress_ratio``; ``sizes``: ``buffer_sizes`` as a list, or None (B each)."""

    hot_locs: torch.Tensor
    slot_tokens: torch.Tensor
    lru: torch.Tensor
    host_locs: torch.Tensor
    B: int
    residency: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    slot_history: Optional[torch.Tensor]
    levels: Optional[torch.Tensor]
    slot_map: Optional[torch.Tensor]
    ratio: int = 1
    sizes: Optional[list[int]] = None

    @classmethod
    def checked(cls, hot_locs, slot_tokens, lru, host_locs, B: int, residency, slot_history, reuse_levels, slot_map,
                ratio: int, buffer_sizes) -> "_Layer":
        """The layer of :func:`resolve_reference`'s keywords, after their checks (ValueError)."""
        policy = policy_tables(slot_history, reuse_levels)
        levels = None if policy is None else reuse_levels.to("cpu")
        check_compress_ratio(ratio)
        sizes = None if buffer_sizes is None else checked_buffer_sizes(buffer_sizes, B)
        return cls(hot_locs, slot_tokens, lru, host_locs, B, residency, slot_history, levels, slot_map, ratio, sizes)

    def size_of(self, r: int) -> int:
        """The slots request slot ``r`` uses."""
        return self.B if self.sizes is None else self.sizes[r]


def _resolve_one(layer: _Layer, r: int, seq_len: int, positions: list[int]
                 ) -> tuple[list[int], list[tuple[int, int]], int]:
    """Request slot ``r``'s device rows in top-k order, the copies its misses need and how many
    positions it counts as selected, by its path (module docstring): resident (its own rows) and
    fast path (slot p) copy, count and write nothing; the long path is :func:`_resolve_request`."""
    if layer.residency is not None and bool(layer.residency[0][r]):  # whole KV on device: its own rows
        _, req_to_token, logical_to_device = layer.residency
        columns = entry_token_columns(torch.arange(seq_len), layer.ratio)
        rows = logical_to_device[req_to_token[r, columns].long() // layer.ratio].tolist()
        return [int(rows[p]) if p >= 0 else -1 for p in positions], [], 0
    if seq_len <= layer.size_of(r):  # fast path: position p sits in slot p
        return [int(layer.hot_locs[r, p]) if p >= 0 else -1 for p in positions], [], 0
    return _resolve_request(layer, r, seq_len, positions)


def _copy_misses(i: int, copies: list[tuple[int, int]], host_kv, device_kv, skip_io: bool,
                 plan: Optional[MissPlan]) -> None:
    """Batch row ``i``'s miss copies ``(host row, device row)``, in top-k order: copied from
    ``host_kv`` into ``device_kv`` (row views; unless ``skip_io``) and, with a ``plan``, recorded in
    its row ``i`` (count and rows)."""
    if copies and not skip_io:
        host_rows, device_rows = zip(*copies)  # distinct victims: one copy, the same result as one by one
        copy_rows(host_kv, torch.tensor(host_rows), device_kv, torch.tensor(device_rows))
    if plan is not None:
        plan.counts[i] = len(copies)
        for n, (host_row, device_row) in enumerate(copies):
            plan.host_rows[i, n] = host_row
            plan.device_rows[i, n] = device_row


def _resolve_request(layer: _Layer, r: int, seq_len: int, positions: list[int]
                     ) -> tuple[list[int], list[tuple[int, int]], int]:
    """One request past the fast path: its device rows in top-k order, the copies its misses need
    as (host row, device row) in top-k order, and how many positions were selected (the newest
    token and padding excluded). Updates the request's ``slot_tokens`` and ``lru`` rows, and with
    the reuse policy (``slot_history`` and the CPU ``levels``) its ``slot_history`` row, and with a
    ``slot_map`` the misses' entries of its row."""
    result, hit_slots, miss_js, selected = _lookup(layer, r, seq_len, positions)
    order = layer.lru[r].tolist()
    size = layer.size_of(r)
    evictable = [slot for slot in order if slot not in hit_slots and slot < size]
    assert len(miss_js) <= len(evictable), "more misses than evictable slots"
    victims, rest = _choose_victims(layer, r, evictable, len(miss_js))
    copies = _fill_victims(layer, r, positions, miss_js, victims, result)
    new_order = rest + victims + [slot for slot in order if slot in hit_slots or slot >= size]
    _update_recency(layer, r, new_order, hit_slots, victims)
    return result, copies, selected


def _lookup(layer: _Layer, r: int, seq_len: int, positions: list[int]
            ) -> tuple[list[int], set[int], list[int], int]:
    """Lookup stage: each selection of request slot ``r`` against its slot table. Returns the
    result row (the newest token's reserved slot B and the hits filled in, -1 elsewhere), the
    hit slots, the top-k indices of the misses and the number of selected positions (the newest
    token and padding excluded). Reads only."""
    result = [-1] * len(positions)
    tokens = layer.slot_tokens[r, : layer.size_of(r)].tolist()  # slots beyond the size hold nothing
    slot_of = {tok: slot for slot, tok in enumerate(tokens) if tok >= 0}
    hit_slots: set[int] = set()
    miss_js: list[int] = []
    selected = 0
    for j, p in enumerate(positions):
        if p < 0:
            continue
        if p == seq_len - 1:  # the newest token: its reserved slot B
            result[j] = int(layer.hot_locs[r, layer.B])
            continue
        selected += 1
        slot = slot_of.get(p)
        if slot is None:
            miss_js.append(j)
        else:
            hit_slots.add(slot)
            result[j] = int(layer.hot_locs[r, slot])
    return result, hit_slots, miss_js, selected


def _choose_victims(layer: _Layer, r: int, evictable: list[int], misses: int) -> tuple[list[int], list[int]]:
    """Eviction choice: the ``misses`` victims among ``evictable`` (request slot ``r``'s slots not
    hit this step, in old LRU order) and the rest, both in old LRU order. LRU: the oldest; reuse
    policy: lowest (level, old LRU position) first. Reads only."""
    if layer.slot_history is None:
        return evictable[:misses], evictable[misses:]
    level = slot_levels(layer.slot_history[r].cpu(), layer.levels).tolist()
    chosen = set(sorted(range(len(evictable)), key=lambda n: (level[evictable[n]], n))[:misses])
    victims = [slot for n, slot in enumerate(evictable) if n in chosen]
    rest = [slot for n, slot in enumerate(evictable) if n not in chosen]
    return victims, rest


def _fill_victims(layer: _Layer, r: int, positions: list[int], miss_js: list[int], victims: list[int],
                  result: list[int]) -> list[tuple[int, int]]:
    """Miss stage: the j-th miss (top-k index ``miss_js[j]``) takes victim slot ``victims[j]``.
    Writes request slot ``r``'s ``slot_tokens`` entries (and ``slot_map`` entries, when given) and
    the misses' ``result`` entries; returns the copies (host row, device row) in top-k order."""
    copies = []
    for j, slot in zip(miss_js, victims):
        device_row = int(layer.hot_locs[r, slot])
        copies.append((int(layer.host_locs[r, positions[j]]), device_row))
        layer.slot_tokens[r, slot] = positions[j]
        if layer.slot_map is not None:
            layer.slot_map[r, positions[j]] = slot
        result[j] = device_row
    return copies


def _update_recency(layer: _Layer, r: int, new_order: list[int], hit_slots: set[int], victims: list[int]) -> None:
    """Table update: writes request slot ``r``'s ``lru`` row (``new_order``) and, with the reuse
    policy, its ``slot_history`` row (hits and victims selected now, the others one step older)."""
    layer.lru[r].copy_(torch.tensor(new_order, dtype=layer.lru.dtype))
    if layer.slot_history is not None:
        hit = torch.zeros(layer.B, dtype=torch.bool)
        hit[torch.tensor(sorted(hit_slots), dtype=torch.long)] = True
        victim = torch.zeros(layer.B, dtype=torch.bool)
        victim[torch.tensor(victims, dtype=torch.long)] = True
        layer.slot_history[r].copy_(updated_history(layer.slot_history[r].cpu(), hit, victim))


def replay_plan_reference(
    *, plan: MissPlan, num_real_reqs: Union[int, torch.Tensor], host_kv, device_kv
) -> int:
    """Copy-only replay of a miss plan on another layer's buffers (``num_real_reqs``: an int or
    an int32 [1] tensor, as for the resolve; buffers: tensors or row views). Returns bytes copied."""
    host_kv, device_kv = row_view(host_kv), row_view(device_kv)
    copied = 0
    for i in range(real_count(num_real_reqs)):
        n = int(plan.counts[i])
        if n == 0:
            continue
        copied += copy_rows(host_kv, plan.host_rows[i, :n], device_kv, plan.device_rows[i, :n])
    return copied
