"""Linear speculative decoding through the coordinator, on CPU with real SGLang objects (the rig):
verify windows of N tokens per request, random acceptance, requests crossing the hot buffer's
size, aborts mid-window. After every verify step each selected position's device row holds its
true KV (committed positions) or this step's KV (window positions): a rejected draft is never
read as a committed position. When every request is gone, every pool is back to its initial
free count. Plus the pieces: the hot buffers' window rule, logical-only allocation, the draft
model's resident pool."""

from __future__ import annotations

import random

import pytest
import torch

from rig import DIM, KV_LORA, PAGE, ROPE, Request, Rig

from sglang_hisparse.memory.device_pool import HiSparseDevicePool, resident_pools


def verify_rows(rng: random.Random, req: Request, N: int, top_k: int) -> list:
    """N verify rows: row j picks from positions < L + j + 1, often the window's own."""
    L = req.seq_len
    rows = []
    for j in range(N):
        chosen = rng.sample(range(L), k=min(L, top_k - j - 1)) + [L + w for w in range(j + 1) if rng.random() < 0.7]
        rng.shuffle(chosen)
        rows.append(chosen[:top_k])
    return rows


def run_spec_lifecycle(rig: Rig, rng: random.Random, *, lengths: list, steps: int, abort_at: dict) -> None:
    reqs = [Request(uid=i + 1, prompt_len=n) for i, n in enumerate(lengths)]
    for r in reqs:
        assert rig.prefill(r)
        rig.stage(r)
    assert rig.collect() == reqs
    live = list(reqs)
    for step in range(steps):
        for r in [r for r in live if abort_at.get(r.uid) == step]:
            rig.release(r)  # abort mid-window: ids allocated past the committed length
            live.remove(r)
        if not live:
            break
        accepts = [rng.randint(1, rig.query_rows) for _ in live]
        rig.verify_step(live, accepts)
        for layer in range(rig.layers):
            rig.resolve_verify_and_check(live, layer, [verify_rows(rng, r, rig.query_rows, rig.top_k) for r in live])
        rig.commit(live)
    for r in live:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


@pytest.mark.parametrize("N, seed", [(2, 0), (3, 1), (4, 2), (4, 3)])
def test_random_verify_windows_stay_exact_and_leak_nothing(gloo_world, N, seed):
    rng = random.Random(seed)
    rig = Rig(gloo_world, device_buffer_size=N * 32, top_k=32, query_rows=N)
    B = rig.B
    lengths = [B - 3, B - 1, B + 5, 40, 3 * B]
    run_spec_lifecycle(rig, rng, lengths=lengths, steps=14, abort_at={2: 5, 5: 9})
    selected, misses = rig.coord.stats.totals()
    assert 0 < misses < selected


def test_every_draft_rejected_then_every_draft_accepted(gloo_world):
    """Accept 1 (the window's drafts always rejected: stale draft KV sits in slots < B and in the
    window) then N (every window position committed from its window slot)."""
    rng = random.Random(7)
    N = 3
    rig = Rig(gloo_world, device_buffer_size=N * 32, top_k=32, query_rows=N)
    reqs = [Request(uid=1, prompt_len=rig.B - 4), Request(uid=2, prompt_len=2 * rig.B)]
    for r in reqs:
        assert rig.prefill(r)
        rig.stage(r)
    rig.collect()
    for accept in [1] * 6 + [N] * 6:
        rig.verify_step(reqs, [accept] * len(reqs))
        for layer in range(rig.layers):
            rig.resolve_verify_and_check(reqs, layer, [verify_rows(rng, r, N, rig.top_k) for r in reqs])
        rig.commit(reqs)
    assert reqs[0].seq_len > rig.B  # the short request crossed into the long path
    for r in reqs:
        rig.release(r)
    assert rig.counts() == rig.initial_counts


