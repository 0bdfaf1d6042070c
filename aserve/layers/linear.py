"""Tensor-parallel linear layers; exact plain linears at world size 1.

Column-parallel layers split the output features over ranks (no communication); row-parallel
layers split the input features and all-reduce the partial sums. Each layer copies the slice
of a checkpoint tensor that belongs to its rank in `load_weight`. On CPU the loaded weights
are replaced by MKL-packed ones (`pack_linear_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.group import TPGroup
from aserve.layers.cpu_gemm import PackedWeight, can_pack
from aserve.layers.weight import WeightSource


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W's rows (outputs) split over ranks.

    `output_sizes` lists the logical matrices fused into this one (e.g. gate and up); each is
    split separately so every rank gets its part of each, and `load_weight(tensor, shard)`
    fills matrix number `shard`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local_sizes = [size // tp.size for size in output_sizes]
        for size in output_sizes:
            tp.shard(size)
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size), False)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), False) if bias else None
        self.packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _rank_rows(self, tensor: WeightSource, shard: int) -> torch.Tensor:
        size = self.local_sizes[shard]
        return tensor[self.tp.rank * size : (self.tp.rank + 1) * size]

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"checkpoint has a {name} this layer does not"
        offset = sum(self.local_sizes[:shard])
        param.data.narrow(0, offset, self.local_sizes[shard]).copy_(self._rank_rows(tensor, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused. With fewer KV heads than ranks, KV heads are
    replicated so each rank keeps whole heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
    ) -> None:
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        kv_total = max(num_kv_heads, tp.size) * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_total, kv_total], bias, tp)

    def _rank_rows(self, tensor: WeightSource, shard: int) -> torch.Tensor:
        size = self.local_sizes[shard]
        index = self.tp.rank if shard == 0 else self.tp.rank // self.kv_replicas
        return tensor[index * size : (index + 1) * size]


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W's columns (inputs) split over ranks; partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        start, end = tp.shard(input_size)
        self.input_start, self.local_input = start, end - start
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input), False)
        self.bias = nn.Parameter(torch.empty(output_size), False) if bias else None
        self.packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight) if self.packed is None else self.packed.linear(x, None)
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        if name == "bias":
            assert self.bias is not None
            self.bias.data.copy_(tensor[:])
        else:
            end = self.input_start + self.local_input
            self.weight.data.copy_(tensor[:, self.input_start : end])


def pack_linear_weights(model: nn.Module) -> None:
    """Swap every packable linear weight of `model` for its MKL-packed form (after loading:
    a packed layer has no plain `weight` left; `return_freed_memory` then gives the plain
    weights' memory back)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and can_pack(
            module.weight
        ):
            module.packed = PackedWeight(module.weight.detach())
            del module.weight
