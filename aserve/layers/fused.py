"""Fused kernels for the layers' small steps: FlashInfer's on CUDA in half precision, aserve's
own CPU ones (layers/cpu_ops.py, the same function names) for quantized models on CPU.

The model is built with `ops` from `fused_ops(device, dtype, quantized)`: the `flashinfer`
module or a `CpuKernels` where they apply, otherwise None, and the layers then use their
plain PyTorch code (float models on CPU, or no FlashInfer installed).
"""

from __future__ import annotations

from types import ModuleType

import torch

from aserve.layers.cpu_ops import CpuKernels, cpu_kernels

FusedOps = ModuleType | CpuKernels


def fused_ops(device: torch.device, dtype: torch.dtype, quantized: bool = False) -> FusedOps | None:
    if device.type == "cpu":
        return cpu_kernels(device, dtype, quantized)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer
