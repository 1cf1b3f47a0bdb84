"""sglang-hisparse: HiSparse for SGLang as a plugin.

The full KV of every decoding request lives in pinned host DRAM; each request keeps, per layer,
a fixed B-slot GPU hot buffer; each sparse layer's top-k selection is resolved to hot-buffer
slots before attention runs, copying misses from host. Outputs are exactly those of a server
that keeps all KV in HBM.
"""

__version__ = "0.1.0"

SUPPORTED_SGLANG_VERSION = "0.5.17"
"""The one SGLang release whose seams (module paths, protocols) this plugin was checked against."""
