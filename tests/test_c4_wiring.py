"""DeepSeek-V4 wired into SGLang: the sparse-prefill gather translated to our rows, SGLang's
coordinator call answered by the C4 coordinator, the self-check accepting V4's objects, and the
seams registered by the plugin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.decode.c4_coordinator import C4Coordinator
from sglang_hisparse.decode.coordinator import HiSparseCoordinator
from sglang_hisparse.memory import c4_device_pool
from sglang_hisparse.memory.c4_allocator import C4Allocator
from sglang_hisparse.memory.c4_device_pool import C4DevicePool, active_c4_mapping
from sglang_hisparse.patches import c4_sparse_prefill, self_check
from sglang_hisparse.resolver.c4_rows import C4_PAGE_ENTRIES

from test_c4_coordinator import Tokens


class Cache:
    """Stand-in of SGLang's SparsePrefillChunkCache: ``ensure_c4`` fills the logical ids once."""

    def __init__(self):
        self.c4_flat_token_ids = None
        self.calls = 0

    def ensure_c4(self, page_table, c4_page_size):
        self.calls += 1
        if self.c4_flat_token_ids is not None:
            return
        self.c4_flat_token_ids = (page_table[0] * c4_page_size).to(torch.int32)


@pytest.fixture
def no_active_pool(monkeypatch):
    monkeypatch.setattr(c4_device_pool, "_active", None)


def test_the_sparse_prefill_gathers_our_rows_once(no_active_pool):
    pool = C4DevicePool(4 * C4_PAGE_ENTRIES, C4_PAGE_ENTRIES, torch.float8_e4m3fn, 448, 64, 1, "cpu", False)
    mapping = torch.zeros(1024, dtype=torch.int64)
    mapping[64] = 7
    mapping[128] = 9
    cache = Cache()
    page_table = torch.tensor([[1, 2, 0]])
    c4_sparse_prefill.ensure_c4(Cache.ensure_c4, cache, page_table, C4_PAGE_ENTRIES)
    assert cache.c4_flat_token_ids.tolist() == [64, 128, 0]  # no pool of ours: SGLang's ids untouched
    pool.attach_mapping(mapping)
    assert active_c4_mapping() is mapping
    cache = Cache()
    c4_sparse_prefill.ensure_c4(Cache.ensure_c4, cache, page_table, C4_PAGE_ENTRIES)
    assert cache.c4_flat_token_ids.tolist() == [7, 9, 0] and cache.c4_flat_token_ids.dtype == torch.int32
    c4_sparse_prefill.ensure_c4(Cache.ensure_c4, cache, page_table, C4_PAGE_ENTRIES)  # later layers: cached
    assert cache.c4_flat_token_ids.tolist() == [7, 9, 0] and cache.calls == 2


def test_sglangs_coordinator_call_builds_the_c4_coordinator_for_a_c4_allocator(gloo_world):
    alloc = C4Allocator(Tokens(1 << 14, 1024))
    rtt = torch.zeros(4, 4096, dtype=torch.int32)
    config = HiSparseConfig(top_k=32, device_buffer_size=128, resolver="reference", residency=False)
    coordinator = HiSparseCoordinator(req_to_token_pool=SimpleNamespace(req_to_token=rtt),
                                      token_to_kv_pool_allocator=alloc, top_k=32, device_buffer_size=128,
                                      device="cpu", tp_group=gloo_world, host_to_device_ratio=2,
                                      swap_in_block_size=960, config=config, pin_memory=False)
    assert isinstance(coordinator, C4Coordinator)
    assert coordinator.padded_buffer_size == 192 and coordinator.mem_pool_host.capacity_tokens == 2048


def test_the_self_check_accepts_either_family_and_names_both():
    from sglang_hisparse.serving.plugin import class_seams, expected_classes

    expected = expected_classes(class_seams())  # what the plugin registers, not a hand-made map
    assert set(expected["device_pool"]) >= {C4DevicePool} and set(expected["allocator"]) >= {C4Allocator}
    check = self_check.make_hook(expected, None)
    tokens = Tokens(1 << 14, 2 * C4_PAGE_ENTRIES)
    tokens._kvcache.c4_kv_pool = C4DevicePool(2 * C4_PAGE_ENTRIES, C4_PAGE_ENTRIES, torch.float8_e4m3fn, 448, 64, 1,
                                              "cpu", False)
    allocator = C4Allocator(tokens)  # get_kvcache() is SGLang's V4 pool: the C4 pool is what is checked
    coordinator = object.__new__(C4Coordinator)
    ok = SimpleNamespace(enable_hisparse=True, token_to_kv_pool_allocator=allocator, hisparse_coordinator=coordinator)
    check(None, ok)
    bad = SimpleNamespace(enable_hisparse=True, token_to_kv_pool_allocator=allocator, hisparse_coordinator=object())
    with pytest.raises(Exception, match="coordinator: expected .*HiSparseCoordinator or .*C4Coordinator, found"):
        check(None, bad)


def test_the_plugin_registers_the_v4_seams():
    from sglang_hisparse.serving.plugin import class_seams, function_seams

    targets = {seam.TARGET for seam in class_seams()} | {getattr(seam, "TARGET", None) for seam in function_seams()}
    assert "sglang.srt.mem_cache.deepseek_v4_memory_pool.HiSparseC4DevicePool" in targets
    assert "sglang.srt.mem_cache.allocator.hisparse.DeepSeekV4HiSparseTokenToKVPoolAllocator" in targets
    assert "sglang.srt.layers.attention.dsv4.sparse_prefill_utils.SparsePrefillChunkCache.ensure_c4" in targets
