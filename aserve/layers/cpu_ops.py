"""aserve's CPU kernels for a decoder's small steps (RMSNorm, the residual add, RoPE) behind
the names of FlashInfer's functions, so that the layers call them as they call FlashInfer on
CUDA (SiLU-and-mul stays ATen's, which was as fast). At batch 1 on the embedded 135M model
the ATen ops these replace cost as much time as the quantized products. Used for quantized
models on CPU in float32; the float path keeps Hugging Face's op-for-op formulas (its tests
compare bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.quant.native import native_kernels


class CpuKernels:
    """The subset of FlashInfer's API that aserve's dense decoder calls."""

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dim() == 2 and out is None:
            return torch.ops.aserve_cpu.rmsnorm(x, weight, eps)
        # Qwen3's per-head Q/K norm on a strided view: the plain formula, written back.
        normed = x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_() * weight
        if out is None:
            return normed
        return out.copy_(normed)

    def fused_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        torch.ops.aserve_cpu.fused_add_rmsnorm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """ATen's own: its vectorized exp ran 5x faster than a C++ loop at 2,048 rows and as
        fast at one row."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def apply_rope_with_cos_sin_cache_inplace(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool = True,
    ) -> None:
        assert is_neox, "aserve's models rotate the halves of each head (neox style)"
        torch.ops.aserve_cpu.rope(positions, query, key, head_size, cos_sin_cache)


def cpu_kernels(device: torch.device, dtype: torch.dtype, quantized: bool) -> CpuKernels | None:
    """The kernels where they apply: quantized weights on CPU in float32, once they build."""
    if device.type != "cpu" or dtype != torch.float32 or not quantized:
        return None
    return CpuKernels() if native_kernels() else None
