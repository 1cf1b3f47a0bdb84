"""DSA's decode path moves nothing to the device with a blocking copy (tests/blocking_moves.py):
the protocol calls on a decode step's path, on entering decode and on finishing, through the CPU
rig's flows with residency on (requests entering resident, page starts, a deferred write-through)
and with hot buffers only (short and long requests). The C4 path's check is in
tests/test_c4_coordinator.py; tests/gpu/test_host_syncs.py is the CUDA counterpart of both."""

from __future__ import annotations

import pytest
import torch

from blocking_moves import BlockingMoves
from rig import PAGE, Request, Rig
from sglang_hisparse.memory.host_mirror import DEFERRED_FLUSH_STEPS

COORDINATOR_CALLS = ("admit_request_into_staging", "collect_ready_reqs", "device_rows_short", "map_last_loc_to_buffer",
                     "wait_for_pending_backup", "request_finished")


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_the_decode_path_makes_no_blocking_device_move(gloo_world, monkeypatch, residency):
    rig = Rig(gloo_world, residency=residency, device_rows=PAGE * 64, max_reqs=8, max_context=2048)
    moves = BlockingMoves(monkeypatch)
    moves.guard(rig.coord, *COORDINATOR_CALLS)
    moves.guard(rig.allocator, "alloc_decode")
    lengths = [100, 130, 64, 257, 400] if residency else [60, 100, 300, 500]  # B = 128: short and long
    reqs = [Request(uid=i, prompt_len=n) for i, n in enumerate(lengths)]
    rig.run_flow(reqs, steps=DEFERRED_FLUSH_STEPS + 6, seed=1)
    assert not moves.sites, sorted(set(moves.sites))


def test_the_check_sees_a_blocking_move_and_only_ours(monkeypatch):
    """A planted blocking move in a guarded call of our package is recorded at its line; the same
    move made non-blocking, or made by test code, is not."""
    import sglang_hisparse.memory.paging as paging

    class Target:
        def blocking(self):
            return torch.zeros(2).to("cpu")  # test code: not ours, not recorded

    allocator = paging.PageAllocator(4, 2, "cpu")
    moves = BlockingMoves(monkeypatch)
    moves.guard(Target(), "blocking")
    Target().blocking()
    moves.guard(allocator, "decode")
    # paging.decode_ids_torch moves its start positions non-blocking: nothing recorded
    allocator.decode([3], torch.tensor([1]))
    assert moves.sites == []
    monkeypatch.setattr(paging, "decode_ids_torch", _blocking_twin)
    allocator.decode([3], torch.tensor([1]))
    assert len(moves.sites) == 1 and moves.sites[0].startswith("paging.py:")


def _blocking_twin(last_loc, starts, pages, page_size):
    """decode_ids_torch with a blocking move of the start positions (the bug the check exists for)."""
    ids = last_loc.to(torch.int64) + 1
    if starts:
        ids[torch.tensor(starts).to(ids.device)] = pages * page_size
    return ids
