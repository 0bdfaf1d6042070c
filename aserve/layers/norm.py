"""RMSNorm as Hugging Face computes it (float32 statistics), with an optional fused residual add."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from aserve.distributed.group import TPGroup
from aserve.layers.fused import FusedOps
from aserve.layers.weight import WeightSource
from aserve.quant.fp8_activations import Fp8Activations

if TYPE_CHECKING:
    from aserve.lora.layers import LoraRows

Fp8Norm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], Fp8Activations]
"""quant/fp8_cuda.py's `norm_fp8(x, residual, weight, eps)`."""


class RMSNorm(nn.Module):
    """With `ops` (FlashInfer), one fused kernel; `add_and_norm` then updates the residual and
    the input in place."""

    def __init__(self, size: int, eps: float, ops: FusedOps | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size), False)
        # Set where an FP8 product follows on CUDA (models/decoder.py, use_fp8_activations):
        # batches of two rows or more are then normalised straight into FP8, but for steps
        # of LoRA adapters (`adapters` active), which multiply the row as it is.
        self.fp8_norm: Fp8Norm | None = None
        self.adapters: LoraRows | None = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """Hugging Face's formula, op for op (the same bits): normalised in float32, then
        weighted. On CPU `F.rms_norm` gives the same bits but took 3.7 ms at 2,400 tokens of
        SmolLM2 against 1.0 ms for these in-place steps."""
        x32 = x.float()
        inv_rms = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        if x.dtype == torch.float32:
            return (x * inv_rms).mul_(self.weight)
        return self.weight * (x32 * inv_rms).to(x.dtype)

    def _in_fp8(self, x: torch.Tensor) -> bool:
        if self.fp8_norm is None or x.shape[0] == 1:
            return False
        return self.adapters is None or self.adapters.ids is None

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Activations:
        if self._in_fp8(x):
            assert self.fp8_norm is not None
            return self.fp8_norm(x, None, self.weight, self.eps)
        if self.ops is not None:
            return self.ops.rmsnorm(x.contiguous(), self.weight, self.eps)
        return self._norm(x)

    def norm_heads(self, x: torch.Tensor, head_dim: int) -> None:
        """Normalise each head of `x` `[tokens, heads * head_dim]` in place (Qwen3's Q/K norm).
        `x` may be Q or K inside the fused QKV output, a strided view that FlashInfer's kernel
        reads as it is, where a reshape would first copy it."""
        heads = x.unflatten(-1, (-1, head_dim))
        if self.ops is not None:
            self.ops.rmsnorm(heads, self.weight, self.eps, out=heads)
        else:
            heads.copy_(self._norm(heads))

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup | None = None
    ) -> tuple[torch.Tensor | Fp8Activations, torch.Tensor]:
        """`residual += x` then normalise it; returns (normalised, new residual). Either
        input may be overwritten (the torch path sums into `x`, saving an allocation).
        With `tp`, `x` is this rank's partial sum, all-reduced first: in the same kernel as
        the add and norm where `tp` can (fused_norm.py; its output stays in float)."""
        if tp is not None and tp.size > 1:
            fused = tp.all_reduce_add_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = tp.all_reduce(x)
        if self._in_fp8(x):
            assert self.fp8_norm is not None
            return self.fp8_norm(x, residual, self.weight, self.eps), residual
        if self.ops is not None:
            self.ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x.add_(residual)
        return self._norm(residual), residual

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        self.weight.data.copy_(tensor[:])


class Float32RMSNorm(RMSNorm):
    """Weighs the float32 row before rounding to the input's dtype, as gpt-oss's and Gemma's
    norms do, by a float32 weight: the CPU kernels, whose models run in float32, take it as
    any norm's weight, and CUDA's weigh a half-precision row by a float32 weight before
    rounding (layers/cuda_ops.py)."""

    def __init__(self, size: int, eps: float, ops: FusedOps | None = None) -> None:
        super().__init__(size, eps, ops)
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        inv_rms = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        if x.dtype == torch.float32:
            return (x * inv_rms).mul_(self.weight)
        return (x32 * inv_rms).mul_(self.weight).to(x.dtype)

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        self.weight.data.copy_(tensor[:].float())


class GemmaRMSNorm(Float32RMSNorm):
    """Gemma's norm weighs by 1 + w: the weight is kept as that sum (which transformers
    forms at every call)."""

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        self.weight.data.copy_(tensor[:].float() + 1)


class AcrossHeadsNorm(Float32RMSNorm):
    """OLMo 2's Q and K norms: one RMSNorm over all heads of a projection, not one a head.
    A tensor-parallel rank holds its heads' `rows` of the weight and sums the squares over
    the ranks, where `replicas` ranks hold each head (K's heads, fewer than the ranks)."""

    def __init__(
        self, width: int, rows: tuple[int, int], eps: float, tp: TPGroup, replicas: int = 1
    ) -> None:
        super().__init__(rows[1] - rows[0], eps)
        self.rows = rows
        self.tp = tp
        self.squares_over = width * replicas  # what the ranks' summed squares cover

    def norm_in_place(self, x: torch.Tensor) -> None:
        """Normalise `x` `[tokens, local width]`, a view inside the fused QKV output."""
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares)
        inv_rms = squares.div_(self.squares_over).add_(self.eps).rsqrt_()
        x.copy_((x32 * inv_rms).mul_(self.weight))

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        self.weight.data.copy_(tensor[self.rows[0] : self.rows[1]].float())
