"""Random valid resolve cases, for the kernel tests, the sanitizer run and the benchmark.

A case is one batch (one kernel launch) with fresh random per-request states that satisfy the
reference's preconditions:

* long requests (``seq_len > B``): ``B`` distinct slot positions below ``seq_len - 1``, some
  slots empty (-1) at times; LRU a random permutation; selections distinct, with a controlled
  share of hits (positions held by a slot) and misses (positions below ``seq_len - 1`` not held),
  the newest position ``seq_len - 1`` at times, -1 padding at the end or interleaved at times;
* short requests (``seq_len <= B``): slot tokens ``arange(B)`` and distinct selections below
  ``seq_len``;
* padded CUDA-graph rows (``i >= num_real_reqs``) hold garbage that must not be touched;
* with ``residency`` on, each pool row is resident with probability ``resident_prob`` (its
  selections are drawn as above; the resolver must ignore its slot tables), and the case passes
  ``resident`` (uint8 with random nonzero flags, or bool), a ``req_to_token`` table of distinct
  logical ids (at times a view with a wider row stride) and a ``logical_to_device`` vector of
  distinct device rows (-1 for the logical ids no request uses);
* with ``reuse`` on (the reuse-table policy), the case passes ``reuse_levels`` (54 random levels
  drawn from ``reuse_levels`` distinct values: 1 makes every slot tie, i.e. LRU order) and random
  history words in every layer (ages skewed small, some saturated; counts 0-127), one layer's
  rows as ``slot_history``;
* with ``slot_map`` on (the position -> slot map), the case passes an int16 ``slot_map`` row per
  pool row and position of the context (and 3 columns more): every held position names its slot
  (the map's invariant), every other entry is garbage, mostly slots that hold other positions
  (stale entries), some out of range;
* with ``buffer_sizes`` on (per-request buffer sizes), each pool row uses ``S`` slots, ``S = B``
  for about a quarter of the rows, else uniform in ``[min(top_k, B), B]``; the slot tables are drawn
  as above, so a slot at or beyond ``S`` holds a position (as a shrunk buffer's stale slot would)
  that the resolver must ignore, and a short-layout row (``seq_len <= B``) longer than ``S`` is a
  long one;
* ``hot_locs`` rows are disjoint device rows; ``host_locs`` rows are contiguous per request or
  random over the host pool;
* with ``item_bytes`` 584 (DeepSeek-V4's C4 rows) the KV buffers are paged (``[pages, 37440]``
  uint8, 64 rows per page), the kernel and the oracles get ``C4PagedRows`` views of them and
  ``compress_ratio`` 4, and ``req_to_token`` holds token ids: entry ``q``'s logical id times 4
  plus 3 at column ``4q + 3`` (the token completing it), garbage in the other columns.

Every output the kernel may write is poisoned with values no real output can take, and the same
poisoned state is handed to the kernel and to the reference, so an unwritten element or a stray
write shows up as a difference. Everything is generated with torch ops on ``device`` from a
``torch.Generator``, so a failing case is reproducible from its seed.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES, C4_PAGE_BYTES, C4_PAGE_ENTRIES, C4PagedRows
from sglang_hisparse.resolver.reference import MissPlan

BF16_ITEM_BYTES = 1152  # bf16 MLA row: 576 x 2 B
FP8_ITEM_BYTES = 656  # FlashMLA FP8 row, stored as uint8


def kv_view(flat: torch.Tensor, item_bytes: int) -> torch.Tensor:
    """View a flat uint8 buffer as ``[rows, 1, dim]`` KV rows: bf16 for 1152-byte rows, else uint8;
    DeepSeek-V4's C4 rows (584 B) as ``[pages, 37440]`` uint8 pages."""
    if item_bytes == C4_ITEM_BYTES:
        pages = flat.numel() // C4_PAGE_BYTES
        return flat[: pages * C4_PAGE_BYTES].view(pages, C4_PAGE_BYTES)
    if item_bytes == BF16_ITEM_BYTES:
        rows = flat.numel() // item_bytes
        return flat[: rows * item_bytes].view(torch.bfloat16).view(rows, 1, item_bytes // 2)
    rows = flat.numel() // item_bytes
    return flat[: rows * item_bytes].view(rows, 1, item_bytes)


def kv_rows(kv: torch.Tensor, item_bytes: int) -> int:
    """Rows of a :func:`kv_view` buffer."""
    return kv.shape[0] * (C4_PAGE_ENTRIES if item_bytes == C4_ITEM_BYTES else 1)


def kv_bytes(rows: int, item_bytes: int) -> int:
    """Bytes of a :func:`kv_view` buffer with at least ``rows`` rows (whole pages for C4 rows)."""
    if item_bytes == C4_ITEM_BYTES:
        return -(-rows // C4_PAGE_ENTRIES) * C4_PAGE_BYTES
    return rows * item_bytes


def compress_ratio_of(item_bytes: int) -> int:
    """Tokens per position: 4 for DeepSeek-V4's C4 rows, else 1."""
    return 4 if item_bytes == C4_ITEM_BYTES else 1


def row_args(kv: torch.Tensor, item_bytes: int):
    """A buffer as the resolvers take it: a ``C4PagedRows`` view for C4 rows, else the tensor."""
    return C4PagedRows(kv) if item_bytes == C4_ITEM_BYTES else kv


class HostPool:
    """Random bytes in (pinned) host memory, the host KV of every case, plus a device mirror.

    Side effect: allocates ``nbytes`` of host memory (pinned when ``pin``) and, for a CUDA
    ``device``, ``nbytes`` on the device.
    """

    def __init__(self, nbytes: int, device: torch.device, pin: bool, seed: int = 0) -> None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        mirror = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
        if device.type == "cpu":
            self.host = mirror if not pin else mirror.pin_memory()
            self.mirror = self.host
        else:
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.host.copy_(mirror)
            self.mirror = mirror

    def views(self, item_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host_kv, device mirror) as ``[rows, 1, dim]`` tensors of this row size."""
        return kv_view(self.host, item_bytes), kv_view(self.mirror, item_bytes)


@dataclass
class CaseSpec:
    """The knobs of one random case."""

    item_bytes: int
    B: int
    top_k: int
    num_reqs: int
    num_real: int
    max_reqs: int
    seed: int
    hit_mode: str = "uniform"  # "uniform" per request in [0, 1], "fixed", "zero", "one"
    hit_rate: float = 0.87
    short_frac: float = 0.15
    pad_prob: float = 0.3
    newest_prob: float = 0.5
    empty_slot_prob: float = 0.2
    interleave_pad_prob: float = 0.2
    contiguous_host_prob: float = 0.5
    seq_dtype: torch.dtype = torch.int64
    rpi_dtype: torch.dtype = torch.int64
    plan: bool = True
    skip_io: bool = False
    counters: bool = True
    block_size: int = 960
    num_copiers: Optional[int] = None
    topk_row_pad: int = 0  # > 0: top_k_positions is a view with a wider row stride
    layers: int = 2
    layer: int = 1
    hot_extra_cols: Optional[int] = None  # None: random in [1, 16]
    out_extra_rows: Optional[int] = None  # None: random in [0, 3]
    residency: bool = False  # pass resident / req_to_token / logical_to_device
    resident_prob: float = 0.3  # with residency: chance that a pool row is resident
    resident_dtype: torch.dtype = torch.uint8  # uint8 or bool
    rtt_row_pad: int = 0  # > 0: req_to_token is a view with a wider row stride
    reuse: bool = False  # pass slot_history / reuse_levels (the reuse-table policy)
    reuse_levels: int = 54  # with reuse: distinct levels drawn for the 54 cells (1: LRU order)
    slot_map: bool = False  # pass slot_map (the position -> slot map)
    buffer_sizes: bool = False  # pass buffer_sizes (per-request buffer sizes)

    def describe(self) -> str:
        d = dataclasses.asdict(self)
        d["seq_dtype"] = str(self.seq_dtype).replace("torch.", "")
        d["rpi_dtype"] = str(self.rpi_dtype).replace("torch.", "")
        d["resident_dtype"] = str(self.resident_dtype).replace("torch.", "")
        return " ".join(f"{k}={v}" for k, v in d.items())


def random_spec(
    rng: random.Random,
    *,
    item_bytes: int,
    B: int,
    top_k: int,
    block_size: int,
    max_batch: int = 128,
    seed: int,
) -> CaseSpec:
    """A spec with random batch (log-uniform in [1, max_batch]), padding, hit regime, dtypes, modes.

    Draws from ``rng`` exactly as before residency existed (so the specs of a given ``rng`` are
    unchanged); the residency knobs come from a generator seeded by ``seed`` (residency on in
    about 35% of specs; then usually 30% resident rows, at times none or all)."""
    num_reqs = max(1, min(max_batch, int(round(2 ** rng.uniform(0, 7)))))
    num_real = num_reqs if rng.random() < 0.7 else rng.randint(0, num_reqs)
    hit_mode = rng.choice(["uniform", "uniform", "fixed", "zero", "one"])
    copier_choice = rng.random()
    return CaseSpec(
        item_bytes=item_bytes,
        B=B,
        top_k=top_k,
        num_reqs=num_reqs,
        num_real=num_real,
        max_reqs=num_reqs + rng.randint(0, 8),
        seed=seed,
        hit_mode=hit_mode,
        hit_rate=rng.random(),
        short_frac=rng.choice([0.0, 0.15, 0.5, 1.0]) if rng.random() < 0.3 else 0.15,
        pad_prob=rng.choice([0.0, 0.3, 1.0]),
        newest_prob=rng.choice([0.0, 0.5, 1.0]),
        empty_slot_prob=rng.choice([0.0, 0.2]),
        interleave_pad_prob=rng.choice([0.0, 0.5]),
        contiguous_host_prob=rng.choice([0.0, 0.5, 1.0]),
        seq_dtype=rng.choice([torch.int32, torch.int64]),
        rpi_dtype=rng.choice([torch.int32, torch.int64]),
        plan=rng.random() < 0.5,
        skip_io=rng.random() < 0.15,
        counters=rng.random() < 0.8,
        block_size=block_size,
        num_copiers=None if copier_choice < 0.6 else (0 if copier_choice < 0.85 else rng.randint(1, 8)),
        topk_row_pad=rng.choice([0, 0, 0, 8]),
        **_residency_knobs(random.Random(seed ^ _RESIDENCY_SALT)),
        **_reuse_knobs(random.Random(seed ^ _REUSE_SALT)),
        slot_map=random.Random(seed ^ _MAP_SALT).random() < 0.4,
        buffer_sizes=random.Random(seed ^ _SIZES_SALT).random() < 0.35,
    )


_RESIDENCY_SALT = 0x7E51DE47
_REUSE_SALT = 0x2E05E7AB
_MAP_SALT = 0x51075A9
_SIZES_SALT = 0x5172E5


def _reuse_knobs(rng: random.Random) -> dict[str, Any]:
    """The reuse-policy fields of a random spec: on in about 40% of specs, with 1 (every slot
    ties: LRU order), 3 (many ties) or 54 distinct levels."""
    return dict(reuse=rng.random() < 0.4, reuse_levels=rng.choice([1, 3, 54, 54]))


def random_history(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random packed history words (int16, ``age | count << 8``) on ``gen``'s device, over the
    fields' whole ranges as a running cache has them: ages skewed small (shifted down by a random
    0-7 bits) with 10% saturated at 255, counts in [0, 127] skewed small the same way."""
    dev = gen.device

    def skewed(high: int, max_shift: int) -> torch.Tensor:
        return (torch.randint(0, high, shape, generator=gen, device=dev)
                >> torch.randint(0, max_shift + 1, shape, generator=gen, device=dev))

    age = torch.where(torch.rand(shape, generator=gen, device=dev) < 0.1, 255, skewed(1 << 8, 7))
    return (age | (skewed(128, 6) << 8)).to(torch.int16)


def verify_slot_positions(gen: torch.Generator, lens: list[int], B: int) -> torch.Tensor:
    """Slot tables for verify-step cases (resolver/verify.py): int32 [len(lens), B], a long request
    (``L + 1 > B``) holding B distinct positions below its length L with about 10% of the slots
    empty (-1), a short one nothing (-1)."""
    tokens = torch.full((len(lens), B), -1, dtype=torch.int32)
    for r, L in enumerate(lens):
        if L + 1 > B:
            held = torch.randperm(L, generator=gen)[:B]
            held[torch.rand(B, generator=gen) < 0.1] = -1
            tokens[r] = held.to(torch.int32)
    return tokens


def verify_rows(rng: random.Random, slot_positions: torch.Tensor, lens: list[int], N: int, k: int) -> torch.Tensor:
    """N query rows per request for verify-step cases: int32 [len(lens) * N, k]. Row j of request
    r draws from one pool per request (positions its slots hold, so hits, and others below L, so
    misses: the rows overlap) and adds window positions ``L .. L + j`` (causal), -1 padding,
    shuffled."""
    out = []
    for r, L in enumerate(lens):
        held = [int(t) for t in slot_positions[r] if t >= 0]
        pool = sorted(set(rng.sample(held, min(len(held), k)) + rng.sample(range(L), min(L, k))))
        for j in range(N):
            choice = rng.sample(pool, max(0, min(len(pool), k - 1 - j)))
            choice += [L + w for w in range(j + 1) if rng.random() < 0.6]
            choice = choice[:k] + [-1] * (k - min(len(choice), k))
            rng.shuffle(choice)
            out.append(choice)
    return torch.tensor(out, dtype=torch.int32)


def _reuse_tables(spec: CaseSpec, gen: torch.Generator, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``reuse_levels`` uint8 [54] (values in [0, spec.reuse_levels)) and per-layer history words
    int16 [layers, R, B] (:func:`random_history`)."""
    levels = torch.randint(0, spec.reuse_levels, (54,), generator=gen, device=gen.device).to(torch.uint8)
    return levels, random_history(gen, (spec.layers, R, spec.B))


def _residency_knobs(rng: random.Random) -> dict[str, Any]:
    """The residency fields of a random spec (see :func:`random_spec`)."""
    return dict(
        residency=rng.random() < 0.35,
        resident_prob=rng.choice([0.3, 0.3, 0.3, 0.0, 1.0]),
        resident_dtype=rng.choice([torch.uint8, torch.bool]),
        rtt_row_pad=rng.choice([0, 0, 5]),
    )


@dataclass
class Case:
    """The tensors of one case: ``kernel`` and ``ref`` hold identical, independent copies of every
    tensor the resolver may write; read-only inputs are shared."""

    spec: CaseSpec
    inputs: dict[str, Any]
    kernel: dict[str, Any]
    ref: dict[str, Any]
    kernel_kv: torch.Tensor
    ref_kv: torch.Tensor
    device_rows: int
    host_kv: torch.Tensor
    host_mirror: torch.Tensor
    slot_tokens_all: dict[str, torch.Tensor] = field(default_factory=dict)
    lru_all: dict[str, torch.Tensor] = field(default_factory=dict)
    history_all: dict[str, torch.Tensor] = field(default_factory=dict)  # with reuse only
    map_all: dict[str, torch.Tensor] = field(default_factory=dict)  # with slot_map only

    def kernel_kwargs(self) -> dict[str, Any]:
        item = self.spec.item_bytes
        return dict(self.inputs, **self.kernel, host_kv=row_args(self.host_kv, item),
                    device_kv=row_args(self.kernel_kv, item), **self._ratio())

    def ref_kwargs(self) -> dict[str, Any]:
        item = self.spec.item_bytes
        return dict(self.inputs, **self.ref, host_kv=row_args(self.host_mirror, item),
                    device_kv=row_args(self.ref_kv, item), **self._ratio())

    def _ratio(self) -> dict[str, int]:
        ratio = compress_ratio_of(self.spec.item_bytes)
        return {"compress_ratio": ratio} if ratio != 1 else {}


def _distinct_below(gen: torch.Generator, rows: int, width: int, limit: torch.Tensor, count: int,
                    exclude: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per row, ``count`` distinct ints in ``[0, limit[row])`` (not excluded), in random order;
    rows with fewer candidates end with -1."""
    dev = limit.device
    keys = torch.rand(rows, width, generator=gen, device=dev)
    bad = torch.arange(width, device=dev)[None, :] >= limit[:, None]
    if exclude is not None:
        bad |= exclude
    keys = keys.masked_fill(bad, 2.0)
    vals, idx = keys.topk(count, dim=1, largest=False)
    return torch.where(vals < 2.0, idx, torch.full_like(idx, -1))


def _residency_tables(spec: CaseSpec, gen: torch.Generator, R: int, ctx: int, first_row: int
                      ) -> dict[str, torch.Tensor]:
    """``resident`` [R], ``req_to_token`` [R, >= ctx] (distinct logical ids, at times a strided
    view) and ``logical_to_device`` (distinct device rows from ``first_row`` on for the ids in
    the table, -1 for the spare ids), drawn from ``gen`` on its device."""
    dev = gen.device

    def randint(lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=gen, device=dev)

    is_resident = torch.rand(R, generator=gen, device=dev) < spec.resident_prob
    if spec.resident_dtype == torch.bool:
        resident = is_resident
    else:
        resident = torch.where(is_resident, randint(1, 256, (R,)), 0).to(torch.uint8)
    entries = ctx + 3  # a few columns beyond host_locs'; shapes depend on the spec only (graph replays)
    ratio = compress_ratio_of(spec.item_bytes)
    cols = entries * ratio
    used = R * entries
    n_logical = used + 32  # spare logical ids, mapped to -1
    ids = torch.randperm(n_logical, generator=gen, device=dev)
    wide = randint(-(1 << 30), 1 << 30, (R, cols + spec.rtt_row_pad)).to(torch.int32)
    wide[:, ratio - 1:cols:ratio] = (ids[:used].view(R, entries) * ratio + ratio - 1).to(torch.int32)
    req_to_token = wide[:, :cols] if spec.rtt_row_pad > 0 else wide.contiguous()
    logical_to_device = torch.full((n_logical,), -1, dtype=torch.int64, device=dev)
    logical_to_device[ids[:used]] = first_row + torch.randperm(used + 64, generator=gen, device=dev)[:used]
    return dict(resident=resident, req_to_token=req_to_token, logical_to_device=logical_to_device)


def make_case(
    spec: CaseSpec,
    pool: HostPool,
    kernel_buf: torch.Tensor,
    ref_buf: torch.Tensor,
    device: torch.device,
) -> Case:
    """Build one case. ``kernel_buf``/``ref_buf`` are flat uint8 device buffers of at least
    ``max_reqs * (B + 1) * item_bytes`` bytes; the used region is poisoned identically in both."""
    gen = torch.Generator(device=device)
    gen.manual_seed(spec.seed)
    draw = _Draws(gen, device)
    ctx = 4 * spec.B + 64  # host_locs columns (max context)
    host_kv, mirror = pool.views(spec.item_bytes)
    assert kv_rows(host_kv, spec.item_bytes) >= ctx, "host pool too small for the context"
    D = spec.max_reqs * (spec.B + 1)
    need = kv_bytes(D, spec.item_bytes)
    assert kernel_buf.numel() >= need and ref_buf.numel() >= need, "device KV buffers too small"

    rows = _pool_rows(spec, draw, ctx, kv_rows(host_kv, spec.item_bytes), D)
    top_k_positions, seq_lens, rpi = _batch(spec, draw, rows, ctx)
    out, plan, counters = _poisoned_outputs(spec, draw)
    byte = int(draw.randint(0, 256, (1,)).item())
    kernel_buf[:need].fill_(byte)
    ref_buf[:need].fill_(byte)
    inputs = dict(top_k_positions=top_k_positions, seq_lens=seq_lens, req_pool_indices=rpi,
                  hot_locs=rows.hot_locs, host_locs=rows.host_locs, device_buffer_size=spec.B, skip_io=spec.skip_io)
    optional, history_all, map_all = _optional_tables(spec, gen, ctx, D, rows.tokens)
    inputs.update(optional)
    tok_k, tok_r = rows.slot_tokens_all.clone(), rows.slot_tokens_all.clone()
    lru_k, lru_r = rows.lru_all.clone(), rows.lru_all.clone()
    kernel = _writable(spec, tok_k, lru_k, out, torch.tensor([spec.num_real], dtype=torch.int32, device=device),
                       plan, counters, history_all.get("kernel"), map_all.get("kernel"))
    ref = _writable(spec, tok_r, lru_r, out, spec.num_real, plan, counters, history_all.get("ref"),
                    map_all.get("ref"))
    return Case(
        spec=spec, inputs=inputs, kernel=kernel, ref=ref, kernel_kv=kv_view(kernel_buf[:need], spec.item_bytes),
        ref_kv=kv_view(ref_buf[:need], spec.item_bytes), device_rows=D, host_kv=host_kv, host_mirror=mirror,
        slot_tokens_all={"kernel": tok_k, "ref": tok_r}, lru_all={"kernel": lru_k, "ref": lru_r},
        history_all=history_all, map_all=map_all,
    )


class _Draws:
    """Random tensors from one case's generator on its device. Every draw advances the generator:
    a case is reproducible from its seed only if the draws keep their order."""

    def __init__(self, gen: torch.Generator, device: torch.device) -> None:
        self.gen = gen
        self.dev = device

    def randint(self, lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.gen, device=self.dev)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen, device=self.dev)


@dataclass
class _PoolRows:
    """The per-pool-row state of a case: sequence lengths and the tables of every request slot."""

    L: torch.Tensor  # [R] sequence lengths
    short: torch.Tensor  # [R] L <= B (fast path)
    tokens: torch.Tensor  # [R, B] the case layer's slot tokens
    slot_tokens_all: torch.Tensor  # int32 [layers, R, B]
    lru_all: torch.Tensor  # int16 [layers, R, B]
    hot_locs: torch.Tensor  # int32 [R, B + 1 + extra]
    host_locs: torch.Tensor  # [R, ctx]


def _pool_rows(spec: CaseSpec, draw: _Draws, ctx: int, H: int, D: int) -> _PoolRows:
    """Draw every pool row's sequence length, slot tables (the case layer's valid, the other
    layers garbage), hot-buffer rows (disjoint, among the ``D`` device rows) and host rows (among
    the ``H`` host rows)."""
    B, R, dev, rand, randint = spec.B, spec.max_reqs, draw.dev, draw.rand, draw.randint
    u = rand(R)
    L = torch.where(u < spec.short_frac, randint(1, B + 1, (R,)), randint(B + 1, ctx + 1, (R,)))
    b = rand(R)
    L = torch.where(b < 0.05, torch.full_like(L, B), torch.where(b < 0.10, torch.full_like(L, B + 1), L))
    short = L <= B

    tokens = _distinct_below(draw.gen, R, ctx, L - 1, B)  # long rows: B distinct positions < L - 1
    empty = (rand(R, 1) < spec.empty_slot_prob) & (rand(R, B) < rand(R, 1))
    tokens = torch.where(empty, -1, tokens)
    tokens = torch.where(short[:, None], torch.arange(B, device=dev)[None, :].expand(R, B), tokens)
    lru = rand(R, B).argsort(dim=1)
    slot_tokens_all = randint(-1, 1 << 20, (spec.layers, R, B)).to(torch.int32)
    lru_all = randint(0, B, (spec.layers, R, B)).to(torch.int16)
    slot_tokens_all[spec.layer] = tokens.to(torch.int32)
    lru_all[spec.layer] = lru.to(torch.int16)

    extra = spec.hot_extra_cols if spec.hot_extra_cols is not None else 1 + int(randint(0, 16, (1,)).item())
    hot = torch.randperm(D, generator=draw.gen, device=dev).view(R, B + 1).to(torch.int32)
    hot_locs = torch.cat([hot, randint(-(1 << 30), 1 << 30, (R, extra)).to(torch.int32)], dim=1)
    contiguous = rand(R) < spec.contiguous_host_prob
    base = randint(0, H - ctx + 1, (R,))
    host_locs = torch.where(
        contiguous[:, None],
        base[:, None] + torch.arange(ctx, device=dev)[None, :],
        randint(0, H, (R, ctx)),
    )
    return _PoolRows(L, short, tokens, slot_tokens_all, lru_all, hot_locs, host_locs)


def _batch(spec: CaseSpec, draw: _Draws, rows: _PoolRows, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw the batch: its request slots (distinct for the real rows), ``top_k_positions``,
    ``seq_lens`` and ``req_pool_indices`` in the spec's dtypes; padded rows hold garbage."""
    R, n, n_real, K, dev = spec.max_reqs, spec.num_reqs, spec.num_real, spec.top_k, draw.dev
    r = torch.randperm(R, generator=draw.gen, device=dev)[:n]
    r = torch.cat([r[:n_real], draw.randint(0, R, (n - n_real,))])  # padded rows may repeat real ones
    Lb = rows.L[r]
    sel = _selections(spec, draw, Lb, rows.tokens[r], rows.short[r], ctx)
    garbage = draw.randint(-3, ctx + 5, (n, K))
    real_rows = (torch.arange(n, device=dev) < n_real)[:, None]
    sel = torch.where(real_rows, sel, garbage)
    if spec.topk_row_pad > 0:
        wide = draw.randint(-5, 5, (n, K + spec.topk_row_pad)).to(torch.int32)
        wide[:, :K] = sel.to(torch.int32)
        top_k_positions = wide[:, :K]
    else:
        top_k_positions = sel.to(torch.int32).contiguous()
    seq_lens = torch.where(real_rows[:, 0], Lb, draw.randint(-5, 2 * ctx, (n,))).to(spec.seq_dtype)
    return top_k_positions, seq_lens, r.to(spec.rpi_dtype)


def _selections(spec: CaseSpec, draw: _Draws, Lb: torch.Tensor, tok_b: torch.Tensor, shortb: torch.Tensor,
                ctx: int) -> torch.Tensor:
    """Draw each batch row's selections [n, K] (``Lb``, ``tok_b``, ``shortb``: its length, slot
    tokens and fast-path flag): long rows get the spec's share of hits, misses, the newest position
    at times and padding; short rows distinct positions below their length; padding at the end or
    interleaved."""
    n, K, rand = spec.num_reqs, spec.top_k, draw.rand
    pad = torch.where(rand(n) < spec.pad_prob, draw.randint(0, K + 1, (n,)),
                      torch.zeros(n, dtype=torch.long, device=draw.dev))
    newest_flag = (rand(n) < spec.newest_prob) & ~shortb
    n_sel = (K - pad - newest_flag.long()).clamp(min=0)
    hits, misses = _hit_counts(spec, draw, n_sel, Lb, tok_b)

    hit_order = rand(n, spec.B).masked_fill(tok_b < 0, 2.0).argsort(dim=1)
    hitcand = tok_b.gather(1, hit_order)[:, :K]
    in_table = torch.zeros(n, ctx, dtype=torch.long, device=draw.dev)
    in_table.scatter_add_(1, tok_b.clamp(min=0), (tok_b >= 0).long())  # add: empties must not clear
    in_table = in_table > 0
    misscand = _distinct_below(draw.gen, n, ctx, Lb - 1, K, exclude=in_table)
    t = torch.arange(K, device=draw.dev)[None, :]
    hits_c, end_c = hits[:, None], (hits + misses)[:, None]
    sel_long = torch.where(
        t < hits_c,
        hitcand,
        torch.where(
            t < end_c,
            misscand.gather(1, (t - hits_c).clamp(0, K - 1)),
            torch.where((t == end_c) & newest_flag[:, None], (Lb - 1)[:, None], -1),
        ),
    )
    n_short = torch.minimum(K - pad, Lb).clamp(min=0)
    short_cand = _distinct_below(draw.gen, n, spec.B, Lb.clamp(max=spec.B), K)
    sel_short = torch.where(t < n_short[:, None], short_cand, -1)
    sel = torch.where(shortb[:, None], sel_short, sel_long)
    order_keys = rand(n, K) + 2.0 * ((sel < 0) & (rand(n, 1) >= spec.interleave_pad_prob))
    return sel.gather(1, order_keys.argsort(dim=1))


def _hit_counts(spec: CaseSpec, draw: _Draws, n_sel: torch.Tensor, Lb: torch.Tensor, tok_b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hits and misses [n] of each batch row's ``n_sel`` selections: the spec's hit rate, within
    what the slots hold (``tok_b``) and the positions not held below the newest (``Lb - 1``)."""
    n, dev = spec.num_reqs, draw.dev
    filled = (tok_b >= 0).sum(1)
    avail = (Lb - 1) - filled
    if spec.hit_mode == "uniform":
        hr = draw.rand(n)
    elif spec.hit_mode == "zero":
        hr = torch.zeros(n, device=dev)
    elif spec.hit_mode == "one":
        hr = torch.ones(n, device=dev)
    else:
        hr = torch.full((n,), float(spec.hit_rate), device=dev)
    target = torch.round(hr * n_sel).long()
    hits = torch.minimum(torch.maximum(target, (n_sel - avail).clamp(min=0)), filled)
    hits = torch.minimum(hits, n_sel)
    return hits, n_sel - hits


def _poisoned_outputs(spec: CaseSpec, draw: _Draws
                      ) -> tuple[torch.Tensor, Optional[MissPlan], Optional[torch.Tensor]]:
    """Draw the outputs' initial state: ``out`` (a few rows more than the batch at times) and the
    plan (when the spec has one) poisoned with values no real output takes, and random counters
    (when the spec has them)."""
    R, K, dev = spec.max_reqs, spec.top_k, draw.dev
    poison = -int(draw.randint(2, 1 << 30, (1,)).item())
    extra_rows = spec.out_extra_rows if spec.out_extra_rows is not None else int(draw.randint(0, 4, (1,)).item())
    out = torch.full((spec.num_reqs + extra_rows, K), poison, dtype=torch.int32, device=dev)
    plan = None
    if spec.plan:
        plan = MissPlan(
            host_rows=torch.full((R, K), poison - 1, dtype=torch.int64, device=dev),
            device_rows=torch.full((R, K), poison - 2, dtype=torch.int32, device=dev),
            counts=torch.full((R,), poison - 3, dtype=torch.int32, device=dev),
        )
    counters = draw.randint(0, 1 << 20, (2,)) if spec.counters else None
    return out, plan, counters


def _optional_tables(spec: CaseSpec, gen: torch.Generator, ctx: int, D: int, tokens: torch.Tensor
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Draw the tables of the spec's optional features, last and in this order (the other tensors
    of a spec do not depend on them): the residency inputs, the reuse policy's ``reuse_levels``
    input and its per-layer history, the slot map, the buffer sizes. Returns the extra inputs and
    the history and map copies ``{"kernel": ..., "ref": ...}`` (empty when off)."""
    inputs: dict[str, torch.Tensor] = {}
    if spec.residency:
        inputs.update(_residency_tables(spec, gen, spec.max_reqs, ctx, first_row=D))
    history_all: dict[str, torch.Tensor] = {}
    if spec.reuse:
        levels, hist = _reuse_tables(spec, gen, spec.max_reqs)
        inputs["reuse_levels"] = levels
        history_all = {"kernel": hist.clone(), "ref": hist.clone()}
    map_all: dict[str, torch.Tensor] = {}
    if spec.slot_map:
        slot_map = random_slot_map(gen, tokens, ctx + 3, spec.B)
        map_all = {"kernel": slot_map.clone(), "ref": slot_map.clone()}
    if spec.buffer_sizes:
        inputs["buffer_sizes"] = random_buffer_sizes(gen, spec.max_reqs, spec.B, spec.top_k)
    return inputs, history_all, map_all


def random_buffer_sizes(gen: torch.Generator, rows: int, B: int, top_k: int) -> torch.Tensor:
    """Per-request buffer sizes (int32 [rows] on ``gen``'s device): B for about a quarter of the
    rows, else uniform in ``[min(top_k, B), B]`` (a size never below the selections a row may
    have, the resolver's precondition)."""
    dev = gen.device
    low = min(top_k, B)
    sizes = torch.randint(low, B + 1, (rows,), generator=gen, device=dev)
    full = torch.rand(rows, generator=gen, device=dev) < 0.25
    return torch.where(full, B, sizes).to(torch.int32)


def _writable(spec: CaseSpec, slot_tokens_all: torch.Tensor, lru_all: torch.Tensor, out: torch.Tensor,
              num_real_reqs: Any, plan: Optional[MissPlan], counters: Optional[torch.Tensor],
              history_all: Optional[torch.Tensor], slot_map: Optional[torch.Tensor]) -> dict[str, Any]:
    """One side's (kernel's or reference's) resolver arguments that may be written: the case
    layer of its own slot tables (and history), and its own copies of ``out``, the plan and the
    counters."""
    side = dict(
        slot_tokens=slot_tokens_all[spec.layer], lru=lru_all[spec.layer], out=out.clone(),
        num_real_reqs=num_real_reqs, plan=_clone_plan(plan), counters=None if counters is None else counters.clone(),
    )
    if history_all is not None:
        side["slot_history"] = history_all[spec.layer]
    if slot_map is not None:
        side["slot_map"] = slot_map
    return side


def _clone_plan(p: Optional[MissPlan]) -> Optional[MissPlan]:
    if p is None:
        return None
    return MissPlan(p.host_rows.clone(), p.device_rows.clone(), p.counts.clone())


def random_slot_map(gen: torch.Generator, tokens: torch.Tensor, cols: int, B: int) -> torch.Tensor:
    """A position -> slot map (int16 [R, cols]) for the slot tables ``tokens`` [R, B]: held
    positions name their slot; the rest is garbage in [-3, B + 3), mostly in-range slots that hold
    other positions (stale entries the kernel must not take for hits)."""
    R = tokens.shape[0]
    dev = tokens.device
    slot_map = torch.randint(-3, B + 3, (R, cols), generator=gen, device=dev).to(torch.int16)
    rows, slots = (tokens >= 0).nonzero(as_tuple=True)
    slot_map[rows, tokens[rows, slots].long()] = slots.to(torch.int16)
    return slot_map


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def differences(case: Case) -> list[str]:
    """Names of the outputs where kernel and reference differ (empty: identical)."""
    bad = []
    k, r = case.kernel, case.ref
    if not torch.equal(k["out"], r["out"]):
        bad.append("out")
    if not torch.equal(case.slot_tokens_all["kernel"], case.slot_tokens_all["ref"]):
        bad.append("slot_tokens")
    if not torch.equal(case.lru_all["kernel"], case.lru_all["ref"]):
        bad.append("lru")
    if case.history_all and not torch.equal(case.history_all["kernel"], case.history_all["ref"]):
        bad.append("slot_history")
    if case.map_all and not torch.equal(case.map_all["kernel"], case.map_all["ref"]):
        bad.append("slot_map")
    if not _bytes_equal(case.kernel_kv, case.ref_kv):
        bad.append("device_kv")
    if k["plan"] is not None:
        if not torch.equal(k["plan"].counts, r["plan"].counts):
            bad.append("plan.counts")
        if not torch.equal(k["plan"].host_rows, r["plan"].host_rows):
            bad.append("plan.host_rows")
        if not torch.equal(k["plan"].device_rows, r["plan"].device_rows):
            bad.append("plan.device_rows")
    if k["counters"] is not None and not torch.equal(k["counters"], r["counters"].to(k["counters"].device)):
        bad.append("counters")
    return bad


def describe_difference(case: Case, name: str, limit: int = 8) -> str:
    """A short human-readable account of where ``name`` differs."""
    k, r = case.kernel, case.ref
    pairs = {
        "out": (k["out"], r["out"]),
        "slot_tokens": (case.slot_tokens_all["kernel"], case.slot_tokens_all["ref"]),
        "lru": (case.lru_all["kernel"], case.lru_all["ref"]),
        "device_kv": (case.kernel_kv.reshape(case.kernel_kv.shape[0], -1).view(torch.uint8),
                      case.ref_kv.reshape(case.ref_kv.shape[0], -1).view(torch.uint8)),
        "counters": (k["counters"], r["counters"]),
    }
    if case.history_all:
        pairs["slot_history"] = (case.history_all["kernel"], case.history_all["ref"])
    if case.map_all:
        pairs["slot_map"] = (case.map_all["kernel"], case.map_all["ref"])
    if k["plan"] is not None:
        pairs["plan.counts"] = (k["plan"].counts, r["plan"].counts)
        pairs["plan.host_rows"] = (k["plan"].host_rows, r["plan"].host_rows)
        pairs["plan.device_rows"] = (k["plan"].device_rows, r["plan"].device_rows)
    a, b = pairs[name]
    diff = (a != b)
    if name == "device_kv":
        diff = diff.any(dim=1)
    idx = diff.nonzero()[:limit].tolist()
    lines = [f"{name}: {int(diff.sum())} differing entries; first {len(idx)}:"]
    for ix in idx:
        t = tuple(ix)
        if name == "device_kv":
            lines.append(f"  row {t[0]}: kernel {a[t[0], :8].tolist()} ref {b[t[0], :8].tolist()}")
        else:
            lines.append(f"  {t}: kernel {a[t].item()} ref {b[t].item()}")
    return "\n".join(lines)
