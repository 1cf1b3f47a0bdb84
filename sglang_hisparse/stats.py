"""What the resolver did, and whether every pool came back: counters, step lines, idle reports.

Owns the device counters the resolver increments (``selected``: selected non-newest positions of
requests past the fast path; ``misses``: those copied from host), the decode-step count, and the
idle-report state. Reading a device counter synchronizes with the device, so step lines are off
unless ``stats_log_interval`` asks for them, and idle reports run only when the server is idle.

Idle report rule: one line per busy -> idle transition, where *busy* means some request was
admitted or some decode step ran since the last report (:meth:`note_activity`). It does not
depend on the counters changing: a server whose requests all stayed on the fast path (no
selection counted) still reports.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, NamedTuple, Optional

import torch

logger = logging.getLogger(__name__)

FreeCounts = dict[str, int]


class HiSparseTokenStats(NamedTuple):
    """What SGLang's scheduler logs and exports about HiSparse memory (``get_token_stats``)."""

    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


def token_stats(allocator, host_pool) -> HiSparseTokenStats:
    """Device rows and host rows in use, and their share of each pool."""
    device_total, host_total = allocator.device_size, host_pool.capacity_tokens
    device_used = device_total - allocator.rows.pages.available_tokens()
    host_used = host_total - host_pool.available_size()
    return HiSparseTokenStats(device_used, device_used / device_total if device_total else 0.0,
                              host_used, host_used / host_total if host_total else 0.0)


def pool_free_counts(allocator, host_pool) -> FreeCounts:
    """Free rows of every pool (equal to their initial values when no request is live)."""
    return {
        "logical_free": allocator.logical.available_tokens(),
        "device_free": allocator.rows.pages.available_tokens(),
        "host_free": host_pool.available_size(),
    }


class HostTime:
    """Host time our code spends per decode step, by part (``check``: the decode memory check,
    ``alloc``: the new tokens' logical ids, ``map``: ``map_last_loc_to_buffer``, ``wait``:
    ``wait_for_pending_backup``, ``ready``: ``collect_ready_reqs`` calls that move requests into
    decode; calls that only find copies still running are not counted: the scheduler repeats them
    while it has nothing else to do), since the last idle report.
    Two ``perf_counter_ns`` reads per timed call; no device sync. Owned by the allocator (the first
    of our objects SGLang builds), read and reset by :class:`ResolveStats` at each idle report."""

    PARTS = ("check", "alloc", "map", "wait", "ready")

    def __init__(self) -> None:
        self.ns = dict.fromkeys(self.PARTS, 0)

    def add(self, part: str, ns: int) -> None:
        self.ns[part] += ns

    def take(self) -> dict[str, int]:
        """The totals (ns) since the last call, and reset them."""
        totals, self.ns = self.ns, dict.fromkeys(self.PARTS, 0)
        return totals


