"""JIT build and cache of the resolve kernels (``kernels/resolve.cuh``).

Modules are built with SGLang's tvm-ffi loader (``sglang.kernels.jit.utils.load_jit``): nvcc +
ninja, one shared library per module, cached under ``$TVM_FFI_CACHE_DIR`` (default
``~/.cache/tvm-ffi``) in a directory named after the module, its source hash, the GPU arch and the
tvm-ffi version. A later process finds the built library there and loads it without compiling.

Modules (every template parameter is in the module name, so it is in the cache key):

* ``hisparse_resolve_<item_bytes>_<B>_<top_k>``: ``bind`` / ``bind_skip_io`` check a layer's
  unchanging arguments once into a CPU byte tensor; ``launch`` (copies) / ``launch_skip_io`` (plans
  and updates tables, copies nothing) take that tensor and the batch's four tensors;
  ``resolve_prepare`` sets the smem attribute and returns the occupancy (called before CUDA-graph
  capture). LRU replacement. The block size is a launch parameter: one module serves every legal
  block size.
* ``hisparse_resolve_reuse_<item_bytes>_<B>_<top_k>``: the same entry points with the reuse-table
  policy (``replacement: "reuse"``); a server builds only the module of its policy.
* ``hisparse_replay_<item_bytes>``: ``replay`` (copy-only replay of a miss plan).

Side effects: building runs nvcc (seconds to tens of seconds, once per machine and cache dir) and
sets ``TVM_FFI_CUDA_ARCH_LIST`` in this process's environment when it is unset, so that concurrent
builds in threads all target the same arch (SGLang's loader sets it temporarily per build).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

KERNEL_FILE = "resolve.cuh"
EXTRA_CUDA_CFLAGS = ("-lineinfo",)
"""Line tables for compute-sanitizer reports; no effect on the generated code."""

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def kernel_source(file: str = KERNEL_FILE) -> Path:
    """Path of a kernel source (default ``resolve.cuh``): inside the installed package, or the
    repository's ``kernels/``."""
    from sglang_hisparse.kernels import source_dir

    path = source_dir() / file
    if not path.is_file():
        raise FileNotFoundError(f"sglang-hisparse kernel source missing: {path}")
    return path


def resolve_module_name(item_bytes: int, device_buffer_size: int, top_k: int, reuse: bool = False) -> str:
    return f"{_resolve_base(reuse)}_{item_bytes}_{device_buffer_size}_{top_k}"


def _resolve_base(reuse: bool) -> str:
    return "hisparse_resolve_reuse" if reuse else "hisparse_resolve"


def resolve_wrappers(item_bytes: int, device_buffer_size: int, top_k: int, reuse: bool = False
                     ) -> list[tuple[str, str]]:
    """(export name, C++ function) pairs of a resolve module (``reuse``: the reuse-table policy's)."""
    args = f"{item_bytes}, {device_buffer_size}, {top_k}"
    policy = "true" if reuse else "false"
    return [
        ("bind", f"hisparse::resolve_bind<{args}, false, {policy}>"),
        ("bind_skip_io", f"hisparse::resolve_bind<{args}, true, {policy}>"),
        ("launch", f"hisparse::resolve_launch<{args}, false, {policy}>"),
        ("launch_skip_io", f"hisparse::resolve_launch<{args}, true, {policy}>"),
        ("resolve_prepare", f"hisparse::resolve_prepare<{args}, {policy}>"),
    ]


def replay_wrappers(item_bytes: int) -> list[tuple[str, str]]:
    return [("replay", f"hisparse::replay<{item_bytes}>")]


DECODE_KERNEL_FILE = "decode.cuh"
DECODE_WRAPPERS = [("decode_ids", "hisparse_decode::decode_ids"), ("map_pages", "hisparse_decode::map_pages")]


@functools.lru_cache(maxsize=None)
def decode_module() -> Any:
    """The decode step's id kernels (``kernels/decode.cuh``: ``decode_ids``, ``map_pages``);
    built on first use, then cached."""
    return _load("hisparse_decode", (), DECODE_WRAPPERS, file=DECODE_KERNEL_FILE)


def _lock_for(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _target_arch() -> Optional[str]:
    """The tvm-ffi arch string SGLang would build for (``9.0a`` on Hopper), or None."""
    try:
        from sglang.kernels.jit.utils import get_jit_cuda_arch

        arch = get_jit_cuda_arch()
        if arch.major > 0:
            return arch.target_name
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor}{'a' if major >= 9 else ''}"
    except Exception:  # no driver: leave the choice to the loader
        pass
    return None