def test_the_window_rule_puts_positions_below_b_in_their_own_slots(gloo_world):
    N = 4
    rig = Rig(gloo_world, device_buffer_size=128, top_k=32, query_rows=N)
    hot = rig.coord.hot
    assert hot.padded == -(-(128 + N) // PAGE) * PAGE
    req = Request(uid=1, prompt_len=126)  # window 126, 127 (slots 126, 127), 128, 129 (slots B + 2, B + 3)
    assert rig.prefill(req)
    rig.stage(req)
    rig.collect()
    rig.verify_step([req], [N])
    idx = torch.tensor([req.req_pool_idx])
    got = hot.rows_of_positions(idx[:, None], torch.tensor([[126, 127, 128, 129]]))
    slots = hot.slot_rows[req.req_pool_idx].to(torch.int64)
    assert got[0].tolist() == [int(slots[126]), int(slots[127]), int(slots[130]), int(slots[131])]
    window_ids = rig.req_to_token_pool.req_to_token[req.req_pool_idx, 126:130].to(torch.int64)
    assert torch.equal(rig.allocator.logical_to_device[window_ids], got[0])


def test_logical_only_allocation_takes_no_device_rows(gloo_world):
    rig = Rig(gloo_world, query_rows=2, device_buffer_size=128, top_k=32)
    before = rig.allocator.rows.pages.available_tokens()
    with rig.allocator.logical_only():
        ids = rig.allocator.alloc(PAGE)
        more = rig.allocator.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([PAGE]),
                                          torch.tensor([PAGE]), torch.tensor([-1]), PAGE)
    assert ids is not None and more is not None
    assert rig.allocator.rows.pages.available_tokens() == before
    assert int(rig.allocator.logical_to_device[torch.cat([ids, more])].abs().sum()) == 0
    rows = rig.allocator.alloc(PAGE)  # outside the block: rows again
    assert rig.allocator.rows.pages.available_tokens() == before - PAGE
    rig.allocator.free(torch.cat([ids, more, rows]))
    assert rig.counts() == rig.initial_counts


def test_a_pool_built_as_resident_is_indexed_by_logical_id():
    kwargs = dict(page_size=PAGE, kv_lora_rank=KV_LORA, dtype=torch.float32, qk_rope_head_dim=ROPE, layer_num=1,
                  device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=DIM,
                  host_to_device_ratio=3)
    plain = HiSparseDevicePool(PAGE * 4, **kwargs)
    with resident_pools():
        draft = HiSparseDevicePool(PAGE * 4, **kwargs)
    assert not plain.resident and draft.resident
    assert draft.kv_buffer[0].shape[0] >= 3 * PAGE * 4 > plain.kv_buffer[0].shape[0]
    loc = torch.tensor([5, 3 * PAGE * 4 - 1])
    assert torch.equal(draft.translate_loc_to_hisparse_device(loc), loc)
    row = torch.arange(DIM, dtype=torch.float32).repeat(2, 1)
    draft.set_mla_kv_buffer(type("L", (), {"layer_id": 0})(), loc, row[:, :KV_LORA].reshape(2, 1, KV_LORA),
                            row[:, KV_LORA:].reshape(2, 1, ROPE))
    assert torch.equal(draft.kv_buffer[0][loc, 0], row)
    with pytest.raises(AssertionError, match="indexed by logical id"):
        draft.attach_mapping(torch.zeros(4, dtype=torch.int64))


def test_the_resident_draft_pool_states_its_memory(caplog):
    """The draft seam builds the draft worker's pool resident and logs its KV bytes and the
    bytes beyond the rows SGLang's memory profile planned (the device rows it passed)."""
    import logging
    from types import SimpleNamespace

    from sglang_hisparse.patches import draft_runner

    kwargs = dict(page_size=PAGE, kv_lora_rank=KV_LORA, dtype=torch.float32, qk_rope_head_dim=ROPE, layer_num=1,
                  device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=DIM,
                  host_to_device_ratio=4)
    built = []

    def original(configurator, *, max_total_num_tokens):
        built.append(HiSparseDevicePool(max_total_num_tokens, **kwargs))
        return built[-1]

    draft = SimpleNamespace(is_draft_worker=True, server_args=SimpleNamespace(enable_hisparse=True))
    with caplog.at_level(logging.INFO, logger=draft_runner.__name__):
        pool = draft_runner.build_dsa_pool(original, draft, max_total_num_tokens=PAGE * 64)
    assert pool is built[0] and pool.resident
    kv = pool.get_kv_size_bytes()
    assert pool.size == 4 * PAGE * 64 and kv >= pool.size * DIM * 4  # float32 rows, one per logical id
    line = caplog.records[-1].getMessage()
    assert f"{pool.size} rows x 1 layer(s), {kv / (1 << 30):.2f} GiB (KV and indexer keys)" in line
    assert f"planned {PAGE * 64} rows, so {(kv - kv * PAGE * 64 // pool.size) / (1 << 30):.2f} GiB more" in line
    target = SimpleNamespace(is_draft_worker=False, server_args=SimpleNamespace(enable_hisparse=True))
    assert not draft_runner.build_dsa_pool(original, target, max_total_num_tokens=PAGE * 4).resident
