"""Seam (CPU platform only): let DSA argument resolution run on a machine without a GPU.

Upstream target: ``sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments``
(AROUND). Checked against: SGLang 0.5.17, where the DSA branch calls
``torch.cuda.get_device_capability()`` unconditionally (its result is unused since the DSA
defaults moved to the resolution pipeline), which raises without an NVIDIA driver.

Registered only when SGLang runs its CPU engine (``SGLANG_USE_CPU_ENGINE=1``). During this one
call, and only when no CUDA device exists, the probe answers ``(0, 0)``; everything else in the
call runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable
from unittest import mock

TARGET = "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments"
CHECKED_AGAINST = "0.5.17"


def handle_model_specific_adjustments(original: Callable[..., Any], server_args: Any, *args: Any, **kwargs: Any) -> Any:
    import torch

    if torch.cuda.is_available():
        return original(server_args, *args, **kwargs)
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (0, 0)):
        return original(server_args, *args, **kwargs)


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, handle_model_specific_adjustments, HookType.AROUND)
