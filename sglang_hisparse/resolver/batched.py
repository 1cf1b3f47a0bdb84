"""Batched reference resolver: the semantics of ``reference.py`` with whole-batch torch ops.

Same keywords and effects as :func:`reference.resolve_reference`, computed for all requests at
once (sorts, cumulative sums, gathers and scatters instead of per-request Python loops), so that
it runs on the GPU in a few milliseconds at batch 128 and top_k 2048. It is the oracle of the GPU
kernel tests; ``tests/test_resolver_batched.py`` checks it against the loop reference.

Extra precondition (true of every SGLang batch): the real rows' ``req_pool_indices`` are
distinct, so per-request updates do not interact. ``host_kv`` may live on any device (a device
mirror of the pinned host pool makes the GPU tests fast). Returns nothing; ``counters`` carries
(selected, misses) as in the kernel.

Resident requests (``resident[r] != 0``) take their rows from
``logical_to_device[req_to_token[r, p]]`` and are left out of the fast and long paths (tables,
plan rows and counters untouched; plan count 0). Where the kernel counts an error on such a row
(a position at or beyond ``seq_len`` or ``req_to_token``'s columns, a logical id outside
``logical_to_device``) this oracle writes -1, as the kernel does.

With ``slot_history`` and ``reuse_levels`` (the reuse policy, see ``reference.py``) the victims
are the evictable slots of lowest ``level * (B + 1) + LRU position``, taken in LRU order, and the
long rows' history is updated; everything is batched as for LRU. With ``slot_map`` (the
position -> slot map, see ``reference.py``) each miss's entry is written. ``compress_ratio`` and
row views (DeepSeek-V4's paged C4 buffers) are as in ``reference.py``, and so are
``buffer_sizes`` (each request's slots in use: the fast path is ``L <= S``; slots ``>= S`` are
masked out of the lookup and the eviction choice).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from sglang_hisparse.resolver.reuse import policy_tables, slot_levels, updated_history
from sglang_hisparse.resolver.c4_rows import copy_rows, row_view
from sglang_hisparse.resolver.reference import (
    MissPlan,
    check_compress_ratio,
    entry_token_columns,
    real_count,
    residency_tables,
)


def resolve_batched(
    *, top_k_positions: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
    hot_locs: torch.Tensor, slot_tokens: torch.Tensor, lru: torch.Tensor, host_locs: torch.Tensor,
    host_kv, device_kv, out: torch.Tensor,
    num_real_reqs: Union[int, torch.Tensor], device_buffer_size: int, skip_io: bool = False,
    plan: Optional[MissPlan] = None, counters: Optional[torch.Tensor] = None,
    resident: Optional[torch.Tensor] = None, req_to_token: Optional[torch.Tensor] = None,
    logical_to_device: Optional[torch.Tensor] = None,
    slot_history: Optional[torch.Tensor] = None, reuse_levels: Optional[torch.Tensor] = None,
    slot_map: Optional[torch.Tensor] = None, compress_ratio: int = 1,
    buffer_sizes: Optional[torch.Tensor] = None,
) -> None:
    """Resolve one layer for a batch (see ``reference.py``); updates tensors in place.

    Raises AssertionError where the reference would (more misses than evictable slots), and when
    the real rows' ``req_pool_indices`` are not distinct; ValueError for a partial set of the
    residency tables (``resident``, ``req_to_token``, ``logical_to_device``: all three or none)
    or of the policy tables (``slot_history``, ``reuse_levels``: both or neither); ValueError for
    a buffer size outside [0, B] among the real rows' (reads them: a host sync).
    """
    residency = residency_tables(resident, req_to_token, logical_to_device)
    policy = policy_tables(slot_history, reuse_levels)
    check_compress_ratio(compress_ratio)
    host_kv, device_kv = row_view(host_kv), row_view(device_kv)
    n = real_count(num_real_reqs)
    if n <= 0:
        return
    B = int(device_buffer_size)
    dev = top_k_positions.device
    pos = top_k_positions[:n].long()  # [n, K]
    L = seq_lens[:n].long().to(dev)
    r = req_pool_indices[:n].long().to(dev)
    assert torch.unique(r).numel() == n, "batched reference needs distinct req_pool_indices"

    hot = hot_locs.index_select(0, r).long()  # [n, W]
    size = _row_sizes(buffer_sizes, r, B)  # [n] slots each row uses
    res, result = _resident_results(pos, L, r, residency, compress_ratio)
    short = (L <= size) & ~res  # fast path rows
    longr = ~short & ~res
    result = torch.where(short[:, None], _fast_results(pos, hot), result)

    history = None if policy is None else slot_history.index_select(0, r.to(slot_history.device)).to(dev)  # [n, B]
    long_rows = _plan_long_rows(pos, L, r, longr, hot, slot_tokens, lru, B, history, reuse_levels, size)
    result = _long_results(long_rows, pos, hot, longr, B, result)

    _write_misses(long_rows.miss, pos, long_rows.victim, long_rows.dev_row, r, host_locs=host_locs,
                  host_kv=host_kv, device_kv=device_kv, slot_tokens=slot_tokens, skip_io=skip_io,
                  plan_rows=None if plan is None else (plan, long_rows.miss_rank), slot_map=slot_map)
    _update_long_rows(long_rows, r, longr, lru, slot_history, history)
    out[:n] = result.to(out.dtype)
    if plan is not None:
        plan.counts[:n] = torch.where(longr, long_rows.M, 0).to(plan.counts.dtype)
    if counters is not None:
        counters += torch.stack([long_rows.valid.sum(), long_rows.M.sum()]).to(counters.device, counters.dtype)


class _LongRows(NamedTuple):
    """The long path's lookup and eviction choice for the batch ([n, K], one entry per selection,
    unless noted; meaningful on long rows only)."""

    newest: torch.Tensor  # the selection is the newest position L - 1
    valid: torch.Tensor  # a counted selection of a long row (not padding, not the newest)
    found: torch.Tensor  # valid and held by a slot
    hit_slot: torch.Tensor  # the slot holding it (-1 if none)
    slot_hit: torch.Tensor  # [n, B] the slot is hit by some selection
    miss: torch.Tensor  # valid and not held
    miss_rank: torch.Tensor  # rank among the row's misses, top-k order
    M: torch.Tensor  # [n] misses per row
    victim: torch.Tensor  # the victim slot each miss takes
    new_order: torch.Tensor  # [n, B] the new recency order, oldest first
    dev_row: torch.Tensor  # the victim slot's device row


def _row_sizes(buffer_sizes: Optional[torch.Tensor], r: torch.Tensor, B: int) -> torch.Tensor:
    """The slots each batch row uses ([n] int64 on ``r``'s device): ``buffer_sizes[r]``, or B
    without the table. Raises ValueError for a size outside [0, B] (a host sync)."""
    if buffer_sizes is None:
        return torch.full_like(r, B)
    size = buffer_sizes.index_select(0, r.to(buffer_sizes.device)).long().to(r.device)
    if bool(((size < 0) | (size > B)).any()):
        raise ValueError(f"buffer_sizes must lie in [0, B = {B}]; got {size.tolist()[:8]} for the batch's rows")
    return size


def _resident_results(pos: torch.Tensor, L: torch.Tensor, r: torch.Tensor, residency: Optional[tuple],
                      ratio: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows are resident ([n] bool) and the result so far ([n, K] int64): resident rows'
    own device rows, -1 elsewhere (all -1 without the residency tables). Reads only."""
    n, K = pos.shape
    if residency is None:
        res = torch.zeros(n, dtype=torch.bool, device=pos.device)
        return res, torch.full((n, K), -1, dtype=torch.long, device=pos.device)
    resident, req_to_token, logical_to_device = residency
    res = resident.index_select(0, r.to(resident.device)).to(pos.device) != 0
    return res, torch.where(res[:, None], _resident_rows(pos, L, r, req_to_token, logical_to_device, ratio), -1)


def _fast_results(pos: torch.Tensor, hot: torch.Tensor) -> torch.Tensor:
    """Fast path: position p lives at slot p (``hot``: the rows' hot_locs); -1 for padding."""
    return torch.where(pos >= 0, hot.gather(1, pos.clamp(0, hot.shape[1] - 1)), -1)


def _plan_long_rows(pos: torch.Tensor, L: torch.Tensor, r: torch.Tensor, longr: torch.Tensor, hot: torch.Tensor,
                    slot_tokens: torch.Tensor, lru: torch.Tensor, B: int, history: Optional[torch.Tensor],
                    reuse_levels: Optional[torch.Tensor], size: torch.Tensor) -> _LongRows:
    """Lookup and eviction choice of the long rows (``longr``): hits against their slot tables
    (the slots below each row's ``size``), misses ranked in top-k order, victims by LRU or, with
    ``history`` (the rows' ``slot_history``), by the reuse levels. Reads only."""
    newest = pos == (L - 1)[:, None]
    valid = (pos >= 0) & ~newest & longr[:, None]
    backed = torch.arange(B, device=pos.device)[None, :] < size[:, None]  # [n, B] slots in use
    tokens = torch.where(backed, slot_tokens.index_select(0, r).long(), -1)  # [n, B]
    order = lru.index_select(0, r).long()  # [n, B], oldest first
    found, hit_slot, slot_hit = _find_hits(pos, valid, tokens, B)
    miss = valid & ~found
    miss_rank = miss.long().cumsum(1) - 1  # rank among misses, top-k order
    M = miss.sum(1)  # [n]
    level = None if history is None else slot_levels(history, reuse_levels)
    kept = slot_hit | ~backed  # neither evictable: hit this step, or beyond the row's size
    victim, new_order = _choose_victims(order, kept, miss_rank, M, pos.shape[1], level)
    dev_row = hot.gather(1, victim.clamp(min=0))
    return _LongRows(newest, valid, found, hit_slot, slot_hit, miss, miss_rank, M, victim, new_order, dev_row)


def _long_results(long_rows: _LongRows, pos: torch.Tensor, hot: torch.Tensor, longr: torch.Tensor, B: int,
                  result: torch.Tensor) -> torch.Tensor:
    """``result`` with the long rows' selections resolved: hits to their slot's row, misses to
    their victim's row, the newest position to the reserved slot B. Reads only."""
    n, K = pos.shape
    result = torch.where(long_rows.found, hot.gather(1, long_rows.hit_slot.clamp(min=0)), result)
    result = torch.where(long_rows.miss, long_rows.dev_row, result)
    return torch.where(long_rows.newest & longr[:, None], hot[:, B : B + 1].expand(n, K), result)


def _update_long_rows(long_rows: _LongRows, r: torch.Tensor, longr: torch.Tensor, lru: torch.Tensor,
                      slot_history: Optional[torch.Tensor], history: Optional[torch.Tensor]) -> None:
    """Table update of the long rows: writes their ``lru`` rows (the new order) and, with the
    reuse policy (``history``: their ``slot_history`` rows before the step), their history."""
    long_idx = longr.nonzero(as_tuple=True)[0]
    if long_idx.numel() == 0:
        return
    lru[r[long_idx]] = long_rows.new_order[long_idx].to(lru.dtype)
    if history is not None:
        victim_hits = torch.zeros_like(long_rows.slot_hit, dtype=torch.long)  # [n, B]
        victim_hits.scatter_add_(1, long_rows.victim.clamp(min=0), long_rows.miss.long())
        new_history = updated_history(history, long_rows.slot_hit, victim_hits > 0)
        rows = r[long_idx].to(slot_history.device)
        slot_history[rows] = new_history[long_idx].to(slot_history.device)


def _write_misses(miss: torch.Tensor, pos: torch.Tensor, victim: torch.Tensor, dev_row: torch.Tensor,
                  r: torch.Tensor, *, host_locs, host_kv, device_kv, slot_tokens, skip_io: bool,
                  plan_rows: Optional[tuple], slot_map: Optional[torch.Tensor] = None) -> None:
    """Every miss (``miss`` [n, K]) takes its victim slot: the slot table (and ``slot_map``, when
    given) learns the position, the
    host row is copied into the slot's device row (unless ``skip_io``), and ``plan_rows``
    ``(plan, miss_rank)`` records (host row, device row) at the miss's rank in top-k order."""
    mi, mj = miss.nonzero(as_tuple=True)
    if mi.numel() == 0:
        return
    m_pos, m_slot, m_dev = pos[mi, mj], victim[mi, mj], dev_row[mi, mj]
    m_host = host_locs[r[mi], m_pos]
    slot_tokens[r[mi], m_slot] = m_pos.to(slot_tokens.dtype)
    if slot_map is not None:
        slot_map[r[mi].to(slot_map.device), m_pos.to(slot_map.device)] = m_slot.to(slot_map.device, slot_map.dtype)
    if not skip_io:
        copy_rows(host_kv, m_host, device_kv, m_dev)
    if plan_rows is not None:
        plan, miss_rank = plan_rows
        m_rank = miss_rank[mi, mj]
        plan.host_rows[mi, m_rank] = m_host.to(plan.host_rows.dtype)
        plan.device_rows[mi, m_rank] = m_dev.to(plan.device_rows.dtype)


def _resident_rows(pos: torch.Tensor, L: torch.Tensor, r: torch.Tensor, req_to_token: torch.Tensor,
                   logical_to_device: torch.Tensor, ratio: int = 1) -> torch.Tensor:
    """Each selection's own device row, ``logical_to_device[req_to_token[r, c] // ratio]`` [n, K]
    (int64; ``c = q * ratio + ratio - 1``, the token completing entry ``q``), for every row as if
    it were resident; -1 for padding and wherever the kernel counts an error (``q >= seq_len``,
    ``c`` beyond ``req_to_token``'s columns, a logical id out of range). Reads only; indices are
    clamped so that garbage in non-resident rows cannot fault."""
    dev = pos.device
    cols = req_to_token.shape[1]
    n_logical = logical_to_device.shape[0]
    col = entry_token_columns(pos, ratio)
    ok = (pos >= 0) & (pos < L[:, None]) & (col < cols)
    rows = req_to_token.index_select(0, r.to(req_to_token.device))  # [n, cols]
    ids = rows.gather(1, col.clamp(0, max(cols - 1, 0)).to(rows.device)).long().to(dev) // ratio
    ok &= (ids >= 0) & (ids < n_logical)
    device_rows = logical_to_device.index_select(0, ids.clamp(0, max(n_logical - 1, 0)).reshape(-1).to(
        logical_to_device.device)).view(ids.shape).to(dev)
    return torch.where(ok, device_rows, -1)


def _find_hits(pos: torch.Tensor, valid: torch.Tensor, tokens: torch.Tensor, B: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which selected positions are in a slot: ``found`` [n, K], the slot of each (-1 if none)
    and ``slot_hit`` [n, B] (slot id -> hit by some selection). A position held twice counts at
    its last slot (stable sort + right search)."""
    n = pos.shape[0]
    sorted_tok, sort_idx = torch.sort(tokens, dim=1, stable=True)
    at = torch.searchsorted(sorted_tok, pos.contiguous(), right=True) - 1
    atc = at.clamp(min=0)
    found = valid & (at >= 0) & (sorted_tok.gather(1, atc) == pos)
    hit_slot = torch.where(found, sort_idx.gather(1, atc), -1)  # [n, K]
    hits_per_slot = torch.zeros((n, B), dtype=torch.long, device=pos.device)
    hits_per_slot.scatter_add_(1, hit_slot.clamp(min=0), found.long())
    return found, hit_slot, hits_per_slot > 0


def _choose_victims(order: torch.Tensor, kept: torch.Tensor, miss_rank: torch.Tensor, M: torch.Tensor, K: int,
                    level: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Victims of a row: its ``M`` least recently used slots that are not ``kept`` ([n, B] by
    slot id: hit this step or beyond the row's size) (LRU), or with ``level`` (int64 [n, B] per
    slot, the reuse policy) the ``M`` such slots of lowest (level, LRU position). Miss ``m`` takes
    the ``m``-th victim in LRU order. Returns each selection's victim slot [n, K] (meaningful where
    it missed) and the new recency order [n, B]: the evictable slots not taken, then the victims,
    then the kept slots, each group in its previous order."""
    n, B = order.shape
    ev = ~kept.gather(1, order)  # evictable, by LRU rank
    ev_l = ev.long()
    ev_before = ev_l.cumsum(1) - ev_l  # evictables strictly before each LRU rank
    E = ev_l.sum(1)
    assert bool((M <= E).all()), "more misses than evictable slots"
    q = torch.arange(B, device=order.device)[None, :]
    Mc, Ec = M[:, None], E[:, None]
    if level is None:
        take = ev & (ev_before < Mc)
    else:  # rank of each evictable LRU rank by (level, LRU rank); hit slots sort last
        key = torch.where(ev, level.gather(1, order) * (B + 1) + q, torch.iinfo(torch.int64).max)
        by_key = torch.argsort(key, dim=1, stable=True)
        key_rank = torch.empty_like(by_key).scatter_(1, by_key, q.expand(n, B).contiguous())
        take = ev & (key_rank < Mc)
    take_l = take.long()
    take_before = take_l.cumsum(1) - take_l  # victims strictly before each LRU rank
    new_pos = torch.where(ev, torch.where(take, Ec - Mc + take_before, ev_before - take_before),
                          Ec + (q - ev_before))
    new_order = torch.empty_like(order).scatter_(1, new_pos, order)
    # victim of miss m: the taken slot of LRU rank m among the taken (column K collects the rest)
    victims = torch.full((n, K + 1), -1, dtype=torch.long, device=order.device)
    victims.scatter_(1, torch.where(take, take_before, K), order)
    return victims.gather(1, miss_rank.clamp(min=0)), new_order


def replay_plan_batched(
    *, plan: MissPlan, num_real_reqs: Union[int, torch.Tensor], host_kv, device_kv
) -> None:
    """Copy-only replay of a miss plan (semantics of ``reference.replay_plan_reference``)."""
    n = real_count(num_real_reqs)
    if n <= 0:
        return
    counts = plan.counts[:n].long()
    width = plan.host_rows.shape[1]
    cols = torch.arange(width, device=counts.device)[None, :]
    mask = cols < counts[:, None]
    src = plan.host_rows[:n][mask]
    dst = plan.device_rows[:n][mask].long()
    if src.numel() == 0:
        return
    copy_rows(row_view(host_kv), src, row_view(device_kv), dst)
