"""sglang-hisparse: HiSparse for SGLang as a plugin.

The full KV of every decoding request lives in pinned host DRAM; each request keeps, per layer,
a fixed B-slot GPU hot buffer; each sparse layer's top-k selection is resolved to hot-buffer
slots before attention runs, copying misses from host. Outputs are exactly those of a server
that keeps all KV in HBM.
"""

__version__ = "0.1.0"

SUPPORTED_SGLANG_VERSION = "0.5.17"
"""The one SGLang release whose seams (module paths, protocols) this plugin was checked against."""


def _map_checkout_subpackages() -> None:
    """Make ``sglang_hisparse.kernels`` / ``.patches`` importable from a source checkout.

    The wheel (and an editable install) map the repository's top-level ``kernels/`` and
    ``patches/`` folders into this package (pyproject ``package-dir``). When the package is
    imported straight from a checkout on ``PYTHONPATH`` (the GPU test machine), those folders sit
    next to this one instead: add the repository root to this package's search path so the same
    import names resolve there. No effect on an installed wheel.
    """
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if not os.path.isdir(os.path.join(here, "kernels")) and os.path.isfile(
        os.path.join(root, "kernels", "__init__.py")
    ):
        __path__.append(root)  # type: ignore[name-defined]


_map_checkout_subpackages()
