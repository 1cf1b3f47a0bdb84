"""The C4 host pool's copies on CUDA (SGLang's transfer kernels moving each 584-byte row as its
576-byte value and its 8-byte scale item) against the torch path of the same pool (``C4PagedRows``
reads and writes: the layout's definition), on fresh random rows, destinations poisoned first;
and neither direction waits for the device on the host. Skips without CUDA."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang_hisparse.memory.c4_host_pool import C4HostPool  # noqa: E402
from sglang_hisparse.resolver.c4_rows import C4_PAGE_BYTES, C4_PAGE_ENTRIES, C4PagedRows  # noqa: E402

pytestmark = pytest.mark.gpu
P = C4_PAGE_ENTRIES


def device_pool(layers: int, pages: int, gen: torch.Generator) -> SimpleNamespace:
    bufs = [torch.randint(0, 256, (pages, C4_PAGE_BYTES), dtype=torch.uint8, generator=gen).cuda() for _ in range(layers)]
    return SimpleNamespace(kv_buffer=bufs, layer_num=layers, device=torch.device("cuda"))


@pytest.mark.parametrize("seed", range(20))
def test_kernel_copies_match_the_paged_rows_both_ways(seed):
    gen = torch.Generator().manual_seed(seed)
    layers, pages = 3, 40
    dev = device_pool(layers, pages, gen)
    pool = C4HostPool(layers, pages * P, pin_memory=True)
    pool.kv_buffer.copy_(torch.randint(0, 256, pool.kv_buffer.shape, dtype=torch.uint8, generator=gen))
    n = int(torch.randint(1, 600, (1,), generator=gen))
    src = torch.randperm(pages * P, generator=gen)[:n].cuda()
    dst = (torch.randperm((pages - 1) * P, generator=gen)[:n] + P).cuda()  # host page 0 is never handed out
    host_before = pool.kv_buffer.clone()
    expect_host = host_before.clone()
    for layer in range(layers):
        C4PagedRows(expect_host[layer]).write(dst.cpu(), C4PagedRows(dev.kv_buffer[layer]).read(src).cpu())
    pool.write_back(dev, src, dst)
    torch.cuda.synchronize()
    assert torch.equal(pool.kv_buffer, expect_host)  # the rows, and every other byte (padding) kept

    target = device_pool(layers, pages, gen)
    before = [b.clone() for b in target.kv_buffer]
    expect_dev = [b.clone() for b in target.kv_buffer]
    back = torch.randperm(pages * P, generator=gen)[:n].cuda()
    for layer in range(layers):
        C4PagedRows(expect_dev[layer]).write(back, C4PagedRows(pool.kv_buffer[layer]).read(dst.cpu()).cuda())
    layer_id = None if seed % 2 else seed % layers
    pool.load_rows(target, dst, back, layer_id=layer_id)
    torch.cuda.synchronize()
    for layer in range(layers):
        loaded = layer_id is None or layer == layer_id
        assert torch.equal(target.kv_buffer[layer], expect_dev[layer] if loaded else before[layer])


def test_copies_do_not_wait_for_the_device():
    gen = torch.Generator().manual_seed(7)
    dev = device_pool(2, 8, gen)
    pool = C4HostPool(2, 8 * P, pin_memory=True)
    rows = torch.arange(P, 3 * P, device="cuda")
    pool.write_back(dev, rows, rows)
    pool.load_rows(dev, rows, rows)
    torch.cuda.synchronize()  # below: the one-layer copy builds its layer address tables (no wait either)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pool.write_back(dev, rows, rows)
            pool.load_rows(dev, rows, rows, layer_id=1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert not syncs, syncs
