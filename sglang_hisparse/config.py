"""Typed HiSparse configuration, parsed once from ``--hisparse-config``.

SGLang carries ``--hisparse-config`` as a string: inline JSON or, with this plugin, the path of
a JSON file. Upstream parses it loosely (unknown keys
are kept silently, types are barely checked, ``swap_in_block_size=256`` crashes the kernel). We
parse it into one frozen :class:`HiSparseConfig` and refuse bad input with a one-line message
that names the key, the value and what is allowed.

Only this module knows the keys. Everything else reads the typed object.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

# Hot-buffer slots are stored as int16 in the LRU tables and in the kernel.
MAX_DEVICE_BUFFER_SIZE = 32767
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 1024
DEFAULT_TOP_K = 2048
DEFAULT_HOST_TO_DEVICE_RATIO = 2
DEFAULT_SWAP_IN_BLOCK_SIZE = 960
RESOLVER_CHOICES = ("auto", "reference", "cuda")
REPLACEMENT_CHOICES = ("lru", "reuse")
LINEAR_SPECULATION_ALGORITHMS = ("EAGLE", "NEXTN")
"""Speculative algorithms served with ``--speculative-eagle-topk 1`` (SGLang resolves NEXTN to
EAGLE before HiSparse is validated)."""


class HiSparseConfigError(ValueError):
    """A ``--hisparse-config`` value is invalid. The message is one line for the user."""


@dataclass(frozen=True)
class HiSparseConfig:
    """The effective HiSparse settings of one server.

    Invariants (checked by :func:`parse_hisparse_config`):
      * ``top_k <= device_buffer_size <= 32767``
      * ``host_to_device_ratio >= 1``
      * ``swap_in_block_size`` is a multiple of 32 in ``[32, 1024]``
    """

    top_k: int = DEFAULT_TOP_K
    """Selected positions per request, layer and step. The model's ``index_topk`` wins."""
    device_buffer_size: int = 2 * DEFAULT_TOP_K
    """B: hot-buffer slots per request and layer, not counting the newest-token page."""
    host_to_device_ratio: int = DEFAULT_HOST_TO_DEVICE_RATIO
    """Logical (and host) token capacity as a multiple of the device pool's capacity."""
    swap_in_block_size: int = DEFAULT_SWAP_IN_BLOCK_SIZE
    """CUDA threads per block of the resolve kernel."""
    resolver: str = "auto"
    """Which resolver runs a layer: ``auto`` (CUDA kernel on CUDA, reference elsewhere),
    ``reference`` (pure torch, any device) or ``cuda`` (fail if the kernel cannot run)."""
    skip_io: bool = False
    """Timing oracle: resolve and plan, but copy no KV bytes. Outputs are garbage."""
    stats_log_interval: int = 0
    """Log resolver statistics every N decode steps (0: never; each line synchronizes)."""
    wait_for_staging: bool = False
    """Block in ``collect_ready_reqs`` until every staged request's host copy has finished, so
    a request joins decode at the first scheduler step after its prefill result is processed,
    as it would without HiSparse. With ``--disable-overlap-schedule`` the decode batches are
    then the same as a server without HiSparse (bit-exact comparisons with eager decode).
    Cost: the scheduler waits for the staging copy at each prefill-to-decode transition."""
    indexshare_prefetch: bool = True
    """IndexShare models (layers reusing an earlier layer's top-k): resolve only the source layer
    and copy its misses into the following layers on a side stream, overlapped with the source
    layer's attention and MLP (docs/design.md, "IndexShare prefetch"). No effect on other models;
    false resolves every layer on its own (for A/B)."""
    residency: bool = True
    """Pressure-driven residency (docs/design.md, "Residency"): a request entering decode keeps
    its whole KV on the device while the pool has room, and is demoted to a hot buffer only
    when rows run short. On by default, except with speculative decoding (resident requests
    have no verify window; an explicit ``true`` is refused there)."""
    residency_watermark: float = 0.05
    """Fraction of the device pool's rows that residency keeps free: a request stays resident
    at admission only if that many rows remain, and decode steps demote resident requests when
    free rows fall below it. A number in [0, 0.5]."""
    promotion_interval: int = 32
    """With residency on, every this many decode steps the shortest request of the step decoding
    from a hot buffer (a demoted or PD-admitted one) moves back into rows of its own when the
    pool keeps the watermark and one more hot buffer free after taking them: its KV is loaded from
    host (one copy on the step's stream), its misses end (docs/design.md, "Residency"). The hot
    buffers thus grow back into free rows after pressure, and admission demotes as before when it
    needs the rows. 0: never (demoted requests stay in hot buffers). An integer >= 0."""
    replacement: str = "lru"
    """Hot-buffer replacement policy: ``lru`` (least recently used slot first) or ``reuse`` (the
    history-only reuse table of docs/policies.md: per-slot age and selection count, the packaged
    table decides which unselected slot goes first, ties by LRU; resolver/reference.py)."""
    slot_map: bool = False
    """Plan with a per-request position -> slot map (int16 per layer, request slot and position of
    the context: ``2 x layers x max_running_requests x context`` bytes of device memory, logged at
    start-up) instead of hashing each step's selections: the CUDA kernel then looks each selected
    position up once (docs/kernel.md, "Position -> slot map"). Same outputs either way."""
    max_device_buffer_size: int = 0
    """Elastic hot buffers (issue 44; docs/performance.md): 0 (off) or the largest size a hot
    buffer may grow to, >= ``device_buffer_size`` (the size every buffer opens at, and what
    admission counts). With residency on, free rows beyond the watermark and one more hot buffer
    grow the buffers of long hot-buffer requests (equal shares, whole pages); pressure shrinks them
    back before it demotes or retracts anything, so no fewer requests are held. The resolver's
    tables are this wide. Not with speculative decoding or DeepSeek-V4 (refused)."""
    query_rows: int = dataclasses.field(default=1, metadata={"derived": True})
    """Query rows per request in a decode step: 1, or with linear speculative decoding the verify
    window, ``--speculative-num-draft-tokens`` (draft steps + 1). Set from the server's
    speculative arguments (:func:`speculative_query_rows`), not a ``--hisparse-config`` key. The
    hot buffer's window has this many slots; ``device_buffer_size`` defaults to
    ``(query_rows + 1) x top_k`` and must be at least ``query_rows x top_k``."""

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_names() -> tuple[str, ...]:
    """The ``--hisparse-config`` keys: every field not derived from other server arguments."""
    return tuple(f.name for f in dataclasses.fields(HiSparseConfig) if not f.metadata.get("derived"))


