"""Torch versions of the seven ``sgl_kernel`` CPU ops SGLang 0.5.17's EAGLE / NEXTN worker calls on
the CPU engine (test and demo use only; tiny batches, plain loops).

Contracts, as SGLang's call sites use them (``srt/mem_cache/allocation.py``,
``srt/speculative/eagle_utils.py``, ``srt/speculative/eagle_worker_common.py``,
``kernels/ops/speculative/cache_locs.py``, ``kernels/ops/speculative/eagle.py``); every op writes its output tensors in place:

* ``assign_req_to_token_pool_cpu``: request i's slice ``[start[i], end[i])`` of its
  ``req_to_token`` row receives the next ``end[i] - start[i]`` entries of ``out_cache_loc``
  (requests in batch order).
* ``assign_extend_cache_locs_cpu``: the reverse gather: ``out_cache_loc`` receives those slices.
* ``assign_draft_cache_locs_contiguous_cpu``: request i's ``topk * num_steps`` draft slots are its
  ``req_to_token`` entries from ``seq_lens[i]`` on.
* ``build_tree_kernel_efficient_cpu``: the draft tree of each request. Node 0 is the verified
  token; node ``x >= 1`` is draft candidate ``top_scores_index[b, x - 1]``, whose parent is the
  root when ``candidate // topk == 0`` and otherwise the node whose candidate equals
  ``parent_list[b, candidate // topk]``. Writes ``positions`` (``seq_len`` + depth),
  ``retrieve_index`` (flat node ids ``b * N + x``), ``retrieve_next_token`` (first child) and
  ``retrieve_next_sibling`` (next child of the same parent, in node order), and the
  ``QLEN_ONLY`` mask (node x sees the root, its ancestors and itself).
* ``verify_tree_greedy_cpu``: walk the tree from the root; at each level accept the first child
  whose candidate token equals the target model's prediction at the last accepted node; writes
  ``accept_index`` (flat node ids, root first), ``accept_token_num`` (accepted drafts) and
  ``predicts`` (the target's token at every accepted node).
"""

from __future__ import annotations

import torch

QLEN_ONLY = 1  # srt/speculative/eagle_utils.TreeMaskMode.QLEN_ONLY, the CPU engine's mode


def _slices(start: torch.Tensor, end: torch.Tensor):
    offset = 0
    for i, (s, e) in enumerate(zip(start.tolist(), end.tolist())):
        yield i, s, e, offset
        offset += e - s


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    for i, s, e, at in _slices(start_offset, end_offset):
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[at : at + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    for i, s, e, at in _slices(start_offset, end_offset):
        out_cache_loc[at : at + e - s] = req_to_token[int(req_pool_indices[i]), s:e].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, speculative_num_steps) -> None:
    width = int(topk) * int(speculative_num_steps)
    for i, (r, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[r, start : start + width].to(out_cache_loc.dtype)


def _parents(candidates: list[int], parents_of: list[int], topk: int) -> list[int]:
    """Parent node of every node (the root's is -1); an unknown parent ends the path at the root."""
    node_of = {c: x + 1 for x, c in enumerate(candidates)}
    parent = [-1]
    for c in candidates:
        group = c // topk
        parent.append(0 if group == 0 else node_of.get(parents_of[group], 0))
    return parent


def build_tree_kernel_efficient_cpu(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling, topk, spec_steps, num_verify_tokens,
                                    tree_mask_mode) -> None:
    if int(tree_mask_mode) != QLEN_ONLY:
        raise NotImplementedError(f"sgl_kernel stand-in: build_tree only for the QLEN_ONLY mask, got {tree_mask_mode}")
    N = int(num_verify_tokens)
    mask = tree_mask.view(-1, N, N)
    parent_rows = parent_list.view(len(seq_lens), -1).tolist()
    for b, L in enumerate(seq_lens.tolist()):
        parent = _parents(top_scores_index[b, : N - 1].tolist(), parent_rows[b], int(topk))
        retrieve_index[b] = torch.arange(b * N, (b + 1) * N)
        retrieve_next_token[b] = -1
        retrieve_next_sibling[b] = -1
        last_child: dict[int, int] = {}
        mask[b] = False
        for x in range(N):
            if x > 0:
                p = parent[x]
                if p in last_child:
                    retrieve_next_sibling[b, last_child[p]] = x
                else:
                    retrieve_next_token[b, p] = x
                last_child[p] = x
            depth, node = 0, x
            mask[b, x, 0] = True
            while node > 0 and depth < int(spec_steps):
                mask[b, x, node] = True
                node, depth = parent[node], depth + 1
            positions[b * N + x] = L + depth


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict) -> None:
    N = candidates.shape[1]
    target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, accept_index.shape[1]):
            child = int(retrive_next_token[b, node])
            want = int(target[last])
            while child != -1 and int(candidates[b, child]) != want:
                child = int(retrive_next_sibling[b, child])
            if child == -1:
                break
            predicts[last] = want
            accepted += 1
            last = int(retrive_index[b, child])
            accept_index[b, accepted] = last
            node = child
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """Request i's bonus token is its last accepted token: ``accept_tokens`` (flat, ``accept_stride``
    per request) at ``accept_lens[i] - 1`` (the length counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[int(accept_stride) * i + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """The KV slots of the accepted nodes, compacted: the j-th non-negative entry of
    ``accept_index`` (flat) contributes ``out_cache_loc[accept_index[j]]``."""
    index = accept_index.reshape(-1)
    kept = index[index >= 0].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)