def timed(part: str):
    """Decorate a method of an object with a ``host_time`` (:class:`HostTime`): add its wall time
    to ``part``."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.host_time.add(part, time.perf_counter_ns() - start)
        return run
    return wrap


def host_time_line(totals: dict[str, int], steps: int) -> str:
    """``host_us_per_step=T (check a alloc b map c wait d ready e)``: our host time per decode step
    (steps > 0), by part."""
    per = {part: ns / 1e3 / steps for part, ns in totals.items()}
    return (f"host_us_per_step={sum(per.values()):.1f} (" +
            " ".join(f"{part} {us:.1f}" for part, us in per.items()) + ")")


class ResolveStats:
    def __init__(self, device: torch.device, *, log_interval: int, row_bytes: int, free_counts: Callable[[], FreeCounts],
                 host_time: HostTime):
        self.host_time = host_time
        """Our host time per part (the allocator's; read and reset at each idle report)."""
        self._steps_at_report = 0
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        """int64 [2] on the KV device: (selected, misses), incremented in place by the resolver."""
        self._log_interval = log_interval
        self._row_bytes = row_bytes
        self.free_counts = free_counts
        self.initial: FreeCounts = free_counts()
        self._decode_steps = 0
        self._logged = (0, 0)
        self._busy = False
        self._export = None
        self.residency = None
        """The coordinator's :class:`~sglang_hisparse.memory.residency.Residency` when residency is on."""
        self.elastic = None
        """The residency driver's :class:`~sglang_hisparse.decode.elastic.ElasticBuffers` when
        ``max_device_buffer_size`` is on (the report's ``grown``/``given_back`` rows)."""
        self.prefix_cache = None
        """The radix cache holding finished requests' ids and host rows (``HostPrefixCache``), when on."""

    def export_to(self, export, gauges: Callable[[], object], interval: int = 40) -> None:
        """Publish to ``export`` (a :class:`sglang_hisparse.metrics.PrometheusExport`) every
        ``interval`` decode steps without a host stall, and exactly at every idle report."""
        from sglang_hisparse.metrics import CounterReader

        self._export = (export, gauges, interval, CounterReader(self.counters))

    def totals(self) -> tuple[int, int]:
        """(selected, misses) over the server's life. Synchronizes with the device."""
        selected, misses = self.counters.tolist()
        return int(selected), int(misses)

    def note_activity(self) -> None:
        """A request was admitted or left, or a decode step ran: the next idle report is due."""
        self._busy = True

    def note_decode_step(self, batch_size: int) -> None:
        """Count a decode step; every ``log_interval`` steps log what the resolver did since the
        last line (hit rate, misses, bytes copied)."""
        self._busy = True
        self._decode_steps += 1
        if self._export is not None and self._decode_steps % self._export[2] == 0:
            export, gauges, _, reader = self._export
            totals = reader.latest()
            if totals is not None:
                export.publish(totals[0], totals[1], self._decode_steps, gauges())
        if not self._log_interval or self._decode_steps % self._log_interval:
            return
        selected, misses = self.totals()
        d_sel, d_miss = selected - self._logged[0], misses - self._logged[1]
        self._logged = (selected, misses)
        hit_rate = 100.0 * (d_sel - d_miss) / d_sel if d_sel else 100.0
        logger.info(
            "sglang-hisparse step %d: batch %d, selected rows %d, hits %d, misses %d "
            "(hit rate %.1f%%), bytes copied %d",
            self._decode_steps, batch_size, d_sel, d_sel - d_miss, d_miss, hit_rate, d_miss * self._row_bytes,
        )

    def idle_report(self) -> Optional[str]:
        """The idle line when activity happened since the last one, else None. Logged at ERROR
        with ``leak=yes`` when a pool's free count differs from its initial value (less the ids and
        host rows the prefix cache holds, ``cached=``, when it is on)."""
        if not self._busy:
            return None
        self._busy = False
        counts = self.free_counts()
        selected, misses = self.totals()
        if self._export is not None:
            self._export[0].publish(selected, misses, self._decode_steps, self._export[1]())
        cached = self.prefix_cache.held_tokens() if self.prefix_cache is not None else 0
        expected = {name: value - (cached if name in ("logical_free", "host_free") else 0)
                    for name, value in self.initial.items()}  # the cache holds one id and one host row per token
        leak = counts != expected
        pools = " ".join(f"{name}={value}/{self.initial[name]}" for name, value in counts.items())
        if self.prefix_cache is not None:
            pools += (f" cached={cached} loaded={self.prefix_cache.loaded_tokens} "
                      f"lent={self.prefix_cache.loans.lent_tokens} shared={self.prefix_cache.shared_tokens} "
                      f"evicted={self.prefix_cache.evicted_tokens}")
            if self.prefix_cache.serves_transfers:
                pools += f" not_sent={self.prefix_cache.tokens_not_sent}"
        line = (
            f"sglang-hisparse idle: {pools} leak={'yes' if leak else 'no'} selected={selected} "
            f"misses={misses} miss_rate={misses / selected if selected else 0.0:.4f} row_bytes={self._row_bytes}"
        )
        steps = self._decode_steps - self._steps_at_report
        self._steps_at_report = self._decode_steps
        totals = self.host_time.take()
        if steps:
            line += f" steps={steps} " + host_time_line(totals, steps)
        if self.residency is not None:
            line += (f" resident={self.residency.count()} admitted_resident={self.residency.admitted_total}"
                     f" demotions={self.residency.demotions_total} promotions={self.residency.promotions_total}")
        if self.elastic is not None:
            line += f" grown={self.elastic.grown_rows_total} given_back={self.elastic.given_back_rows_total}"
        (logger.error if leak else logger.info)(line)
        return line
