"""Which resolver runs a layer, behind one call.

Rules (config key ``resolver``):

* ``reference``: the pure-torch reference, on any device.
* ``cuda``: the fused kernel; refused (HiSparsePluginError) unless the device is a CUDA device of
  a CUDA build of torch (not ROCm).
* ``auto`` (default): the kernel on CUDA devices of a CUDA build, the reference elsewhere.

:func:`resolve_layer` then forwards the reference's keywords to the chosen implementation; the
kernel-only keywords (``workspace``, ``block_size``) are dropped for the reference.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Optional, Union

import torch

from sglang_hisparse.errors import HiSparsePluginError

Impl = Literal["cuda", "reference"]


def kernel_supported(device: Union[torch.device, str]) -> bool:
    """True when the fused kernel can run on ``device`` (CUDA device, CUDA build of torch)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.version.cuda is not None and torch.version.hip is None


def choose_resolver(setting: str, device: Union[torch.device, str]) -> Impl:
    """Apply the rules above to the config's ``resolver`` setting and the KV device."""
    if setting == "reference":
        return "reference"
    if setting == "cuda":
        if not kernel_supported(device):
            raise HiSparsePluginError(
                f"--hisparse-config resolver=cuda needs a CUDA device with a CUDA build of torch; "
                f"the KV cache is on {torch.device(device)} (torch CUDA {torch.version.cuda}); "
                "use resolver=auto or resolver=reference"
            )
        return "cuda"
    if setting == "auto":
        return "cuda" if kernel_supported(device) else "reference"
    raise ValueError(f"unknown resolver setting {setting!r}; expected auto, reference or cuda")


def resolve_layer(
    impl: Impl, *, workspace: Optional[Any] = None, block_size: Optional[int] = None, **kwargs: Any
) -> None:
    """Resolve one layer with ``impl`` (keywords of ``reference.resolve_reference``).

    Side effects: those of the chosen resolver (tables, ``out``, ``device_kv``, plan, counters).
    """
    if impl == "cuda":
        if workspace is None:
            raise ValueError("the CUDA resolver needs a workspace (resolver.cuda.make_workspace)")
        from sglang_hisparse.resolver.cuda import resolve_cuda

        resolve_cuda(workspace=workspace, block_size=block_size, **kwargs)
        return
    if impl == "reference":
        from sglang_hisparse.resolver.reference import resolve_reference

        resolve_reference(**kwargs)
        return
    raise ValueError(f"unknown resolver {impl!r}")



class Resolver:
    """A named resolve function with a start-up hook (JIT build before CUDA-graph capture).

    The coordinator holds one; calling it resolves one layer (keywords of
    ``reference.resolve_reference``).
    """

    def __init__(self, name: str, fn, warmup):
        self.name = name
        self._fn = fn
        self._warmup = warmup

    def __call__(self, **kwargs: Any) -> None:
        self._fn(**kwargs)

    def warmup(self, row_bytes: int, device_buffer_size: int, top_k: int) -> None:
        self._warmup(row_bytes, device_buffer_size, top_k)


def make_resolver(config, device: Union[torch.device, str], max_reqs: int, top_k: int) -> Resolver:
    """The resolver for a server: ``config.resolver`` applied by :func:`choose_resolver`, every
    call going through :func:`resolve_layer`.

    For the kernel, allocates its workspace once (fixed addresses for CUDA graphs) and passes the
    configured block size on every call; ``warmup`` JIT-builds the variant the server needs.
    """
    impl = choose_resolver(config.resolver, device)
    workspace = None
    warmup = lambda *_: None  # noqa: E731 - the reference needs no build
    if impl == "cuda":
        from sglang_hisparse.resolver import cuda as cuda_resolver

        workspace = cuda_resolver.make_workspace(max_reqs, device, top_k=top_k)

        def warmup(row_bytes: int, device_buffer_size: int, top_k_: int) -> None:
            cuda_resolver.warmup_build(row_bytes, device_buffer_size, top_k_, config.swap_in_block_size)

    resolve = functools.partial(resolve_layer, impl, workspace=workspace, block_size=config.swap_in_block_size)
    return Resolver(impl, resolve, warmup)
