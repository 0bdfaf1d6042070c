"""A one-row residual add and RMSNorm left to the product that reads its output.

At batch 1 a decode step is a chain of dependent kernels, and each link costs about a
microsecond or two of launch, wait and tail whatever the kernel's work. The add-and-norm
before a layer's first product (QKV; gate|up) reads 16 KB: each program of the one-row
product can as well compute the row's statistics itself and normalise the inputs it reads,
and the chain has one kernel fewer a norm (layers/gemv.py, `NORM`). The first program
stores the new residual into a tensor of its own: the others still read the old one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingNorm:
    """`residual += x`, then RMSNorm times `weight`, for one row, not yet computed: the
    product that takes it computes it (`resolve` where it cannot). `new_residual` receives
    the sum, as the fused kernel would leave it in `residual`."""

    x: torch.Tensor  # [1, K], contiguous
    residual: torch.Tensor  # [1, K], contiguous
    weight: torch.Tensor  # [K], of the rows' dtype
    eps: float
    new_residual: torch.Tensor  # [1, K], written by the product

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def resolve(self) -> torch.Tensor:
        """The normalised row, rounded as the add-and-norm kernel rounds it (layers/
        cuda_ops.py): the sum in the rows' dtype, the normalised row too, then weighted."""
        dtype = self.x.dtype
        rounded = (self.x.float() + self.residual.float()).to(dtype)
        self.new_residual.copy_(rounded)
        values = rounded.float()
        inv_rms = values.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        normed = (values * inv_rms).to(dtype).float()
        return (normed * self.weight.float()).to(dtype)
