"""Capacity planner: what a HiSparse deployment holds, before launching it.

    python -m sglang_hisparse.tools.plan --model-config <dir or config.json> --tp 8 --dp 8 --dp-attention \
        --gpu-mem-gib 141 --host-mem-gib 2000 --context 32768 --device-buffer-size 4096 --ratio 8

From the model's config (DSA dimensions, layers, weights), the GPU and host memory, the TP/DP
layout, the context length, B and the host ratio, it prints per rank the device rows and host
rows, the pinned host memory per rank and per host, and the most requests of that context that
can decode at once with and without HiSparse; it refuses (exit 2, one line) a plan whose pinned
host memory exceeds the host's. The ``sglang-hisparse capacity:`` line it prints is the one every
HiSparse server logs at start-up (:func:`sglang_hisparse.memory.admission.capacity_line`), so a plan can
be checked against the server it describes.

Accounting (per rank; every TP rank holds the MLA KV of the requests of its attention group):

* without HiSparse each token costs ``layers x (KV row + indexer row)`` of device memory;
* with HiSparse a device row costs ``layers x KV row`` and every logical id keeps its indexer row
  on the device (``ratio`` logical ids per device row): ``D = budget / (layers x (KV row + ratio
  x indexer row))`` device rows, ``ratio x D`` host rows of ``layers x KV row`` each, pinned;
* the device budget is ``GPU memory x mem_fraction_static - weights per GPU`` (weights estimated
  from the config, or ``--weights-gib``);
* a decoding request holds ``round_up(B + 1, page)`` device rows (its hot buffer) and ``context``
  host rows; without HiSparse it holds ``context`` device tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_hisparse.memory.admission import Capacity, capacity_line, hot_buffer_rows

GIB = 1 << 30
PAGE_SIZE = 64


class PlanError(ValueError):
    """The plan cannot run; the message is one line for the user."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a DSA model that decide its memory (read from its config.json)."""

    layers: int
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    weight_params_attention: int
    """Parameters of every layer's attention and indexer (replicated across DP-attention ranks)."""
    weight_params_other: int
    """Every other parameter (embeddings, dense MLPs, experts; sharded across all TP ranks)."""
    weight_bytes_per_param: int

    @classmethod
    def from_config(cls, path: Path) -> "ModelDims":
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        h, layers = config["hidden_size"], config["num_hidden_layers"]
        heads, q_lora, kv_lora = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
        nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        index_heads, index_dim = config["index_n_heads"], config["index_head_dim"]
        attention = (h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope) + kv_lora * heads * (nope + v_dim)
                     + heads * v_dim * h + q_lora * index_heads * index_dim + h * index_dim + h * index_heads)
        dense = config.get("first_k_dense_replace", layers)
        experts = config.get("n_routed_experts") or 0
        moe = (experts + config.get("n_shared_experts", 0)) * 3 * h * config.get("moe_intermediate_size", 0) + h * experts
        other = 2 * config["vocab_size"] * h + dense * 3 * h * config["intermediate_size"] + (layers - dense) * moe
        quantized = "quantization_config" in config
        return cls(layers, kv_lora, rope, index_dim, layers * attention, other, 1 if quantized else 2)

    def kv_row_bytes(self, kv_cache_dtype: str) -> int:
        """One token's MLA KV in one layer: bf16 latent + rope, or SGLang's fp8_e4m3 layout (fp8
        latent, one fp32 scale per 128 values, bf16 rope)."""
        if kv_cache_dtype == "fp8_e4m3":
            return self.kv_lora_rank + 4 * (self.kv_lora_rank // 128) + 2 * self.rope_dim
        return 2 * (self.kv_lora_rank + self.rope_dim)

    def index_row_bytes(self) -> int:
        """One token's indexer key in one layer: fp8 values plus one fp32 scale per 128."""
        return self.index_head_dim + 4 * max(1, self.index_head_dim // 128)


@dataclass(frozen=True)
class Plan:
    ranks_per_host: int
    request_groups: int
    """Independent sets of decoding requests: the DP-attention ranks, or 1 under plain TP."""
    capacity: Capacity
    tokens_without_hisparse: int
    pinned_host_bytes_per_rank: int
    decoding_with: int
    decoding_without: int

    def lines(self, context: int, host_mem_gib: float) -> list[str]:
        per_host = self.pinned_host_bytes_per_rank * self.ranks_per_host
        return [
            capacity_line(self.capacity),
            f"per host: {self.ranks_per_host} ranks, pinned host memory {per_host / GIB:.1f} GiB of {host_mem_gib:g} GiB",
            f"requests of {context} tokens decoding at once: {self.decoding_with} with HiSparse, "
            f"{self.decoding_without} without ({self.request_groups} request group(s); without HiSparse "
            f"{self.tokens_without_hisparse} device tokens per rank)",
        ]


def make_plan(dims: ModelDims, *, tp: int, dp: int, dp_attention: bool, gpu_mem_gib: float, host_mem_gib: float,
              context: int, device_buffer_size: int, ratio: int, kv_cache_dtype: str = "bfloat16",
              mem_fraction_static: float = 0.85, weights_gib: Optional[float] = None) -> Plan:
    """Raises PlanError for a layout SGLang would refuse or a plan that does not fit."""
    if tp < 1 or dp < 1 or tp % dp:
        raise PlanError(f"invalid layout --tp {tp} --dp {dp}: dp must divide tp")
    attention_tp = tp // dp if dp_attention else tp
    if weights_gib is None:
        params = dims.weight_params_attention / attention_tp + dims.weight_params_other / tp
        weights_gib = params * dims.weight_bytes_per_param / GIB
    budget = gpu_mem_gib * GIB * mem_fraction_static - weights_gib * GIB
    if budget <= 0:
        raise PlanError(f"the weights ({weights_gib:.1f} GiB per GPU) leave no KV memory in "
                        f"{gpu_mem_gib:g} GiB x mem_fraction_static {mem_fraction_static}")
    kv_row, index_row = dims.kv_row_bytes(kv_cache_dtype), dims.index_row_bytes()
    pages = lambda tokens: int(tokens) // PAGE_SIZE * PAGE_SIZE  # noqa: E731
    without = pages(budget / (dims.layers * (kv_row + index_row)))
    device_rows = pages(budget / (dims.layers * (kv_row + ratio * index_row)))
    padded = hot_buffer_rows(device_buffer_size, 1, PAGE_SIZE)
    held_rows = min(padded, pages(context + PAGE_SIZE - 1))  # a request shorter than a hot buffer holds its own rows
    capacity = Capacity(device_rows=device_rows, hot_buffer_rows=padded, page_size=PAGE_SIZE,
                        logical_ids=ratio * device_rows, host_rows=ratio * device_rows,
                        device_buffer_size=device_buffer_size, host_row_bytes=dims.layers * kv_row)
    pinned = capacity.host_rows * capacity.host_row_bytes
    groups = dp if dp_attention else 1
    plan = Plan(ranks_per_host=tp, request_groups=groups, capacity=capacity, tokens_without_hisparse=without,
                pinned_host_bytes_per_rank=pinned,
                decoding_with=groups * min(device_rows // held_rows, capacity.host_rows // context),
                decoding_without=groups * (without // context))
    if pinned * tp > host_mem_gib * GIB:
        raise PlanError(
            f"pinned host memory {pinned * tp / GIB:.1f} GiB ({tp} ranks x {pinned / GIB:.1f} GiB) exceeds the "
            f"host's {host_mem_gib:g} GiB: lower host_to_device_ratio (now {ratio}) or the device pool"
        )
    return plan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_hisparse.tools.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", type=Path, required=True, help="the model's directory or its config.json")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--dp-attention", action="store_true")
    p.add_argument("--gpu-mem-gib", type=float, default=141.0)
    p.add_argument("--host-mem-gib", type=float, required=True)
    p.add_argument("--context", type=int, required=True, help="tokens per request (prompt + output)")
    p.add_argument("--device-buffer-size", type=int, default=4096)
    p.add_argument("--ratio", type=int, default=2, help="host_to_device_ratio")
    p.add_argument("--kv-cache-dtype", choices=("bfloat16", "fp8_e4m3"), default="bfloat16")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--weights-gib", type=float, default=None, help="weights per GPU (default: estimated from the config)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(ModelDims.from_config(args.model_config), tp=args.tp, dp=args.dp,
                         dp_attention=args.dp_attention, gpu_mem_gib=args.gpu_mem_gib,
                         host_mem_gib=args.host_mem_gib, context=args.context,
                         device_buffer_size=args.device_buffer_size, ratio=args.ratio,
                         kv_cache_dtype=args.kv_cache_dtype, mem_fraction_static=args.mem_fraction_static,
                         weights_gib=args.weights_gib)
    except PlanError as e:
        print(f"sglang-hisparse plan refused: {e}", file=sys.stderr)
        return 2
    print("\n".join(plan.lines(args.context, args.host_mem_gib)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
