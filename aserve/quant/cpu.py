"""Where a quantized weight runs on CPU: aserve's kernels (aserve/quant/native.py) when they
build, else float32 de-quantized once at load, MKL-packed where that is available. A 16-bit
float weight stays in its two bytes there too (`HalfWeight`)."""

from __future__ import annotations

import torch

from aserve.config import EngineConfig, ModelConfig
from aserve.layers.cpu_gemm import PackedWeight, can_pack
from aserve.quant.codes import Codes
from aserve.quant.native import HalfWeight, NativeWeight, Scratch, native_kernels

HALF_DTYPES = (torch.float16, torch.bfloat16)


def keeps_16_bit_weights(
    config: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether a checkpoint of bfloat16 or float16 weights keeps them in their two bytes on
    CPU (the `half` quantization: `HalfWeight`), where the model runs in float32: the same
    products from half the bytes, which a decode step is bound by (float32 copies had
    doubled the memory and, on AMD CPUs, run on MKL at a third of the memory's speed:
    bench/NOTES.md). Not for MoE experts (they run quantized or in --dtype), dummy weights
    or `--quantization none`, nor where the kernels do not build."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and config.quantization == "auto"
        and model.quantization is None
        and not config.dummy_weight
        and not model.num_experts
        and (model.torch_dtype or "").removeprefix("torch.") in ("float16", "bfloat16")
        and native_kernels()
    )


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
) -> HalfWeight | DenseWeight:
    """A float weight: in its two bytes where it has two and the kernels build, else in
    `dtype`."""
    if weight.dtype in HALF_DTYPES and native_kernels():
        return HalfWeight(weight.contiguous(), scratch)
    return DenseWeight(weight.to(dtype))


def cpu_weight(codes: Codes, dtype: torch.dtype, scratch: Scratch) -> NativeWeight | DenseWeight:
    """`codes` in the form that multiplies fastest here."""
    fits = codes.shape[1] % 32 == 0 and codes.bits <= 8 and codes.group in (16, 32, 64, 128, 256)
    if fits and native_kernels():
        return NativeWeight(codes, scratch)
    return DenseWeight(codes.dequantize(dtype))
