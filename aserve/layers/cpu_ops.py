"""aserve's CPU kernels for a decoder's small steps (RMSNorm, the residual add; Q/K norm, RoPE
and the KV write) behind the names of FlashInfer's functions (and of aserve's Triton kernel
for the last), so that the layers call them as they call those on CUDA (SiLU-and-mul stays
ATen's, which was as fast). At batch 1 on the embedded 135M model the ATen ops these replace
cost as much time as the quantized products. Used for quantized
models on CPU in float32; the float path keeps Hugging Face's op-for-op formulas (its tests
compare bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.quant.native import native_kernels


class CpuKernels:
    """The subset of FlashInfer's API that aserve's dense decoder calls, and
    `norm_rope_store` (models/decoder.py takes it in place of the rope and per-head norm
    calls)."""

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert x.dim() == 2 and out is None, "per-head norms run inside norm_rope_store"
        return torch.ops.aserve_cpu.rmsnorm(x, weight, eps)

    def fused_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        torch.ops.aserve_cpu.fused_add_rmsnorm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """ATen's own: its vectorized exp ran 5x faster than a C++ loop at 2,048 rows and as
        fast at one row."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's gate, ATen's too (transformers' `gelu_pytorch_tanh`)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def norm_rope_store(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        cache: torch.Tensor,
        slots: torch.Tensor,
        head_dim: int,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """layers/rope_store.py's `norm_rope_store` (the same arguments) in C++: Q/K norm,
        RoPE and the KV write in one call, where the rope call, its slices and the pool's
        write cost 7-15 us a layer of the embedded model's decode step. The CPU has no FP8
        cache, so `kv_scales` are always 1."""
        assert kv_scales == (1.0, 1.0), "an FP8 cache is for GPUs"
        torch.ops.aserve_cpu.norm_rope_store(
            q, kv, positions, cos_sin, q_weight, k_weight, eps, cache, slots, head_dim
        )


def cpu_kernels(device: torch.device, dtype: torch.dtype, quantized: bool) -> CpuKernels | None:
    """The kernels where they apply: quantized weights on CPU in float32, once they build."""
    if device.type != "cpu" or dtype != torch.float32 or not quantized:
        return None
    return CpuKernels() if native_kernels() else None
