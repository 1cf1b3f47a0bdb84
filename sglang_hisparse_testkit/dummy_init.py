"""Test-only plugin (entry point ``hisparse_dummy_init``): dummy weights that make attention matter.

SGLang's ``--load-format dummy`` fills every float tensor, norm weights included, with
U(-1e-3, 1e-3) from one seed, which makes a tiny model's outputs nearly independent of which KV
rows attention reads: a wrong resolver would go unnoticed. With
``SGLANG_HISPARSE_DUMMY_INIT=normal`` this plugin replaces SGLang's dummy initialiser with a
deterministic one: every tensor ~ N(0, std) seeded by its name (std from
``SGLANG_HISPARSE_DUMMY_STD``, default 0.02), norm weights 1, biases 0. Without the variable it
registers nothing.

Locality dial, ``SGLANG_HISPARSE_DUMMY_LOCALITY`` (a preset name or a number >= 0, default 0):
random weights give the indexer no locality (87% of the selected rows miss on the GPU tiny model
at B = 2 x top_k, 94% on the CPU one). A strength ``s > 0`` gives every token embedding a shared
direction that only the indexer reads (:func:`add_shared_direction`): its queries then share a
component from step to step and each head ranks keys by a stable per-token salience, as a
trained model's do. So that a strength means the same on every width and depth, the mode also
scales the layers' residual writers to the embedding's scale (:func:`_damp_residual_writers`).
Presets, calibrated on tiny-dsa-cpu (3 requests of 1.5k-3k tokens, 64 new tokens, B = 2 x top_k;
docs/performance.md, where the GPU models' rates are): ``none`` (0, ~94% misses), ``medium``
(2.5, ~31%), ``realistic`` (5, ~13%). Outputs stay diverse (every other reader of the hidden state
has the direction projected out and its gain restored), and they are the same for every server
that loads these weights, so exactness comparisons keep working.

It is a separate entry point so that it can be loaded alone next to SGLang's own HiSparse
(``SGLANG_PLUGINS=hisparse_dummy_init``) or together with ours, and both see the same weights.

Upstream target: ``sglang.srt.model_loader.weight_utils.initialize_dummy_weights`` (REPLACE).
Checked against: SGLang 0.5.17.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import Any

import torch

TARGET = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"
ENV = "SGLANG_HISPARSE_DUMMY_INIT"
STD_ENV = "SGLANG_HISPARSE_DUMMY_STD"
LOCALITY_ENV = "SGLANG_HISPARSE_DUMMY_LOCALITY"
LOCALITY_PRESETS = {"none": 0.0, "medium": 2.5, "realistic": 5.0}


def locality_strength(value: str) -> float:
    """The strength a ``SGLANG_HISPARSE_DUMMY_LOCALITY`` value names (a preset or a number >= 0)."""
    if value in LOCALITY_PRESETS:
        return LOCALITY_PRESETS[value]
    try:
        strength = float(value)
    except ValueError:
        strength = -1.0
    if strength < 0:
        raise ValueError(f"{LOCALITY_ENV}={value!r}: allowed values are {', '.join(LOCALITY_PRESETS)} "
                         "or a number >= 0")
    return strength

logger = logging.getLogger(__name__)


def initialize_dummy_weights(model: torch.nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234) -> None:
    """Fill ``model``'s float tensors in place (see the module docstring)."""
    std = float(os.environ.get(STD_ENV, "0.02"))
    counts = {"normal": 0, "norm": 0, "bias": 0}
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        lname = name.lower()
        if "cos_sin_cache" in lname or "inv_freq" in lname:
            continue
        if lname.endswith("bias"):
            param.zero_()
            counts["bias"] += 1
        elif "norm" in lname and lname.endswith("weight"):
            param.fill_(1.0)
            counts["norm"] += 1
        else:
            generator = torch.Generator(device=param.device)
            generator.manual_seed(seed + zlib.crc32(name.encode()) % 1_000_003)
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            values.normal_(0.0, std, generator=generator)
            param.copy_(values.to(param.dtype))
            counts["normal"] += 1
    locality = locality_strength(os.environ.get(LOCALITY_ENV, "0"))
    if locality:
        add_shared_direction(model, locality, seed, std)
    logger.warning(
        "%s=normal: %d tensors ~N(0, %s) seeded by name, %d norm weights = 1, %d biases = 0, locality %s",
        ENV, counts["normal"], std, counts["norm"], counts["bias"], locality,
    )


