"""Our protocol calls on a decode step's path, on entering decode and on finishing never wait for the
device. Skips without CUDA.

The overlap scheduler prepares step n + 1 while the device runs step n; a host sync inside one of
our calls stalls it until the forward in flight ends, so every sync costs that step its overlap
(measured as the ``ready`` part of our host time growing with the prefill in flight, gpu_run68).
The CPU rig's flows run here on CUDA with torch's sync debug mode switched on inside each guarded
call; every synchronizing op is recorded with the source line that issued it, and the test fails
naming those lines.

Flows: residency on without pressure (requests enter resident, resident steps across page starts
and a deferred write-through, finishing), and hot buffers only (short and long requests, the full
step path, finishing), each after one unguarded warm-up request (first-use set-up, e.g. the copy
lanes' streams, is not a per-step cost). Demotion is guarded in the elastic flow (hand-called
there; it used boolean masks on the selections and the dropped pages until 2026-12-07, fourth
session; tests/test_device_scalar_writes.py has its CPU guard).

``HiSparseAllocator.free`` (SGLang's free of the logical ids, once per step with finishing
requests: its result processing groups the frees) is recorded and printed but not asserted: it
compacts the freed rows on the device (boolean masks, ``unique``), as SGLang's own paged free does
(``torch.unique``), so it waits once either way.

First run (gpu_run70, before the fixes): every ``x[idx] = scalar`` on a device tensor synchronized
(the scalar is copied from pageable memory): the resident flag at entry and exit, the hot-owned
rows, the mapping cleared at finish; and the hot buffers' entry and release counted and
compacted pages on the device.
"""

from __future__ import annotations

import collections
import random
import warnings

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from rig import PAGE, Request, Rig  # noqa: E402,F401
from sglang_hisparse.memory.host_mirror import DEFERRED_FLUSH_STEPS  # noqa: E402

pytestmark = pytest.mark.gpu

COORDINATOR_CALLS = ("admit_request_into_staging", "collect_ready_reqs", "device_rows_short", "map_last_loc_to_buffer",
                     "wait_for_pending_backup", "request_finished")
ALLOCATOR_CALLS = ("alloc_decode",)
REPORTED_ONLY = ("free",)  # see the module docstring
SYNC_WARNING = "called a synchronizing CUDA operation"
"""torch's warning for each synchronizing op in "warn" mode (c10 ``warn_or_error_on_sync``), matched
by its start (torch appends the C++ source line). The first switch to "warn" in a process also warns,
once, that the mode "does not yet detect all synchronizing operations": not a sync (gpu_run71 counted
it against the first guarded call while the filter was the substring "synchroniz")."""


