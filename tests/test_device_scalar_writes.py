"""No Python scalar is written into device state through indexing in our protocol calls (CPU guard
of tests/gpu/test_host_syncs.py).

On a GPU, ``t[i] = 1`` and ``t[idx] = 0`` (``i`` an int, ``idx`` a tensor) copy the scalar from
pageable host memory into the device tensor, and that copy waits for the stream: gpu_run70 found
such writes in entering decode, in growth and in finishing, each stalling the scheduler until the
forward in flight ended. ``fill_`` / ``index_fill_`` pass the scalar as a kernel argument and slice
assignments go through ``fill_``: those are fine. On the CPU rig every tensor is on the CPU, so
this test marks the tensors that live on the KV device in a server (by storage) and records, with
the line of ours that issued it, every ``copy_`` / ``index_put_`` of a lifted Python scalar into
one of them during the same flows as the GPU test (SGLang's free of the ids included; the CPU
reference resolver's own writes left out: a GPU server resolves in the CUDA kernel).
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rig import PAGE, Request, Rig


def device_state(rig: Rig) -> list[torch.Tensor]:
    """The tensors of ours that a server keeps on the KV device."""
    coord, allocator = rig.coord, rig.allocator
    tensors = [allocator.logical_to_device, allocator.page_resident, allocator.rows.hot_owned,
               coord.hot.slot_rows, coord.hot.slot_positions, coord.hot.recency, coord.mirror.row_table,
               coord.num_real_reqs]
    if coord.residency is not None:
        tensors.append(coord.residency.flags)
    return tensors


class ScalarWrites(TorchDispatchMode):
    """Records ``copy_`` / ``index_put_`` of a lifted Python scalar into the watched storages."""

    def __init__(self, watched: list[torch.Tensor]):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.lifted: dict[int, torch.Tensor] = {}  # held, so that no id is reused while watched
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default:
            self.lifted[id(out)] = out
        elif func in (torch.ops.aten.copy_.default, torch.ops.aten.index_put_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[2]
            if self.lifted.get(id(source)) is source and args[0].untyped_storage().data_ptr() in self.storages:
                ours = [f for f in traceback.extract_stack() if "sglang_hisparse" in f.filename]
                if ours and "resolver/reference.py" in ours[-1].filename:
                    return out  # the CPU resolver; a GPU server resolves in the CUDA kernel
                where = f"{ours[-1].filename.split('sglang_hisparse/')[-1]}:{ours[-1].lineno}" if ours else "not ours"
                self.sites[where] += 1
        return out


def scalar_writes_in_flow(gloo_world, **kwargs) -> collections.Counter:
    rig = Rig(gloo_world, device_rows=PAGE * 64, max_reqs=8, max_context=2048, **kwargs)
    reqs = [Request(uid=i, prompt_len=n) for i, n in enumerate([60, 100, 130, 257, 400])]
    with ScalarWrites(device_state(rig)) as mode:
        rig.run_flow(reqs, steps=70, seed=3)
    return mode.sites


def test_resident_flow_writes_no_scalar_into_device_state(gloo_world):
    sites = scalar_writes_in_flow(gloo_world, residency=True)
    assert not sites, f"scalars written into device state through indexing (a sync each on a GPU): {dict(sites)}"


def test_hot_buffer_flow_writes_no_scalar_into_device_state(gloo_world):
    sites = scalar_writes_in_flow(gloo_world, residency=False)
    assert not sites, f"scalars written into device state through indexing (a sync each on a GPU): {dict(sites)}"


def test_the_guard_sees_a_scalar_written_through_indexing(gloo_world):
    """The guard itself: a planted ``flags[i] = 1`` and ``logical_to_device[ids] = 0`` are caught
    (and ``fill_`` / ``index_fill_`` / slice assignments are not)."""
    rig = Rig(gloo_world, residency=True)
    with ScalarWrites(device_state(rig)) as mode:
        rig.coord.residency.flags[1].fill_(1)
        rig.allocator.logical_to_device.index_fill_(0, torch.tensor([3, 4]), 0)
        rig.coord.hot.slot_positions[:, 1] = -1
    assert not mode.sites
    with ScalarWrites(device_state(rig)) as mode:
        rig.coord.residency.flags[1] = 1
        rig.allocator.logical_to_device[torch.tensor([3, 4])] = 0
    assert sum(mode.sites.values()) == 2



class DeviceReads(TorchDispatchMode):
    """Records, with the line of ours that issued it, every op on a tensor that a server keeps on
    the KV device (the given state, and by propagation every result of an op reading one) whose
    result size depends on device values (``nonzero``, boolean-mask indexing, ``masked_select``,
    ``unique``) or that reads a value back (``_local_scalar_dense``): each waits for the device on a
    GPU. Host-side state (numpy views, the step's CPU tensors) is never marked, so its reads pass."""

    READS = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
             torch.ops.aten._local_scalar_dense.default, torch.ops.aten._unique2.default,
             torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default}

    def __init__(self, device_tensors: list[torch.Tensor]):
        super().__init__()
        self.marked = {t.untyped_storage().data_ptr() for t in device_tensors}
        self.held: list[torch.Tensor] = []  # so that no marked storage is freed and its address reused
        self.sites: collections.Counter[str] = collections.Counter()

    def _on_device(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in self.marked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        on_device = any(self._on_device(x) for x in inputs)
        bool_index = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if on_device and (func in self.READS or bool_index):
            ours = [f for f in traceback.extract_stack() if "sglang_hisparse" in f.filename]
            where = f"{ours[-1].filename.split('sglang_hisparse/')[-1]}:{ours[-1].lineno}" if ours else "not ours"
            self.sites[f"{func}: {where}"] += 1
        out = func(*args, **(kwargs or {}))
        if on_device:
            for x in [*torch.utils._pytree.tree_leaves(out), *(args[:1] if func._schema.is_mutable else [])]:
                if isinstance(x, torch.Tensor):
                    self.marked.add(x.untyped_storage().data_ptr())
                    self.held.append(x)
        return out


def test_demoting_a_long_resident_request_reads_nothing_back_from_the_device(gloo_world):
    """A demotion under pressure (pages kept by the last step's selections, the rest freed) issues
    no op that waits for the device: demotions run while a prefill is in flight (a prefill's
    reclaim) or inside a decode step (pressure relief, elastic buffers' trades). The selections'
    empty entries and the dropped pages were boolean masks before (gpu_run88's trades and the
    admission phase's demotions each waited)."""
    rig = Rig(gloo_world, device_rows=PAGE * 24, residency=True, residency_watermark=0.0, top_k=32, debug=False)
    req = Request(uid=1, prompt_len=10 * PAGE)
    rig.enter_by_prefill([req])
    assert rig.decode_step([req])
    for layer in range(rig.layers):
        rig.resolve_and_check([req], layer, [list(range(2 * PAGE, 2 * PAGE + 20))])  # 12 empty selections
    device = [*device_state(rig), rig.coord._resident_decode.selections, rig.req_to_token_pool.req_to_token]
    with DeviceReads(device) as mode:
        rig.coord._resident_decode.reclaim(rig.allocator.rows.room() + PAGE)
    assert rig.coord.hot.holds(req.req_pool_idx)
    assert not mode.sites, f"ops that wait for the device in a demotion: {dict(mode.sites)}"
    rig.release(req)
    assert rig.counts() == rig.initial_counts
