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

Adapters sit in slots (`AdapterSlots`): those of `--lora-modules` from the start, and with
`--enable-lora` room for `--max-loras` of rank up to `--max-lora-rank` on every attention
and dense-MLP projection, which adapters loaded at run time fill and unloading empties (in
place: the CUDA graphs keep reading the same tensors).

Tensor parallelism: a column-parallel layer keeps A whole and its rank's rows of each B; a
row-parallel one its rank's columns of A and all of B, so its partial sums add up over the
ranks with the base layer's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

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
            self._alone = [self._one_adapter(slot) for slot in range(b.shape[1])]

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

    def write(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter in `slot` (0-based): `parts` maps a part to its A `[r, in]` and
        B `[part's outputs, r]` (this rank's shares); the parts it lacks, and the ranks past
        its own, are zeros. An empty `parts` empties the slot."""
        a, b = self.a.view(len(self.offsets), self.b.shape[1], self.b.shape[2], -1), self.b
        a[:, slot].zero_()
        b[:, slot].zero_()
        for part, (a_part, b_part) in parts.items():
            rank, start = a_part.shape[0], self.offsets[part]
            a[part, slot, :rank].copy_(a_part)
            b[start : start + b_part.shape[0], slot, :rank].copy_(b_part)
        if self._alone:
            self._alone[slot] = self._one_adapter(slot)

    def _one_adapter(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapter in `slot` as A `[parts * rank, in]` and B `[out, parts * rank]`, each
        part's rows of B in its own columns (zeros elsewhere): a CPU step of one adapter's
        tokens (a single stream's decode, say) adds its product in two calls, where the op
        count, not the arithmetic, is the cost of these thin products."""
        out, slots, rank = self.b.shape
        parts = len(self.offsets)
        a = self.a.view(parts, slots, rank, -1)[:, slot].reshape(parts * rank, -1)
        b = self.b.new_zeros(out, parts, rank)
        ends = [*self.offsets[1:], out]
        for part, (start, end) in enumerate(zip(self.offsets, ends, strict=True)):
            b[start:end, part] = self.b[start:end, slot]
        return a.contiguous(), b.flatten(1)


# The rank that adapters loaded at run time may have at most, unless --max-lora-rank says
# (vLLM's default)
DEFAULT_RUNTIME_RANK = 16
# The layers that adapters loaded at run time may target (`--enable-lora`), by name.
ADAPTABLE = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)$")

Placement = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]
"""An adapter's matrices by our layer and part: (A, B) as this rank holds them."""


