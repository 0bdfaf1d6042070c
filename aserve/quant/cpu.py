"""Where a quantized weight runs on CPU: aserve's kernels (aserve/quant/native.py) when they
build, else float32 de-quantized once at load, MKL-packed where that is available."""

from __future__ import annotations

import torch

from aserve.layers.cpu_gemm import PackedWeight, can_pack
from aserve.quant.codes import Codes
from aserve.quant.native import NativeWeight, Scratch, native_kernels


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


def cpu_weight(codes: Codes, dtype: torch.dtype, scratch: Scratch) -> NativeWeight | DenseWeight:
    """`codes` in the form that multiplies fastest here."""
    fits = codes.shape[1] % 32 == 0 and codes.bits <= 8 and codes.group in (16, 32, 64, 128, 256)
    if fits and native_kernels():
        return NativeWeight(codes, scratch)
    return DenseWeight(codes.dequantize(dtype))
