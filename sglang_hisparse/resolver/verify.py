"""Resolving a speculative verify step: N query rows per request (docs/speculative.md).

With linear speculation (MTP / EAGLE, ``--speculative-eagle-topk 1``) a decode step verifies
N = draft steps + 1 tokens per request, and the indexer gives each of them its own top-k row:
``top_k_positions`` is ``[num_reqs * N, top_k]``, rows ``i * N .. i * N + N - 1`` belong to
request ``i``. This module defines their semantics on top of the one-row resolvers
(``reference.resolve_reference``, ``batched.resolve_batched``, the kernel), so that one
definition serves every implementation:

* ``seq_lens[i]`` = L, the request's committed length (SGLang's ``batch.seq_lens`` in a verify
  step). Token j of the window sits at position ``L + j`` in hot-buffer slot ``B + j``
  (``hot_locs`` has >= B + N columns); row j may select window positions ``L .. L + j``
  (causality) and resolves them to those slots, with no IO and no table change.
* The other selected positions (``0 <= p < L``) of the N rows form one **union** per request, in
  first-occurrence order (row 0's top-k order, then the new positions of row 1, ...). The union
  is resolved by the one-row resolver as a single top-k row of width ``N * top_k`` with
  ``seq_len = L + 1`` (so its newest position, L, is never in the union): the fast path when
  ``L + 1 <= B``, otherwise hits, misses, victims, copies, plan, counters and the replacement
  policy exactly as for one row. A position several rows select is looked up and copied once,
  and every row that selects it gets the same device row.
* Each row's output is then read from the union's: ``out[i * N + j, c]`` is the device row of
  ``top_k_positions[i * N + j, c]`` (-1 for padding).

With N = 1 and a long request (``L >= B``) this is the one-row resolver with ``seq_len = L + 1``
bit for bit (its newest position L is the window's slot B). For a short request the window
slots differ from the one-row fast path, where the newest position sits in slot L.

Preconditions (checked, ValueError): ``hot_locs`` has >= B + N columns; row j selects only
positions ``< L + j + 1``; positions within a row are distinct. The union must fit the buffer
(the one-row resolver's "more misses than evictable slots"); ``B >= N * top_k`` guarantees it.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from sglang_hisparse.resolver.reference import real_count


def resolve_verify(
    resolve_one_row: Callable[..., Any],
    *,
    top_k_positions: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    hot_locs: torch.Tensor,
    out: torch.Tensor,
    num_real_reqs: Union[int, torch.Tensor],
    device_buffer_size: int,
    query_rows: int,
    **tables: Any,
) -> None:
    """Resolve one layer of a verify step (module docstring) with ``resolve_one_row`` (a resolver
    taking the reference's keywords). ``tables``: the other keywords of the one-row resolver
    (slot tables, LRU, host locs, KV buffers, plan, counters, policy tables), passed through.

    Side effects: the one-row resolver's on the union (tables, copies, plan rows ``< num_real``,
    counters); ``out[: num_real * N]`` is written, rows beyond it are not touched.
    """
    n = real_count(num_real_reqs)
    N, B = int(query_rows), int(device_buffer_size)
    if n <= 0:
        return
    rows = top_k_positions[: n * N].long()
    k = rows.shape[1]
    if hot_locs.shape[1] < B + N:
        raise ValueError(f"hot_locs needs >= B + N = {B + N} columns for {N} query rows, has {hot_locs.shape[1]}")
    L = seq_lens[:n].long().to(rows.device)
    per_req = rows.view(n, N, k)
    _check_causal(per_req, L)

    window = per_req >= L[:, None, None]
    union = _union_rows(torch.where(window, -1, per_req).view(n, N * k))
    union_out = torch.empty((n, N * k), dtype=out.dtype, device=out.device)
    resolve_one_row(top_k_positions=union.to(torch.int32), seq_lens=(L + 1).to(seq_lens.dtype),
                    req_pool_indices=req_pool_indices[:n], hot_locs=hot_locs, out=union_out, num_real_reqs=n,
                    device_buffer_size=B, **tables)

    r = req_pool_indices[:n].long().to(hot_locs.device)
    window_rows = hot_locs[r][:, B : B + N].long().to(rows.device)  # [n, N]
    slot = (per_req - L[:, None, None]).clamp(0, N - 1).view(n, N * k)
    from_window = window_rows.gather(1, slot).view(n, N, k)
    from_union = _lookup(union, union_out.long().to(rows.device), per_req.view(n, N * k)).view(n, N, k)
    result = torch.where(window, from_window, from_union)
    out[: n * N].copy_(torch.where(per_req >= 0, result, -1).view(n * N, k).to(out.dtype))


def _check_causal(per_req: torch.Tensor, L: torch.Tensor) -> None:
    """Row j of a request selects positions < L + j + 1 only, each at most once (ValueError)."""
    n, N, k = per_req.shape
    limit = L[:, None] + torch.arange(1, N + 1, device=per_req.device)[None, :]  # [n, N]
    bad = (per_req >= limit[:, :, None]).nonzero()
    if bad.numel():
        i, j, c = bad[0].tolist()
        raise ValueError(f"verify row {j} of request {i} selects position {int(per_req[i, j, c])}, but only "
                         f"positions < L + {j + 1} = {int(limit[i, j])} exist for it")
    s = per_req.sort(dim=2).values
    if ((s[:, :, 1:] == s[:, :, :-1]) & (s[:, :, 1:] >= 0)).any():
        raise ValueError("a verify row selects a position twice")


def _union_rows(flat: torch.Tensor) -> torch.Tensor:
    """Per row of ``flat`` ([n, W], -1 = none): its distinct non-negative values in order of first
    occurrence, left-aligned and padded with -1."""
    n, W = flat.shape
    idx = torch.arange(W, device=flat.device).expand(n, W)
    key = torch.where(flat >= 0, flat, flat.max() + 1 if flat.numel() else 0)
    by_value = torch.argsort(key * W + idx, dim=1)  # equal values together, first occurrence first
    sorted_vals = flat.gather(1, by_value)
    first = torch.ones_like(sorted_vals, dtype=torch.bool)
    first[:, 1:] = sorted_vals[:, 1:] != sorted_vals[:, :-1]
    keep = torch.zeros_like(first)
    keep.scatter_(1, by_value, first & (sorted_vals >= 0))
    order = torch.argsort(torch.where(keep, idx, W + idx), dim=1)  # kept ones first, in original order
    return torch.where(keep.gather(1, order), flat.gather(1, order), -1)


def _lookup(union: torch.Tensor, union_out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """For each entry of ``positions`` ([n, X]) present in its row of ``union``, the matching entry
    of ``union_out`` (-1 where absent or negative)."""
    big = torch.iinfo(torch.int64).max
    keys, order = torch.where(union >= 0, union, big).sort(dim=1)
    at = torch.searchsorted(keys, positions.clamp(min=0)).clamp(max=keys.shape[1] - 1)
    found = (keys.gather(1, at) == positions) & (positions >= 0)
    return torch.where(found, union_out.gather(1, order.gather(1, at)), -1)