def add_shared_direction(model: torch.nn.Module, strength: float, seed: int, std: float) -> None:
    """Locality dial (see the module docstring): a shared direction ``e`` of the hidden space.

    * every token embedding gets ``strength`` x (a typical row norm) along ``e``; the residual
      stream keeps it in every hidden state;
    * only the indexer reads it: through the query path (``q_a`` maps ``e`` to a fixed direction
      ``f`` of the query latent, so every step's indexer queries share a component and each head
      ranks the keys by the same per-token salience from step to step) and through the head
      weights (``weights_proj`` rows gain 3 x their norm along ``e``: every head counts with a
      positive weight at every step);
    * every other reader of the hidden state (key/value latent, MLPs, router, experts, LM head,
      the indexer's key projection) has ``e`` projected out, and MLA's ``q_b`` has ``f`` projected
      out, so attention, the MLPs and the next-token logits see no shared component.
    """
    state = model.state_dict()
    hidden = next(p.shape[1] for n, p in state.items() if n.endswith("embed_tokens.weight"))
    generator = torch.Generator()
    generator.manual_seed(seed + 7)
    e32 = torch.randn(hidden, generator=generator, dtype=torch.float32)
    e32 /= e32.norm()
    query_dirs: dict[str, torch.Tensor] = {}  # layer prefix -> f
    # The norms before these readers now spend most of the activation on ``e``: scale them so
    # that they see the rest at its old size (keeps attention and the MLPs as lively as before).
    gain = (1.0 + strength * strength) ** 0.5
    for name, param in state.items():
        e = e32.to(param.device)
        if name.endswith("embed_tokens.weight"):
            param.add_((strength * param.float().norm(dim=1).mean() * e).to(param.dtype))
        elif name.endswith("fused_qkv_a_proj_with_mqa.weight"):  # q_a rows, then the kv_a rows (checked first:
            q_lora = state[name.replace("fused_qkv_a_proj_with_mqa", "q_b_proj")].shape[1]  # its name ends like kv_a's)
            _project_out(param[q_lora:], e, gain)
            query_dirs[name.rsplit("fused_qkv_a_proj_with_mqa", 1)[0]] = _unit(param[:q_lora].float() @ e)
        elif name.endswith(("lm_head.weight", "indexer.wk.weight", "kv_a_proj_with_mqa.weight", "gate_up_proj.weight",
                            "mlp.gate.weight", "experts.w13_weight")):
            _project_out(param, e, gain)
        elif name.endswith("q_a_proj.weight"):
            query_dirs[name.rsplit("q_a_proj", 1)[0]] = _unit(param.float() @ e)
        elif name.endswith("indexer.weights_proj.weight"):
            _read_strongly(param, e)
        elif name.endswith("indexer.wk_weights_proj.weight"):  # CUDA: wk rows, then weights_proj rows
            heads = model.get_submodule(name.rsplit(".wk_weights_proj", 1)[0]).n_heads
            _project_out(param[:-heads], e, gain)
            _read_strongly(param[-heads:], e)
    for prefix, f in query_dirs.items():
        _project_out(state[prefix + "q_b_proj.weight"], f, gain)
    _damp_residual_writers(state, std=std, seed=seed)


WRITERS = ("o_proj.weight", "down_proj.weight", "experts.w2_weight")  # what adds to the residual stream


def _damp_residual_writers(state: dict[str, torch.Tensor], std: float, seed: int) -> None:
    """Scale every residual writer so that each adds about ``std / sqrt(writers)`` per element.

    Why: with N(0, std) weights a writer's output grows with the width (a 7168-wide MoE block
    writes ~1.5 per element, 70 x an embedding's 0.02), so on wide models the layers' writes swamp
    the embedding's shared direction after the first layer and the dial loses its effect (measured
    before this existed: 78% misses at strength 8 on ds32-width, 13% on tiny-dsa-cpu). After this, the
    residual stream's token-specific part stays about ``std * sqrt(2)`` per element whatever the
    width and depth, so a strength means the same share of ``e`` on every model.

    A writer's output size is estimated from its fan-in and its input's size: MLA's ``o_proj`` reads
    values of ``std * sqrt(kv_lora)`` per element (an upper bound: attention averages them); the MLP
    down projections read ``silu(g) * u`` with ``g, u ~ N(0, (std * sqrt(hidden))^2)`` (their
    readers see unit-size inputs), whose size is sampled once from a seeded generator.
    """
    writers = [n for n in state if n.endswith(WRITERS)]
    if not writers:
        return
    hidden = next(p.shape[1] for n, p in state.items() if n.endswith("embed_tokens.weight"))
    kv_lora = next((p.shape[0] for n, p in state.items() if n.endswith("kv_a_layernorm.weight")), hidden)
    layers = len({n.split(".mlp.")[0].split(".self_attn.")[0] for n in writers})
    target = std / (2 * layers) ** 0.5
    generator = torch.Generator()
    generator.manual_seed(seed + 11)
    g, u = (std * hidden ** 0.5 * torch.randn(2, 1 << 16, generator=generator)).unbind(0)
    act_rms = float((torch.nn.functional.silu(g) * u).pow(2).mean().sqrt())
    for name in writers:
        param = state[name]
        input_rms = std * kv_lora ** 0.5 if name.endswith("o_proj.weight") else act_rms
        param.mul_(target / (std * param.shape[-1] ** 0.5 * input_rms))


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def _project_out(weight: torch.Tensor, direction: torch.Tensor, gain: float) -> None:
    """Remove ``direction`` from the input (last) axis of a weight (it no longer reads it) and
    scale what is left by ``gain``."""
    w = weight.float()
    weight.copy_((gain * (w - (w @ direction).unsqueeze(-1) * direction)).to(weight.dtype))


def _read_strongly(rows: torch.Tensor, direction: torch.Tensor) -> None:
    w = rows.float()
    rows.copy_((w + 3.0 * w.norm(dim=1).mean() * direction[None, :]).to(rows.dtype))


def register(registry: Any = None) -> None:
    """Entry point. Registers the REPLACE only when the environment asks for it."""
    if os.environ.get(ENV, "") != "normal":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    (registry or HookRegistry).register(TARGET, initialize_dummy_weights, HookType.REPLACE)
