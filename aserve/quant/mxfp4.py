"""gpt-oss's published checkpoints: MXFP4 experts as transformers stores them, read as
llama.cpp's MXFP4 blocks, so that they run where GGUF experts run (quant/gguf.py decodes the
blocks; the CPU kernels and the CUDA code kernels multiply them).

A checkpoint holds each layer's experts stacked: `mlp.experts.gate_up_proj_blocks` `[E, 2I,
H / 32, 16]` (two FP4 codes a byte, the even input in the low nibble; gate and up rows
interleaved), `..._scales` `[E, 2I, H / 32]` (an E8M0 exponent a block of 32, 127 for 1),
`down_proj_blocks` / `_scales` likewise over `[E, H, I / 32]`, and float biases `[E, 2I]`
(interleaved too) and `[E, H]`. They come out under the per-expert names the MoE layers
take (`mlp.experts.{e}.gate_proj.weight`, `.bias`): blocks of GGUF's layout (an exponent
byte, then the low nibbles holding inputs 0-15 and the high ones 16-31), or float32 with
`dequantize`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from gguf import GGMLQuantizationType as QType

from aserve.layers.weight import read_whole
from aserve.quant.gguf import QuantizedTensor

PARTS = ("gate_up_proj", "down_proj")
"""The stacked expert products a checkpoint stores in MXFP4."""


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[rows, groups, 16]` code bytes and `[rows, groups]` exponents in transformers' order
    as `[rows, groups * 17]` bytes of llama.cpp's MXFP4 blocks (the same values)."""
    codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-2)  # inputs in order
    packed = codes[..., :16] | codes[..., 16:] << 4
    return torch.cat((scales[..., None], packed), -1).flatten(1)


def mxfp4_experts(
    weights: Iterable[tuple[str, Any]], dequantize: bool
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each layer's MXFP4 experts (blocks joined to their scales,
    whichever comes first) and their biases split expert by expert; everything else as it
    comes."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        base, _, kind = name.rpartition("_")
        if kind in ("blocks", "scales") and base.rpartition(".")[2] in PARTS:
            held[name] = read_whole(tensor)
            if f"{base}_blocks" in held and f"{base}_scales" in held:
                blocks, scales = held.pop(f"{base}_blocks"), held.pop(f"{base}_scales")
                yield from _experts(base, blocks, scales, dequantize)
        elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            yield from _expert_biases(name, read_whole(tensor))
        else:
            yield name, tensor
    if held:
        raise ValueError(f"MXFP4 tensor {sorted(held)[0]} has no partner in the checkpoint")


def _experts(
    base: str, blocks: torch.Tensor, scales: torch.Tensor, dequantize: bool
) -> Iterator[tuple[str, QuantizedTensor | torch.Tensor]]:
    prefix, _, part = base.rpartition(".")
    cols = blocks.shape[-2] * 32
    for expert in range(blocks.shape[0]):
        rows = QuantizedTensor(ggml_blocks(blocks[expert], scales[expert]), QType.MXFP4, cols)
        pieces = (
            {"gate_proj": rows.permute_rows(_every_other(rows, 0)),
             "up_proj": rows.permute_rows(_every_other(rows, 1))}
            if part == "gate_up_proj"
            else {"down_proj": rows}
        )  # fmt: skip
        for name, piece in pieces.items():
            value = piece.decode().dequantize() if dequantize else piece
            yield f"{prefix}.{expert}.{name}.weight", value


def _every_other(rows: QuantizedTensor, first: int) -> torch.Tensor:
    return torch.arange(first, rows.shape[0], 2)


def _expert_biases(name: str, biases: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    prefix, _, stacked = name.rpartition(".")
    for expert in range(biases.shape[0]):
        if stacked == "gate_up_proj_bias":
            yield f"{prefix}.{expert}.gate_proj.bias", biases[expert, 0::2]
            yield f"{prefix}.{expert}.up_proj.bias", biases[expert, 1::2]
        else:
            yield f"{prefix}.{expert}.down_proj.bias", biases[expert]
