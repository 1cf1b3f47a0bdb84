"""Test-only plugin (entry point ``hisparse_test_fault``): a deliberately wrong resolver.

With ``SGLANG_HISPARSE_TEST_FAULT=wrong_row``, every resolve returns one wrong device row per
request: its first selection points at the row of the newest token. End-to-end tests use it to
prove that their output comparison detects a broken resolver. Without the variable it registers
nothing, so the serving path never contains the fault.

Target: ``sglang_hisparse.decode.coordinator.HiSparseCoordinator.swap_in_selected_pages`` (AFTER; our
own class, hooked through SGLang's HookRegistry like any other target).
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENV = "SGLANG_HISPARSE_TEST_FAULT"
FAULTS = ("wrong_row",)
TARGET = "sglang_hisparse.decode.coordinator.HiSparseCoordinator.swap_in_selected_pages"

logger = logging.getLogger(__name__)


def point_first_selection_at_newest(result: Any, coordinator: Any, req_pool_indices: Any, seq_lens: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER body: overwrite each request's first resolved row with its newest token's row."""
    import torch

    newest = coordinator.device_rows_now(req_pool_indices, seq_lens - 1).to(result.dtype)
    result[:, 0] = torch.where(result[:, 0] >= 0, newest, result[:, 0])
    return result


def register(registry: Any = None) -> None:
    """Entry point. Registers the fault only when the environment asks for it."""
    fault = os.environ.get(ENV, "")
    if not fault:
        return
    if fault not in FAULTS:
        raise ValueError(f"{ENV}={fault!r}: allowed values are {', '.join(FAULTS)} or unset")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    (registry or HookRegistry).register(TARGET, point_first_selection_at_newest, HookType.AFTER)
    logger.warning("sglang-hisparse: test fault %s is ON: outputs will be wrong", fault)
