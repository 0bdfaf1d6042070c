"""Tensor-parallel linear layers; exact plain linears at world size 1.

Column-parallel layers split the output features over ranks (no communication); row-parallel
layers split the input features and all-reduce the partial sums (or leave that to the next
layer). Each layer copies the slice of a checkpoint tensor that belongs to its rank in
`load_weight`. On CPU the loaded weights are replaced by MKL-packed ones
(`pack_linear_weights`); on CUDA in half precision a one-row input goes through the GEMV
kernel of layers/gemv.py (`use_one_row_kernel`). A layer under a `quantization` allocates no
float weight: aserve/quant/method.py keeps its checkpoint weight (quantized in the file, or
quantized as it arrives), packs and multiplies it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from aserve.config import ConfigError
from aserve.distributed.group import TPGroup
from aserve.layers.activation import silu_and_mul
from aserve.layers.cpu_gemm import PackedWeight, can_pack
from aserve.layers.embedding import VocabParallelEmbedding
from aserve.layers.fused import FusedOps
from aserve.layers.weight import WeightSource, read_whole
from aserve.quant.fp8_activations import Fp8Activations
from aserve.quant.method import QuantizedLinearWeight

if TYPE_CHECKING:
    from aserve.lora.layers import LoraWeights

OneRowProduct = Callable[..., torch.Tensor]
"""`(x, weight, bias, gated=False) -> x W^T + bias` for one row (layers/gemv.py)."""


def active_lora(lora: LoraWeights | None) -> LoraWeights | None:
    """A layer's adapters where this step has rows on them (`LoraWeights.active`), else
    None: the layer then runs as without adapters."""
    return lora if lora is not None and lora.active else None


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W's rows (outputs) split over ranks.

    `output_sizes` lists the logical matrices fused into this one (e.g. gate and up); each is
    split separately so every rank gets its part of each, and `load_weight(tensor, shard)`
    fills matrix number `shard`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.local_sizes = [size // tp.size for size in output_sizes]
        for size in output_sizes:
            tp.shard(size)
        self.quantized = (
            QuantizedLinearWeight(self.local_sizes, input_size, quantization)
            if quantization
            else None
        )
        if quantization:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size), False)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), False) if bias else None
        self.packed: PackedWeight | None = None
        self.one_row: OneRowProduct | None = None
        self.lora: LoraWeights | None = None  # adapters on this layer (aserve/lora/)

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        """`x` in FP8 only where an FP8 weight takes it (models/decoder.py,
        use_fp8_activations), never in a step of LoRA adapters."""
        y = self._product(x)
        lora = active_lora(self.lora)
        if lora is None:
            return y
        assert isinstance(x, torch.Tensor)
        return lora.add_to(y, x)

    def _product(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.linear(x, self.bias)
        assert isinstance(x, torch.Tensor)
        if self.packed is not None:
            return self.packed.linear(x, self.bias)
        if self.one_row is not None and x.shape[0] == 1:
            return self.one_row(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def rank_rows(self, tensor: WeightSource, shard: int) -> torch.Tensor:
        size = self.local_sizes[shard]
        return tensor[self.tp.rank * size : (self.tp.rank + 1) * size]

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        if name == "weight" and self.quantized is not None:
            self.quantized.load(shard, self.rank_rows(tensor, shard))
            return
        if name == "bias" and self.bias is None:
            _zero_bias(tensor)
            return
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"checkpoint has a {name} this layer does not"
        offset = sum(self.local_sizes[:shard])
        param.data.narrow(0, offset, self.local_sizes[shard]).copy_(self.rank_rows(tensor, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused (and, where `gated`, a gate a query head after them:
    Qwen3.5's). With fewer KV heads than ranks, KV heads are replicated so each rank keeps
    whole heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        quantization: str | None = None,
        gated: bool = False,
    ) -> None:
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        kv_total = max(num_kv_heads, tp.size) * head_dim
        sizes = [num_heads * head_dim, kv_total, kv_total] + [num_heads * head_dim] * gated
        super().__init__(hidden_size, sizes, bias, tp, quantization)

    def rank_rows(self, tensor: WeightSource, shard: int) -> torch.Tensor:
        size = self.local_sizes[shard]
        index = self.tp.rank if shard in (0, 3) else self.tp.rank // self.kv_replicas
        return tensor[index * size : (index + 1) * size]


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W's columns (inputs) split over ranks; partial sums all-reduced,
    or with `reduce_results=False` returned as they are, for the layer after to reduce (the
    decoder's next RMSNorm, which can fuse the all-reduce into its kernel)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TPGroup,
        reduce_results: bool = True,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce_results = reduce_results
        self.input_size, self.output_size = input_size, output_size
        start, end = tp.shard(input_size)
        self.input_start, self.local_input = start, end - start
        self.quantized = (
            QuantizedLinearWeight([output_size], self.local_input, quantization)
            if quantization
            else None
        )
        if quantization:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(output_size, self.local_input), False)
        self.bias = nn.Parameter(torch.empty(output_size), False) if bias else None
        self.packed: PackedWeight | None = None
        self.one_row: OneRowProduct | None = None
        self.lora: LoraWeights | None = None  # adapters on this layer (aserve/lora/)

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        bias = self._product_bias()
        if self.quantized is not None:
            partial = self.quantized.linear(x, bias)
        else:
            assert isinstance(x, torch.Tensor)
            if self.packed is not None:
                partial = self.packed.linear(x, bias)
            elif self.one_row is not None and x.shape[0] == 1:
                partial = self.one_row(x, self.weight, bias)
            else:
                partial = F.linear(x, self.weight, bias)
        lora = active_lora(self.lora)
        if lora is not None:
            assert isinstance(x, torch.Tensor)
            partial = lora.add_to(partial, x)
        return self._reduce(partial)

    def forward_gated(self, gate_up: torch.Tensor, ops: FusedOps | None) -> torch.Tensor:
        """The layer applied to SiLU(gate) * up of a fused gate|up output: at one row on CUDA
        one kernel does both (float or FP8 weights); FP8 weights take many rows' activation
        in FP8 from one kernel (`Fp8Weight.gated`)."""
        if active_lora(self.lora) is not None:  # the adapters take the activation
            return self(silu_and_mul(gate_up, ops))
        bias = self._product_bias()
        if self.one_row is not None and self.weight is not None and gate_up.shape[0] == 1:
            return self._reduce(self.one_row(gate_up, self.weight, bias, gated=True))
        if self.quantized is not None and bias is None:
            product = self.quantized.gated(gate_up)
            if product is not None:
                return self._reduce(product)
        return self(silu_and_mul(gate_up, ops))

    def _product_bias(self) -> torch.Tensor | None:
        """The bias where the product adds it: with one rank, or to rank 0's partial sum
        where the layer after reduces the sums; else `_reduce` adds it after the all-reduce."""
        if self.tp.size == 1 or (not self.reduce_results and self.tp.rank == 0):
            return self.bias
        return None

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if not self.reduce_results or self.tp.size == 1:
            return partial
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        if name == "bias":
            if self.bias is None:
                _zero_bias(tensor)
            else:
                self.bias.data.copy_(tensor[:])
            return
        columns = tensor[:, self.input_start : self.input_start + self.local_input]
        if self.quantized is not None:
            self.quantized.load(0, columns)
        else:
            self.weight.data.copy_(columns)


def _zero_bias(tensor: WeightSource) -> None:
    """A bias that a layer without one is given: GPTQ files may hold zeros for every layer,
    which change nothing and are passed over, as vLLM does; any other is refused."""
    if read_whole(tensor).any():
        raise ConfigError("the checkpoint has a bias for a layer that has none in this model")


def pack_linear_weights(model: nn.Module) -> None:
    """Swap every packable linear weight of `model` for its MKL-packed form (after loading:
    a packed layer has no plain `weight` left; `return_freed_memory` then gives the plain
    weights' memory back)."""
    for module in model.modules():
        if (
            isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            and module.weight is not None
            and can_pack(module.weight)
        ):
            module.packed = PackedWeight(module.weight.detach())
            del module.weight


def use_one_row_kernel(model: nn.Module) -> None:
    """Route `model`'s one-row products (decode at batch 1) through the Triton GEMV; where
    Triton is missing nothing changes. For CUDA in half precision: float32 keeps cuBLAS, so
    its results stay those the CPU comparisons were made with."""
    try:
        from aserve.layers.gemv import gemv
    except ImportError:
        return
    kinds = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    for module in model.modules():
        if isinstance(module, kinds) and getattr(module, "weight", None) is not None:
            module.one_row = gemv
