"""Torch-native DSA for SGLang's CPU engine: the indexer and sparse MLA attention.

Upstream SGLang cannot run a DSA model without a GPU: its indexer has no torch path and every
sparse-attention backend is a GPU kernel. This module is small on purpose and doubles as a
readable statement of what the GPU path computes:

* Indexer (per layer): index queries ``q[t, h]`` (from ``q_lora``), one index key ``k[s]`` per
  token (from the hidden state, normed), both with RoPE on their first ``rope_head_dim`` dims,
  and head gates ``w[t, h]``. The score of position ``s`` for token ``t`` is
  ``sum_h w[t, h] * relu(q[t, h] . k[s])``; the token selects the ``index_topk`` best positions
  among ``0..pos(t)``. (The GPU path also applies a Hadamard rotation to q and k before FP8
  quantization; an orthonormal rotation of both leaves q . k unchanged, so it is omitted here.)
  Keys are stored per logical id, for the whole logical space, in the device pool's own index
  buffer (FP8 with a scale per 128 dims, SGLang's page layout), where a PD transfer finds them.
* Sparse MLA attention: each query attends, with the usual absorbed-MLA math, to the latent
  rows of its selected positions only. For decode with HiSparse, the rows come from the
  coordinator's resolver (``swap_in_selected_pages``; for a speculative verify batch,
  ``resolve_verify``); without HiSparse, from ``req_to_token``.

The results are the same whether or not HiSparse runs, as long as the resolver returns the right
rows: that is what the CPU end-to-end test checks.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

_QUERY_CHUNK = 256


FP8_MAX = 448.0  # largest finite float8_e4m3fn
KEY_BLOCK = 128  # index-key dims per scale (the pool's ``quant_block_size``)


class PoolIndexKeys:
    """The index keys of one layer in the device pool's own buffer (``index_k_with_scale_buffer``),
    in SGLang's page layout: per page, ``page_size x head_dim`` FP8 bytes, then ``page_size x
    head_dim / 128`` float32 scales. Keeping them there (not in a store of ours) is what lets a PD
    prefill instance's transfer move them to the decode instance, as on the GPU. Keys are quantized
    per 128 dims (scale = amax / 448), as the GPU indexer's keys are; indexed by logical id."""

    def __init__(self, pool, layer_id: int, head_dim: int):
        if head_dim % KEY_BLOCK:
            raise ValueError(f"the CPU DSA indexer needs index_head_dim a multiple of {KEY_BLOCK}, got {head_dim}")
        buf = pool.index_k_with_scale_buffer[layer_id - getattr(pool, "start_layer", 0)]
        page, blocks = pool.page_size, head_dim // KEY_BLOCK
        if buf.shape[1] != page * (head_dim + 4 * blocks):
            raise ValueError(f"index key buffer rows of {buf.shape[1]} bytes, expected {page * (head_dim + 4 * blocks)}")
        self.page_size, self.blocks = page, blocks
        self.fp8 = buf[:, : page * head_dim].view(buf.shape[0], page, head_dim)
        self.scale = buf[:, page * head_dim:].view(buf.shape[0], page, 4 * blocks)

    def write(self, loc: torch.Tensor, key: torch.Tensor) -> None:
        """Store float keys ``[n, head_dim]`` at logical ids ``loc`` (side effect: the pool's buffer)."""
        page, offset = loc // self.page_size, loc % self.page_size
        blocks = key.float().view(key.shape[0], self.blocks, KEY_BLOCK)
        scale = blocks.abs().amax(dim=-1).clamp_min(1e-4) / FP8_MAX  # [n, blocks]
        quantized = (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(key.shape[0], -1)
        self.fp8[page, offset] = quantized.view(torch.uint8)
        self.scale[page, offset] = scale.contiguous().view(torch.uint8).view(key.shape[0], -1)

    def read(self, loc: torch.Tensor) -> torch.Tensor:
        """Float32 keys ``[n, head_dim]`` at logical ids ``loc`` (dequantized; no side effects)."""
        page, offset = loc // self.page_size, loc % self.page_size
        n = loc.shape[0]
        keys = self.fp8[page, offset].view(torch.float8_e4m3fn).float().view(n, self.blocks, KEY_BLOCK)
        scale = self.scale[page, offset].contiguous().view(torch.float32).view(n, self.blocks, 1)
        return (keys * scale).view(n, -1)


def _request_layout(forward_batch, tokens: int) -> list[tuple[int, int, int, int]]:
    """(first token in the batch, tokens, first position, seq_len) per request, for the batch's
    ``tokens`` query tokens. A speculative verify batch (TARGET_VERIFY) has the same number of
    tokens for every request, after its committed ``seq_lens``; a draft extend batch carries its
    extend lengths (prefix lengths on the host or the device)."""
    seq_lens = (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens).tolist()
    mode = forward_batch.forward_mode
    if mode.is_decode_or_idle():
        return [(i, 1, s - 1, s) for i, s in enumerate(seq_lens)]
    if mode.is_target_verify():
        n = tokens // max(len(seq_lens), 1)
        return [(i * n, n, s, s + n) for i, s in enumerate(seq_lens)]
    prefixes = forward_batch.extend_prefix_lens_cpu
    if prefixes is None:
        prefixes = forward_batch.extend_prefix_lens.tolist()
    layout, start = [], 0
    for n, prefix, s in zip(forward_batch.extend_seq_lens_cpu, prefixes, seq_lens):
        layout.append((start, int(n), int(prefix), int(s)))
        start += int(n)
    return layout


def indexer_forward_native(indexer, x, q_lora, positions, forward_batch, layer_id, return_indices: bool = True):
    """``Indexer.forward_native``: store this batch's index keys, return each token's top-k
    positions (int32 [tokens, index_topk], -1 padding)."""
    tokens = q_lora.shape[0]
    query, _ = indexer.wq_b(q_lora)
    query = query.view(tokens, indexer.n_heads, indexer.head_dim)
    key, _ = indexer.wk(x)
    key = indexer.k_norm(key)
    r = indexer.rope_head_dim
    # keys get a head axis of one so the rotary embedding broadcasts them like the queries
    q_rope, k_rope = indexer.rotary_emb(positions, query[..., :r].contiguous(), key[:, None, :r].contiguous())
    query = torch.cat([q_rope.view(tokens, indexer.n_heads, r), query[..., r:]], dim=-1).float()
    key = torch.cat([k_rope.view(tokens, r), key[..., r:]], dim=-1).float()
    gate = indexer.weights_proj.weight  # bf16 whatever the model dtype (as upstream)
    weights = torch.nn.functional.linear(x.to(gate.dtype), gate).float() * indexer.n_heads**-0.5 * indexer.softmax_scale

    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    store = PoolIndexKeys(get_token_to_kv_pool(), layer_id, indexer.head_dim)
    store.write(forward_batch.out_cache_loc.long(), key)
    if not return_indices:
        return None

    req_to_token = get_req_to_token_pool().req_to_token
    top_k = indexer.index_topk
    out = torch.full((tokens, top_k), -1, dtype=torch.int32)
    pos_all = positions.long()
    for req_row, (first, count, _, seq_len) in enumerate(_request_layout(forward_batch, tokens)):
        req = int(forward_batch.req_pool_indices[req_row])
        keys = store.read(req_to_token[req, :seq_len].long())  # [seq_len, D]
        for c0 in range(first, first + count, _QUERY_CHUNK):
            c1 = min(c0 + _QUERY_CHUNK, first + count)
            out[c0:c1] = select_top_k(query[c0:c1], weights[c0:c1], keys, pos_all[c0:c1], top_k)
    return out


def select_top_k(
    query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The DSA indexer's choice for a block of query tokens of one request.

    Args:
        query: [t, H, D] index queries; weights: [t, H] head gates; keys: [S, D] the request's
            index keys for positions 0..S-1; positions: [t] each query token's position.
    Returns int32 [t, top_k]: positions with the highest ``sum_h w * relu(q . k)`` among
    ``0..position`` (causal), best first; -1 where fewer than ``top_k`` exist.
    """
    seq_len = keys.shape[0]
    scores = (torch.einsum("thd,sd->ths", query, keys).relu() * weights[:, :, None]).sum(dim=1)
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
    out = torch.full((query.shape[0], top_k), -1, dtype=torch.int32)
    k = min(top_k, seq_len)
    values, idx = torch.topk(scores, k, dim=-1)
    out[:, :k] = idx.to(torch.int32).masked_fill(values == float("-inf"), -1)
    return out


class TorchDSABackend(AttentionBackend):
    """Sparse absorbed-MLA attention for DSA models on SGLang's CPU engine.

    Reads and writes the KV pool through its public methods (so HiSparse's logical -> device
    translation applies to writes), reads latent rows by device row, and asks the HiSparse
    coordinator (when there is one) to resolve each decode layer's selection.
    """

    def __init__(self, model_runner):
        super().__init__()
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.hisparse_coordinator = getattr(model_runner, "hisparse_coordinator", None)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch) -> None:
        return None

    def get_indexer_metadata(self, layer_id, forward_batch):
        return None

    def support_triton(self) -> bool:
        return False

    # --- rows ----------------------------------------------------------------------------
    def _rows_of_logical(self, logical: torch.Tensor) -> torch.Tensor:
        translate = getattr(self.token_to_kv_pool, "translate_loc_to_hisparse_device", None)
        return logical if translate is None else translate(logical)

    def _rows_of_positions(self, req: int, positions: torch.Tensor) -> torch.Tensor:
        valid = positions >= 0
        logical = self.req_to_token_pool.req_to_token[req, positions.clamp(min=0).long()].long()
        return torch.where(valid, self._rows_of_logical(logical), torch.full_like(logical, -1))

    def _attend(self, q: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, layer) -> torch.Tensor:
        """q [t, H, D]; rows [t, k] device rows (-1 = none) -> [t, H, v_dim]."""
        valid = rows >= 0
        latent = kv[rows.clamp(min=0).long()].float().squeeze(-2)  # [t, k, D]
        scores = torch.einsum("thd,tkd->thk", q.float(), latent) * layer.scaling
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("thk,tkd->thd", probs, latent[..., : layer.v_head_dim])

    def _save(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)

    # --- forward -------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, topk_indices=None, **kwargs):
        self._save(layer, forward_batch, k, v, save_kv_cache)
        heads = layer.tp_q_head_num
        q = q.reshape(-1, heads, layer.qk_head_dim)
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if self.hisparse_coordinator is not None and forward_batch.forward_mode.is_target_verify():
            rows = self.hisparse_coordinator.resolve_verify(
                forward_batch.req_pool_indices, forward_batch.seq_lens, topk_indices, layer.layer_id
            ).long()
            out = self._attend(q, rows[: q.shape[0]], kv, layer)
            return out.to(q.dtype).reshape(-1, heads * layer.v_head_dim)
        out = torch.empty((q.shape[0], heads, layer.v_head_dim), dtype=torch.float32)
        for req_row, (first, count, prefix, seq_len) in enumerate(_request_layout(forward_batch, q.shape[0])):
            req = int(forward_batch.req_pool_indices[req_row])
            for c0 in range(first, first + count, _QUERY_CHUNK):
                c1 = min(c0 + _QUERY_CHUNK, first + count)
                if topk_indices is not None:
                    positions = topk_indices[c0:c1].long()
                else:  # dense causal: every earlier position
                    local = torch.arange(c0 - first, c1 - first) + prefix
                    positions = torch.arange(seq_len)[None, :].expand(c1 - c0, -1)
                    positions = torch.where(positions <= local[:, None], positions, torch.full_like(positions, -1))
                rows = self._rows_of_positions(req, positions)
                out[c0:c1] = self._attend(q[c0:c1], rows, kv, layer)
        return out.to(q.dtype).reshape(-1, heads * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, topk_indices=None, **kwargs):
        self._save(layer, forward_batch, k, v, save_kv_cache)
        heads = layer.tp_q_head_num
        q = q.reshape(-1, heads, layer.qk_head_dim)
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if self.hisparse_coordinator is not None:
            rows = self.hisparse_coordinator.swap_in_selected_pages(
                forward_batch.req_pool_indices, forward_batch.seq_lens, topk_indices, layer.layer_id
            ).long()
        else:
            rows = torch.stack(
                [self._rows_of_positions(int(r), topk_indices[i].long())
                 for i, r in enumerate(forward_batch.req_pool_indices.tolist())]
            )
        out = self._attend(q, rows[: q.shape[0]], kv, layer)
        return out.to(q.dtype).reshape(-1, heads * layer.v_head_dim)


def attention_method_for(attn, forward_batch, fallback) -> Optional[object]:
    """DeepSeek attention dispatch for the CPU DSA backend: absorbed MLA for every batch."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    if getattr(attn, "use_dsa", False):
        return AttnForwardMethod.MLA
    return fallback(attn, forward_batch)
