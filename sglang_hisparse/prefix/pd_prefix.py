"""PD decode: a prefix the decode instance holds in its radix tree is not sent again by prefill.

SGLang 0.5.17's PD protocol lets a decode instance say how many leading tokens of a request it
already holds (``decode_prefix_len``, sent with the request's destination pages); the prefill
instance then sends the KV pages from that token on (``start_send_idx``), and the indexer keys of
the whole sequence as before. SGLang allows it with ``--disaggregation-decode-enable-radix-cache``
and a device-resident tree; with HiSparse it refuses the flag at start-up and asserts no prefix in
its HiSparse preallocation. Four seams of ours: ``patches/pd_radix_validation.py`` (the start-up
refusal), ``patches/pd_prefix_match.py`` (our tree's match reported as held),
``patches/pd_prefix_prealloc.py`` (the preallocation with a prefix) and
``patches/pd_prefix_budget.py`` (what the tree can give back counted in the admission budget, as
SGLang does for its own decode tree).

Ours, per request (one owner per row, as in the colocated prefix reuse, ``prefix/host_tree.py``):

* **match** (:func:`match_for_transfer`): the longest page-aligned cached prefix of the prompt,
  short of its last token, is reported to SGLang as held (its ``l1_prefix_len``), under the
  node's lock (SGLang's own call takes it), but only when the request's own logical ids for its
  whole sequence fit beside the running requests' decode reserve (free ids plus what eviction
  gives back); otherwise no prefix (everything is sent, as without the tree);
* **preallocation** (:func:`preallocate_with_prefix`): the request gets logical ids of its own for
  every position (the resolver maps a request's ids to its own device rows), its host rows of the
  prefix are the tree's, lent to its slot until its ``cache_finished_req`` (no copy), its own host
  rows cover the rest and are the transfer's destination; the prefill writes the indexer keys of
  every position into the request's own ids, as without a prefix;
* **admission, decode and finish** are those of any transferred request (the coordinator loads
  the prefix from the lent rows like the rest), and the finished request's tokens are inserted as
  in colocated serving.

Nothing here keeps state: the tree (locks, loans), the host pool (rows) and the allocator (ids)
own theirs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

logger = logging.getLogger(__name__)


def transfer_match(tree: Any, params: MatchPrefixParams) -> MatchResult:
    """What our tree (``HostPrefixCache``) reports while ``transfer_matching``: SGLang's match
    of the prompt short of its last token (so a prefill always sends at least one page), whole
    pages, as held ids (the tree's, for SGLang's bookkeeping only; the request gets its own), no
    host hit."""
    key = params.key
    tokens = len(key.token_ids) if key.limit is None else min(key.limit, len(key.token_ids))
    capped = RadixKey(key.token_ids, key.extra_key, is_bigram=key.is_bigram, limit=max(tokens - 1, 0))
    found = RadixCache.match_prefix(tree, dataclasses.replace(params, key=capped))
    return MatchResult(device_indices=found.device_indices.to(torch.int64), last_device_node=found.last_device_node,
                       last_host_node=found.last_device_node, best_match_node=found.last_device_node)


def host_rows_of_prefix(tree: Any, node: Any, count: int) -> torch.Tensor:
    """The tree's host rows of the first ``count`` tokens on the path to ``node`` (CPU int64;
    AssertionError where one has none: a tree-owned id always has a host row)."""
    rows = tree.host_rows_of[tree.path_ids(node)[:count].cpu()]
    if rows.numel() != count or bool((rows < 0).any()):
        raise AssertionError(f"sglang-hisparse: {count} cached prefix tokens asked for, the tree holds "
                             f"{int((rows >= 0).sum())} host rows on that path")
    return rows


def own_ids_needed(queue: Any, req: Any, page_size: int) -> int:
    """Logical ids a request's preallocation takes with a prefix lent: its whole sequence (whole
    pages), since its ids are its own even where its host rows are the tree's."""
    fill_len = queue._pre_alloc_fill_len(req)
    return -(-fill_len // page_size) * page_size


def ids_from_eviction(tree: Any) -> int:
    """What evicting every unlocked cached prefix adds to the ids a PD decode instance may hand out
    (its admission reads ``decode_available_size``: ids net of the host rows they need; an
    eviction gives back both, no device rows). No side effects."""
    room = tree.token_to_kv_pool_allocator.room
    return room.decode_room_with_freed(tree.evictable_size_) - room.decode_room()


def room_for_own_ids(queue: Any, req: Any, tree: Any) -> bool:
    """Whether ``req``'s own ids fit with the decode reserve SGLang keeps for one more request:
    free ids plus what evicting unlocked cached prefixes gives back (the matched one is locked)."""
    room = queue.token_to_kv_pool_allocator.decode_available_size() + ids_from_eviction(tree)
    return own_ids_needed(queue, req, tree.page_size) + queue.num_reserved_decode_tokens <= room


def match_for_transfer(original: Callable[..., Any], queue: Any, req: Any, tree: Any) -> Any:
    """SGLang's ``_match_prefix_and_lock`` with our tree reporting its prefix as held (module
    docstring). Returns SGLang's ``DecodePrefixMatch``; a prefix is reported only with room for
    the request's own ids, else the match is undone (lock released) and none is reported."""
    tree.transfer_matching = True
    try:
        match = original(queue, req)
    finally:
        tree.transfer_matching = False
    if match.l1_prefix_len and not room_for_own_ids(queue, req, tree):
        logger.info("sglang-hisparse: request %s: cached prefix of %d tokens not used (no room for the request's "
                    "own ids beside the decode reserve); the prefill sends every token", req.rid, match.l1_prefix_len)
        tree.dec_lock_ref(match.last_device_node)
        match = original(queue, req)  # outside the transfer match our tree reports nothing
    return match


def preallocate_with_prefix(original: Callable[..., Any], queue: Any, req: Any, prefix_len: int, tree: Any,
                            coordinator: Any) -> torch.Tensor:
    """SGLang's ``_pre_alloc`` for a request whose first ``prefix_len`` tokens the tree holds
    (its node locked by the match, ``req.last_node``). Runs SGLang's preallocation of a request
    without a prefix (ids and host rows for every position) with the tree's host rows of the
    prefix lent as the slot's first rows; then records the loan, tells SGLang the prefix
    (``req.prefix_indices``: the request's own ids of it; the extend range from ``prefix_len``),
    and returns the host rows from position ``prefix_len`` on: SGLang takes the transfer's
    destination from their front. Evicts unlocked cached prefixes first when the ids are short.
    Raises AssertionError when SGLang's preallocation did not take the lent rows (a contract
    change: nothing would say which rows are whose)."""
    allocator = queue.token_to_kv_pool_allocator
    short = own_ids_needed(queue, req, tree.page_size) - allocator.decode_available_size()
    if short > 0:
        tree.evict(EvictParams(num_tokens=short))
    lent_rows = host_rows_of_prefix(tree, req.last_node, prefix_len)
    pool = coordinator.mirror.pool
    with pool.lending_first_rows(lent_rows):
        host_rows = original(queue, req, None, 0, 0)
    idx = req.req_pool_idx
    if pool.borrowed_count(idx) != prefix_len:
        raise AssertionError(f"sglang-hisparse: request {req.rid}: SGLang's preallocation did not take the "
                             f"{prefix_len} cached host rows lent to it ({pool.borrowed_count(idx)} borrowed)")
    tree.loans.lend_to_slot(idx, prefix_len)
    tree.tokens_not_sent += prefix_len
    req.prefix_indices = queue.req_to_token_pool.req_to_token[idx, :prefix_len].to(torch.int64, copy=True)
    req.set_extend_range(prefix_len, req.kv_committed_len)
    return host_rows[prefix_len:]
