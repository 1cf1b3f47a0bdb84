"""Resolving a speculative verify step: N query rows per request (docs/speculative.md).

With linear speculation (MTP / EAGLE, ``--speculative-eagle-topk 1``) a decode step verifies
N = draft steps + 1 tokens per request, and the indexer gives each of them its own top-k row:
``top_k_positions`` is ``[num_reqs * N, top_k]``, rows ``i * N .. i * N + N - 1`` belong to
request ``i``. This module defines their semantics on top of the one-row resolvers
(``reference.resolve_reference``, ``batched.resolve_batched``, the kernel), so that one
definition serves every implementation:

* ``seq_lens[i]`` = L, the request's committed length (SGLang's ``batch.seq_lens`` in a verify
  step). Token j of the window sits at position ``p = L + j``, in hot-buffer slot ``p`` while
  ``p < B`` and in window slot ``B + j`` otherwise (``hot_locs`` has >= B + N columns; the hot
  buffers' window rule, ``hot_buffers.py``); row j may select window positions ``L .. L + j``
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

With N = 1 this is the one-row resolver with ``seq_len = L + 1`` bit for bit (its newest position
L sits in slot L on the fast path and in slot B otherwise, as the window's).

:func:`resolve_verify` checks the preconditions and resolves the real rows (tests, any one-row
resolver); :class:`VerifyStep` is the server's form: fixed shapes and preallocated buffers, no
host reads (the one-row resolver reads ``num_real_reqs`` on the device), no checks.

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
    _check_causal(rows.view(n, N, k), seq_lens[:n].long().to(rows.device))

    def resolve_union(union: torch.Tensor, union_lens: torch.Tensor, union_out: torch.Tensor) -> None:
        resolve_one_row(top_k_positions=union, seq_lens=union_lens, req_pool_indices=req_pool_indices[:n],
                        hot_locs=hot_locs, out=union_out, num_real_reqs=n, device_buffer_size=B, **tables)

    union_out = torch.empty((n, N * k), dtype=out.dtype, device=out.device)
    out[: n * N].copy_(_resolve_rows(resolve_union, top_k_positions[: n * N], seq_lens[:n], req_pool_indices[:n],
                                     hot_locs, B, N, union_out))


class VerifyStep:
    """The server's form of a verify step: preallocated union and output buffers (fixed
    addresses for CUDA graphs: up to ``max_reqs`` requests of N rows of ``top_k``), no host reads.

    ``resolve(resolve_union, top_k_positions, seq_lens, req_pool_indices)`` resolves all
    ``len(req_pool_indices)`` requests' rows; ``resolve_union(union, seq_lens, req_pool_indices,
    out)`` is the layer's one-row resolver bound for width ``N * top_k``, which skips the padding
    requests (``num_real_reqs`` on the device). Rows of padding requests in the result are
    garbage; nothing reads them.
    """

    def __init__(self, *, max_reqs: int, top_k: int, query_rows: int, device_buffer_size: int,
                 hot_locs: torch.Tensor, device: torch.device):
        self.query_rows, self.buffer_size, self.hot_locs = query_rows, device_buffer_size, hot_locs
        self.union_out = torch.full((max_reqs, query_rows * top_k), -1, dtype=torch.int32, device=device)
        self.out = torch.full((max_reqs * query_rows, top_k), -1, dtype=torch.int32, device=device)

    def resolve(self, resolve_union: Callable[..., None], top_k_positions: torch.Tensor, seq_lens: torch.Tensor,
                req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Device rows (int32 [num_reqs * N, top_k]) of the batch's verify rows. Side effects:
        ``resolve_union``'s (tables, copies, counters), this object's buffers."""
        n, N = req_pool_indices.shape[0], self.query_rows

        def bound(union: torch.Tensor, union_lens: torch.Tensor, union_out: torch.Tensor) -> None:
            resolve_union(union, union_lens, req_pool_indices, union_out)

        out = self.out[: n * N]
        out.copy_(_resolve_rows(bound, top_k_positions[: n * N], seq_lens[:n], req_pool_indices, self.hot_locs,
                                self.buffer_size, N, self.union_out[:n]))
        return out


def _resolve_rows(resolve_union: Callable[..., None], top_k_positions: torch.Tensor, seq_lens: torch.Tensor,
                  req_pool_indices: torch.Tensor, hot_locs: torch.Tensor, B: int, N: int,
                  union_out: torch.Tensor) -> torch.Tensor:
    """The rows of ``n = len(seq_lens)`` requests (module docstring), fixed shapes, no host reads:
    ``resolve_union(union int32 [n, N * k], seq_lens + 1, union_out)`` resolves the unions into
    ``union_out``. Returns int32 [n * N, k] on ``union_out``'s device."""
    rows = top_k_positions.long()
    n, k = seq_lens.shape[0], rows.shape[1]
    L = seq_lens.long().to(rows.device)
    per_req = rows.view(n, N, k)
    window = per_req >= L[:, None, None]
    union = _union_rows(torch.where(window, -1, per_req).view(n, N * k))
    resolve_union(union.to(torch.int32), (L + 1).to(seq_lens.dtype), union_out)

    r = req_pool_indices.long().to(hot_locs.device)
    slot = torch.where(per_req < B, per_req, B + per_req - L[:, None, None]).clamp(0, hot_locs.shape[1] - 1)
    from_window = hot_locs[r[:, None, None], slot.to(hot_locs.device)].long().to(rows.device)
    from_union = _lookup(union, union_out.long().to(rows.device), per_req.view(n, N * k)).view(n, N, k)
    result = torch.where(window, from_window, from_union)
    return torch.where(per_req >= 0, result, -1).view(n * N, k).to(union_out.dtype)


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