class AdapterSlots:
    """The adapters a model holds: `count` slots of rank `rank` (a power of two) on each
    layer of `layers`, every slot in every step's products. A slot's adapter has a key of its
    own, never reused (`keys`), by which requests name it and the prefix cache keeps its KV
    apart, so a slot emptied and filled again at run time shares nothing with its past."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[str],
        count: int,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.rank = rank
        self.rows = LoraRows(count, dtype, device)
        self.keys = [0] * count  # each slot's adapter's key; 0: empty
        self.names: dict[str, int] = {}  # adapter name -> key
        self.paths: dict[str, str] = {}  # adapter name -> its folder
        self._next_key = 1
        modules = dict(model.named_modules())
        self.layers: dict[str, LoraWeights] = {}
        for name in layers:
            weights = _empty_weights(modules[name], self.rows, count, rank, device, dtype)
            modules[name].lora = self.layers[name] = weights

    def place(self, adapter: Adapter, placement: Placement | None = None) -> int:
        """Put `adapter` in a free slot (its `place_adapter` matrices, if already made);
        returns its key. A ConfigError (one line) where it cannot go: its name taken, no slot
        free, its rank too large, a layer it targets not held."""
        if adapter.name in self.names:
            raise ConfigError(f"a LoRA adapter named {adapter.name!r} is loaded already")
        if 0 not in self.keys:
            raise ConfigError(
                f"all {len(self.keys)} LoRA adapter slots are taken (--max-loras): unload one first"
            )
        if adapter.rank > self.rank:
            raise ConfigError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}; this server holds "
                f"rank {self.rank} at most (--max-lora-rank)"
            )
        if placement is None:
            placement = place_adapter(self.model, adapter, self.layers)
        slot = self.keys.index(0)
        for name, weights in self.layers.items():
            weights.write(slot, placement.get(name, {}))
        key = self.keys[slot] = self._next_key
        self._next_key += 1
        self.names[adapter.name] = key
        self.paths[adapter.name] = str(adapter.path)
        return key

    def remove(self, name: str) -> None:
        """Empty the slot of adapter `name` (no request may still run on it)."""
        key = self.names.pop(name)
        del self.paths[name]
        slot = self.keys.index(key)
        for weights in self.layers.values():
            weights.write(slot, {})
        self.keys[slot] = 0

    def slot_of(self, key: int) -> int:
        """The slot id (from 1) that holds the adapter of `key`; a ValueError once it is
        unloaded."""
        if key not in self.keys:
            raise ValueError("the LoRA adapter of this request has been unloaded")
        return self.keys.index(key) + 1


def make_adapter_slots(
    model: nn.Module,
    adapters: Sequence[Adapter],
    device: torch.device,
    dtype: torch.dtype,
    count: int,
    rank: int | None = None,
    every_layer: bool = False,
) -> AdapterSlots:
    """`count` slots holding `adapters` (keys 1, 2, ... in order) on the layers they target,
    or with `every_layer` on every layer adapters may target (room for adapters loaded at
    run time, of rank `rank` at most)."""
    if getattr(model, "lora_targets", None) is None:
        raise ConfigError(f"LoRA adapters: {type(model).__name__} takes none")
    modules = dict(model.named_modules())
    held = set()
    if every_layer:
        linear = ColumnParallelLinear | RowParallelLinear
        held = {n for n, m in modules.items() if ADAPTABLE.search(n) and isinstance(m, linear)}
    placements = [place_adapter(model, adapter, modules) for adapter in adapters]
    held |= {name for placement in placements for name in placement}
    room = rank or (DEFAULT_RUNTIME_RANK if every_layer else 1)
    largest = max([room, *(adapter.rank for adapter in adapters)])
    slots = AdapterSlots(model, sorted(held), count, 1 << (largest - 1).bit_length(), device, dtype)
    for adapter, placement in zip(adapters, placements, strict=True):
        slots.place(adapter, placement)
    return slots


def place_adapter(model: nn.Module, adapter: Adapter, layers: Mapping[str, object]) -> Placement:
    """`adapter`'s matrices by our layer (of `layers`) and part, as this rank holds them: the
    model places a checkpoint layer's B rows (`lora_targets`: fused projections, rows it
    reorders); shapes are checked against the layer's."""
    modules = dict(model.named_modules())
    architecture = type(model).__name__
    placement: Placement = {}
    for name, pair in adapter.pairs.items():
        for layer_name, part, b in model.lora_targets(name, pair.b):
            layer = modules.get(layer_name)
            if layer_name not in layers or not isinstance(
                layer, ColumnParallelLinear | RowParallelLinear
            ):
                raise ConfigError(
                    f"LoRA adapter {adapter.name!r} targets {name}, which is not a linear "
                    f"layer of this {architecture} that takes adapters (attention's and dense "
                    "MLPs' projections do)"
                )
            shares = (
                _column_shares(layer, part, pair.a, b, layer_name)
                if isinstance(layer, ColumnParallelLinear)
                else _row_shares(layer, pair.a, b, layer_name)
            )
            placement.setdefault(layer_name, {})[part] = shares
    return placement


def _empty_weights(
    layer: ColumnParallelLinear | RowParallelLinear,
    rows: LoraRows,
    count: int,
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
) -> LoraWeights:
    zeros = {"device": device, "dtype": dtype}
    if isinstance(layer, ColumnParallelLinear):
        sizes = layer.local_sizes
        a = torch.zeros(len(sizes) * count * rank, layer.input_size, **zeros)
        offsets = [sum(sizes[:part]) for part in range(len(sizes))]
        return LoraWeights(rows, a, torch.zeros(sum(sizes), count, rank, **zeros), offsets)
    a = torch.zeros(count * rank, layer.local_input, **zeros)
    return LoraWeights(rows, a, torch.zeros(layer.output_size, count, rank, **zeros), [0])


def _column_shares(
    layer: ColumnParallelLinear, part: int, a: torch.Tensor, b: torch.Tensor, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    expected = _checkpoint_rows(layer, part)
    if a.shape[1] != layer.input_size or b.shape[0] != expected:
        raise ConfigError(
            f"LoRA: {name} (part {part}) takes A [r, {layer.input_size}] and B "
            f"[{expected}, r]; the adapter has {tuple(a.shape)} and {tuple(b.shape)}: an "
            "adapter of another model?"
        )
    return a, layer.rank_rows(b, part)


def _checkpoint_rows(layer: ColumnParallelLinear, part: int) -> int:
    """Rows of part `part` in the checkpoint (K and V heads replicated over ranks counted
    once)."""
    rows = layer.local_sizes[part] * layer.tp.size
    if isinstance(layer, QKVParallelLinear) and part > 0:
        rows //= layer.kv_replicas
    return rows


def _row_shares(
    layer: RowParallelLinear, a: torch.Tensor, b: torch.Tensor, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if a.shape[1] != layer.input_size or b.shape[0] != layer.output_size:
        raise ConfigError(
            f"LoRA: {name} takes A [r, {layer.input_size}] and B [{layer.output_size}, r]; "
            f"the adapter has {tuple(a.shape)} and {tuple(b.shape)}: an adapter of another "
            "model?"
        )
    start = layer.input_start
    return a[:, start : start + layer.local_input], b