KNOWN_KEYS: tuple[str, ...] = _field_names()


def _fail(key: str, value: Any, allowed: str) -> HiSparseConfigError:
    return HiSparseConfigError(
        f"--hisparse-config: invalid {key}={json.dumps(value)}: {allowed}"
    )


def _require_int(raw: Mapping[str, Any], key: str, default: int) -> int:
    if key not in raw:
        return default
    value = raw[key]
    # bool is an int subclass; "true" is never a valid size.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(key, value, "must be an integer")
    return value


def _require_bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    if key not in raw:
        return default
    value = raw[key]
    if not isinstance(value, bool):
        raise _fail(key, value, "must be true or false")
    return value


def _require_choice(
    raw: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]
) -> str:
    if key not in raw:
        return default
    value = raw[key]
    if value not in choices:
        raise _fail(key, value, f"must be one of {', '.join(choices)}")
    return value


def parse_hisparse_config(
    raw_json: Optional[str], model_index_topk: Optional[int] = None, query_rows: int = 1,
    residency_default: bool = True,
) -> HiSparseConfig:
    """Parse and validate ``--hisparse-config``.

    Args:
        raw_json: the value of ``--hisparse-config``: a JSON object, the path of a file holding
            one, or None (all defaults).
        model_index_topk: the model's ``index_topk``; when given it is the effective top_k
            (as upstream), whatever the ``top_k`` key says.
        query_rows: query rows per request in a decode step (:attr:`HiSparseConfig.query_rows`).
        residency_default: ``residency`` when the key is absent (and no speculation): false for
            DeepSeek-V4 (:func:`config_from_server_args`).

    Raises:
        HiSparseConfigError: one line naming the key, the value and what is allowed.
    """
    return _parse_cached(raw_json, model_index_topk, int(query_rows), bool(residency_default))


