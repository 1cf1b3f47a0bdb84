"""Seam: a request this server can never admit is refused at once, with the reason.

Upstream target: ``sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens`` (AFTER).
Checked against: SGLang 0.5.17, where ``handle_generate_request`` calls it for every new request
right before validating the prompt length, and a request marked with ``set_finish_with_abort``
is answered with that error (HTTP 400) after a one-token prefill instead of being queued.

SGLang bounds a prompt by the logical pool, which HiSparse makes ``ratio`` times the device
pool. A request whose budget exceeds what the HiSparse allocator can ever report free (device
rows, logical ids, host rows) would otherwise wait in the queue forever and block every request
behind it. The rule is :func:`sglang_hisparse.memory.admission.refusal`.
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.memory.admission import refusal
from sglang_hisparse.decode.coordinator import HiSparseCoordinator

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens"
CHECKED_AGAINST = "0.5.17"


def refuse_unadmittable(_result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    coordinator = getattr(scheduler, "hisparse_coordinator", None)
    if not isinstance(coordinator, HiSparseCoordinator) or getattr(req, "to_finish", None) is not None:
        return None
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, IGNORE_EOS_RESERVE_TOKENS

    params = req.sampling_params
    problem = refusal(
        coordinator.capacity,
        prompt_len=len(req.origin_input_ids),
        max_new_tokens=params.max_new_tokens,
        ignore_eos=bool(params.ignore_eos),
        clip_new_tokens=CLIP_MAX_NEW_TOKENS,
        ignore_eos_reserve=IGNORE_EOS_RESERVE_TOKENS,
    )
    if problem is not None:
        req.set_finish_with_abort(problem)
    return None


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, refuse_unadmittable, HookType.AFTER)
