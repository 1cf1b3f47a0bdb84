"""Construct the tiny DeepSeek-V4 model on CPU in-process (ModelRunner path of sglang.benchmark.one_batch),
count parameters, then poke individual forward pieces to see which ops have no CPU path."""
import os, sys, traceback, collections
import torch
from sglang.srt.server_args import ServerArgs, PortArgs
import sglang.benchmark.one_batch as ob
ob.get_tokenizer = lambda *a, **k: None  # the tiny model ships no tokenizer (requests carry token ids)
load_model = ob.load_model

model = sys.argv[1] if len(sys.argv) > 1 else str(__import__("pathlib").Path(__file__).resolve().parents[2] / "sglang_hisparse/models/tiny-dsv4")
sa = ServerArgs(model_path=model, load_format="dummy", skip_tokenizer_init=True, device="cpu",
                disable_radix_cache=True, max_total_tokens=16384, max_running_requests=8,
                mem_fraction_static=0.5, random_seed=0)
runner = load_model(sa, PortArgs.init_new(sa), 0, 0)[0].torch_runner
m = runner.model
print("server_args resolved: attention_backend=%s page_size=%s kv_cache_dtype=%s" % (sa.attention_backend, sa.page_size, sa.kv_cache_dtype))
print("model class:", type(m).__name__, "attn backend:", type(runner.attn_backend).__name__,
      "kv pool:", type(runner.token_to_kv_pool).__name__)
total = sum(p.numel() for p in m.parameters())
print(f"parameters: {total:,} ({total/1e6:.2f} M)")
groups = collections.Counter()
for n, p in m.named_parameters():
    key = n.split(".")
    key = ".".join(k for k in key if not k.isdigit())[:60]
    groups[".".join(key.split(".")[:4])] += p.numel()
for k, v in groups.most_common(25):
    print(f"  {v:>10,}  {k}")
for i, layer in enumerate(m.model.layers):
    a = layer.self_attn
    print(f"layer {i}: compress_ratio={a.compress_ratio} compressor={type(a.compressor).__name__ if a.compressor else None} "
          f"indexer={type(a.indexer).__name__ if a.indexer else None} moe_hash={layer.mlp.is_hash} topk={type(layer.mlp.topk).__name__} experts={type(layer.mlp.experts).__name__}")

def probe(name, fn):
    try:
        out = fn()
        print(f"PROBE {name}: OK", tuple(out.shape) if hasattr(out, "shape") else type(out).__name__)
    except BaseException as e:
        tb = traceback.extract_tb(e.__traceback__)
        rel = lambda f: f"{os.path.relpath(f.filename, os.path.dirname(torch.__file__)+'/../')}:{f.lineno} {f.name}"
        sg = [f for f in tb if "/sglang/" in f.filename]
        frames = [rel(f) for f in sg[-3:]] + ["-> " + rel(tb[-1])]
        print(f"PROBE {name}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        for f in frames:
            print("      ", f)

T = 8
H = m.config.hidden_size
hc = m.config.hc_mult
layer = m.model.layers[1]
attn = layer.self_attn
x4 = torch.randn(T, hc, H, dtype=torch.bfloat16)
pos = torch.arange(T)
ids = torch.randint(2, 2000, (T,))
probe("embed_tokens", lambda: m.model.embed_tokens(ids))
probe("hc_pre (mHC pre: mixing + sinkhorn)", lambda: layer.hc_pre(x4, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base, norm=layer.input_layernorm)[0])
x = torch.randn(T, H, dtype=torch.bfloat16)
probe("hc_post", lambda: layer.hc_post(x, x4, torch.rand(T, hc), torch.rand(T, hc, hc)))
probe("wqkv_a/wq_a linear", lambda: (attn.wqkv_a(x) if attn.fuse_wqa_wkv else attn.wq_a(x))[0])
ql = torch.randn(T, attn.q_lora_rank, dtype=torch.bfloat16)
probe("MQA _compute_q_b (fused_q_norm_rope)", lambda: attn._compute_q_b(ql, pos))
kv = torch.randn(T, attn.head_dim, dtype=torch.bfloat16)
from sglang.kernels.ops.attention.dsv4 import fused_rope_inplace, fused_norm_rope_inplace
probe("fused_rope_inplace (inverse rope on o)", lambda: fused_rope_inplace(torch.randn(T, attn.n_local_heads, 64, dtype=torch.bfloat16), None, attn.freqs_cis, pos, inverse=True))
probe("fused_norm_rope_inplace (kv)", lambda: fused_norm_rope_inplace(kv.clone(), attn.kv_norm.weight.data, attn.eps, attn.freqs_cis, pos))
pool = runner.token_to_kv_pool
probe("pool.set_swa_key_buffer_radix_fused_norm_rope", lambda: pool.set_swa_key_buffer_radix_fused_norm_rope(layer_id=1, swa_loc=torch.arange(T), kv=kv, kv_weight=attn.kv_norm.weight.data, eps=attn.eps, freqs_cis=attn.freqs_cis, positions=pos))
probe("MoE gate", lambda: layer.mlp.gate(x))
probe("MoE topk (sqrtsoftplus, layer 1)", lambda: layer.mlp.topk(x, layer.mlp.gate(x)))
l0 = m.model.layers[0]
probe("MoE HashTopK (layer 0)", lambda: l0.mlp.topk(x, l0.mlp.gate(x), input_ids=ids))
probe("shared_experts MLP (swiglu clamp)", lambda: layer.mlp.shared_experts(x))
probe("routed experts (FusedMoE)", lambda: layer.mlp.experts(x, layer.mlp.topk(x, layer.mlp.gate(x))))
probe("hc_head (final)", lambda: m.model.hc_head(x4, m.model.hc_head_fn, m.model.hc_head_scale, m.model.hc_head_base))
comp = attn.compressor
print("compressor attrs:", [n for n, _ in comp.named_children()], "params:", [(n, tuple(p.shape)) for n, p in comp.named_parameters()])
idx = attn.indexer
print("indexer attrs:", [n for n, _ in idx.named_children()], "params:", [(n, tuple(p.shape)) for n, p in idx.named_parameters()][:8])
