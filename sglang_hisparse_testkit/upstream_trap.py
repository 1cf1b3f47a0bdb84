"""Test-only plugin (entry point ``hisparse_upstream_trap``): SGLang's own HiSparse must not run.

With ``SGLANG_HISPARSE_TRAP_UPSTREAM=1``, every function defined by SGLang's own HiSparse
classes (coordinator, allocators, DSA device pool, host-pool mixin) and its HiSparse kernel ops
module is replaced, on SGLang's class and module objects themselves, by a trap that logs
``sglang-hisparse trap: <name> called`` at ERROR and raises. It runs at plugin load, before
SGLang applies the registered hooks (which rebind those names to our classes), and logs
``sglang-hisparse trap: installed on N upstream members``. An end-to-end run with the trap on and
no trap line in its log shows that none of upstream's HiSparse behaviour ran. Without the
variable it does nothing. It edits no file: only the objects of the process that loads it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from typing import Any, Callable

ENV = "SGLANG_HISPARSE_TRAP_UPSTREAM"

UPSTREAM_CLASSES = (
    "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator",
    "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator",
    "sglang.srt.mem_cache.allocator.hisparse.DeepSeekV4HiSparseTokenToKVPoolAllocator",
    "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool",
    "sglang.srt.mem_cache.pool_host.hisparse.HiSparseHostPoolMixin",
)
UPSTREAM_MODULES = ("sglang.kernels.ops.kvcache.hisparse",)
"""Modules whose every function is trapped when they import on this machine."""

logger = logging.getLogger(__name__)


def _trap(name: str) -> Callable[..., Any]:
    def trapped(*args: Any, **kwargs: Any) -> Any:
        logger.error("sglang-hisparse trap: %s called", name)
        raise AssertionError(f"sglang-hisparse trap: SGLang's own HiSparse {name} was called")

    trapped.__name__ = name.rsplit(".", 1)[-1]
    return trapped


def install() -> list[str]:
    """Trap every upstream HiSparse function reachable here. Returns the trapped names."""
    trapped = []
    for path in UPSTREAM_CLASSES:
        module_name, class_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), class_name)
        for name, member in list(vars(cls).items()):
            function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if inspect.isfunction(function):
                setattr(cls, name, _trap(f"{path}.{name}"))
                trapped.append(f"{path}.{name}")
    for module_name in UPSTREAM_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # a kernel module may not import without its GPU toolchain
            logger.warning("sglang-hisparse trap: %s not importable here (%s); not trapped", module_name, e)
            continue
        for name, member in list(vars(module).items()):
            if inspect.isfunction(member) and member.__module__ == module_name:
                setattr(module, name, _trap(f"{module_name}.{name}"))
                trapped.append(f"{module_name}.{name}")
    return trapped


def register(registry: Any = None) -> None:
    """Entry point. Installs the traps only when the environment asks for it."""
    if os.environ.get(ENV, "") != "1":
        return
    names = install()
    logger.warning("sglang-hisparse trap: installed on %d upstream members", len(names))
