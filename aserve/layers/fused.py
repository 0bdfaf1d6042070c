"""Fused kernels for the layers' small steps: aserve's Triton ones (layers/cuda_ops.py) on
CUDA in half precision, its CPU ones (layers/cpu_ops.py, the same function names, except
that RoPE comes with the Q/K norm and the K/V write in `norm_rope_store`, as the decoder
takes the Triton kernel of that name on CUDA) for quantized models on CPU.

The model is built with `ops` from `fused_ops(device, dtype, quantized)`: a `CudaKernels` or
a `CpuKernels` where they apply, otherwise None, and the layers then use their plain PyTorch
code (float models on CPU, or no Triton installed).
"""

from __future__ import annotations

from typing import Protocol

import torch

from aserve.layers.cpu_ops import cpu_kernels


class FusedOps(Protocol):
    """What the layers call: FlashInfer's names and signatures, which both sets keep."""

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def fused_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def apply_rope_with_cos_sin_cache_inplace(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool = True,
    ) -> None: ...


def fused_ops(device: torch.device, dtype: torch.dtype, quantized: bool = False) -> FusedOps | None:
    if device.type == "cpu":
        return cpu_kernels(device, dtype, quantized)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from aserve.layers.cuda_ops import CudaKernels
    except ImportError:
        return None
    return CudaKernels()
