"""The radix cache of a HiSparse server: cached prefixes live in host rows, not on the device.

SGLang's ``RadixCache`` keeps each cached token's logical id (its KV index) in the tree. With
HiSparse a logical id's KV is in a host row; a device row holds it only while a request prefills
or decodes resident. :class:`HostPrefixCache` keeps SGLang's tree (keys, splits, locks, eviction
order) and changes what a node's ids carry and how a match is served:

* **a cached token** is a logical id the tree owns, with its indexer key on the device (keys live
  at logical ids: whoever owns the id owns the key) and its KV in the host row
  ``host_rows_of[id]``; no device row (nothing is mapped to a tree-owned id).
* **a match** is reported to SGLang as a host hit (``host_hit_length``), so SGLang's prefill
  admission calls :meth:`init_load_back` under the node's lock: the request gets ids of its own
  with device rows, the indexer keys are copied device to device, the KV host to device, on the
  current stream. The request then prefills only its unmatched part and decodes exactly as one that
  prefilled everything (its prefix ids and device rows are its own). Its host rows of the prefix
  are the tree's, lent at staging (:meth:`lend_rows`): only the positions after the prefix are
  copied to host, and the loan ends in :meth:`cache_finished_req` (SGLang keeps the node locked
  from admission until then, so the lent rows cannot be evicted under it).
* **at finish** our coordinator writes the request's pending KV through and hands over its host
  rows (:meth:`hand_over`, from ``request_finished``, which SGLang calls first);
  :meth:`cache_finished_req` (SGLang's call right after) inserts the page-aligned committed
  tokens, adopts the ids and host rows of the part the tree did not have, and frees everything
  else the request held: the ids of its loaded prefix copy, its duplicates, its unaligned tail
  (never the rows the tree lent it).
* **a running request's prompt is shared** once it reached host rows (:meth:`share_running`, when
  the request enters decode): the tree takes those host rows under ids of its own and lends them
  back; :meth:`cache_unfinished_req` inserts nothing (a prefill chunk's KV is not on the host yet).
* **eviction** (SGLang's, by its policy) frees a leaf's host rows here and its ids through the
  allocator; :meth:`reset` (``/flush_cache``, idle only) frees every host row the tree holds.
* **room**: :meth:`evictable_size` is what evicting would add to the allocator's room (logical
  ids and host rows come back, device rows do not), so SGLang's ``available + evictable`` stays
  exact.

Owns: the tree (SGLang's structure) and ``host_rows_of`` (host row of each tree-owned id, -1
for none) with the handed-over rows of finishing requests until SGLang's ``cache_finished_req``,
and the loans of its host rows to running requests (:class:`PrefixLoans`).
Not owned: the host rows' bytes and free list (the coordinator's host mirror), the ids' free list
and device rows (the allocator).

Limits: one tree per scheduler process (attention TP ranks build identical trees from identical
calls); a DSA model; no speculation or DeepSeek-V4 (refused at start-up by server_checks). On a PD
decode instance (``serves_transfers``) a match serves the prefill's skipping of a held prefix
instead of a load-back (``prefix/pd_prefix.py``).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams,
                                                     MatchResult)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from .pd_prefix import transfer_match
from .running_share import share_running_prompt

logger = logging.getLogger(__name__)


class PendingLoads:
    """Loads not yet in a prefill, by request: SGLang may load a request's prefix
    (``init_load_back``) and then not schedule it this round (its chunk budget ran out). Such a load's
    ids are freed when the request is loaded again or found gone (aborted while waiting). Owns the
    table; the ids go back through ``free`` (the allocator's)."""

    def __init__(self, free: Any):
        self._free = free
        self._loads: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def add(self, req: Any, ids: torch.Tensor) -> None:
        self._loads[id(req)] = (weakref.ref(req), ids)

    def consumed(self, req: Any) -> None:
        """The request's loaded ids are in its prefill (``req_to_token``): they are freed with it."""
        self._loads.pop(id(req), None)

    def free_stale(self, req: Any) -> None:
        """Free this request's earlier load and those of requests that no longer exist."""
        stale = [key for key, (ref, _) in self._loads.items() if ref() is None or ref() is req]
        for key in stale:
            self._free(self._loads.pop(key)[1])


class PrefixLoans:
    """The tree's host rows in use by running requests, until each request's finish: a loaded
    prefix's rows offered at load-back (by request) and lent at staging (by request slot); a
    running request's shared prompt extends its slot's loan; ``cache_finished_req`` ends it. Owns
    both tables; the rows themselves stay the tree's (``host_rows_of``) throughout."""

    def __init__(self):
        self._offers: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._lent: dict[int, int] = {}
        self.lent_tokens = 0
        """Tokens whose host rows were lent to a staged request since start (not copied)."""

    def offer(self, req: Any, host_rows: torch.Tensor) -> None:
        """The prefix ``req``'s load-back just loaded; offers of requests gone are dropped."""
        for key in [key for key, (ref, _) in self._offers.items() if ref() is None]:
            del self._offers[key]
        self._offers[id(req)] = (weakref.ref(req), host_rows)

    def withdraw(self, req: Any) -> None:
        """Drop ``req``'s offer (matched again: a new load-back, if any, offers anew)."""
        self._offers.pop(id(req), None)

    def lend(self, req: Any) -> Optional[torch.Tensor]:
        """Take ``req``'s offer and record the loan by its slot; None without an offer.
        AssertionError when the slot has a loan open (its request never ended: freeing by the
        wrong count would free the tree's rows or leak the request's)."""
        if req.req_pool_idx in self._lent:
            raise AssertionError(f"sglang-hisparse: request slot {req.req_pool_idx} staged with a loan of cached host rows open")
        offer = self._offers.pop(id(req), None)
        if offer is None or offer[0]() is not req:
            return None
        self._lent[req.req_pool_idx] = int(offer[1].numel())
        self.lent_tokens += int(offer[1].numel())
        return offer[1]

    def lend_to_slot(self, req_pool_idx: int, count: int) -> None:
        """Record a loan of ``count`` leading rows to a slot directly (PD decode: the rows were lent
        at preallocation, ``prefix/pd_prefix.py``, with no load-back to offer them). Same
        AssertionError as :meth:`lend` for a slot with a loan open."""
        if req_pool_idx in self._lent:
            raise AssertionError(f"sglang-hisparse: request slot {req_pool_idx} preallocated with a loan of cached host rows open")
        self._lent[req_pool_idx] = count
        self.lent_tokens += count

    def extend(self, req_pool_idx: int, count: int) -> None:
        """The slot's loan now covers its first ``count`` rows (the tree took the rest of them from
        the running request: :meth:`HostPrefixCache.share_running`)."""
        self._lent[req_pool_idx] = count

    def end(self, req: Any) -> int:
        """The request is done with the tree's rows: its offer and loan dropped; returns how many
        leading rows of its slot were lent (0 for none)."""
        self.withdraw(req)
        return self._lent.pop(req.req_pool_idx, 0)

    def clear(self) -> None:
        """Drop every offer (``/flush_cache``); AssertionError while a loan is open (SGLang resets
        only when idle, after every request's ``cache_finished_req``)."""
        if self._lent:
            raise AssertionError(f"sglang-hisparse: the prefix cache was reset with host rows lent to slots {sorted(self._lent)}")
        self._offers.clear()


@dataclass
class HandedOver:
    """A finishing request's host rows, in position order, complete for positions ``[0, complete)``."""

    rows: torch.Tensor
    complete: int


class HostPrefixCache(RadixCache):
    """SGLang's radix cache over host rows (module docstring). Built by ``patches/prefix_cache.py``;
    the coordinator attaches itself with :meth:`attach` before the first request."""

    def __init__(self, params: Any, *, serves_transfers: bool = False):
        """``serves_transfers``: a PD decode instance's tree (``prefix/pd_prefix.py``)."""
        self.host_rows_of: Optional[torch.Tensor] = None  # RadixCache.__init__ calls reset()
        super().__init__(params)
        self.serves_transfers = serves_transfers
        self.transfer_matching = False
        """PD decode: set while SGLang's decode matches a request for its transfer; only then does
        :meth:`match_prefix` report a prefix (``prefix/pd_prefix.py``, :func:`transfer_match`)."""
        self.tokens_not_sent = 0
        """PD decode: prompt tokens the prefill did not send since start (held here, lent)."""
        allocator = self.token_to_kv_pool_allocator
        # logical ids run from page 1 to the last page's end: size_full + page_size - 1
        self.host_rows_of = torch.full((allocator.size_full + self.page_size,), -1, dtype=torch.int64)
        """Host row of each tree-owned logical id (-1: none). CPU."""
        self._handed: dict[int, HandedOver] = {}
        self._pending = PendingLoads(self.token_to_kv_pool_allocator.free)
        self.loans = PrefixLoans()
        self.coordinator: Any = None
        self.loaded_tokens = 0
        """Tokens served from the tree since start (loaded, not prefilled)."""
        self.evicted_tokens = 0
        """Tokens evicted since start (their ids and host rows freed)."""
        self.shared_tokens = 0
        """Tokens running requests shared since start (:meth:`share_running`)."""

    def attach(self, coordinator: Any) -> None:
        """The coordinator whose host mirror, device pool and allocator serve the loads."""
        self.coordinator = coordinator

    # --- matching --------------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached page-aligned prefix, reported as a host hit: no device indices; the
        matched node is where :meth:`init_load_back` starts (SGLang locks it through the prefill).
        A PD decode instance's tree reports no match except while ``transfer_matching``."""
        if params.req is not None:  # a new match supersedes the request's earlier load-back
            self.loans.withdraw(params.req)
        if self.serves_transfers:
            return transfer_match(self, params) if self.transfer_matching else self.no_match()
        found = super().match_prefix(params)
        hit = int(found.device_indices.numel())
        if hit == 0:
            return found
        return MatchResult(device_indices=self._empty_match_result.device_indices, last_device_node=self.root_node,
                           last_host_node=found.last_device_node, best_match_node=found.last_device_node,
                           host_hit_length=hit, full_kv_hit_length=hit)

    def no_match(self) -> MatchResult:
        """An empty match at the root."""
        return MatchResult(device_indices=self._empty_match_result.device_indices, last_device_node=self.root_node,
                           last_host_node=self.root_node, best_match_node=self.root_node)

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """Give the request ``host_hit_length`` ids of its own holding the matched prefix: device
        rows for them (the allocator's ``alloc``; cached prefixes other than this one are evicted
        first when ids or host rows are short), the tree ids' indexer-key pages copied into theirs,
        the KV loaded from the tree's host rows, on the current stream (ordered after the copies that
        wrote those rows: the coordinator orders the stream after them when it hands rows over).
        Returns ``(ids, node)``; ``(empty, root)`` when no device rows can be found (the request
        prefills everything; logged)."""
        node, hit, req = params.best_match_node, params.host_hit_length, params.req
        if hit <= 0:  # SGLang calls only with a host hit; nothing to load otherwise
            return self._empty_match_result.device_indices, self.root_node
        self._pending.free_stale(req)
        allocator = self.token_to_kv_pool_allocator
        self.inc_lock_ref(node)  # SGLang locks it only once the request is admitted
        try:
            short = hit - allocator.decode_available_size()  # ids and host rows: what eviction gives back
            if short > 0:
                self.evict(EvictParams(num_tokens=short))
            ids = allocator.alloc(hit)
        finally:
            self.dec_lock_ref(node)
        if ids is None:
            logger.info("sglang-hisparse: prefix of %d tokens not loaded (no device rows free: %s); prefilled instead",
                        hit, allocator.debug_print())
            return self._empty_match_result.device_indices, self.root_node
        tree_ids = self.path_ids(node)[:hit]
        host_rows = self.host_rows_of[tree_ids.cpu()]
        if bool((host_rows < 0).any()):
            raise AssertionError("sglang-hisparse: a cached prefix token has no host row")
        coordinator = self.coordinator
        coordinator.device_pool.copy_index_key_pages(tree_ids, ids)
        coordinator.mirror.pool.load_rows(coordinator.device_pool, host_rows, allocator.device_rows_of(ids))
        self.loaded_tokens += hit
        if req is not None:
            self._pending.add(req, ids)
            self.loans.offer(req, host_rows)
        return ids.to(torch.int64), node

    def lend_rows(self, req: Any) -> Optional[torch.Tensor]:
        """At staging (the coordinator's call, after the request's last prefill chunk): the tree's
        host rows of the prefix loaded for ``req`` (positions ``0..L-1``, CPU int64, whole pages),
        lent to its slot until :meth:`cache_finished_req`; None when its prefill loaded none. Side
        effects and error: :meth:`PrefixLoans.lend`."""
        return self.loans.lend(req)

    def path_ids(self, node: Any) -> torch.Tensor:
        """The ids of every token from the root to ``node``, in order."""
        parts = []
        while node is not None and node is not self.root_node:
            parts.append(node.value)
            node = node.parent
        if not parts:
            return self._empty_match_result.device_indices
        return torch.cat(parts[::-1]).to(torch.int64)

    # --- requests leaving --------------------------------------------------------------------------
    def hand_over(self, req_pool_idx: int, rows: torch.Tensor, complete: int) -> None:
        """A finishing request's host rows (position order; positions ``[0, complete)`` hold its
        KV), kept until :meth:`cache_finished_req` adopts or frees them (the coordinator's call).
        A slot holds one hand-over at a time (AssertionError otherwise: rows would be lost)."""
        if req_pool_idx in self._handed:
            raise AssertionError(f"sglang-hisparse: request slot {req_pool_idx} handed over its host rows twice")
        self._handed[req_pool_idx] = HandedOver(rows.to(torch.int64).cpu(), complete)

    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int) -> None:
        """Insert the request's page-aligned committed tokens whose KV reached host rows; adopt the
        ids and rows of the part the tree lacked, free the rest (module docstring); unlock."""
        allocator = self.token_to_kv_pool_allocator
        self._pending.consumed(req)
        lent = self.loans.end(req)
        handed = self._handed.pop(req.req_pool_idx, None)
        token_ids = (req.origin_input_ids + req.output_ids)[:kv_len_to_handle]
        ids = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)].to(torch.int64)
        insert_len = 0
        if is_insert and handed is not None and not self.disable_finished_insert:  # SGLang's deterministic mode
            insert_len = min(len(token_ids), handed.complete) // self.page_size * self.page_size
        adopted_from = insert_len
        if insert_len:
            key = RadixKey(token_ids[:insert_len], req.extra_key, is_bigram=self.is_eagle)
            result = self.insert(InsertParams(key=key, value=ids[:insert_len].clone(),
                                              priority=getattr(req, "priority", 0) or 0))
            adopted_from = result.prefix_len
            if adopted_from < min(lent, insert_len):
                raise AssertionError(f"sglang-hisparse: request {req.rid} borrowed {lent} cached host rows but the "
                                     f"tree holds only {adopted_from} of its tokens (the prefix node was not locked)")
            adopted = ids[adopted_from:insert_len]
            if adopted.numel():
                allocator.release_device_rows(adopted)  # C3: tree-owned ids have no device rows
                self.host_rows_of[adopted.cpu()] = handed.rows[adopted_from:insert_len]
        allocator.free(torch.cat([ids[:adopted_from], ids[insert_len:]]))
        if handed is not None:  # the request's own rows: after the lent ones, neither adopted nor the tree's
            rows = handed.rows
            self.coordinator.mirror.pool.free(torch.cat([rows[lent:adopted_from], rows[max(insert_len, lent):]]))
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    def share_running(self, req: Any) -> int:
        """A running request whose prompt reached host rows shares it (``prefix/running_share.py``;
        the coordinator's call when the request enters decode). Returns the tokens shared."""
        return share_running_prompt(self, req)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Inserts nothing: after a prefill chunk the KV is on the device only (a running request's
        prompt is shared when it enters decode, :meth:`share_running`); its ids stay its own
        (SGLang's chunk-cache behaviour: the next chunk continues from them)."""
        self._pending.consumed(req)
        ids = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.extend_range.end]
        req.prefix_indices = ids.to(dtype=torch.int64, copy=True)

    # --- eviction and room ---------------------------------------------------------------------------
    def _delete_leaf(self, node: Any) -> None:
        """SGLang's eviction frees the leaf's ids (the allocator) and then deletes it: its host rows
        are freed here."""
        ids = node.value.to(torch.int64).cpu()
        rows = self.host_rows_of[ids]
        self.host_rows_of[ids] = -1
        self.evicted_tokens += ids.numel()
        self.coordinator.mirror.pool.free(rows[rows >= 0])
        super()._delete_leaf(node)

    def reset(self) -> None:
        """Empty the tree (``/flush_cache``, only when idle): every host row it holds is freed.
        The ids go back with SGLang's ``allocator.clear()``, which follows."""
        if self.host_rows_of is not None:
            self.loans.clear()
            held = self.host_rows_of[self.host_rows_of >= 0]
            if held.numel():
                self.coordinator.mirror.pool.free(held)
            self.host_rows_of.fill_(-1)
            if self.coordinator is not None:
                self.coordinator.stats.note_activity()  # the next idle report shows the pools back
        super().reset()

    def held_tokens(self) -> int:
        """Tokens the tree holds (ids and host rows)."""
        return int((self.host_rows_of >= 0).sum()) if self.host_rows_of is not None else 0

    def evictable_size(self) -> int:
        """What evicting every unlocked leaf would add to the allocator's room (SGLang adds this to
        ``available_size()``): ids and host rows come back, device rows do not."""
        evictable = self.evictable_size_
        if not evictable:
            return 0
        return max(0, self.token_to_kv_pool_allocator.room.available_with_freed(evictable)
                   - self.token_to_kv_pool_allocator.available_size())
