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


def test_index_keys_live_in_the_pools_page_layout():
    """Keys go into the device pool's ``index_k_with_scale_buffer`` (what a PD transfer moves):
    page ``l // P``, FP8 bytes at offset ``l % P``, one float32 scale per 128 dims after the
    page's FP8 part; reading them back dequantizes within FP8's rounding, and other ids' bytes
    are untouched."""
    from sglang_hisparse.cpu.dsa_torch import PoolIndexKeys

    torch.manual_seed(2)
    page, dim, pages = 4, 256, 5
    buffer = torch.zeros(pages, page * (dim + 4 * (dim // 128)), dtype=torch.uint8)
    pool = SimpleNamespace(index_k_with_scale_buffer=[torch.zeros_like(buffer), buffer], page_size=page, start_layer=0)
    store = PoolIndexKeys(pool, 1, dim)
    loc = torch.tensor([5, 6, 13])
    keys = torch.randn(3, dim) * torch.tensor([1.0, 10.0, 0.01])[:, None]
    store.write(loc, keys)
    back = store.read(loc)
    block_scale = keys.view(3, -1, 128).abs().amax(dim=-1, keepdim=True) / 448
    bound = keys.abs() * 2**-4 + (block_scale * 2**-9).expand(-1, -1, 128).reshape(3, dim)  # half an ulp; subnormals
    assert ((back - keys).abs() <= bound * 1.0001).all()
    assert pool.index_k_with_scale_buffer[0].count_nonzero() == 0, "another layer's buffer was written"
    written = buffer.view(pages, -1).count_nonzero(dim=1)
    assert written[[1, 3]].gt(0).all() and written[[0, 2, 4]].eq(0).all(), "keys must land in pages l // P"
    scales = buffer[1, page * dim:].view(torch.float32).view(page, dim // 128)
    assert torch.allclose(scales[1], keys[0].view(2, 128).abs().amax(dim=-1) / 448)  # id 5: page 1, offset 1
    assert scales[0].eq(0).all() and scales[3].eq(0).all()
    assert torch.equal(store.read(torch.tensor([4])), torch.zeros(1, dim)), "an unwritten id reads zero keys"


def test_index_keys_refuse_a_head_dim_the_layout_cannot_hold():
    import pytest

    from sglang_hisparse.cpu.dsa_torch import PoolIndexKeys

    pool = SimpleNamespace(index_k_with_scale_buffer=[torch.zeros(2, 4 * 100, dtype=torch.uint8)], page_size=4)
    with pytest.raises(ValueError, match="multiple of 128"):
        PoolIndexKeys(pool, 0, 96)
