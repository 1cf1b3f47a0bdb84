"""Seam (CPU platform only): a torch path for the DSA indexer.

Upstream target: ``sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.forward_native``
(REPLACE). Checked against: SGLang 0.5.17, where it raises NotImplementedError ("no native
path") and is what ``MultiPlatformOp`` dispatches to on the CPU engine. Ours is
:func:`sglang_hisparse.cpu.dsa_torch.indexer_forward_native`.
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.cpu.dsa_torch import indexer_forward_native

TARGET = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.forward_native"
CHECKED_AGAINST = "0.5.17"


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, indexer_forward_native, HookType.REPLACE)
