"""Choose the resolver a coordinator uses: the CUDA kernel on CUDA, the reference elsewhere.

Both take the same keyword arguments (see ``reference.resolve_reference``). ``resolver`` in the
config selects: ``auto`` (kernel on CUDA devices, reference otherwise), ``reference``, or
``cuda`` (refuse to start if the kernel cannot be used).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.resolver.reference import resolve_reference

logger = logging.getLogger(__name__)


class Resolver:
    """A named resolve function with a start-up hook (JIT build before CUDA-graph capture)."""

    def __init__(self, name: str, fn: Callable[..., Any], warmup: Callable[[int, int, int], None]):
        self.name = name
        self._fn = fn
        self._warmup = warmup

    def __call__(self, **kwargs: Any) -> None:
        self._fn(**kwargs)

    def warmup(self, row_bytes: int, device_buffer_size: int, top_k: int) -> None:
        self._warmup(row_bytes, device_buffer_size, top_k)


def reference_resolver() -> Resolver:
    return Resolver("reference", resolve_reference, lambda *_: None)


def make_resolver(config: HiSparseConfig, device: torch.device, max_reqs: int) -> Resolver:
    want_cuda = config.resolver == "cuda" or (config.resolver == "auto" and device.type == "cuda")
    if not want_cuda:
        return reference_resolver()
    if device.type != "cuda":
        raise HiSparsePluginError(
            f"--hisparse-config resolver=cuda needs a CUDA device, the server runs on {device.type}"
        )
    from sglang_hisparse.resolver import cuda as cuda_resolver

    workspace = cuda_resolver.make_workspace(max_reqs, device)

    def resolve(**kwargs: Any) -> None:
        cuda_resolver.resolve_cuda(workspace=workspace, block_size=config.swap_in_block_size, **kwargs)

    def warmup(row_bytes: int, device_buffer_size: int, top_k: int) -> None:
        cuda_resolver.warmup_build(row_bytes, device_buffer_size, top_k, config.swap_in_block_size)

    return Resolver("cuda", resolve, warmup)
