"""The plugin entry point (group ``sglang.srt.plugins``, name ``hisparse``).

SGLang calls :func:`register` with no arguments in the launcher and first thing in every
scheduler process, then applies the registered hooks. SGLang logs and swallows exceptions
raised here, so registration is ordered to fail safe: the self-check (which makes
``--enable-hisparse`` refuse to start unless every HiSparse object is ours) is registered first
and learns each class only once that class's seam is registered.

Nothing changes while ``--enable-hisparse`` is off: the hooked SGLang functions are either only
called on HiSparse paths or check first that our coordinator (or ``--enable-hisparse``) is there
and otherwise call the original unchanged; the REPLACEd classes are only built when HiSparse is
enabled.
"""

from __future__ import annotations

import importlib.metadata
import logging
from types import ModuleType
from typing import Any, Optional, Sequence

from sglang_hisparse import SUPPORTED_SGLANG_VERSION

logger = logging.getLogger(__name__)


def installed_sglang_version() -> str:
    return importlib.metadata.version("sglang")


def version_problem(version: str) -> Optional[str]:
    """The message for an unsupported SGLang, or None when ``version`` is supported."""
    if version == SUPPORTED_SGLANG_VERSION:
        return None
    return f"sglang-hisparse supports SGLang {SUPPORTED_SGLANG_VERSION}; found {version}"


def function_seams() -> list[ModuleType]:
    """Seams that hook functions or methods (no class replacement)."""
    from sglang_hisparse.patches import (
        c4_sparse_prefill,
        config_parser,
        decode_memory_check,
        draft_runner,
        idle_report,
        metrics,
        pd_bootstrap_check,
        pd_prefix_budget,
        pd_prefix_match,
        pd_prefix_prealloc,
        pd_radix_validation,
        pd_retraction,
        prefix_cache,
        prefix_cache_attach,
        request_admission,
        staging_draft,
        validation,
        verify_forward,
        verify_step,
    )

    seams = [validation, config_parser, decode_memory_check, idle_report, request_admission, pd_retraction,
             pd_bootstrap_check, metrics, verify_step, verify_forward, draft_runner, staging_draft, c4_sparse_prefill,
             prefix_cache, prefix_cache_attach, pd_radix_validation, pd_prefix_match, pd_prefix_prealloc,
             pd_prefix_budget]
    if cpu_platform():
        from sglang_hisparse.patches import (
            cpu_capability_probe,
            cpu_dsa_attention,
            cpu_dsa_indexer,
            cpu_paged_allocator,
        )

        seams += [cpu_capability_probe, cpu_paged_allocator, cpu_dsa_indexer, cpu_dsa_attention]
    else:
        from sglang_hisparse.patches import verify_attention

        seams.append(verify_attention)
    return seams


def cpu_platform() -> bool:
    """SGLang runs its CPU engine (no GPU): the torch-native DSA path is needed."""
    from sglang.srt.utils import is_cpu

    return bool(is_cpu())


def class_seams() -> list[ModuleType]:
    """Seams that replace an upstream class with ours; each has ROLE and IMPLEMENTATION."""
    from sglang_hisparse.patches import allocator, c4_allocator, c4_device_pool, coordinator, device_pool

    return [device_pool, allocator, c4_device_pool, c4_allocator, coordinator]


class _Recording:
    """A hook registry that remembers each ``(target, hook)`` it passes on (for the self-check)."""

    def __init__(self, registry: Any, hooks: list):
        self._registry, self._hooks = registry, hooks

    def register(self, target: str, hook: Any, hook_type: Any) -> None:
        self._hooks.append((target, hook))
        self._registry.register(target, hook, hook_type)


def register(
    registry: Any = None,
    *,
    sglang_version: Optional[str] = None,
    seams: Optional[Sequence[ModuleType]] = None,
) -> list:
    """Register our hooks. Arguments exist for tests; SGLang passes none.

    Side effects: registrations in ``registry`` (SGLang's ``HookRegistry`` by default); SGLang
    applies them after every plugin ran. Returns the ``(target, hook)`` pairs registered besides
    the self-check's own (the self-check verifies each is applied).
    """
    from sglang_hisparse.patches import self_check

    if registry is None:
        from sglang.srt.plugins.hook_registry import HookRegistry

        registry = HookRegistry
    version = sglang_version or installed_sglang_version()
    problem = version_problem(version)
    if problem is not None:
        logger.error("%s: only the self-check is registered; --enable-hisparse will refuse to start", problem)
        self_check.register(registry, expected={}, version_problem=problem)
        return []

    # Filled as each seam registers; the self-check reads them when it runs.
    expected: dict[str, tuple[type, ...]] = {}
    hooks: list = []
    self_check.register(registry, expected=expected, version_problem=None, hooks=hooks)
    recording = _Recording(registry, hooks)
    for seam in function_seams():
        seam.register(recording)
    class_seam_list = class_seams() if seams is None else seams
    for seam in class_seam_list:
        seam.register(recording)
    expected.update(expected_classes(class_seam_list))
    logger.info("sglang-hisparse %s: hooks registered for SGLang %s", _own_version(), version)
    return hooks


def expected_classes(seams: Sequence[ModuleType]) -> dict[str, tuple[type, ...]]:
    """Role -> every class the class seams build for it (DSA's and DeepSeek-V4's alike): what the
    self-check accepts in the scheduler for that role."""
    expected: dict[str, tuple[type, ...]] = {}
    for seam in seams:
        expected[seam.ROLE] = expected.get(seam.ROLE, ()) + (seam.IMPLEMENTATION,) + getattr(seam, "ALSO_BUILDS", ())
    return expected


def _own_version() -> str:
    from sglang_hisparse import __version__

    return __version__