@functools.lru_cache(maxsize=16)
def _load_object(raw_json: Optional[str]) -> dict[str, Any]:
    """The JSON object of ``--hisparse-config`` (empty when not given): inline JSON when the value
    starts with ``{`` or ``[``, else the path of a JSON file (logged once per process). Raises on a
    missing file, bad JSON, a non-object or an unknown key."""
    if raw_json is None or raw_json.strip() == "":
        raw: Any = {}
    elif raw_json.lstrip()[:1] in ("{", "["):
        raw = _decode(raw_json, source="")
    else:
        raw = _decode(_read_config_file(raw_json), source=f" (file {raw_json})")
    if not isinstance(raw, dict):
        raise HiSparseConfigError(
            f"--hisparse-config: expected a JSON object, got {json.dumps(raw)}"
        )

    unknown = sorted(set(raw) - set(KNOWN_KEYS))
    if unknown:
        raise HiSparseConfigError(
            f"--hisparse-config: unknown key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(KNOWN_KEYS)}"
        )
    return raw


def _read_config_file(path: str) -> str:
    """The text of the config file ``path``; one-line errors for what cannot be read."""
    resolved = Path(path).expanduser()
    try:
        text = resolved.read_text()
    except FileNotFoundError:
        raise HiSparseConfigError(
            f"--hisparse-config: {path!r} is neither inline JSON (which starts with '{{') nor an "
            "existing file; pass e.g. '{\"device_buffer_size\": 4096}' or the path of a JSON file"
        ) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise HiSparseConfigError(f"--hisparse-config: cannot read {path!r}: {type(e).__name__}") from None
    logger.info("sglang-hisparse: --hisparse-config read from %s", resolved.resolve())
    return text


