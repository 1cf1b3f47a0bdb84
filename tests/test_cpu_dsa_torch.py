"""The torch DSA path (CPU engine) against naive per-token definitions."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_hisparse.cpu.dsa_torch import TorchDSABackend


def naive_sparse_mla(q, latent_rows, scaling, v_dim):
    """One query token: softmax over its selected latent rows, values = the first v_dim dims."""
    out = []
    for h in range(q.shape[0]):
        scores = torch.stack([q[h].float() @ row.float() for row in latent_rows]) * scaling
        probs = torch.softmax(scores, dim=0)
        out.append(sum(p * row[:v_dim].float() for p, row in zip(probs, latent_rows)))
    return torch.stack(out)


def test_sparse_attention_matches_the_naive_definition():
    torch.manual_seed(0)
    heads, dim, v_dim, rows_total, top_k = 3, 12, 8, 40, 5
    kv = torch.randn(rows_total, 1, dim)
    backend = TorchDSABackend.__new__(TorchDSABackend)
    layer = SimpleNamespace(scaling=0.3, v_head_dim=v_dim)
    q = torch.randn(2, heads, dim)
    rows = torch.tensor([[3, 17, -1, 8, 30], [0, 1, 2, -1, -1]])
    out = backend._attend(q, rows, kv, layer)
    for t in range(2):
        selected = [kv[r, 0] for r in rows[t].tolist() if r >= 0]
        assert torch.allclose(out[t], naive_sparse_mla(q[t], selected, 0.3, v_dim), atol=1e-5)


def test_padding_rows_do_not_contribute():
    kv = torch.randn(10, 1, 6)
    backend = TorchDSABackend.__new__(TorchDSABackend)
    layer = SimpleNamespace(scaling=1.0, v_head_dim=4)
    q = torch.randn(1, 2, 6)
    with_padding = backend._attend(q, torch.tensor([[4, -1, 7, -1]]), kv, layer)
    without = backend._attend(q, torch.tensor([[4, 7]]), kv, layer)
    assert torch.allclose(with_padding, without)


def test_index_top_k_matches_a_per_token_loop():
    from sglang_hisparse.cpu.dsa_torch import select_top_k

    torch.manual_seed(1)
    heads, dim, seq_len, top_k = 4, 16, 30, 6
    query, weights = torch.randn(5, heads, dim), torch.rand(5, heads)
    keys = torch.randn(seq_len, dim)
    positions = torch.tensor([2, 9, 17, 25, 29])
    got = select_top_k(query, weights, keys, positions, top_k)
    for t, p in enumerate(positions.tolist()):
        scores = [sum(float(weights[t, h]) * max(0.0, float(query[t, h] @ keys[s])) for h in range(heads))
                  for s in range(p + 1)]
        order = sorted(range(p + 1), key=lambda s: -scores[s])[:top_k]
        want = order + [-1] * (top_k - len(order))
        assert sorted(got[t].tolist()) == sorted(want)
        chosen = [s for s in got[t].tolist() if s >= 0]
        assert all(s <= p for s in chosen)
