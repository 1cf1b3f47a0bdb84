"""Which server settings HiSparse (ours) can serve, checked before any GPU work.

Pure policy on plain values: the seam in ``patches/validation.py`` reads them off SGLang's
server arguments. Each failure is one line naming the flag, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_hisparse.config import LINEAR_SPECULATION_ALGORITHMS, HiSparseConfig, HiSparseConfigError

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
    dcp_size: int = 1
    attn_cp_size: int = 1
    enable_prefill_cp: bool = False
    disaggregation_mode: str = "null"
    enable_unified_memory: bool = False
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_adaptive: bool = False
    enable_multi_layer_eagle: bool = False
    disable_overlap_schedule: bool = False
    enable_hierarchical_cache: bool = False
    disaggregation_transfer_backend: str = "mooncake"
    test_retract: bool = False
    """``SGLANG_TEST_RETRACT``: SGLang retracts requests on purpose every few decode steps."""


def check_server_settings(s: ServerSettings) -> None:
    """Raise :class:`HiSparseConfigError` for the first setting HiSparse cannot serve."""
    if s.is_deepseek_v4:
        _check_deepseek_v4(s)
        return
    if not s.is_dsa_model:
        raise HiSparseConfigError(
            f"--enable-hisparse: model {s.architecture} has no DSA indexer; HiSparse serves "
            "DSA models (DeepSeek-V3.2, GLM-5)"
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
    _check_speculation(s)
    if not s.disable_radix_cache:
        _check_prefix_reuse(s)
    if s.pp_size != 1:
        raise HiSparseConfigError(
            f"--enable-hisparse: --pp-size={s.pp_size} is not supported (must be 1)"
        )
    _check_parallel_layout(s)


def _check_prefix_reuse(s: ServerSettings) -> None:
    """The radix cache on (prefix reuse, ``prefix/host_tree.py``): colocated serving or a PD decode
    instance (``--disaggregation-decode-enable-radix-cache``: SGLang turns its radix cache on only
    then; the prefill skips a prefix the decode instance holds, ``prefix/pd_prefix.py``), without
    speculation. What SGLang would build instead of a plain radix cache (HiCache, other backends) is
    refused where the cache is built (``patches/prefix_cache.py``)."""
    if s.speculative_algorithm:
        raise HiSparseConfigError(
            f"--enable-hisparse with the radix cache on (prefix reuse) does not support --speculative-algorithm="
            f"{s.speculative_algorithm}: add --disable-radix-cache")
    if s.disaggregation_mode not in ("null", "decode"):
        raise HiSparseConfigError(
            f"--enable-hisparse with the radix cache on (prefix reuse) does not support --disaggregation-mode="
            f"{s.disaggregation_mode} (allowed: null, decode): add --disable-radix-cache")
    if s.enable_hierarchical_cache:
        raise HiSparseConfigError(
            "--enable-hisparse does not support --enable-hierarchical-cache (HiCache keeps its own host copy of "
            "the KV; the radix cache alone reuses prefixes with HiSparse): leave it off")


def _check_deepseek_v4(s: ServerSettings) -> None:
    """DeepSeek-V4 (its C4 layers' entries go through HiSparse; SGLang picks its attention
    backend and KV dtype itself): colocated serving or a PD decode instance, without speculation."""
    if not s.disable_radix_cache:
        raise HiSparseConfigError(
            "--enable-hisparse with DeepSeek-V4 requires --disable-radix-cache (prefix reuse serves DSA models only)")
    if s.enable_mixed_chunk:
        raise HiSparseConfigError(
            "--enable-hisparse: --enable-mixed-chunk is not supported (decode requests must not share a batch "
            "with prefill chunks)")
    if s.speculative_algorithm:
        raise HiSparseConfigError(
            f"--enable-hisparse: --speculative-algorithm={s.speculative_algorithm} with DeepSeek-V4 is not "
            "supported (SGLang 0.5.17 does not call HiSparse from V4's draft and verify steps): leave it unset")
    if s.disaggregation_mode == "decode":
        _check_deepseek_v4_pd_decode(s)
    if s.pp_size != 1:
        raise HiSparseConfigError(f"--enable-hisparse: --pp-size={s.pp_size} is not supported (must be 1)")
    _check_parallel_layout(s)


V4_PD_TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "fake")
"""What SGLang 0.5.17's V4 direct-to-host path accepts: Mooncake (``mooncake_tcp`` is Mooncake over
TCP, renamed by SGLang's PD argument hook) and its ``fake`` backend (no KV moves: benchmarks)."""


def _check_deepseek_v4_pd_decode(s: ServerSettings) -> None:
    """A DeepSeek-V4 PD decode instance: the prefill writes the C4 entries into our host rows
    (``C4Coordinator.admit_request_direct``). SGLang 0.5.17 sends them that way over Mooncake only
    (its decode path raises for any other backend when the first request arrives), and cannot
    retract a V4 request on a decode instance at all (it would take a CPU copy of the V4 pool,
    which SGLang does not implement, with or without HiSparse), so its test switch that retracts
    on purpose is refused here rather than crashing the scheduler later."""
    if s.disaggregation_transfer_backend not in V4_PD_TRANSFER_BACKENDS:
        raise HiSparseConfigError(
            f"--enable-hisparse with DeepSeek-V4 on a PD decode instance: --disaggregation-transfer-backend="
            f"{s.disaggregation_transfer_backend} is not supported (allowed: {', '.join(V4_PD_TRANSFER_BACKENDS)}; "
            "SGLang 0.5.17 writes V4's C4 KV straight into the host pool over Mooncake only)")
    if s.test_retract:
        raise HiSparseConfigError(
            "--enable-hisparse with DeepSeek-V4 on a PD decode instance: SGLANG_TEST_RETRACT is not supported "
            "(SGLang 0.5.17 cannot retract a V4 request on a decode instance: its V4 pool has no CPU copy): unset it")


