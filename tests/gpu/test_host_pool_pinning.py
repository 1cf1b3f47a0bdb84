"""The host pool's pinning lives and ends with the coordinator.

SGLang's host pool maps its buffer with ``mmap`` and pins it with ``cudaHostRegister``. A pool
dropped without ``destroy`` leaves its range registered after ``munmap``; the next pool whose
mapping lands on those addresses then fails to register ("part or all of the requested memory
range is already mapped": the second rig of the first ``scripts/research/bench_step_host.py --device cuda``
run, the call before gpu_run74). The coordinator's ``destroy`` (SGLang calls it at shutdown; the
rig's ``close``) must unpin it, and pools of one size must then build again and again in one
process.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from rig import PAGE, Request, Rig  # noqa: E402

pytestmark = pytest.mark.gpu


def test_a_destroyed_coordinator_unpins_its_host_pool_and_the_next_one_builds(gloo_world):
    for round_ in range(3):
        rig = Rig(gloo_world, device="cuda", debug=False, residency=True, device_rows=PAGE * 32, max_context=1024)
        buffer = rig.coord.mirror.pool.kv_buffer  # keeps the mapping alive past destroy
        assert buffer.is_pinned(), f"round {round_}: the host pool is not pinned"
        rig.run_flow([Request(uid=round_, prompt_len=150)], steps=3, seed=round_)
        rig.close()
        assert not buffer.is_pinned(), f"round {round_}: destroy left the host pool pinned"
        del rig, buffer
