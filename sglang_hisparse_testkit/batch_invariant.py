"""Test-only plugin (entry point ``hisparse_batch_invariant``): CPU matrix products whose result for a
row does not depend on the rows beside it.

On SGLang's CPU engine a bf16 ``linear`` runs through oneDNN, whose kernels tile the batch
dimension differently for different row counts: the same token's logits can differ in the last
bit depending on how many requests share its decode step (measured: 4 of 11 of the tiny CPU
model's projection shapes, e.g. 256 -> 1024 at 11 rows). Two servers then agree only when they run
identical batches, which a PD pair never does against a colocated server (requests join the decode
instance when their KV has arrived). With ``SGLANG_HISPARSE_CPU_BATCH_INVARIANT=1`` this plugin turns
oneDNN off in every process it loads in (``torch.backends.mkldnn.enabled = False``): torch's own
CPU GEMM computes each output element in a fixed order, so a row's result is the same at any batch
size (tests/test_test_plugins.py checks it on the model's shapes). Prefill is ~3-4x slower in the
projections. Without the variable, or with a GPU, it does nothing. Loaded by every server that has
the package installed, with HiSparse or without, so a baseline and ours compute alike.
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENV = "SGLANG_HISPARSE_CPU_BATCH_INVARIANT"

logger = logging.getLogger(__name__)


def register(registry: Any = None) -> None:
    """Entry point. Side effect (CPU, variable set): oneDNN off in this process."""
    value = os.environ.get(ENV, "")
    if value in ("", "0"):
        return
    if value != "1":
        raise ValueError(f"{ENV}={value!r}: allowed values are 1, 0 or unset")
    import torch

    if torch.cuda.is_available():
        return
    torch.backends.mkldnn.enabled = False
    logger.info("sglang-hisparse (test): CPU matrix products batch-invariant (oneDNN off)")
