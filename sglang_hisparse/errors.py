"""Exceptions the plugin raises on purpose."""


class HiSparsePluginError(RuntimeError):
    """sglang-hisparse cannot run as configured; the message says why and what to do."""
