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
        "sglang_hisparse.decode.coordinator sglang_hisparse.memory.allocator sglang_hisparse.memory.device_pool",
        "True True True",
        "ScheduleBatch.check_decode_mem",
    ]


# --- allocator and host pool: what SGLang's PD decode and scheduler code reads ------------------
SCANNED = ("disaggregation", "managers")
NOT_OURS_TO_SCAN = ("hisparse_coordinator.py", "cache_controller.py")  # upstream's HiSparse, HiCache
NOT_ON_HISPARSE_PATHS = {
    "alloc_extend_swa_tail": "hybrid sliding-window models only (DSA models have no SWA layers)",
    "full_available_size": "hybrid sliding-window models only",
    "size_swa": "hybrid sliding-window models only",
    "swa_available_size": "hybrid sliding-window models only",
    "translate_loc_from_full_to_swa": "hybrid sliding-window models only",
    "mamba_allocator": "Mamba (SSM) models only",
    "mamba_slot_full_token_cost": "Mamba (SSM) models only",
    "flush_opportunistic": "--enable-unified-memory only, which --enable-hisparse refuses",
    "set_inflight_forward": "--enable-unified-memory only",
    "set_latest_forward_done_event": "--enable-unified-memory only",
    "hisparse_page_size": "read with getattr and a default (the page size), which is ours",
}


def scanned_members() -> dict[str, set[str]]:
    """Members SGLang's disaggregation and scheduler code reads off the allocator, the allocator's
    two HiSparse budgets and the coordinator's host pool (grep of the installed source)."""
    root = Path(sglang.__file__).parent / "srt"
    found = {"allocator": set(), "budgets": set(), "host_pool": set()}
    for directory in SCANNED:
        for path in (root / directory).rglob("*.py"):
            if path.name in NOT_OURS_TO_SCAN:
                continue
            text = path.read_text(errors="ignore")
            found["budgets"] |= set(re.findall(r"(?:logical_attn_allocator|hisparse_attn_allocator)\.([A-Za-z_]\w*)", text))
            found["host_pool"] |= set(re.findall(r"mem_pool_host\.([A-Za-z_]\w*)", text))
            if re.search(r"transfer_kv_pool\s*=\s*\(\s*self\.scheduler\.hisparse_coordinator\.mem_pool_host", text):
                found["host_pool"] |= set(re.findall(r"transfer_kv_pool\.([A-Za-z_]\w*)", text))
            found["allocator"] |= set(re.findall(r"token_to_kv_pool_allocator\.([A-Za-z_]\w*)", text))
            if re.search(r"\ballocator\s*=\s*self\.token_to_kv_pool_allocator", text):
                found["allocator"] |= set(re.findall(r"(?<![\w.])allocator\.([A-Za-z_]\w*)", text))
            found["allocator"] |= set(re.findall(r"getattr\(\s*(?:self\.)?(?:token_to_kv_pool_)?allocator,\s*\"(\w+)\"", text))
    return found


def test_installed_sglang_reads_the_known_pd_members():
    """A new member in SGLang's PD or scheduler code fails here first: add it to ours or, with the
    reason, to NOT_ON_HISPARSE_PATHS."""
    found = scanned_members()
    assert {"logical_attn_allocator", "hisparse_attn_allocator", "alloc_logical_only", "get_kvcache"} <= found["allocator"]
    assert found["budgets"] == {"available_size"}
    assert {"alloc_paged_token_slots", "get_contiguous_buf_infos", "layer_num"} <= found["host_pool"]


def test_our_allocator_and_host_pool_provide_every_pd_member(gloo_world):
    rig = Rig(gloo_world)
    found = scanned_members()
    missing = sorted(n for n in found["allocator"] if not hasattr(rig.allocator, n) and n not in NOT_ON_HISPARSE_PATHS)
    assert not missing, f"allocator lacks {missing}"
    stale = sorted(n for n in NOT_ON_HISPARSE_PATHS if n not in found["allocator"])
    assert not stale, f"no longer read by SGLang, drop from the exclusions: {stale}"
    for budget in (rig.allocator.logical_attn_allocator, rig.allocator.hisparse_attn_allocator):
        assert all(isinstance(getattr(budget, n)(), int) for n in found["budgets"])
    host = rig.coord.mem_pool_host
    assert not sorted(n for n in found["host_pool"] if not hasattr(host, n)), "host pool lacks members"
    assert host.get_contiguous_buf_infos()[0]


# --- call sites: every argument SGLang passes binds to our signatures ---------------------------
def coordinator_call_sites() -> list[tuple[str, str, int, list[str]]]:
    """``(file, method, positional count, keyword names)`` of every ``<...>.hisparse_coordinator.m(...)``
    call in the installed SGLang (its own coordinator module and tests excluded)."""
    import ast

    root = Path(sglang.__file__).parent
    sites = []
    for path in root.rglob("*.py"):
        if path.name == "hisparse_coordinator.py" or "test" in path.parts:
            continue
        text = path.read_text(errors="ignore")
        if "hisparse_coordinator." not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, (ast.Attribute, ast.Name))
                    and getattr(node.func.value, "attr", getattr(node.func.value, "id", None)) == "hisparse_coordinator"):
                sites.append((str(path.relative_to(root)), node.func.attr, len(node.args),
                              [k.arg for k in node.keywords if k.arg is not None]))
    return sites


def test_every_sglang_call_binds_to_both_coordinators():
    """SGLang's V4 indexer calls ``swap_in_selected_pages(req_pool_indices=..., compressed_seq_lens=...,
    ...)`` by keyword: a parameter named otherwise fails only on the GPU, at the first decode step."""
    import inspect

    from sglang_hisparse.decode.c4_coordinator import C4Coordinator
    from sglang_hisparse.decode.coordinator import HiSparseCoordinator

    sites = coordinator_call_sites()
    assert {method for _, method, _, _ in sites} >= {"swap_in_selected_pages", "map_last_loc_to_buffer", "request_finished"}
    assert any("compressed_seq_lens" in kws for _, m, _, kws in sites if m == "swap_in_selected_pages")
    problems = []
    family_of = {HiSparseCoordinator: "dsv4/", C4Coordinator: "dsa_backend.py"}  # the other family's files
    for cls, other in family_of.items():
        for path, method, n_pos, keywords in sites:
            if other in path:
                continue
            member = inspect.getattr_static(cls, method, None)
            if member is None:
                problems.append(f"{cls.__name__} lacks {method} ({path})")
                continue
            try:
                inspect.signature(getattr(cls, method)).bind(None, *range(n_pos), **{k: None for k in keywords})
            except TypeError as err:
                problems.append(f"{cls.__name__}.{method}: {path} passes {n_pos} positional + {keywords}: {err}")
    assert not problems, problems
