"""LoRA adapters on the model's linear layers, many adapters in one batch.

Every adapter stays resident. A layer stacks its adapters' matrices: A as
`[parts * adapters * rank, in]` (parts: the fused layer's Q, K and V, or gate and up), one B
`[out, adapters * rank]` a part, the rank the largest adapter's (smaller ones padded with
zeros, which add nothing). A step multiplies its tokens by every adapter's A, zeroes the
columns of the adapters a token does not take (a one-hot of the step's adapter ids), and adds
the product with B to the base layer's output. That costs two thin products a layer whatever
mix of adapters a batch holds, needs no gather and no kernel of its own, and gives a token of
the base model exactly the base layer's output (its columns are all zero). The ranks of
adapters summed over a layer stay small next to the layer's width, so this serves a handful of
adapters; many more would want grouped products (vLLM's Punica kernels).

A step where no token takes an adapter leaves `LoraRows.onehot` None and the layers run as
they do without adapters (their CUDA graphs, the CPU's C++ decode layers, fused kernels); one
that has such tokens runs through the plain modules, decode steps in CUDA graphs of their own
(engine/graph.py). There FP8 weights take the norms' rows in the model's dtype, not in FP8,
as the adapters multiply them.

Tensor parallelism: a column-parallel layer keeps A whole and its rank's rows of each B; a
row-parallel one its rank's columns of A and all of B, so its partial sums add up over the
ranks with the base layer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from aserve.config import ConfigError
from aserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aserve.lora.adapter import Adapter


class LoraRows:
    """Which adapter each token of the step being run takes, as the layers read it:
    `onehot` `[tokens, adapters]` in the model's dtype (adapter ids count from 1; 0 is the
    base model), or None in a step without adapter tokens."""

    def __init__(self, names: Sequence[str], dtype: torch.dtype, device: torch.device) -> None:
        self.names = list(names)
        self.dtype = dtype
        self._labels = torch.arange(1, len(names) + 1, device=device)
        self.onehot: torch.Tensor | None = None

    def begin(self, adapter_ids: torch.Tensor) -> None:
        """The step's adapter id of each token (a comparison, no host sync)."""
        self.onehot = (adapter_ids[:, None] == self._labels[None, :]).to(self.dtype)

    def end(self) -> None:
        self.onehot = None


class LoraWeights:
    """A layer's stacked adapters (see the module's docstring)."""

    def __init__(
        self, rows: LoraRows, a: torch.Tensor, b: list[torch.Tensor], offsets: list[int]
    ) -> None:
        self.rows = rows
        self.a = a
        self.b = b
        self.offsets = offsets

    @property
    def active(self) -> bool:
        return self.rows.onehot is not None

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` (the base layer's output for input `x`) plus each token's adapter's product,
        in place; `y` itself where the step has no adapter tokens."""
        onehot = self.rows.onehot
        if onehot is None:
            return y
        tokens, parts = x.shape[0], len(self.b)
        xa = F.linear(x, self.a).view(tokens, parts, onehot.shape[1], -1)
        xa = (xa * onehot[:, None, :, None]).view(tokens, parts, -1)
        for part, (b, offset) in enumerate(zip(self.b, self.offsets, strict=True)):
            y.narrow(-1, offset, b.shape[0]).addmm_(xa[:, part], b.t())
        return y


def attach_adapters(
    model: nn.Module, adapters: Sequence[Adapter], device: torch.device, dtype: torch.dtype
) -> LoraRows:
    """Give each linear layer of `model` that an adapter targets its `LoraWeights` (adapter
    i gets id i + 1); returns the rows object the engine sets each step. The model places a
    checkpoint layer's B rows (`lora_targets`: fused projections, rows it reorders)."""
    targets = getattr(model, "lora_targets", None)
    architecture = type(model).__name__
    if targets is None:
        raise ConfigError(f"LoRA adapters: {architecture} takes none")
    modules = dict(model.named_modules())
    # layer -> part -> adapter slot -> (A, B rows of the part)
    placed: dict[str, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for slot, adapter in enumerate(adapters):
        for name, pair in adapter.pairs.items():
            for layer_name, part, b in targets(name, pair.b):
                layer = modules.get(layer_name)
                if not isinstance(layer, ColumnParallelLinear | RowParallelLinear):
                    raise ConfigError(
                        f"LoRA adapter {adapter.name!r} targets {name}, which is not a linear "
                        f"layer of this {architecture} (only attention's and dense MLPs' "
                        "projections take adapters)"
                    )
                placed.setdefault(layer_name, {}).setdefault(part, {})[slot] = (pair.a, b)
    rows = LoraRows([adapter.name for adapter in adapters], dtype, device)
    rank = max(adapter.rank for adapter in adapters)
    for layer_name, parts in placed.items():
        layer = modules[layer_name]
        weights = (
            _column_weights(layer, parts, len(adapters), rank, layer_name)
            if isinstance(layer, ColumnParallelLinear)
            else _row_weights(layer, parts, len(adapters), rank, layer_name)
        )
        a, b, offsets = weights
        layer.lora = LoraWeights(
            rows,
            a.flatten(0, 2).to(device, dtype),
            [part.flatten(1).to(device, dtype) for part in b],
            offsets,
        )
    return rows


Placed = dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def _column_weights(
    layer: ColumnParallelLinear, parts: Placed, count: int, rank: int, name: str
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    sizes = layer.local_sizes
    a = torch.zeros(len(sizes), count, rank, layer.input_size)
    b = [torch.zeros(size, count, rank) for size in sizes]
    for part, slots in parts.items():
        for slot, (a_part, b_part) in slots.items():
            expected = _checkpoint_rows(layer, part)
            if a_part.shape[1] != layer.input_size or b_part.shape[0] != expected:
                raise ConfigError(
                    f"LoRA: {name} (part {part}) takes A [r, {layer.input_size}] and B "
                    f"[{expected}, r]; the adapter has {tuple(a_part.shape)} and "
                    f"{tuple(b_part.shape)}: an adapter of another model?"
                )
            r = a_part.shape[0]
            a[part, slot, :r] = a_part
            b[part][:, slot, :r] = layer.rank_rows(b_part, part)
    offsets = [sum(sizes[:part]) for part in range(len(sizes))]
    return a, b, offsets


def _checkpoint_rows(layer: ColumnParallelLinear, part: int) -> int:
    """Rows of part `part` in the checkpoint (K and V heads replicated over ranks counted
    once)."""
    rows = layer.local_sizes[part] * layer.tp.size
    if isinstance(layer, QKVParallelLinear) and part > 0:
        rows //= layer.kv_replicas
    return rows


def _row_weights(
    layer: RowParallelLinear, parts: Placed, count: int, rank: int, name: str
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    start, width = layer.input_start, layer.local_input
    a = torch.zeros(1, count, rank, width)
    b = torch.zeros(layer.output_size, count, rank)
    for slot, (a_full, b_full) in parts[0].items():
        if a_full.shape[1] != layer.input_size or b_full.shape[0] != layer.output_size:
            raise ConfigError(
                f"LoRA: {name} takes A [r, {layer.input_size}] and B [{layer.output_size}, r]; "
                f"the adapter has {tuple(a_full.shape)} and {tuple(b_full.shape)}: an adapter "
                "of another model?"
            )
        r = a_full.shape[0]
        a[0, slot, :r] = a_full[:, start : start + width]
        b[:, slot, :r] = b_full
    return a, [b], [0]
