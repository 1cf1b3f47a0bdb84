"""Seam: refuse to run HiSparse unless every HiSparse object in the scheduler is ours.

Upstream target: ``sglang.srt.managers.scheduler.Scheduler.init_hisparse_coordinator`` (AFTER).
Checked against: SGLang 0.5.17.

SGLang's plugin loader logs and swallows plugin exceptions, and ``HookRegistry.apply_hooks``
does the same per target: a broken install would silently serve with SGLang's own HiSparse.
This hook runs in every scheduler process right after the coordinator is attached and raises
if HiSparse is enabled and (a) the installed SGLang is not the supported version, (b) the
coordinator, the allocator or the device pool is not the class this plugin registered, or (c) a
function hook this plugin registered is not what its target runs now (e.g. the speculative step
start: without it a verify window would read unmapped rows, silently).
With HiSparse disabled it does nothing.
"""

from __future__ import annotations

import pkgutil
from typing import Any, Callable, Mapping, Optional, Sequence

from sglang_hisparse.errors import HiSparsePluginError

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_hisparse_coordinator"
CHECKED_AGAINST = "0.5.17"

ROLES = ("coordinator", "allocator", "device_pool")


def scheduler_objects(scheduler: Any) -> dict[str, Any]:
    """The HiSparse objects a scheduler holds, by role."""
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    get_kvcache = getattr(allocator, "get_kvcache", None)
    c4_pool = getattr(allocator, "hisparse_kvcache", None)  # DeepSeek-V4: the pool HiSparse serves is its C4 pool
    return {
        "coordinator": getattr(scheduler, "hisparse_coordinator", None),
        "allocator": allocator,
        "device_pool": c4_pool if c4_pool is not None else (get_kvcache() if callable(get_kvcache) else None),
    }


def unapplied(hooks: Sequence[tuple[str, Any]]) -> list[str]:
    """The targets of ``(target, hook)`` pairs whose current value does not run ``hook`` (a
    class REPLACE: is not the class; a function hook: no wrapper in its ``__wrapped__`` chain holds
    it), in order."""
    missing = []
    for target, hook in hooks:
        owner_path, name = target.rsplit(".", 1)
        try:
            current = getattr(pkgutil.resolve_name(owner_path), name)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
            continue
        if not _runs(current, hook):
            missing.append(target)
    return missing


def _runs(fn: Any, hook: Any) -> bool:
    for _ in range(64):  # a chain of wrappers, one per hook on the target
        fn = getattr(fn, "__func__", fn)  # classmethods and bound methods
        if fn is hook or any(_cell_holds(cell, hook) for cell in getattr(fn, "__closure__", None) or ()):
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def _cell_holds(cell: Any, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def make_hook(
    expected: Mapping[str, tuple[type, ...]], version_problem: Optional[str],
    hooks: Sequence[tuple[str, Any]] = (),
) -> Callable[..., None]:
    """Build the AFTER hook.

    Args:
        expected: role -> the classes this plugin registered for it (DSA's and DeepSeek-V4's). A
            role missing here has no implementation of ours yet, so HiSparse must not start.
        version_problem: a message when the installed SGLang is unsupported, else None.
        hooks: every ``(target, hook)`` the plugin registered (read when the hook runs).
    """

    def check_hisparse_objects(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        if not getattr(scheduler, "enable_hisparse", False):
            return None
        if version_problem is not None:
            raise HiSparsePluginError(version_problem)
        objects = scheduler_objects(scheduler)
        problems = []
        for role in ROLES:
            classes = expected.get(role)
            obj = objects[role]
            if not classes:
                problems.append(f"{role}: sglang-hisparse has no implementation yet")
            elif not isinstance(obj, tuple(classes)):
                names = " or ".join(f"{c.__module__}.{c.__qualname__}" for c in classes)
                problems.append(f"{role}: expected {names}, found {type(obj).__module__}.{type(obj).__qualname__}")
        problems += [f"hook not applied: {target}" for target in unapplied(hooks)]
        if problems:
            raise HiSparsePluginError(
                "--enable-hisparse: sglang-hisparse is installed but not in control ("
                + "; ".join(problems)
                + "). Look for 'Failed to' lines from sglang.srt.plugins above, or set "
                "SGLANG_PLUGINS to names that exclude 'hisparse' to run SGLang's own HiSparse."
            )
        return None

    return check_hisparse_objects


def register(registry: Any, expected: Mapping[str, tuple[type, ...]], version_problem: Optional[str],
             hooks: Sequence[tuple[str, Any]] = ()) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, make_hook(expected, version_problem, hooks), HookType.AFTER)
