"""Seam: a PD decode instance may run our HiSparse with its radix cache on.

Upstream target: ``sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation`` (AROUND).
Checked against: SGLang 0.5.17, where ``ServerArgs.__post_init__`` calls it (importing it at call
time) and its decode branch refuses ``--disaggregation-decode-enable-radix-cache`` with
``--enable-hisparse``; ``enable_hisparse`` is read nowhere else in it. The same branch turns the
radix cache on (``disable_radix_cache = False``) and refuses the fake transfer backend and
speculation, which stay SGLang's.

Ours: for exactly that combination, the original runs with ``enable_hisparse`` reported off and
restored before it returns (or raises); our launcher checks (``patches/validation.py``) then decide
what HiSparse allows with the decode radix cache (``prefix/pd_prefix.py``). Every other setting
runs the original unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

TARGET = "sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation"
CHECKED_AGAINST = "0.5.17"


def hisparse_with_decode_radix(server_args: Any) -> bool:
    return (bool(getattr(server_args, "enable_hisparse", False))
            and getattr(server_args, "disaggregation_mode", "null") == "decode"
            and bool(getattr(server_args, "disaggregation_decode_enable_radix_cache", False)))


def handle_pd_disaggregation(original: Callable[..., Any], server_args: Any, *args: Any, **kwargs: Any) -> Any:
    if not hisparse_with_decode_radix(server_args):
        return original(server_args, *args, **kwargs)
    server_args.enable_hisparse = False
    try:
        return original(server_args, *args, **kwargs)
    finally:
        server_args.enable_hisparse = True


def register(registry: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(TARGET, handle_pd_disaggregation, HookType.AROUND)
