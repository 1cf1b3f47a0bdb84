"""Seam: a verify forward waits for our write-through and tells the resolver the batch size.

Upstream target: ``sglang.srt.model_executor.model_runner.ModelRunner._forward_raw`` (AROUND).
Checked against: SGLang 0.5.17, where ``_forward_raw`` calls the coordinator's
``wait_for_pending_backup`` and sets ``num_real_reqs`` for DECODE batches only; a speculative
verify batch (TARGET_VERIFY) is an extend mode. For a TARGET_VERIFY batch of the runner that
holds our coordinator we do both (the write-through reads window slots the forward overwrites;
CUDA-graph replays set ``num_real_reqs`` themselves, as for decode). Every other forward runs
the original unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_hisparse.decode.coordinator import HiSparseCoordinator

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw"
CHECKED_AGAINST = "0.5.17"


def forward_raw(original: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    coordinator = runner.hisparse_coordinator
    if isinstance(coordinator, HiSparseCoordinator) and forward_batch.forward_mode.is_target_verify():
        forward_batch.hisparse_coordinator = coordinator
        coordinator.wait_for_pending_backup()
        coordinator.num_real_reqs.fill_(forward_batch.batch_size)
    return original(runner, forward_batch, *args, **kwargs)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, forward_raw, HookType.AROUND)
