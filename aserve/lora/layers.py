"""LoRA adapters on the model's linear layers, many adapters in one batch.

Every adapter stays resident. A layer stacks its adapters' matrices: A as
`[parts * adapters * rank, in]` (parts: the fused layer's Q, K and V, or gate and up), B as
`[out, adapters, rank]`, the rank the largest adapter's rounded up to a power of two (smaller
ones padded with zeros, which add nothing). On CUDA, up to `GATHERED_TOKENS` tokens (decode
steps, short prefills) take their own adapter's matrices by its id in two Triton kernels a
layer (lora/triton_ops.py). Larger steps, and every step on CPU, multiply their tokens by
every adapter's A, zero the columns of the adapters a token does not take (a one-hot of the
step's adapter ids) and add the product with B a part: cuBLAS's or MKL's products, which
cost little next to the layer's own at those sizes. Either way a token of the base model
gets exactly the base layer's output (nothing is added to it). The adapters' ranks summed
over a layer stay small next to its width, so the dense form serves a handful of adapters.

A step where no token takes an adapter leaves `LoraRows.ids` None and the layers run as
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

# Up to this many tokens a step on CUDA, each token multiplies its own adapter's matrices
# (lora/triton_ops.py); past it, the dense products below.
GATHERED_TOKENS = 256


class LoraRows:
    """Which adapter each token of the step being run takes, as the layers read it: `ids`
    `[tokens]` (adapter ids count from 1; 0 is the base model), or None in a step without
    adapter tokens."""

    def __init__(self, count: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self._labels = torch.arange(1, count + 1, device=device)
        self.ids: torch.Tensor | None = None
        self._onehot: torch.Tensor | None = None
        # on CPU, the adapter id of a step whose every token takes that one (else None)
        self.single: int | None = None

    def begin(self, adapter_ids: torch.Tensor) -> None:
        self.ids = adapter_ids
        self._onehot = None
        self.single = None
        if adapter_ids.device.type == "cpu":  # read without a device sync
            taken = set(adapter_ids.tolist())
            self.single = taken.pop() if len(taken) == 1 and 0 not in taken else None

    def end(self) -> None:
        self.ids = self._onehot = self.single = None

    def onehot(self) -> torch.Tensor:
        """`[tokens, adapters]` in the model's dtype, made once a step (a comparison on the
        device, no host sync)."""
        assert self.ids is not None
        if self._onehot is None:
            self._onehot = (self.ids[:, None] == self._labels[None, :]).to(self.dtype)
        return self._onehot


class LoraWeights:
    """A layer's stacked adapters (see the module's docstring): `a` `[parts * adapters *
    rank, in]`, `b` `[out, adapters, rank]` (every part's rows, at `offsets`)."""

    def __init__(
        self, rows: LoraRows, a: torch.Tensor, b: torch.Tensor, offsets: list[int]
    ) -> None:
        self.rows = rows
        self.a = a
        self.b = b
        self.offsets = offsets
        ends = [*offsets[1:], b.shape[0]]
        self._parts = [b[start:end].flatten(1) for start, end in zip(offsets, ends, strict=True)]
        self._alone: list[tuple[torch.Tensor, torch.Tensor]] = []
        if a.device.type == "cpu":
            self._alone = self._one_adapter_each(ends)

    @property
    def active(self) -> bool:
        return self.rows.ids is not None

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` (the base layer's output for input `x`) plus each token's adapter's product,
        in place; `y` itself where the step has no adapter tokens."""
        ids = self.rows.ids
        if ids is None:
            return y
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.is_cuda and x.shape[0] <= GATHERED_TOKENS:
            from aserve.lora.triton_ops import add_lora

            return add_lora(y, x, ids, self.a, self.b, self.offsets)
        if self.rows.single is not None:  # two products, where the dense form takes 2 + parts
            a, b = self._alone[self.rows.single - 1]
            return y.addmm_(F.linear(x, a), b.t())
        onehot = self.rows.onehot()
        tokens, parts = x.shape[0], len(self._parts)
        xa = F.linear(x, self.a).view(tokens, parts, onehot.shape[1], -1)
        xa = (xa * onehot[:, None, :, None]).view(tokens, parts, -1)
        for part, (b, offset) in enumerate(zip(self._parts, self.offsets, strict=True)):
            y.narrow(-1, offset, b.shape[0]).addmm_(xa[:, part], b.t())
        return y

    def _one_adapter_each(self, ends: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each adapter's A `[parts * rank, in]` and B `[out, parts * rank]`, each part's
        rows of B in its own columns (zeros elsewhere): a CPU step of one adapter's tokens
        (a single stream's decode, say) adds its product in two calls, where the op count,
        not the arithmetic, is the cost of these thin products."""
        out, slots, rank = self.b.shape
        parts = len(self.offsets)
        a = self.a.view(parts, slots, rank, -1)
        alone = []
        for slot in range(slots):
            b = self.b.new_zeros(out, parts, rank)
            for part, (start, end) in enumerate(zip(self.offsets, ends, strict=True)):
                b[start:end, part] = self.b[start:end, slot]
            alone.append((a[:, slot].reshape(parts * rank, -1).contiguous(), b.flatten(1)))
        return alone


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
    rows = LoraRows(len(adapters), dtype, device)
    rank = 1 << (max(adapter.rank for adapter in adapters) - 1).bit_length()  # a power of 2
    for layer_name, parts in placed.items():
        layer = modules[layer_name]
        weights = (
            _column_weights(layer, parts, len(adapters), rank, layer_name)
            if isinstance(layer, ColumnParallelLinear)
            else _row_weights(layer, parts, len(adapters), rank, layer_name)
        )
        a, b, offsets = weights
        layer.lora = LoraWeights(
            rows, a.flatten(0, 2).to(device, dtype), torch.cat(b).to(device, dtype), offsets
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
