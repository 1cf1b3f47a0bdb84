"""The CPU stand-in's torch versions of the speculative worker's sgl_kernel ops
(sglang_hisparse/cpu/stand_in/sgl_kernel/cpu_spec_ops.py), on tiny hand-built and random inputs."""

from __future__ import annotations

import importlib.util
import random

import torch

from sglang_hisparse.serving.launcher import CPU_STAND_IN


def _ops():
    spec = importlib.util.spec_from_file_location("cpu_spec_ops", CPU_STAND_IN / "sgl_kernel" / "cpu_spec_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ops = _ops()


def test_req_to_token_slices_are_written_and_read_back_in_batch_order():
    rng = random.Random(1)
    for _ in range(20):
        R, width, bs = 5, 40, rng.randint(1, 5)
        rows = torch.tensor(rng.sample(range(R), bs))
        start = torch.tensor([rng.randrange(0, 20) for _ in range(bs)])
        end = start + torch.tensor([rng.randrange(0, 10) for _ in range(bs)])
        locs = torch.randperm(1000)[: int((end - start).sum())]
        table = torch.full((R, width), -1, dtype=torch.int32)
        ops.assign_req_to_token_pool_cpu(rows, table, start, end, locs, width)
        at = 0
        for i in range(bs):
            n = int(end[i] - start[i])
            assert table[rows[i], start[i]:end[i]].tolist() == locs[at : at + n].tolist()
            at += n
        assert int((table >= 0).sum()) == locs.numel()
        back = torch.full_like(locs, -5)
        ops.assign_extend_cache_locs_cpu(rows, table, start, end, back, width)
        assert torch.equal(back, locs)


def test_draft_cache_locs_are_each_requests_entries_after_its_length():
    table = torch.arange(3 * 20).view(3, 20)
    out = torch.full((2 * 3 * 2,), -1)
    ops.assign_draft_cache_locs_contiguous_cpu(torch.tensor([2, 0]), table, torch.tensor([5, 9]), out, 20, 3, 2)
    assert out.tolist() == table[2, 5:11].tolist() + table[0, 9:15].tolist()


def _tree(parent_list, top_scores_index, L, topk, steps, N):
    bs = len(L)
    mask = torch.full((bs * N * N,), True)
    positions = torch.empty(bs * N, dtype=torch.long)
    index, next_token, sibling = torch.full((3, bs, N), -1, dtype=torch.long)
    ops.build_tree_kernel_efficient_cpu(parent_list, top_scores_index, torch.tensor(L), mask, positions, index,
                                        next_token, sibling, topk, steps, N, 1)
    return mask.view(bs, N, N), positions.view(bs, N), index, next_token, sibling


def test_a_linear_chain_attends_to_its_prefix_of_drafts():
    N = 4
    mask, positions, index, next_token, sibling = _tree(
        torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, 2]]), torch.tensor([[0, 1, 2], [0, 1, 2]]), [7, 30], 1, 3, N)
    assert positions.tolist() == [[7, 8, 9, 10], [30, 31, 32, 33]]
    assert index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next_token.tolist() == [[1, 2, 3, -1]] * 2 and (sibling == -1).all()
    assert torch.equal(mask[0], torch.tril(torch.ones(N, N, dtype=torch.bool)))


def test_a_branching_tree_links_siblings_and_masks_ancestors():
    # topk 2: candidates 0 and 1 hang under the root; candidate 2 (group 1) under the node whose
    # candidate is parent_list[1] = 0, i.e. node 1.
    mask, positions, _, next_token, sibling = _tree(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), [10], 2, 2, 4)
    assert positions.tolist() == [[10, 11, 11, 12]]
    assert next_token[0].tolist() == [1, 3, -1, -1] and sibling[0].tolist() == [-1, 2, -1, -1]
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]

    # greedy verify: the target predicts candidate 1's token at the root (node 2, the sibling), and
    # nothing under node 2 exists, so one draft is accepted
    candidates = torch.tensor([[50, 60, 70, 80]])
    target = torch.tensor([[70, 0, 99, 0]])
    predicts = torch.full((4,), -1)
    accept_index = torch.full((1, 3), -1)
    accept_num = torch.full((1,), -1)
    index = torch.arange(4).view(1, 4)
    ops.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, index, next_token, sibling, target)
    assert accept_index.tolist() == [[0, 2, -1]] and accept_num.tolist() == [1]
    assert predicts[0] == 70 and predicts[2] == 99


def test_greedy_verify_of_a_chain_stops_at_the_first_mismatch():
    N = 4
    _, _, index, next_token, sibling = _tree(torch.tensor([[-1, 0, 1, 2]] * 2), torch.tensor([[0, 1, 2]] * 2),
                                              [5, 5], 1, 3, N)
    candidates = torch.tensor([[9, 11, 12, 13], [9, 21, 22, 23]])
    target = torch.tensor([[11, 12, 77, 5], [21, 99, 0, 0]])  # request 0 accepts 2 drafts, request 1 one
    predicts = torch.full((2 * N,), -1)
    accept_index = torch.full((2, N), -1)
    accept_num = torch.zeros(2, dtype=torch.long)
    ops.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, index, next_token, sibling, target)
    assert accept_num.tolist() == [2, 1]
    assert accept_index.tolist() == [[0, 1, 2, -1], [4, 5, -1, -1]]
    assert predicts.tolist() == [11, 12, 77, -1, 21, 99, -1, -1]


def test_bonus_tokens_and_accepted_cache_locs():
    bonus = torch.zeros(2, dtype=torch.long)
    ops.fill_bonus_tokens_cpu(torch.tensor([[11, 12, 13], [21, 22, 23]]), torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [12, 23]
    out = torch.full((4,), -1)
    ops.fill_accept_out_cache_loc_cpu(torch.tensor([[0, 2, -1], [3, -1, -1]]), torch.tensor([100, 101, 102, 103]), out)
    assert out.tolist() == [100, 102, 103, -1]
