"""Activations already in FP8, in a module of their own: the CUDA kernels that write them
(quant/fp8_cuda.py) and the FP8 products that read them (quant/fp8.py, which loads those
kernels on CUDA) both import it, so neither imports the other's module back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Fp8Activations:
    """Activations in FP8 with one scale per token: what a norm hands an FP8 product on CUDA,
    so that no quantization kernel runs between the two (two of an FP8 layer's four products
    take them)."""

    values: torch.Tensor  # [tokens, cols] float8_e4m3fn
    scales: torch.Tensor  # [tokens, 1] float32
    dtype: torch.dtype  # the model's activations', which the product returns
