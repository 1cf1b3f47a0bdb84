"""DeepSeek-V4: what the C4 coordinator reports, the idle line and the metrics export.

Owns the report state: whether something happened since the last idle line (``_busy``), the
decode-step count, each pool's free count at start-up (``initial``), and, with
``--enable-metrics``, the export and the non-blocking reader of the resolver's device counters.
Reads (never writes) the allocator, the hot buffers, the host mirror, residency and the counters.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang_hisparse.metrics import CounterReader, Gauges

logger = logging.getLogger(__name__)


class C4Report:
    def __init__(self, *, allocator, hot, mirror, residency, counters: torch.Tensor):
        """``counters``: the resolver's (selected, misses) device counters over every C4 layer call."""
        self.allocator, self.hot, self.mirror, self.residency, self.counters = allocator, hot, mirror, residency, counters
        self.initial = self.free_counts()
        self._busy = False
        self._decode_steps = 0
        self._export: Optional[tuple[Any, int, CounterReader]] = None
        """(PrometheusExport, steps between publications, the counters' reader) with --enable-metrics."""

    def export_to(self, export, interval: int = 40) -> None:
        """Publish our series to ``export`` (``sglang_hisparse.metrics.PrometheusExport``) every
        ``interval`` decode steps without a host stall, and exactly at every idle report."""
        self._export = (export, interval, CounterReader(self.counters))

    def busy(self) -> None:
        """A request was admitted or left, or a decode step ran: the next idle report is due."""
        self._busy = True

    def note_decode_step(self) -> None:
        """Count a decode step; every export interval publish the counters' latest host copy."""
        self._decode_steps += 1
        if self._export is not None and self._decode_steps % self._export[1] == 0:
            export, _, reader = self._export
            totals = reader.latest()
            if totals is not None:
                export.publish(totals[0], totals[1], self._decode_steps, self.gauges())

    def gauges(self) -> Gauges:
        """The gauges of the metrics export (and the demotions counter), read on the host."""
        residency = self.residency.residency if self.residency is not None else None
        return Gauges(staging_requests=self.mirror.staged_count(),
                      host_rows_used=self.mirror.host_entries_used(),
                      host_rows_capacity=self.mirror.pool.capacity_tokens,
                      hot_buffers_in_use=sum(1 for held in self.hot.capacity if held),
                      resident_requests=residency.count() if residency is not None else 0,
                      demotions_total=residency.demotions_total if residency is not None else 0)

    def free_counts(self) -> dict[str, int]:
        """Free token ids (full and SWA), C4 device rows and C4 host rows (their initial values
        when no request is live)."""
        tokens = self.allocator.logical_attn_allocator
        return {"token_free": int(tokens.full_available_size()), "swa_free": int(tokens.swa_available_size()),
                "c4_rows_free": self.allocator.c4.rows.room(), "c4_host_free": self.mirror.pool.available_size()}

    def idle_report(self) -> Optional[str]:
        """Once per busy -> idle transition: every pool's free count against its initial value
        (``leak=yes``, at ERROR, when one differs) and the C4 layers' selected / missed entries
        (reads the device counters: the server is idle). None when nothing happened since."""
        if not self._busy:
            return None
        self._busy = False
        counts = self.free_counts()
        leak = counts != self.initial
        selected, misses = (int(x) for x in self.counters.tolist())
        if self._export is not None:
            self._export[0].publish(selected, misses, self._decode_steps, self.gauges())
        pools = " ".join(f"{name}={value}/{self.initial[name]}" for name, value in counts.items())
        line = (f"sglang-hisparse idle (DeepSeek-V4 C4): {pools} leak={'yes' if leak else 'no'} "
                f"selected={selected} misses={misses} miss_rate={misses / selected if selected else 0.0:.4f}")
        if self.residency is not None:
            r = self.residency.residency
            line += (f" resident={r.count()} admitted_resident={r.admitted_total} demotions={r.demotions_total}"
                     f" promotions={r.promotions_total}")
        (logger.error if leak else logger.info)(line)
        return line
