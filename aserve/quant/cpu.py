"""Where a quantized weight runs on CPU: aserve's kernels (aserve/quant/native.py) when they
build, else float32 de-quantized once at load, MKL-packed where that is available. Float
weights run on the kernels too (`FloatWeight`), 16-bit ones kept in their two bytes."""

from __future__ import annotations

import torch

from aserve.config import EngineConfig, ModelConfig
from aserve.layers.cpu_gemm import PackedWeight, can_pack
from aserve.quant.codes import Codes
from aserve.quant.native import FLOAT_WORDS, FloatWeight, NativeWeight, Scratch, native_kernels

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_ON_KERNELS = ("half", "float32")
"""The quantizations `float_weights_on_kernels` picks: float weights, whose model keeps a
float32 KV cache (quantized ones keep float16)."""


def float_weights_on_kernels(
    config: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype
) -> str | None:
    """The quantization under which a float checkpoint's linear layers, embedding and LM head
    run on aserve's kernels on CPU (`FloatWeight`), where the model runs in float32: "half"
    keeps bfloat16 / float16 weights in their two bytes (the same products from half the
    bytes, which a decode step is bound by), "float32" widens every weight to float32 at
    load (a float32 checkpoint, or `--quantization none`). On an AMD EPYC, MKL's products of
    a few float32 rows read the weights at 3-11 GB/s where the kernels read 17-25
    (bench/NOTES.md). None (torch's float path, MKL-packed) for MoE experts, dummy weights,
    other dtypes, an FP8 KV cache (which the kernels' decode does not read; refused on CPU
    before any kernel builds), or where the kernels do not build."""
    if not (
        device.type == "cpu"
        and dtype == torch.float32
        and model.quantization is None
        and not config.dummy_weight
        and not model.num_experts
        and config.kv_cache_dtype in ("auto", "float16", "float32")
        and native_kernels()
    ):
        return None
    stored = (model.torch_dtype or "").removeprefix("torch.")
    if config.quantization == "auto" and stored in ("float16", "bfloat16"):
        return "half"
    return "float32"


class DenseWeight:
    """The weight de-quantized to float, for machines where the kernels do not build."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))
        self.packed = PackedWeight(weight) if can_pack(weight) else None
        self.weight = None if self.packed is not None else weight

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.packed.nbytes
        assert self.weight is not None
        return self.weight.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, bias)
        return torch.nn.functional.linear(x, self.weight, bias)


def dense_cpu_weight(
    weight: torch.Tensor, dtype: torch.dtype, scratch: Scratch
) -> FloatWeight | DenseWeight:
    """A float weight: on the kernels as it is where they build and multiply `dtype`
    (float32), else in `dtype`."""
    if weight.dtype in FLOAT_WORDS and dtype == torch.float32 and native_kernels():
        return FloatWeight(weight.contiguous(), scratch)
    return DenseWeight(weight.to(dtype))


def cpu_weight(codes: Codes, dtype: torch.dtype, scratch: Scratch) -> NativeWeight | DenseWeight:
    """`codes` in the form that multiplies fastest here."""
    fits = codes.shape[1] % 32 == 0 and codes.bits <= 8 and codes.group in (16, 32, 64, 128, 256)
    if fits and native_kernels():
        return NativeWeight(codes, scratch)
    return DenseWeight(codes.dequantize(dtype))
