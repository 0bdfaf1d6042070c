"""The tensor-parallel group that layers reduce and gather over.

At world size 1 every collective is the identity, so the same layers run unsharded on a
laptop. Larger groups go through torch.distributed (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def shard(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of a dimension of size `total` that divides evenly."""
        if total % self.size:
            raise ValueError(f"size {total} does not split over {self.size} ranks")
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part
