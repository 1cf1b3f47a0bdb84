"""Which server settings HiSparse (ours) can serve, checked before any GPU work.

Pure policy on plain values: the seam in ``patches/validation.py`` reads them off SGLang's
server arguments. Each failure is one line naming the flag, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_hisparse.config import HiSparseConfigError

SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")
# Sparse-MLA backends whose page table our resolver output feeds, by KV dtype (CUDA).
CUDA_DSA_BACKENDS_BY_DTYPE = {
    "auto": ("flashmla_sparse",),
    "bfloat16": ("flashmla_sparse",),
    "fp8_e4m3": ("flashmla_kv",),
}


@dataclass(frozen=True)
class ServerSettings:
    """The server arguments HiSparse depends on, already resolved."""

    architecture: str
    is_dsa_model: bool
    is_deepseek_v4: bool
    disable_radix_cache: bool
    kv_cache_dtype: str
    dsa_prefill_backend: Optional[str]
    dsa_decode_backend: Optional[str]
    enable_mixed_chunk: bool
    speculative_algorithm: Optional[str]
    pp_size: int
    cpu_engine: bool = False
    """SGLang's CPU engine: attention runs on our torch DSA path, whatever the DSA backend flags."""


def check_server_settings(s: ServerSettings) -> None:
    """Raise :class:`HiSparseConfigError` for the first setting HiSparse cannot serve."""
    if s.is_deepseek_v4:
        raise HiSparseConfigError(
            f"--enable-hisparse: model {s.architecture} (DeepSeek-V4) is not supported by "
            "sglang-hisparse, which serves DSA models (DeepSeek-V3.2, GLM-5); set "
            "SGLANG_PLUGINS to names that exclude 'hisparse' to use SGLang's own HiSparse"
        )
    if not s.is_dsa_model:
        raise HiSparseConfigError(
            f"--enable-hisparse: model {s.architecture} has no DSA indexer; HiSparse serves "
            "DSA models (DeepSeek-V3.2, GLM-5)"
        )
    if not s.disable_radix_cache:
        raise HiSparseConfigError(
            "--enable-hisparse requires --disable-radix-cache (each request owns its KV)"
        )
    if s.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise HiSparseConfigError(
            f"--enable-hisparse: invalid --kv-cache-dtype={s.kv_cache_dtype}: must be one of "
            f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    allowed = CUDA_DSA_BACKENDS_BY_DTYPE[s.kv_cache_dtype]
    for label, backend in (("prefill", s.dsa_prefill_backend), ("decode", s.dsa_decode_backend)):
        if not s.cpu_engine and backend is not None and backend not in allowed:
            raise HiSparseConfigError(
                f"--enable-hisparse: invalid --dsa-{label}-backend={backend} with "
                f"--kv-cache-dtype={s.kv_cache_dtype}: must be one of {', '.join(allowed)} "
                "or left unset"
            )
    if s.enable_mixed_chunk:
        raise HiSparseConfigError(
            "--enable-hisparse: --enable-mixed-chunk is not supported (decode requests must "
            "not share a batch with prefill chunks)"
        )
    if s.speculative_algorithm:
        raise HiSparseConfigError(
            f"--enable-hisparse: --speculative-algorithm={s.speculative_algorithm} is not "
            "supported by sglang-hisparse yet"
        )
    if s.pp_size != 1:
        raise HiSparseConfigError(
            f"--enable-hisparse: --pp-size={s.pp_size} is not supported (must be 1)"
        )
