"""The MLA host pool's copies take host rows on the CPU as well as on the device.

A prefix load-back (``prefix/host_tree.py``) reads its host rows from the tree's CPU table and
hands them to ``load_rows`` with device rows on CUDA; SGLang's transfer kernel accepts device
index lists only (the first H200 prefix run stopped there: "Device value [cpu] not in the allowed
options: [cuda]"). Both directions are checked against a torch copy on fresh random rows, the
destination poisoned first.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from rig import PAGE, Rig  # noqa: E402

pytestmark = pytest.mark.gpu


def _random_rows(count: int, limit: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randperm(limit, generator=generator)[:count].to(torch.int64)


@pytest.mark.parametrize("host_rows_on", ["cpu", "cuda"])
def test_load_and_write_back_match_torch_with_host_rows_on_either_device(gloo_world, host_rows_on):
    rig = Rig(gloo_world, device="cuda", debug=False, device_rows=PAGE * 32, max_context=1024)
    try:
        pool, device_pool = rig.coord.mirror.pool, rig.coord.device_pool
        generator = torch.Generator().manual_seed(7)
        count = 3 * PAGE + 5
        host_rows = _random_rows(count, pool.capacity_tokens, generator)
        device_rows = _random_rows(count, PAGE * 32, generator).cuda()
        layers = range(pool.layer_num)
        for layer in layers:
            pool.kv_buffer[layer].copy_(torch.randint_like(pool.kv_buffer[layer], 0, 255))
            device_pool.kv_buffer[layer].fill_(0)  # poison: zeros are never all of a random row

        pool.load_rows(device_pool, host_rows.to(host_rows_on), device_rows)
        torch.cuda.synchronize()
        for layer in layers:
            expected = pool.kv_buffer[layer][host_rows].to("cuda")
            assert torch.equal(device_pool.kv_buffer[layer][device_rows], expected), f"load, layer {layer}"

        for layer in layers:
            device_pool.kv_buffer[layer].copy_(torch.randint_like(device_pool.kv_buffer[layer], 0, 255))
            pool.kv_buffer[layer].fill_(0)
        pool.write_back(device_pool, device_rows, host_rows.to(host_rows_on))
        torch.cuda.synchronize()
        for layer in layers:
            expected = device_pool.kv_buffer[layer][device_rows].cpu()
            assert torch.equal(pool.kv_buffer[layer][host_rows], expected), f"write-back, layer {layer}"
    finally:
        rig.close()
