"""Which resolver runs a layer, behind one call.

Rules (config key ``resolver``), applied to the :class:`Platform` the KV cache lives on:

* ``reference``: the pure-torch reference, on any platform.
* ``cuda``: the fused kernel; refused unless the platform can run it (:func:`kernel_problem`).
* ``auto`` (default): the kernel where it can run; the reference on SGLang's CPU engine (the
  CPU platform has no kernel by design); any other platform (ROCm, a GPU the kernel is not
  built for, XPU, ...) is refused: no silent fallback to a resolver hundreds of times slower.

The fused kernel is built (JIT) for sm_90a and validated on H100/H200 only.

:func:`resolve_layer` then forwards the reference's keywords to the chosen implementation; the
kernel-only keywords (``workspace``, ``block_size``) are dropped for the reference.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch

from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.resolver.reference import replay_plan_reference, resolve_reference

logger = logging.getLogger(__name__)

Impl = Literal["cuda", "reference"]

KERNEL_CAPABILITIES = ((9, 0),)
"""Compute capabilities the fused kernel is built (sm_90a) and validated for."""


@dataclass(frozen=True)
class Platform:
    """Where the KV cache lives, as far as the resolver choice cares."""

    device_type: str
    """``torch.device(...).type``: cuda (also ROCm builds), cpu, xpu, ..."""
    rocm: bool = False
    capability: Optional[tuple[int, int]] = None
    """Compute capability of the CUDA device (None off CUDA)."""

    def describe(self) -> str:
        if self.device_type != "cuda":
            return f"a {self.device_type} device"
        if self.rocm:
            return "a ROCm GPU"
        return f"a GPU of compute capability {self.capability[0]}.{self.capability[1]}"


def platform_of(device: Union[torch.device, str]) -> Platform:
    """Read the platform of ``device`` (queries the GPU's compute capability on CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return Platform(device.type)
    if torch.version.hip is not None:
        return Platform("cuda", rocm=True)
    return Platform("cuda", capability=tuple(torch.cuda.get_device_capability(device)))


def kernel_problem(platform: Platform) -> Optional[str]:
    """Why the fused kernel cannot run on ``platform``, or None when it can."""
    if platform.device_type != "cuda" or platform.rocm or platform.capability not in KERNEL_CAPABILITIES:
        return f"the fused kernel runs on NVIDIA sm_90 GPUs (H100/H200) only; the KV cache is on {platform.describe()}"
    return None


def choose_resolver(setting: str, platform: Platform) -> Impl:
    """Apply the rules above. Raises HiSparsePluginError (one line naming the key and the
    allowed values) for a combination that cannot run."""
    if setting == "reference":
        return "reference"
    if setting not in ("auto", "cuda"):
        raise ValueError(f"unknown resolver setting {setting!r}; expected auto, reference or cuda")
    if setting == "auto" and platform.device_type == "cpu":
        return "reference"
    problem = kernel_problem(platform)
    if problem is not None:
        raise HiSparsePluginError(
            f"--hisparse-config resolver={setting}: {problem}; allowed here: resolver=reference "
            "(pure torch, exact but slow)"
        )
    return "cuda"


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
        resolve_reference(**kwargs)
        return
    raise ValueError(f"unknown resolver {impl!r}")



class Resolver:
    """A named resolve function with a start-up hook (JIT build before CUDA-graph capture).

    The coordinator's ``LayerResolve`` holds one and binds each layer's resolver from it (:meth:`bind`).
    """

    def __init__(self, name: str, warmup, replay, bind):
        self.name = name
        self._warmup = warmup
        self._replay = replay
        self._bind = bind

    def bind(self, width: Optional[int] = None, **static: Any):
        """One layer's resolver: the unchanging keywords (tables, KV buffers, counters, plan,
        residency tables, the reuse policy's ``slot_history`` / ``reuse_levels``, ``num_real_reqs``
        tensor, B) checked once and forwarded unfiltered to the implementation; returns
        ``resolve(top_k_positions, seq_lens, req_pool_indices, out)``. ``width``: positions per
        row (default: the server's top_k; a verify union's ``N x top_k``). Call after
        :meth:`warmup` for that width."""
        return self._bind(width=width, **static)

    def replay(self, *, plan, num_real_reqs: torch.Tensor, host_kv: torch.Tensor, device_kv: torch.Tensor) -> None:
        """Copy-only replay of a miss plan onto another layer's KV (``reference.replay_plan_reference``)."""
        self._replay(plan=plan, num_real_reqs=num_real_reqs, host_kv=host_kv, device_kv=device_kv)

    def warmup(self, row_bytes: int, device_buffer_size: int, top_k: int) -> None:
        self._warmup(row_bytes, device_buffer_size, top_k)


def make_resolver(config, device: Union[torch.device, str], max_reqs: int, top_k: int) -> Resolver:
    """The resolver for a server: ``config.resolver`` applied by :func:`choose_resolver`.

    For the kernel, allocates its workspace once (fixed addresses for CUDA graphs; sized for rows
    of ``config.query_rows x top_k`` positions, the verify union's width, with the spill buffer
    when that width's planner spills: ``cuda.planner_spills``), binds layers
    with the configured block size (``resolver.cuda.bind_resolve_cuda``) and replays plans with
    ``replay_plan_cuda``; ``warmup`` JIT-builds the variants the server needs. For the reference,
    ``reference.resolve_reference`` and ``replay_plan_reference``.
    """
    impl = choose_resolver(config.resolver, platform_of(device))
    workspace = None
    warmup = lambda *_: None  # noqa: E731 - the reference needs no build
    replay = replay_plan_reference
    bind = _bind_reference
    if impl == "cuda":
        from sglang_hisparse.resolver import cuda as cuda_resolver

        width = top_k * config.query_rows
        spill = cuda_resolver.planner_spills(config.device_buffer_size, width, config.replacement == "reuse")
        workspace = cuda_resolver.make_workspace(max_reqs, device, top_k=width, spill=spill)
        if spill:
            logger.info("sglang-hisparse: B=%d with rows of %d positions (top_k x %d query rows) keeps the resolve "
                        "planner's top-k-sized arrays in global memory (%.1f MB of spill slices for %d requests)",
                        config.device_buffer_size, width, config.query_rows,
                        max_reqs * cuda_resolver.planner_spill_bytes(width) / 2**20, max_reqs)

        def warmup(row_bytes: int, device_buffer_size: int, top_k_: int) -> None:
            cuda_resolver.warmup_build(row_bytes, device_buffer_size, top_k_, config.swap_in_block_size,
                                       reuse=config.replacement == "reuse")

        replay = functools.partial(cuda_resolver.replay_plan_cuda, workspace=workspace)

        def bind(width: Optional[int] = None, **static: Any):
            return cuda_resolver.bind_resolve_cuda(workspace=workspace, block_size=config.swap_in_block_size,
                                                   top_k=width or top_k, **static)

    return Resolver(impl, warmup, replay, bind)


def _bind_reference(width: Optional[int] = None, **static: Any):
    def resolve(top_k_positions, seq_lens, req_pool_indices, out) -> None:
        resolve_reference(top_k_positions=top_k_positions, seq_lens=seq_lens, req_pool_indices=req_pool_indices,
                          out=out, **static)

    return resolve
