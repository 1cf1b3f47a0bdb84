"""PD decode: moving a retracted request's KV out of the host pool and back.

SGLang's decode instance retracts requests under memory pressure by taking a CPU copy of their KV
and, on resume, giving them new logical ids and host rows and loading the copy back
(``patches/pd_retraction.py`` routes both steps here for requests our coordinator serves).
Both functions act through the coordinator's components; neither keeps state of its own.
"""

from __future__ import annotations

from typing import Any

import torch


def offload_request(coordinator: Any, req: Any) -> torch.Tensor:
    """The KV of the request's committed positions ``0..seqlen-2`` in ordinary CPU memory
    (``[layers, positions, 1, row]``): the last decoded token is written through first, then
    everything the request holds in the coordinator is freed (``request_finished``)."""
    n = req.seqlen - 1
    coordinator.mirror.write_through([req.req_pool_idx], [n + 1], coordinator.device_rows_now)
    snapshot = coordinator.mirror.snapshot(req.req_pool_idx, n)
    coordinator.request_finished(req)
    return snapshot


def restore_request(coordinator: Any, req: Any, snapshot: torch.Tensor) -> None:
    """On resume, after SGLang preallocated the request's new logical ids and host rows for the
    snapshot's positions: write the snapshot into those rows and admit the request as a
    transferred one (a fresh hot buffer, short requests loaded from host)."""
    coordinator.mirror.restore(req.req_pool_idx, snapshot)
    coordinator.admit_request_direct(req)
