"""Our coordinator provides every member SGLang 0.5.17 uses (found by grepping the installed
SGLang), and after load_plugins() SGLang's HiSparse names resolve to our classes."""

from __future__ import annotations

import re
from pathlib import Path

import sglang

from rig import Rig

EXPECTED_0_5_17 = {
    "set_decode_producer_stream", "destroy", "get_token_stats", "admit_request_into_staging",
    "admit_request_direct", "request_finished", "retract_req", "collect_ready_reqs",
    "has_ongoing_staging", "host_token_len", "map_last_loc_to_buffer", "wait_for_pending_backup",
    "swap_in_selected_pages", "num_real_reqs", "mem_pool_host", "req_to_host_pool",
    "req_to_host_pool_allocated_len", "padded_buffer_size", "raw_indices_buffer",
}


def used_members() -> set[str]:
    root = Path(sglang.__file__).parent
    names = set()
    # `hisparse_coordinator.x`, and `coordinator.x` in files that bind the HiSparse coordinator
    # to a local name (the PD decode path does `coordinator = self.scheduler.hisparse_coordinator`)
    direct = re.compile(r"hisparse_coordinator\.([A-Za-z_][A-Za-z0-9_]*)")
    local = re.compile(r"(?<![A-Za-z0-9_])coordinator\.([A-Za-z_][A-Za-z0-9_]*)")
    for path in root.rglob("*.py"):
        if path.name == "hisparse_coordinator.py" or "test" in path.parts:
            continue
        text = path.read_text(errors="ignore")
        names |= set(direct.findall(text))
        if "= self.scheduler.hisparse_coordinator" in text or "= self.hisparse_coordinator" in text:
            names |= set(local.findall(text))
    return names


def test_installed_sglang_uses_the_known_protocol():
    assert used_members() == EXPECTED_0_5_17


def test_our_coordinator_provides_every_member(gloo_world):
    coord = Rig(gloo_world).coord
    missing = sorted(name for name in used_members() if not hasattr(coord, name))
    assert not missing, f"coordinator lacks {missing}"
    # PD decode calls this on the host pool with upstream's signature
    assert callable(coord.mem_pool_host.alloc_paged_token_slots)
    assert coord.mem_pool_host.get_contiguous_buf_infos()[0]


def test_sglang_names_resolve_to_our_classes_after_load_plugins(run_fresh_python):
    result = run_fresh_python(
        """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import sglang.srt.managers.hisparse_coordinator as c
        import sglang.srt.mem_cache.allocator.hisparse as a
        import sglang.srt.mem_cache.hisparse_memory_pool as p
        import sglang.srt.mem_cache.kv_cache_configurator as kvc
        import sglang.srt.managers.scheduler as s
        print(c.HiSparseCoordinator.__module__, a.HiSparseTokenToKVPoolAllocator.__module__,
              p.HiSparseDSATokenToKVPool.__module__)
        print(kvc.HiSparseTokenToKVPoolAllocator is a.HiSparseTokenToKVPoolAllocator,
              kvc.HiSparseDSATokenToKVPool is p.HiSparseDSATokenToKVPool,
              s.HiSparseCoordinator is c.HiSparseCoordinator)
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        print(ScheduleBatch.check_decode_mem.__wrapped__.__qualname__)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "sglang_hisparse.coordinator sglang_hisparse.allocator sglang_hisparse.device_pool",
        "True True True",
        "ScheduleBatch.check_decode_mem",
    ]
