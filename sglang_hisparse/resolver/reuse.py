"""The history-only reuse-table policy (``sglang_hisparse_analysis.policies.ReuseTable`` with ``use_rank=False``)
in the form the resolvers run it (config ``replacement: "reuse"``).

Per request and layer every hot-buffer slot keeps one int16 of history, ``age | (count << 8)``:
``age`` (low byte, 0..255) is the number of steps since the slot was last selected minus one,
``count`` (high byte, 0..127) how often its position was selected since it was inserted. A slot
with history ``h`` sits in cell ``age_bucket((h & 0xff) + 1) * 6 + count_bucket(h >> 8)`` of the
9 x 6 table; ``reuse_levels(table)`` turns the table's probabilities into one eviction level per
cell (lower: evicted first). The exact resolver semantics are in
``sglang_hisparse/resolver/reference.py``.

The packaged table (:func:`history_table`) was fitted by ``scripts/research/traces/report.py`` on the
tune documents of ``docs/policies.md`` (attention selector, k = 256, B = 512, horizon 4).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Optional, Union

import numpy as np
import torch

#: Upper edges (inclusive) of the age buckets: steps since the resident was last selected.
AGE_EDGES = (1, 2, 4, 8, 16, 32, 64, 128)
#: Upper edges (inclusive) of the count buckets: selections since the resident was inserted.
COUNT_EDGES = (1, 3, 7, 15, 31)
#: Table probabilities are quantized to this many levels in composite keys.
PRIORITY_LEVELS = 1 << 13

#: Number of age buckets x count buckets.
AGE_BUCKETS = len(AGE_EDGES) + 1
COUNT_BUCKETS = len(COUNT_EDGES) + 1
CELLS = AGE_BUCKETS * COUNT_BUCKETS
#: Saturation of the packed history fields.
AGE_MAX = 255
COUNT_MAX = 127
HISTORY_TABLE_FILE = "reuse_history_table.json"


@dataclass(frozen=True)
class HistoryTable:
    """A history-only reuse table: ``table[age_bucket, count_bucket]`` is the probability that an
    unselected resident of that cell is selected again within the fit's horizon."""

    table: np.ndarray
    """float64 [9, 6]."""
    provenance: dict[str, Any]

    def describe(self) -> str:
        p = self.provenance
        return f"{p.get('selector', '?')} k={p.get('k', '?')} B={p.get('B', '?')}"


@functools.lru_cache(maxsize=1)
def history_table() -> HistoryTable:
    """The packaged table (``reuse_history_table.json``, shipped with the package)."""
    text = resources.files(__package__).joinpath(HISTORY_TABLE_FILE).read_text()
    raw = json.loads(text)
    table = np.asarray(raw["table"], dtype=np.float64)
    if table.shape != (AGE_BUCKETS, COUNT_BUCKETS):
        raise ValueError(f"{HISTORY_TABLE_FILE}: table must be {AGE_BUCKETS}x{COUNT_BUCKETS}, got {table.shape}")
    if tuple(raw["age_edges"]) != AGE_EDGES or tuple(raw["count_edges"]) != COUNT_EDGES:
        raise ValueError(f"{HISTORY_TABLE_FILE}: bucket edges differ from replacement.policies")
    table.setflags(write=False)
    return HistoryTable(table=table, provenance=dict(raw["provenance"]))


def reuse_levels(table: Union[np.ndarray, torch.Tensor]) -> torch.Tensor:
    """Eviction level of each of the 54 cells (uint8 [54], CPU; cell = age_bucket * 6 + count_bucket).

    The level is the dense rank of ``round(table * (PRIORITY_LEVELS - 1))`` over the cells, so
    ordering residents by level is ordering them by the quantized probability the simulator's
    :class:`~.policies.ReuseTable` uses. ``table`` has 54 entries in age-major order (shape
    [9, 6] or [9, 6, 1])."""
    values = np.asarray(table.cpu() if isinstance(table, torch.Tensor) else table, dtype=np.float64)
    if values.size != CELLS:
        raise ValueError(f"a history-only reuse table has {CELLS} cells, got shape {values.shape}")
    quantized = np.round(values.reshape(CELLS) * (PRIORITY_LEVELS - 1)).astype(np.int64)
    _, dense = np.unique(quantized, return_inverse=True)
    return torch.from_numpy(dense.reshape(CELLS).astype(np.uint8))


def age_bucket(age: torch.Tensor) -> torch.Tensor:
    """Age bucket (int64, 0..8) of ``age`` = steps since last selected (>= 1): the first
    :data:`AGE_EDGES` entry >= ``min(age, 129)``."""
    edges = torch.tensor(AGE_EDGES, dtype=torch.int64, device=age.device)
    return torch.searchsorted(edges, age.long().clamp(max=AGE_EDGES[-1] + 1), right=False)


def count_bucket(count: torch.Tensor) -> torch.Tensor:
    """Count bucket (int64, 0..5) of ``count`` selections since insertion: the first
    :data:`COUNT_EDGES` entry >= ``min(count, 32)``."""
    edges = torch.tensor(COUNT_EDGES, dtype=torch.int64, device=count.device)
    return torch.searchsorted(edges, count.long().clamp(max=COUNT_EDGES[-1] + 1), right=False)


def unpack(history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(age, count)`` fields (int64) of packed int16 history."""
    h = history.long()
    return h & 0xFF, h >> 8


def pack(age: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Packed history (int16) of ``age`` in [0, 255] and ``count`` in [0, 127]."""
    return (age | (count << 8)).to(torch.int16)


def slot_levels(history: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Eviction level (int64) of every slot of packed ``history`` (any shape), given the 54 cell
    levels ``levels`` (any device)."""
    age, count = unpack(history)
    cell = age_bucket(age + 1) * COUNT_BUCKETS + count_bucket(count)
    return levels.to(history.device).long()[cell]


def updated_history(history: torch.Tensor, hit: torch.Tensor, victim: torch.Tensor) -> torch.Tensor:
    """History after a step (int16, same shape): a hit slot gets age 0 and count + 1 (saturating
    at 127), a victim slot age 0 and count 1, every other slot age + 1 (saturating at 255) and
    its count unchanged. ``hit`` and ``victim`` are disjoint bool masks of ``history``'s shape."""
    age, count = unpack(history)
    age = torch.where(hit | victim, 0, (age + 1).clamp(max=AGE_MAX))
    count = torch.where(hit, (count + 1).clamp(max=COUNT_MAX), torch.where(victim, 1, count))
    return pack(age, count)


def policy_tables(slot_history: Optional[torch.Tensor], reuse_levels_: Optional[torch.Tensor]
                  ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(slot_history, reuse_levels)`` when the reuse policy is on, None for LRU. Raises
    ValueError when only one is given or a table has the wrong dtype or size."""
    if slot_history is None and reuse_levels_ is None:
        return None
    if slot_history is None or reuse_levels_ is None:
        raise ValueError("slot_history and reuse_levels are passed together or not at all")
    if slot_history.dtype != torch.int16:
        raise ValueError(f"slot_history must be int16, got {slot_history.dtype}")
    if reuse_levels_.dtype != torch.uint8 or reuse_levels_.numel() != CELLS:
        raise ValueError(f"reuse_levels must be uint8 [{CELLS}], got {reuse_levels_.dtype} {tuple(reuse_levels_.shape)}")
    return slot_history, reuse_levels_
