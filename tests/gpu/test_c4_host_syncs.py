"""DeepSeek-V4's coordinator (C4 entries) on CUDA: the protocol calls of a decode step and of a
request's finish never wait for the device. Skips without CUDA.

The CUDA counterpart of ``tests/test_c4_coordinator.py::test_a_decode_step_moves_nothing_to_the_device_with_a_blocking_copy``
(which checks on CPU that every device move is non-blocking): here torch's sync debug mode records
every synchronizing op inside the guarded calls (``SyncRecorder`` of test_host_syncs.py), whatever
its kind (a blocking copy, ``.item()``, ``nonzero``). The rig is the CPU test's (``Rig`` with
``device="cuda"``: SGLang's tensors on the GPU, the C4 host pool pinned, its copies SGLang's transfer
kernels), warmed up by one request first (first-use set-up such as the copy lanes' streams and the
layer address tables is not a per-step cost). ``collect_ready_reqs`` is not guarded: the rig asks
for ``wait_for_staging``, which waits for the staging copies on purpose.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from test_c4_coordinator import Rig  # noqa: E402
from test_host_syncs import SyncRecorder  # noqa: E402

pytestmark = pytest.mark.gpu

GUARDED = ("map_last_loc_to_buffer", "wait_for_pending_backup", "device_rows_short", "request_finished")


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_c4_decode_steps_and_finishes_do_not_wait_for_the_device(gloo_world, residency):
    rig = Rig(seed=21, tp_group=gloo_world, residency=residency, device="cuda", wait_for_staging=True)
    warm = rig.prefill(5, 700)
    assert [r.rid for r in rig.coord.collect_ready_reqs()] == [warm.rid]
    for _ in range(5):
        rig.step([warm])
    rig.finish(warm)
    recorder = SyncRecorder()
    for name in GUARDED:
        recorder.guard(rig.coord, name)
    reqs = [rig.prefill(i, n) for i, n in enumerate([9, 600, 2203, 2900])]  # empty, short, crossing B, long
    assert len(rig.coord.collect_ready_reqs()) == len(reqs)
    for _ in range(9):  # entries completed and backed up, short buffers grown, resident pages started
        short = rig.coord.device_rows_short([r.req_pool_idx for r in reqs], [r.kv.kv_allocated_len for r in reqs])
        assert short == 0
        rig.step(reqs)
    for r in reqs:
        rig.finish(r)
    torch.cuda.synchronize()
    assert not recorder.sites, "host syncs in our calls:\n" + recorder.report()
    assert rig.free_counts() == rig.initial
