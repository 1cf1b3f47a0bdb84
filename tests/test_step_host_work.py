"""A decode step's host work (our part of it) must not grow with the context length or the layer
count, and only a little with the batch: scripts/research/bench_step_host.py timed here with generous
bounds (a regression that makes it proportional to context or layers is tens of times over them;
the numbers themselves are in docs/performance.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "research"))

import bench_step_host  # noqa: E402
from sglang_hisparse.memory.host_mirror import DEFERRED_FLUSH_STEPS  # noqa: E402


@pytest.mark.parametrize("residency", [True, False])
def test_host_work_does_not_grow_with_context_or_layers(gloo_world, residency):
    def us(**kw) -> float:
        return bench_step_host.step_host_us(gloo_world, residency=residency, steps=48, **kw)

    us(batch=16, context=1024, layers=2)  # warm-up: first calls of each torch op
    base = us(batch=16, context=1024, layers=2)
    long = us(batch=16, context=65536, layers=2)
    deep = us(batch=16, context=1024, layers=16)
    assert long < 2 * base + 200, (base, long)
    assert deep < 2 * base + 200, (base, deep)


@pytest.mark.parametrize("residency", [True, False])
def test_host_work_per_request_is_small(gloo_world, residency):
    def us(batch: int) -> float:
        return bench_step_host.step_host_us(gloo_world, batch=batch, context=1024, layers=2, residency=residency,
                                            steps=48)

    us(1)
    one, many = us(1), us(256)
    assert many < 3 * one + 256 * 4, (one, many)  # at most a few microseconds per request


@pytest.mark.parametrize("admit", ["pd", "prefill"])
def test_the_benchmark_times_each_part_on_either_admission(gloo_world, admit):
    """The breakdown the GPU run reads (``--parts``): every part of a step timed on its own, over
    a run crossing a deferred write-through, with the batch admitted either way; every pool back
    at its initial count (checked inside)."""
    steps = DEFERRED_FLUSH_STEPS + 6
    times = bench_step_host.time_steps(gloo_world, batch=3, context=256, layers=1, residency=True, steps=steps,
                                       admit=admit)
    assert set(times) == {*bench_step_host.PARTS, "total"}
    assert all(len(v) == steps for v in times.values())
    for step in range(steps):
        assert times["total"][step] == pytest.approx(sum(times[p][step] for p in bench_step_host.PARTS))