def _decode(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise HiSparseConfigError(
            f"--hisparse-config{source}: not valid JSON ({e.msg} at line {e.lineno} "
            f"column {e.colno}); expected an object such as "
            '\'{"device_buffer_size": 4096, "host_to_device_ratio": 2}\''
        ) from None


def _parse_cached(raw_json: Optional[str], model_index_topk: Optional[int], query_rows: int,
                  residency_default: bool = True) -> HiSparseConfig:
    raw = _load_object(raw_json)
    user_top_k = _require_int(raw, "top_k", DEFAULT_TOP_K)
    if user_top_k < 1:
        raise _fail("top_k", user_top_k, "must be >= 1")
    top_k = user_top_k
    if model_index_topk is not None:
        top_k = int(model_index_topk)
        if "top_k" in raw and user_top_k != top_k:
            logger.warning(
                "--hisparse-config top_k=%d ignored: the model's index_topk=%d is used",
                user_top_k,
                top_k,
            )

    device_buffer_size = _require_int(raw, "device_buffer_size", (query_rows + 1) * top_k)
    lowest = query_rows * top_k
    if not lowest <= device_buffer_size <= MAX_DEVICE_BUFFER_SIZE:
        low = f"top_k={top_k}" if query_rows == 1 else (
            f"{query_rows} x top_k={lowest}: a verify step of {query_rows} tokens per request")
        raise _fail(
            "device_buffer_size",
            device_buffer_size,
            f"must be in [{low}, {MAX_DEVICE_BUFFER_SIZE}] "
            "(hot-buffer slots are int16)",
        )

    ratio = _require_int(raw, "host_to_device_ratio", DEFAULT_HOST_TO_DEVICE_RATIO)
    if ratio < 1:
        raise _fail("host_to_device_ratio", ratio, "must be an integer >= 1")

    block = _require_int(raw, "swap_in_block_size", DEFAULT_SWAP_IN_BLOCK_SIZE)
    if block % 32 != 0 or not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
        raise _fail(
            "swap_in_block_size",
            block,
            f"must be a multiple of 32 in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]",
        )

    residency = _require_bool(raw, "residency", query_rows == 1 and residency_default)
    return HiSparseConfig(
        top_k=top_k,
        device_buffer_size=device_buffer_size,
        host_to_device_ratio=ratio,
        swap_in_block_size=block,
        resolver=_require_choice(raw, "resolver", "auto", RESOLVER_CHOICES),
        skip_io=_require_bool(raw, "skip_io", False),
        stats_log_interval=_stats_interval(raw),
        wait_for_staging=_require_bool(raw, "wait_for_staging", False),
        indexshare_prefetch=_require_bool(raw, "indexshare_prefetch", True),
        residency=residency,
        residency_watermark=_watermark(raw),
        promotion_interval=_promotion_interval(raw),
        replacement=_require_choice(raw, "replacement", "lru", REPLACEMENT_CHOICES),
        slot_map=_require_bool(raw, "slot_map", False),
        max_device_buffer_size=_max_buffer_size(raw, device_buffer_size, query_rows, residency),
        query_rows=query_rows,
    )


def _max_buffer_size(raw: Mapping[str, Any], device_buffer_size: int, query_rows: int, residency: bool) -> int:
    value = _require_int(raw, "max_device_buffer_size", 0)
    if value and not device_buffer_size <= value <= MAX_DEVICE_BUFFER_SIZE:
        raise _fail("max_device_buffer_size", value,
                    f"must be 0 (off) or in [device_buffer_size={device_buffer_size}, {MAX_DEVICE_BUFFER_SIZE}]")
    if value and query_rows > 1:
        raise _fail("max_device_buffer_size", value, "must be 0 with speculative decoding (elastic hot buffers "
                    "are for one-token decode steps)")
    if value and not residency:
        raise _fail("max_device_buffer_size", value, "needs residency on (pressure shrinks grown buffers where it "
                    "demotes resident requests)")
    return value


def _watermark(raw: Mapping[str, Any]) -> float:
    value = raw.get("residency_watermark", 0.05)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 0.5:
        raise _fail("residency_watermark", value, "must be a number in [0, 0.5] (fraction of the device pool kept free)")
    return float(value)


def _promotion_interval(raw: Mapping[str, Any]) -> int:
    value = _require_int(raw, "promotion_interval", 32)
    if value < 0:
        raise _fail("promotion_interval", value, "must be an integer >= 0 (decode steps between promotions; 0 = off)")
    return value


def _stats_interval(raw: Mapping[str, Any]) -> int:
    value = _require_int(raw, "stats_log_interval", 0)
    if value < 0:
        raise _fail("stats_log_interval", value, "must be an integer >= 0 (0 = off)")
    return value


def model_index_topk(model_config: Any) -> Optional[int]:
    """The model's ``index_topk`` (DSA), read from an SGLang ``ModelConfig``, or None."""
    for attr in ("hf_text_config", "hf_config"):
        hf = getattr(model_config, attr, None)
        topk = getattr(hf, "index_topk", None) if hf is not None else None
        if topk is not None:
            return int(topk)
    return None


def speculative_query_rows(server_args: Any) -> int:
    """Query rows per request in a decode step of this server: ``--speculative-num-draft-tokens``
    (draft steps + 1; SGLang has resolved it by the time HiSparse is validated) with linear
    speculation (EAGLE or NEXTN, ``--speculative-eagle-topk 1``), else 1 (other speculation is
    refused by the server checks)."""
    if getattr(server_args, "speculative_algorithm", None) not in LINEAR_SPECULATION_ALGORITHMS:
        return 1
    if getattr(server_args, "speculative_eagle_topk", None) != 1:
        return 1
    return max(1, int(server_args.speculative_num_draft_tokens or 1))


V4_RESIDENCY_DEFAULT = False
"""DeepSeek-V4's ``residency`` when not given: off. Measured on an H100 (tiny-dsv4, 24 x 12,000
tokens under pressure, 4 paired rounds; docs/deepseek_v4/gpu-probe.md, gpu_v4probe9): C4 entries
resident decoded at 0.80x the tok/s of hot buffers (median of per-round ratios; no demotion
happened, 0% vs 5% misses), while hot buffers were at parity with SGLang's HiSparse (0.97x paired,
1.09x by medians); ``"residency": true`` turns it on."""


def config_from_server_args(server_args: Any) -> HiSparseConfig:
    """The typed config of a server, with the model's ``index_topk`` and the speculative verify
    window applied; ``residency`` defaults to off for DeepSeek-V4 (:data:`V4_RESIDENCY_DEFAULT`)."""
    model_config = server_args.get_model_config()
    return parse_hisparse_config(
        server_args.hisparse_config,
        model_index_topk(model_config),
        speculative_query_rows(server_args),
        residency_default=V4_RESIDENCY_DEFAULT if is_v4_model(model_config) else True,
    )


def is_v4_model(model_config: Any) -> bool:
    """Whether an SGLang ``ModelConfig`` is DeepSeek-V4 (SGLang's own test on its ``hf_config``;
    a config without one, as a stand-in's, is not)."""
    from sglang.srt.configs.model_config import is_deepseek_v4

    hf_config = getattr(model_config, "hf_config", None)
    return hf_config is not None and bool(is_deepseek_v4(hf_config))