def _check_speculation(s: ServerSettings) -> None:
    """Linear speculative decoding (a fixed verify window per request) is served; anything whose
    window varies or branches is refused, as is what the first version does not cover yet."""
    algorithm = s.speculative_algorithm
    if not algorithm:
        return
    if algorithm not in LINEAR_SPECULATION_ALGORITHMS:
        raise HiSparseConfigError(
            f"--enable-hisparse: --speculative-algorithm={algorithm} is not supported by sglang-hisparse "
            "(allowed: EAGLE or NEXTN with --speculative-eagle-topk 1)")
    if s.speculative_eagle_topk != 1:
        raise HiSparseConfigError(
            f"--enable-hisparse: --speculative-eagle-topk={s.speculative_eagle_topk} is not supported by "
            "sglang-hisparse (linear speculation only: --speculative-eagle-topk 1)")
    if s.speculative_adaptive:
        raise HiSparseConfigError(
            "--enable-hisparse: --speculative-adaptive is not supported by sglang-hisparse (the verify "
            "window must keep one size: leave it off)")
    if s.enable_multi_layer_eagle:
        raise HiSparseConfigError(
            "--enable-hisparse: --enable-multi-layer-eagle is not supported by sglang-hisparse (leave it off)")
    if not s.disable_overlap_schedule:
        raise HiSparseConfigError(
            f"--enable-hisparse with --speculative-algorithm={algorithm} needs --disable-overlap-schedule: "
            "sglang-hisparse maps each verify window from the committed lengths on the host, which the "
            "overlap scheduler learns one step late")
    if s.disaggregation_mode == "decode":
        raise HiSparseConfigError(
            f"--enable-hisparse: --speculative-algorithm={algorithm} with --disaggregation-mode=decode is "
            "not supported by sglang-hisparse yet (allowed: --disaggregation-mode null)")


def check_speculative_config(config: HiSparseConfig) -> None:
    """HiSparse options that have no meaning with a verify window of more than one token."""
    if config.query_rows > 1 and config.residency:
        raise HiSparseConfigError(
            "--hisparse-config: residency=true is not supported with speculative decoding (resident "
            "requests have no verify window): leave residency off")


def _check_parallel_layout(s: ServerSettings) -> None:
    """Layouts sglang-hisparse has not been run with are refused. Allowed: TP and DP attention
    (each rank keeps its own hot buffers and host rows), colocated prefill and decode."""
    for flag, value in (("--dcp-size", s.dcp_size), ("--attn-cp-size", s.attn_cp_size)):
        if value != 1:
            raise HiSparseConfigError(
                f"--enable-hisparse: {flag}={value} is not supported by sglang-hisparse (must be 1: "
                "context parallelism splits a request's KV across ranks, which the hot buffers do not)"
            )
    if s.enable_unified_memory:
        raise HiSparseConfigError(
            "--enable-hisparse: --enable-unified-memory is not supported by sglang-hisparse (must be off: "
            "it replaces the KV allocator HiSparse builds)"
        )
    if s.enable_prefill_cp:
        raise HiSparseConfigError(
            "--enable-hisparse: --enable-prefill-cp is not supported by sglang-hisparse (must be off)"
        )
    if s.disaggregation_mode == "prefill":
        raise HiSparseConfigError(
            "--enable-hisparse: --disaggregation-mode=prefill is not supported (HiSparse runs on the "
            "decode instance, which receives the prefill's KV in its host rows; allowed: null, decode)"
        )


def check_kernel_buffer_size(config: HiSparseConfig) -> None:
    """The fused kernel keeps a request's hot-buffer tables in one block's shared memory (its
    top-k-sized arrays spill to global memory when they do not fit): refuse a
    ``device_buffer_size`` above what fits for the model's top_k and the replacement policy (a
    verify step resolves a union of ``query_rows x top_k`` positions per request)."""
    from sglang_hisparse.resolver.cuda import MAX_SMEM_BYTES, largest_buffer_size

    reuse = config.replacement == "reuse"
    width = config.query_rows * config.top_k
    limit = largest_buffer_size(width, reuse)
    if limit < width:
        steps = max((n for n in range(1, config.query_rows + 1)
                     if largest_buffer_size(n * config.top_k, reuse) >= n * config.top_k), default=0)
        fewer = f"--speculative-num-steps {steps - 1} or fewer, or " if steps >= 2 else ""
        raise HiSparseConfigError(
            f"--enable-hisparse: a verify step of {config.query_rows} tokens per request resolves a union of "
            f"{config.query_rows} x top_k={width} positions, which the fused kernel's shared memory "
            f"({MAX_SMEM_BYTES // 1024} KiB per block) does not hold for any device_buffer_size"
            f"{' with replacement=reuse' if reuse else ''}: use {fewer}--hisparse-config resolver=reference")
    if config.device_buffer_size > limit:
        what = f"top_k={config.top_k}" if config.query_rows == 1 else (
            f"a verify union of {config.query_rows} x top_k={width} positions")
        if reuse:
            what += " with replacement=reuse"
        raise HiSparseConfigError(
            f"--hisparse-config: invalid device_buffer_size={config.device_buffer_size}: the fused "
            f"kernel's shared memory ({MAX_SMEM_BYTES // 1024} KiB per block) holds at most {limit} "
            f"slots for {what}; allowed: [{width}, {limit}]"
        )
