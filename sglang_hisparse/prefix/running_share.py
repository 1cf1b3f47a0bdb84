"""A running request's prompt shared through the radix tree as soon as its KV is in host rows.

SGLang's own radix cache inserts a running request's prefix after each prefill
(``cache_unfinished_req``). Ours cannot then: the KV is on the device until the request's staging
copy finishes. :func:`share_running_prompt` runs when the request enters decode (its staging copy
done): the tree takes the request's host rows of its page-aligned prompt under logical ids of its
own and lends them back to the request (docs/prefix_reuse/README.md, "Ownership").
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey


def share_running_prompt(tree: Any, req: Any) -> int:
    """Share ``req``'s page-aligned prompt beyond what ``tree`` (the ``HostPrefixCache``) holds,
    once its host rows are complete (called when the request enters decode): inserted under new
    tree-owned ids (logical only, no device rows; indexer-key pages copied from the request's
    ids on the device), whose host rows are the request's rows of those positions, now the
    tree's and lent back to it (its borrowed count and loan grow); its lock moves to the new
    node (SGLang unlocks ``req.last_node`` at its ``cache_finished_req``, which ends the loan).
    Skipped (0) in SGLang's deterministic mode (``disable_finished_insert``), where the tree holds
    all of it already, holds other than what the request borrowed (its rows would interleave with
    the tree's), or it would take more than half of the free logical ids (the running requests'
    decode steps and admissions need them; a shared prompt holds its ids until its request ends).
    Returns the tokens shared.

    Invariant kept: a tree-owned id has a host row and no device row; the request's own ids (with
    device rows) stay its own and are freed at its finish as before."""
    if tree.disable_finished_insert:  # SGLang's deterministic mode inserts no request's tokens
        return 0
    idx, pool = req.req_pool_idx, tree.coordinator.mirror.pool
    end = min(len(req.origin_input_ids), int(tree.coordinator.mirror.mirrored_len[idx]))
    end -= end % tree.page_size
    if end == 0:
        return 0
    key = RadixKey(req.origin_input_ids[:end], req.extra_key, is_bigram=tree.is_eagle)
    found = RadixCache.match_prefix(tree, MatchPrefixParams(key=key))
    held = int(found.device_indices.numel())
    if held >= end or held != pool.borrowed_count(idx):
        return 0
    allocator = tree.token_to_kv_pool_allocator
    if 2 * (end - held) > allocator.decode_available_size():
        return 0  # never more than half the free ids: running requests' decode steps need them
    with allocator.logical_only():
        new_ids = allocator.alloc(end - held)
    if new_ids is None:
        return 0
    new_ids = new_ids.to(torch.int64)
    own_ids = tree.req_to_token_pool.req_to_token[idx, held:end].to(torch.int64)
    tree.coordinator.device_pool.copy_index_key_pages(own_ids, new_ids)
    tree.host_rows_of[new_ids.cpu()] = pool.rows_of(idx)[held:end]
    value = torch.cat([found.device_indices.to(new_ids.device, torch.int64), new_ids])
    result = tree.insert(InsertParams(key=key, value=value, priority=getattr(req, "priority", 0) or 0))
    if result.prefix_len != held:
        raise AssertionError(f"sglang-hisparse: the tree held {result.prefix_len} tokens of request {req.rid} "
                             f"at its insert, {held} at its match")
    tree.inc_lock_ref(result.last_device_node)
    if req.last_node is not None:
        tree.dec_lock_ref(req.last_node)
    req.last_node = result.last_device_node
    pool.give_up_leading_rows(idx, end)
    tree.loans.extend(idx, end)
    tree.shared_tokens += end - held
    return end - held
