"""PD decode prefix skipping, the pieces without a server (``prefix/pd_prefix.py``): the host rows
a preallocation borrows from the tree, and the launcher seam that lets HiSparse run with SGLang's
decode radix cache. End to end: tests/test_e2e_cpu_pd_prefix.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hisparse.memory.c4_host_pool import C4HostPool
from sglang_hisparse.patches import pd_radix_validation

P = 64  # C4HostPool's page (entries)


def _pool_and_table(pages: int = 8, slots: int = 4):
    pool = C4HostPool(1, pages * P, pin_memory=False, debug=True)
    table = torch.full((slots, pages * P), -1, dtype=torch.int64)
    lengths = torch.zeros(slots, dtype=torch.int64)
    return pool, table, lengths


def test_a_preallocation_takes_the_lent_rows_first_and_frees_only_its_own():
    pool, table, lengths = _pool_and_table()
    cached = pool.alloc(2 * P)  # the tree's rows of a 128-token prefix
    free_before = pool.available_size()
    with pool.lending_first_rows(cached):
        rows = pool.alloc_paged_token_slots(table, lengths, 2, 0, 200)
        other = pool.alloc_paged_token_slots(table, lengths, 3, 0, 10)  # the offer is taken once
    assert torch.equal(rows[: 2 * P], cached) and rows.numel() == 200
    assert pool.borrowed_count(2) == 2 * P and int(lengths[2]) == 4 * P
    assert pool.borrowed_count(3) == 0 and not bool(torch.isin(other, cached).any())
    assert pool.available_size() == free_before - 2 * P - P, "own pages: 2 for slot 2's tail, 1 for slot 3"
    assert pool.free_request_rows(table, lengths, 2) == 2 * P, "the lent rows stay the tree's"
    assert bool((table[2] == -1).all()) and pool.borrowed_count(2) == 0


def test_the_offer_ends_with_its_block_and_never_reaches_a_slot_that_has_rows():
    pool, table, lengths = _pool_and_table()
    cached = pool.alloc(P)
    pool.alloc_paged_token_slots(table, lengths, 0, 0, P)
    with pool.lending_first_rows(cached):
        pool.alloc_paged_token_slots(table, lengths, 0, P, P)  # slot 0 grows: not a fresh preallocation
    assert pool.borrowed_count(0) == 0
    with pool.lending_first_rows(cached):
        pass
    pool.alloc_paged_token_slots(table, lengths, 1, 0, P)
    assert pool.borrowed_count(1) == 0, "an offer not taken inside its block is gone"
    with pytest.raises(AssertionError, match="whole pages within"):
        with pool.lending_first_rows(cached):
            pool.alloc_paged_token_slots(table, lengths, 2, 0, P // 2)  # fewer positions than lent rows


def _pd_args(**overrides):
    values = dict(enable_hisparse=True, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True)
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("overrides, seen", [
    ({}, False),  # SGLang's refusal of HiSparse with the decode radix cache is what the seam opens
    (dict(disaggregation_decode_enable_radix_cache=False), True),
    (dict(disaggregation_mode="prefill"), True),
    (dict(enable_hisparse=False), False),
])
def test_the_pd_check_sees_hisparse_only_where_it_does_not_refuse_the_decode_radix_cache(overrides, seen):
    args = _pd_args(**overrides)
    before = args.enable_hisparse
    observed = []
    pd_radix_validation.handle_pd_disaggregation(lambda a: observed.append(a.enable_hisparse), args)
    assert observed == [seen] and args.enable_hisparse == before


def test_the_pd_check_gives_hisparse_back_when_it_raises():
    args = _pd_args()

    def refuse(a):
        raise ValueError("--disaggregation-decode-enable-radix-cache is incompatible with speculative decoding")

    with pytest.raises(ValueError, match="speculative"):
        pd_radix_validation.handle_pd_disaggregation(refuse, args)
    assert args.enable_hisparse is True


def test_sglangs_own_pd_check_refuses_hisparse_with_the_decode_radix_cache_without_the_seam():
    """The seam exists because SGLang 0.5.17 refuses the combination (checked, not assumed)."""
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation

    original = getattr(handle_pd_disaggregation, "__wrapped__", handle_pd_disaggregation)
    args = SimpleNamespace(disaggregation_mode="decode", dcp_size=1, disaggregation_decode_enable_radix_cache=True,
                           enable_hisparse=True, disaggregation_transfer_backend="mooncake")
    with pytest.raises(ValueError, match="incompatible with --enable-hisparse"):
        original(args)
