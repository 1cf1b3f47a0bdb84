"""Test-only plugin (entry point ``hisparse_dummy_init``): dummy weights that make attention matter.

SGLang's ``--load-format dummy`` fills every float tensor, norm weights included, with
U(-1e-3, 1e-3) from one seed, which makes a tiny model's outputs nearly independent of which KV
rows attention reads: a wrong resolver would go unnoticed. With
``SGLANG_HISPARSE_DUMMY_INIT=normal`` this plugin replaces SGLang's dummy initialiser with a
deterministic one: every tensor ~ N(0, std) seeded by its name (std from
``SGLANG_HISPARSE_DUMMY_STD``, default 0.02), norm weights 1, biases 0. Without the variable it
registers nothing.

It is a separate entry point so that it can be loaded alone next to SGLang's own HiSparse
(``SGLANG_PLUGINS=hisparse_dummy_init``) or together with ours, and both see the same weights.

Upstream target: ``sglang.srt.model_loader.weight_utils.initialize_dummy_weights`` (REPLACE).
Checked against: SGLang 0.5.17.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import Any

import torch

TARGET = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"
ENV = "SGLANG_HISPARSE_DUMMY_INIT"
STD_ENV = "SGLANG_HISPARSE_DUMMY_STD"

logger = logging.getLogger(__name__)


def initialize_dummy_weights(model: torch.nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234) -> None:
    """Fill ``model``'s float tensors in place (see the module docstring)."""
    std = float(os.environ.get(STD_ENV, "0.02"))
    counts = {"normal": 0, "norm": 0, "bias": 0}
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        lname = name.lower()
        if "cos_sin_cache" in lname or "inv_freq" in lname:
            continue
        if lname.endswith("bias"):
            param.zero_()
            counts["bias"] += 1
        elif "norm" in lname and lname.endswith("weight"):
            param.fill_(1.0)
            counts["norm"] += 1
        else:
            generator = torch.Generator(device=param.device)
            generator.manual_seed(seed + zlib.crc32(name.encode()) % 1_000_003)
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            values.normal_(0.0, std, generator=generator)
            param.copy_(values.to(param.dtype))
            counts["normal"] += 1
    logger.warning(
        "%s=normal: %d tensors ~N(0, %s) seeded by name, %d norm weights = 1, %d biases = 0",
        ENV, counts["normal"], std, counts["norm"], counts["bias"],
    )


def register(registry: Any = None) -> None:
    """Entry point. Registers the REPLACE only when the environment asks for it."""
    if os.environ.get(ENV, "") != "normal":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    (registry or HookRegistry).register(TARGET, initialize_dummy_weights, HookType.REPLACE)