class SyncRecorder:
    """Wraps methods so that each call runs with torch's sync debug mode on ("warn") and records
    the ``file:line`` of every synchronizing op it issues (the Python frame that called torch)."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self._depth = 0

    def guard(self, obj, name: str) -> None:
        method = getattr(obj, name)

        def guarded(*args, **kwargs):
            if self._depth:  # nested guarded call: the outer one records
                return method(*args, **kwargs)
            self._depth += 1
            previous = torch.cuda.get_sync_debug_mode()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        return method(*args, **kwargs)
                    finally:
                        torch.cuda.set_sync_debug_mode(previous)
                        for w in caught:
                            if str(w.message).startswith(SYNC_WARNING):  # torch appends where in C++
                                self.sites[f"{name}: {w.filename.split('site-packages/')[-1]}:{w.lineno}"] += 1
            finally:
                self._depth -= 1

        setattr(obj, name, guarded)

    def report(self) -> str:
        return "\n".join(f"{count:4d}x {site}" for site, count in self.sites.most_common())


def guarded_rig(gloo_world, **kwargs) -> tuple[Rig, SyncRecorder, SyncRecorder]:
    """A CUDA rig warmed up by one request, then guarded: the asserted calls' recorder and the
    reported-only one."""
    rig = Rig(gloo_world, device="cuda", debug=False, **kwargs)  # debug asserts read pages back: tests only
    rig.run_flow([Request(uid=99, prompt_len=70)], steps=2, seed=0)
    recorder, reported = SyncRecorder(), SyncRecorder()
    for name in COORDINATOR_CALLS:
        recorder.guard(rig.coord, name)
    for name in ALLOCATOR_CALLS:
        recorder.guard(rig.allocator, name)
    for name in REPORTED_ONLY:
        reported.guard(rig.allocator, name)
    return rig, recorder, reported


def test_resident_requests_enter_decode_and_finish_without_a_host_sync(gloo_world):
    rig, recorder, reported = guarded_rig(gloo_world, residency=True, device_rows=PAGE * 64, max_reqs=8,
                                          max_context=2048)
    reqs = [Request(uid=i, prompt_len=n) for i, n in enumerate([100, 130, 64, 257, 400])]
    try:
        # page starts for every request, and a deferred write-through
        rig.run_flow(reqs, steps=DEFERRED_FLUSH_STEPS + 6, seed=1)
    finally:
        rig.close()
    print("syncs in free (not asserted):\n" + reported.report())
    assert not recorder.sites, "host syncs in our calls:\n" + recorder.report()


def test_hot_buffer_requests_enter_decode_and_finish_without_a_host_sync(gloo_world):
    rig, recorder, reported = guarded_rig(gloo_world, residency=False, device_rows=PAGE * 64, max_reqs=8,
                                          max_context=2048)
    reqs = [Request(uid=i, prompt_len=n) for i, n in enumerate([60, 100, 300, 500])]  # B = 128: short and long
    try:
        rig.run_flow(reqs, steps=70, seed=2)
    finally:
        rig.close()
    print("syncs in free (not asserted):\n" + reported.report())
    assert not recorder.sites, "host syncs in our calls:\n" + recorder.report()


def test_elastic_hot_buffers_open_grow_and_close_without_a_host_sync(gloo_world):
    """``max_device_buffer_size`` (issue 44): a request entering decode as a hot buffer whose
    window slots are not next to its size (slot tables 6 pages wide, the buffer at 2), growth of
    three buffers at the checks (every step) inside ``map_last_loc_to_buffer``, and finishing.
    The first GPU run (gpu_run88) waited ~125 ms per request entering decode: the slots were
    written through an index tensor built on the host (a pageable copy to the device). The two
    demotions that make the rows spare are by hand, guarded too."""
    rig, recorder, reported = guarded_rig(gloo_world, residency=True, residency_watermark=0.25, device_rows=PAGE * 24,
                                          max_reqs=8, max_context=2048, promotion_interval=1,
                                          max_device_buffer_size=6 * PAGE)
    reqs = [Request(uid=i, prompt_len=8 * PAGE) for i in range(3)]
    rng = random.Random(4)
    try:
        for req in reqs:
            assert rig.prefill(req)
            rig.stage(req)
            torch.cuda.synchronize()  # its staging copy done: it enters at this collect
            assert rig.collect() == [req]
        assert rig.coord.hot.holds(reqs[2].req_pool_idx), "the third should enter as a hot buffer"
        recorder.guard(rig.coord._resident_decode, "demote")
        for req in reqs[:2]:
            rig.coord._resident_decode.demote(req.req_pool_idx)
        for _ in range(6):
            assert rig.decode_step(reqs)
            for layer in range(rig.layers):
                rig.resolve_and_check(reqs, layer, [rng.sample(range(r.seq_len), rig.top_k) for r in reqs])
        assert rig.coord._resident_decode.elastic.grown_rows_total > 0
        for req in reqs:
            rig.release(req)
    finally:
        rig.close()
    print("syncs in free (not asserted):\n" + reported.report())
    assert not recorder.sites, "host syncs in our calls:\n" + recorder.report()


def test_the_recorder_catches_a_planted_sync_and_only_syncs():
    """The recorder is not blind: a guarded call that reads a device value back is recorded at its
    line, and a quiet one records nothing (where ``quiet`` is the process's first guarded call, as
    when this test runs alone, the debug mode's one-time notice falls in it and must not count)."""

    class Target:
        def quiet(self):
            return torch.ones(4, device="cuda") + 1

        def reads_back(self):
            return torch.ones(4, device="cuda").sum().item()

    target, recorder = Target(), SyncRecorder()
    recorder.guard(target, "quiet")
    recorder.guard(target, "reads_back")
    target.quiet()
    assert not recorder.sites, recorder.report()
    target.reads_back()
    line = Target.reads_back.__code__.co_firstlineno + 1
    assert list(recorder.sites) == [f"reads_back: {__file__}:{line}"], recorder.report()
