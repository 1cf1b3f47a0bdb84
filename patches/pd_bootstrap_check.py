"""Seam: a PD decode instance refuses a request that carries no bootstrap address, alone.

Upstream target: ``sglang.srt.disaggregation.decode.DecodePreallocQueue.add`` (AROUND).
Checked against: SGLang 0.5.17, where ``add`` builds the request's KV receiver from
``NetworkAddress(req.bootstrap_host, req.bootstrap_port)`` first thing: a ``/generate`` sent to a
decode instance without ``bootstrap_host`` (a client that bypassed the PD router) raises there,
in the scheduler's event loop, and the whole server dies. ``bootstrap_port`` has a default (the
server's own bootstrap port); the host and the room have none.

Ours: on a server with our HiSparse coordinator (DSA or DeepSeek-V4), a new request (not a
retracted one coming back) without ``bootstrap_host`` or ``bootstrap_room`` is aborted with HTTP
400 and a one-line reason,
the way ``add`` itself refuses a request larger than the pool (``prepare_abort`` and
``stream_output``); it takes nothing from any pool. Other requests and servers run SGLang's code
unchanged.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Callable, Optional

from sglang_hisparse.decode.c4_coordinator import C4Coordinator
from sglang_hisparse.decode.coordinator import HiSparseCoordinator

TARGET = "sglang.srt.disaggregation.decode.DecodePreallocQueue.add"
CHECKED_AGAINST = "0.5.17"

logger = logging.getLogger(__name__)


def missing_bootstrap(req: Any) -> Optional[str]:
    """Why a request cannot be paired with its prefill half (None when it can)."""
    missing = [name for name in ("bootstrap_host", "bootstrap_room") if getattr(req, name, None) is None]
    if not missing:
        return None
    return (f"sglang-hisparse: request {req.rid} reached a PD decode instance without {' and '.join(missing)}; "
            "send requests to the PD router (it pairs each request with its prefill instance), not to the "
            "decode instance directly")


def add(original: Callable[..., Any], queue: Any, req: Any, is_retracted: bool = False, **kwargs: Any) -> Any:
    coordinator = getattr(queue.scheduler, "hisparse_coordinator", None)
    ours = isinstance(coordinator, (HiSparseCoordinator, C4Coordinator))
    problem = None if is_retracted or not ours else missing_bootstrap(req)
    if problem is None:
        return original(queue, req, is_retracted=is_retracted, **kwargs)
    from sglang.srt.disaggregation.utils import prepare_abort

    logger.warning(problem)
    prepare_abort(req, problem, status_code=HTTPStatus.BAD_REQUEST)
    queue.scheduler.output_streamer.stream_output([req], req.return_logprob)
    return None


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, add, HookType.AROUND)
