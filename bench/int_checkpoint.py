"""A random integer checkpoint (AWQ, GPTQ or compressed-tensors W4A16) of a dense Llama-like
shape, for benchmarks of how those files run:

    python bench/int_checkpoint.py bench/models/llama-3.1-8b /tmp/llama8b-awq --layout awq
    python bench/latency.py --model /tmp/llama8b-awq

Codes are random, zero points the middle code and scales small, so weights spread about as
`--dummy-weight`'s do; the embedding and LM head are random bfloat16, norms ones. The packing
is each publisher's (aserve/quant/int_checkpoints.py describes them); groups of 128 inputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYOUTS = ("awq", "gptq", "compressed-tensors")
GROUP = 128


def nibbles(value: int) -> int:
    """The int32 whose eight 4-bit fields all hold `value`."""
    return int.from_bytes(bytes([value * 0x11] * 4), "little", signed=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="random integer checkpoint of a model shape")
    p.add_argument("shape", type=Path, help="a folder with the model's config.json")
    p.add_argument("out", type=Path)
    p.add_argument("--layout", choices=LAYOUTS, default="awq")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Outputs by inputs of each layer's linear weights, by checkpoint name."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    parts = {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    return {
        f"model.layers.{layer}.{part}": shape
        for layer in range(config["num_hidden_layers"])
        for part, shape in parts.items()
    }


def packed_weight(
    layout: str, rows: int, cols: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One weight's tensors, random codes in the layout's packing."""
    groups = cols // GROUP

    def words(shape: tuple[int, int]) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32)

    scales = (torch.rand(groups, rows, generator=generator) * 0.004 + 0.002).half()
    if layout == "awq":
        zeros = torch.full((groups, rows // 8), nibbles(8), dtype=torch.int32)  # the middle
        return {"qweight": words((cols, rows // 8)), "qzeros": zeros, "scales": scales}
    if layout == "gptq":  # zero points stored minus one
        zeros = torch.full((groups, rows // 8), nibbles(8 - 1), dtype=torch.int32)
        index = (torch.arange(cols) // GROUP).int()
        return {
            "qweight": words((cols // 8, rows)),
            "qzeros": zeros,
            "scales": scales,
            "g_idx": index,
        }
    return {
        "weight_packed": words((rows, cols // 8)),
        "weight_scale": scales.t().contiguous().bfloat16(),
        "weight_shape": torch.tensor([rows, cols]),
    }


def quantization_config(layout: str) -> dict[str, object]:
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": GROUP}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def main() -> None:
    args = parse_args()
    config = json.loads((args.shape / "config.json").read_text())
    generator = torch.Generator().manual_seed(args.seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (
            torch.randn(vocab, hidden, generator=generator) * 0.02
        ).bfloat16(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    if not config.get("tie_word_embeddings", False):
        head = torch.randn(vocab, hidden, generator=generator) * 0.02
        tensors["lm_head.weight"] = head.bfloat16()
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    for layer in range(config["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = ones.clone()
    for base, (rows, cols) in linear_shapes(config).items():
        for part, tensor in packed_weight(args.layout, rows, cols, generator).items():
            tensors[f"{base}.{part}"] = tensor
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "model.safetensors"))
    config["quantization_config"] = quantization_config(args.layout)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    size = sum(t.nbytes for t in tensors.values()) / 2**30
    print(f"{args.out}: {args.layout}, {len(tensors)} tensors, {size:.2f} GiB")


if __name__ == "__main__":
    main()
