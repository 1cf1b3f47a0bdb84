"""Seam: a PD decode instance retracts a HiSparse request by moving its KV out of the host pool,
and resumes it by moving the KV back and admitting it like a transferred request.

Upstream targets (SGLang 0.5.17, ``sglang.srt.managers.schedule_batch``):
* ``release_req`` (AROUND): on a decode instance SGLang retracts a request under memory pressure
  (or ``SGLANG_TEST_RETRACT``) by asking the allocator for a CPU copy of its KV
  (``offload_kv_cache`` -> ``get_cpu_copy``), which the HiSparse pools cannot give: its KV lives in
  host rows. For a request our coordinator serves, the coordinator takes the copy itself
  (``sglang_hisparse.serving.pd.offload_request``: the last token written through, the KV and indexer keys of
  positions ``0..seqlen-2`` copied to ordinary memory, every row freed) and SGLang releases the rest
  without its copy.
* ``Req.load_kv_cache`` (AROUND): on resume SGLang has given the request new logical ids and new
  host rows; the coordinator writes the copy back (the indexer keys into the new ids' pages) and
  admits the request (rows of its own or a fresh hot buffer)
  (``sglang_hisparse.serving.pd.restore_request``), which SGLang's resume path would otherwise never do.
Other requests and servers run SGLang's code unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sglang_hisparse.decode.coordinator import HiSparseCoordinator
from sglang_hisparse.serving.pd import RequestSnapshot, offload_request, restore_request

RELEASE_TARGET = "sglang.srt.managers.schedule_batch.release_req"
LOAD_TARGET = "sglang.srt.managers.schedule_batch.Req.load_kv_cache"
CHECKED_AGAINST = "0.5.17"


@dataclass
class HiSparseOffload:
    """What a retracted request carries as ``kv_cache_cpu`` while it waits to resume."""

    coordinator: HiSparseCoordinator
    snapshot: RequestSnapshot
    """Its KV rows and indexer-key pages, in ordinary CPU memory."""


def release_req(original: Callable[..., Any], *, req: Any, server_args: Any, hisparse_coordinator: Any = None,
                offload_kv: bool = True, **kwargs: Any) -> Any:
    if (isinstance(hisparse_coordinator, HiSparseCoordinator) and offload_kv and not req.finished()
            and server_args.disaggregation_mode == "decode"):
        req.kv_cache_cpu = HiSparseOffload(hisparse_coordinator, offload_request(hisparse_coordinator, req))
        offload_kv = False
    return original(req=req, server_args=server_args, hisparse_coordinator=hisparse_coordinator,
                    offload_kv=offload_kv, **kwargs)


def load_kv_cache(original: Callable[..., Any], req: Any, *args: Any, **kwargs: Any) -> Any:
    offload = getattr(req, "kv_cache_cpu", None)
    if not isinstance(offload, HiSparseOffload):
        return original(req, *args, **kwargs)
    restore_request(offload.coordinator, req, offload.snapshot)
    del req.kv_cache_cpu
    return None


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(RELEASE_TARGET, release_req, HookType.AROUND)
    registry.register(LOAD_TARGET, load_kv_cache, HookType.AROUND)