def _load(name: str, args: Sequence[int], wrappers: list[tuple[str, str]], extra_flags: Sequence[str] = (),
          file: str = KERNEL_FILE) -> Any:
    """Build (or load from the cache) one module of ``kernels/<file>``; serialised per module name."""
    key = "_".join([name, *map(str, args)])
    with _lock_for(key):
        if "TVM_FFI_CUDA_ARCH_LIST" not in os.environ:
            arch = _target_arch()
            if arch is not None:
                os.environ["TVM_FFI_CUDA_ARCH_LIST"] = arch
        source = str(kernel_source(file))
        try:
            from sglang.kernels.jit.utils import load_jit
        except ImportError as e:  # SGLang's JIT package unavailable: same build through tvm-ffi
            logger.warning("sglang.kernels.jit unavailable (%s); building %s with tvm-ffi directly", e, key)
            return _load_with_tvm_ffi(key, source, wrappers, extra_flags)
        return load_jit(
            name,
            *map(str, args),
            external_cuda_files=[source],
            cuda_wrappers=wrappers,
            extra_cuda_cflags=[*EXTRA_CUDA_CFLAGS, *extra_flags],
        )


def _sglang_include_dir() -> str:
    """SGLang's JIT headers (``sgl_kernel/*.h``), located without importing ``sglang``."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed: its JIT headers are needed to build the kernels")
    include = Path(list(spec.submodule_search_locations)[0]) / "kernels" / "jit" / "include"
    if not include.is_dir():
        raise ImportError(f"sglang JIT headers not found at {include}")
    return str(include)


def _load_with_tvm_ffi(key: str, source: str, wrappers: list[tuple[str, str]], extra_flags: Sequence[str] = ()) -> Any:
    """The same build as SGLang's ``load_jit`` (flags, wrappers, cache layout), through tvm-ffi."""
    import hashlib

    import tvm_ffi
    from tvm_ffi.cpp import load_inline

    arch = os.environ.get("TVM_FFI_CUDA_ARCH_LIST", "").split()
    if not arch:
        raise RuntimeError("cannot tell the GPU arch: set TVM_FFI_CUDA_ARCH_LIST (e.g. 9.0a)")
    major, minor = arch[0].rstrip("af").split(".")
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]
    module_name = f"sgl_kernel_jit_{key}_{digest}"
    cache = Path(os.environ.get("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi")).expanduser()
    build_dir = cache / f"{module_name}__arch_{arch[0]}__tvmffi_{getattr(tvm_ffi, '__version__', 'unknown')}"
    prebuilt = build_dir / f"{module_name}.so"
    if prebuilt.is_file():
        return tvm_ffi.load_module(str(prebuilt))
    cuda_sources = [f'#include "{source}"'] + [
        f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({export}, ({fn}));" for export, fn in wrappers
    ]
    return load_inline(
        module_name,
        cpp_sources=[],
        cuda_sources=cuda_sources,
        extra_cflags=["-std=c++20", "-O3"],
        extra_cuda_cflags=[
            f"-DSGL_CUDA_ARCH={int(major) * 100 + int(minor) * 10}",
            "-std=c++20",
            "-O3",
            "--expt-relaxed-constexpr",
            *EXTRA_CUDA_CFLAGS,
            *extra_flags,
        ],
        extra_include_paths=[_sglang_include_dir()],
        build_directory=str(build_dir),
    )


@functools.lru_cache(maxsize=None)
def resolve_module(item_bytes: int, device_buffer_size: int, top_k: int, reuse: bool = False) -> Any:
    """The resolve module for one (item size, B, top_k, policy); built on first use, then cached."""
    return _load(
        _resolve_base(reuse),
        (item_bytes, device_buffer_size, top_k),
        resolve_wrappers(item_bytes, device_buffer_size, top_k, reuse),
    )


@functools.lru_cache(maxsize=None)
def resolve_stage_clock_module(item_bytes: int, device_buffer_size: int, top_k: int, twice: bool = False,
                               reuse: bool = False) -> Any:
    """Diagnostic build of the resolve module (``-DHISPARSE_STAGE_CLOCK``): CTA 0 writes per-stage
    clock stamps into the workspace (see ``kernels/resolve.cuh``); ``twice``: the skip-IO kernel
    plans twice per launch and keeps the second pass's stamps (warm instruction caches). For
    benchmarks only; a separate module name keeps it out of the production cache entry."""
    flags = ("-DHISPARSE_STAGE_CLOCK",) + (("-DHISPARSE_STAGE_CLOCK_TWICE",) if twice else ())
    return _load(
        _resolve_base(reuse) + "_stage_clock" + ("_twice" if twice else ""),
        (item_bytes, device_buffer_size, top_k),
        resolve_wrappers(item_bytes, device_buffer_size, top_k, reuse),
        extra_flags=flags,
    )


@functools.lru_cache(maxsize=None)
def replay_module(item_bytes: int) -> Any:
    """The plan-replay module for one item size."""
    return _load("hisparse_replay", (item_bytes,), replay_wrappers(item_bytes))


def build_all(jobs: Sequence[Callable[[], Any]], max_workers: Optional[int] = None) -> list[Any]:
    """Run module builds concurrently (each is an nvcc subprocess); re-raises the first error."""
    if not jobs:
        return []
    workers = max_workers or min(len(jobs), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]
