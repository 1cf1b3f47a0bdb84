"""PD decode: moving a retracted request's KV out of the host pool and back.

SGLang's decode instance retracts requests under memory pressure by taking a CPU copy of their KV
and, on resume, giving them new logical ids and host rows and loading the copy back
(``patches/pd_retraction.py`` routes both steps here for requests our coordinator serves).
Both functions act through the coordinator's components; neither keeps state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RequestSnapshot:
    """What a retracted request keeps in ordinary CPU memory while it waits to resume."""

    kv: torch.Tensor
    """KV rows of positions ``0..n-1``: ``[layers, n, 1, row]``."""
    index_keys: torch.Tensor
    """The indexer-key pages of those positions: ``[layers, pages, bytes]``. They live on the
    device by logical id, and the request gets new logical ids when it resumes."""


def offload_request(coordinator: Any, req: Any) -> RequestSnapshot:
    """The request's committed positions ``0..seqlen-2`` in ordinary CPU memory: their KV (the
    last decoded token is written through first) and their indexer keys; then everything the
    request holds in the coordinator is freed (``request_finished``)."""
    n = req.seqlen - 1
    coordinator.mirror.write_through([req.req_pool_idx], [n + 1], coordinator.device_rows_now)
    kv = coordinator.mirror.snapshot(req.req_pool_idx, n)
    index_keys = coordinator.device_pool.index_key_pages(coordinator.logical_ids_of(req, n))
    coordinator.request_finished(req)
    return RequestSnapshot(kv=kv, index_keys=index_keys)


def restore_request(coordinator: Any, req: Any, snapshot: RequestSnapshot) -> None:
    """On resume, after SGLang preallocated the request's new logical ids and host rows for the
    snapshot's positions: write the KV into those rows and the indexer keys into the new ids'
    pages, then admit the request as a transferred one (rows of its own or a hot buffer)."""
    n = snapshot.kv.shape[1]
    coordinator.mirror.restore(req.req_pool_idx, snapshot.kv)
    coordinator.device_pool.restore_index_key_pages(coordinator.logical_ids_of(req, n), snapshot.index_keys)
    coordinator.admit_request_direct(req)
