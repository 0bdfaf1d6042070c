"""What a linear layer or embedding holds when its checkpoint weight arrives quantized.

Layers know nothing of formats: they hand each arriving shard to a `QuantizedLinearWeight`
(`load`), ask it to pack once every shard is in (`finalize`), and call `linear`. A fused
projection whose shards share a format (the usual case) becomes one packed matrix; shards of
different formats (a Q4_K_M file's Q4_K query beside its Q6_K value) stay separate products
whose outputs are joined.
"""

from __future__ import annotations

from typing import Protocol

import torch

from aserve.config import ConfigError
from aserve.quant.codes import Codes, quantize
from aserve.quant.cpu import (
    FLOAT_ON_KERNELS,
    HALF_DTYPES,
    DenseWeight,
    cpu_weight,
    dense_cpu_weight,
)
from aserve.quant.fp8 import Fp8Rows, Fp8Tensor, Fp8Weight, quantize_rows
from aserve.quant.fp8_activations import Fp8Activations
from aserve.quant.gguf import QuantizedTensor
from aserve.quant.int_checkpoints import CodesTensor
from aserve.quant.native import NativeWeight, Scratch, linear_group, one_format


class QuantizedProduct(Protocol):
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int: ...

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


Shard = Codes | Fp8Rows | torch.Tensor


# `--quantization` methods that quantize a float checkpoint at load into codes, and their
# widths; "fp8" quantizes it at load into FP8 rows (quant/fp8.py).
LOAD_TIME_BITS = {"int8": 8, "int4": 4}

TABLE_QUANTIZATIONS = ("gguf", *FLOAT_ON_KERNELS)
"""Quantizations whose embedding and LM head load in their own form (`load_table_rows`): a
GGUF file's codes, or floats for CPU's kernels. The others keep those two in the model's
dtype, as vLLM does."""


class QuantizedLinearWeight:
    """The weight of a linear layer whose rows come in `len(shard_rows)` shards, under
    `quantization`: "gguf" (shards arrive quantized), a `LOAD_TIME_BITS` method, "fp8"
    (float shards are quantized as they arrive), or on CPU "half" (16-bit float shards kept
    as they are) or "float32" (float shards widened to it): aserve/quant/cpu.py,
    `float_weights_on_kernels`."""

    def __init__(self, shard_rows: list[int], cols: int, quantization: str) -> None:
        self.shard_rows = shard_rows
        self.cols = cols
        self.bits = LOAD_TIME_BITS.get(quantization)
        self.fp8 = quantization == "fp8"
        self.quantization = quantization
        self.shards: list[Shard | None] = [None] * len(shard_rows)
        self.orders: list[torch.Tensor | None] = [None] * len(shard_rows)
        self.products: list[QuantizedProduct] = []

    def load(
        self, shard: int, tensor: Codes | QuantizedTensor | CodesTensor | Fp8Tensor | torch.Tensor
    ) -> None:
        """This rank's rows of shard `shard`: still quantized, or a float tensor (files may
        keep some matrices unquantized)."""
        piece: Shard
        shape = None  # the piece's, but for an act-order rank's padded inputs
        if isinstance(tensor, Codes):  # decoded already (a MoE part, for every expert at once)
            piece = tensor
        elif isinstance(tensor, (QuantizedTensor, CodesTensor)):
            piece = tensor.decode()
            if isinstance(tensor, CodesTensor):
                self.orders[shard] = tensor.order
                shape = tensor.shape
        elif isinstance(tensor, Fp8Tensor):
            piece = tensor.rows()
        elif self.bits is not None:
            piece = quantize(tensor, self.bits)
        elif self.fp8:
            piece = quantize_rows(tensor)
        else:
            piece = float_shard(tensor, self.quantization)
        shape = tuple(shape or piece.shape)
        if shape != (self.shard_rows[shard], self.cols):
            raise ValueError(
                f"shard {shard} is {shape}, expected {(self.shard_rows[shard], self.cols)}"
            )
        self.shards[shard] = piece

    @property
    def loaded(self) -> bool:
        return all(s is not None for s in self.shards)

    def finalize(self, device: torch.device, dtype: torch.dtype, scratch: Scratch) -> None:
        """Pack the shards for products on `device`; runs of shards in one format join.
        `scratch`: the model's buffer for de-quantized slices (CPU)."""
        runs: list[list[Shard]] = []
        run_orders: list[torch.Tensor | None] = []
        for piece, order in zip(self.shards, self.orders, strict=True):
            assert piece is not None, "finalize before every shard is loaded"
            if runs and _same_format(runs[-1][-1], piece) and _same_order(run_orders[-1], order):
                runs[-1].append(piece)
            else:
                runs.append([piece])
                run_orders.append(order)
        self.products = [
            _product(run, device, dtype, scratch)
            if order is None
            else PermutedInputs(_product(run, device, dtype, scratch), order, self.cols, device)
            for run, order in zip(runs, run_orders, strict=True)
        ]
        self.shards, self.orders = [], []

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.products)

    def _only_fp8(self) -> Fp8Weight | None:
        """The one FP8 product this weight is, if it is one."""
        product = self.products[0] if len(self.products) == 1 else None
        return product if isinstance(product, Fp8Weight) else None

    def fp8_product(self) -> Fp8Weight | None:
        """The one FP8 product this weight is, if it takes FP8 activations."""
        product = self._only_fp8()
        return product if product is not None and product.aligned else None

    def silu(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor | None:
        """SiLU(gate) * up of a fused gate|up weight's product with `x` in one kernel
        (`Fp8Weight.silu`, `NativeWeight.silu` on CPU), or None (the caller multiplies, then
        activates)."""
        product = self.products[0] if len(self.products) == 1 else None
        if isinstance(product, NativeWeight) and isinstance(x, torch.Tensor):
            return product.silu(x)
        fp8 = self._only_fp8()
        return None if fp8 is None else fp8.silu(x)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of fused gate|up rows times this weight with a kernel fewer
        (`Fp8Weight.gated`), where the weight is one FP8 product on CUDA; else None (the
        caller runs the activation)."""
        product = self._only_fp8()
        return None if product is None else product.gated(gate_up)

    def linear(self, x: torch.Tensor | Fp8Activations, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Fp8Activations):
            product = self.fp8_product()
            assert product is not None, "FP8 activations reach only an FP8 weight"
            return product.linear(x, bias)
        if len(self.products) == 1:
            return self.products[0].linear(x, bias)
        out = torch.cat([p.linear(x, None) for p in self.products], -1)
        return out if bias is None else out + bias


class ProductGroup:
    """Weights of one shape whose products a step runs side by side, each on rows of its own
    (a MoE layer's experts: each one's gate|up, or each one's down). Where every weight is
    one product of aserve's CPU kernels in one code format (decided once, at `finalize`),
    the chosen weights with fewer than their `blas_from` float32 rows each run in one call
    of the kernels (`linear_group`: a decode step's experts are products too small each to
    keep the cores busy alone); otherwise one by one. The same outputs either way."""

    def __init__(self, count: int, shard_rows: list[int], cols: int, quantization: str) -> None:
        self.weights = [QuantizedLinearWeight(shard_rows, cols, quantization) for _ in range(count)]
        self.native: list[NativeWeight] | None = None

    def finalize(self, device: torch.device, dtype: torch.dtype, scratch: Scratch) -> None:
        for weight in self.weights:
            weight.finalize(device, dtype, scratch)
        products = [w.products[0] for w in self.weights if len(w.products) == 1]
        native = [p for p in products if isinstance(p, NativeWeight)]
        whole = len(native) == len(self.weights) and one_format(native)
        self.native = native if whole else None

    @property
    def nbytes(self) -> int:
        return sum(weight.nbytes for weight in self.weights)

    def linear(self, chosen: list[int], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """`weights[chosen[i]].linear(xs[i], None)` for every i."""
        if self.native is not None and all(
            x.dtype == torch.float32 and x.shape[0] < self.native[0].blas_from for x in xs
        ):
            return linear_group([self.native[i] for i in chosen], [x.contiguous() for x in xs])
        return [self.weights[i].linear(x, None) for i, x in zip(chosen, xs, strict=True)]


class PermutedInputs:
    """The product of an act-order weight, whose columns were sorted by group at load
    (quant/int_checkpoints.py): each row's `inputs` inputs are gathered into that order
    first, with a zero appended where a rank's columns hold padding (`order` points past
    the last input)."""

    def __init__(
        self, product: QuantizedProduct, order: torch.Tensor, inputs: int, device: torch.device
    ) -> None:
        self.product = product
        self.order = order.to(device)
        self.padded = bool((order >= inputs).any())
        self.shape = product.shape

    @property
    def nbytes(self) -> int:
        return self.product.nbytes + self.order.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.padded:
            x = torch.nn.functional.pad(x, (0, 1))
        return self.product.linear(x.index_select(-1, self.order), bias)


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two shards gather their inputs alike (fused projections of one input whose
    act-order weights came out in one order, as GPTQ's of one input do)."""
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def _same_format(a: Shard, b: Shard) -> bool:
    if isinstance(a, Codes) and isinstance(b, Codes):
        return a.packs_with(b)
    return type(a) is type(b) and not isinstance(a, Codes)


def _product(
    run: list[Shard], device: torch.device, dtype: torch.dtype, scratch: Scratch
) -> QuantizedProduct:
    if isinstance(run[0], torch.Tensor):
        weight = torch.cat(run)  # type: ignore[arg-type]
        if device.type == "cpu":
            return dense_cpu_weight(weight, dtype, scratch)
        return DenseWeight(weight.to(device, dtype))
    if isinstance(run[0], Fp8Rows):
        return Fp8Weight(Fp8Rows.concat_rows(run), device)  # type: ignore[arg-type]
    codes = Codes.concat_rows(run)  # type: ignore[arg-type]
    if device.type == "cuda":
        from aserve.quant.cuda import CudaWeight

        return CudaWeight(codes, device, dtype)
    return cpu_weight(codes, dtype, scratch)


class QuantizedTable:
    """An embedding table or LM head that arrived quantized: rows de-quantized as they are
    looked up (`lookups`), and the weight packed for the logits product (`head`: an untied
    LM head, or an embedding that the head is tied to). With aserve's kernels one copy
    serves both."""

    def __init__(
        self,
        table: Shard,
        device: torch.device,
        dtype: torch.dtype,
        lookups: bool,
        head: bool,
        scratch: Scratch,
    ) -> None:
        self.dtype = dtype
        product = _product([table], device, dtype, scratch)
        self.head = product if head else None
        self.lookups: QuantizedProduct | torch.Tensor | None = None
        if lookups:
            if hasattr(product, "rows"):  # aserve's CPU kernels or the CUDA weight
                self.lookups = product
            else:
                dense = table.dequantize(dtype) if isinstance(table, Codes) else table
                self.lookups = dense.to(device, dtype)

    @property
    def nbytes(self) -> int:
        sizes = [] if self.head is None else [self.head.nbytes]
        if self.lookups is not None and self.lookups is not self.head:
            sizes.append(self.lookups.nbytes)
        return sum(sizes)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.lookups is not None, "this table serves no lookups"
        flat = ids.reshape(-1)
        if isinstance(self.lookups, torch.Tensor):
            return self.lookups[flat].to(self.dtype)
        return self.lookups.rows(flat).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.head is not None, "this table is no LM head"
        return self.head.linear(hidden, None)


def float_shard(tensor: torch.Tensor, quantization: str) -> torch.Tensor:
    """A float shard as it is loaded: 16-bit floats as they are (`_product` widens them where
    they cannot stay), but under "float32", which widens every float weight at load."""
    return tensor if tensor.dtype in HALF_DTYPES and quantization != "float32" else tensor.float()


def load_table_rows(
    tensor: QuantizedTensor | CodesTensor | torch.Tensor, rows: int, quantization: str
) -> Shard:
    """A rank's slice of a vocabulary table, zero rows appended up to `rows` (the last rank
    of a vocabulary that does not split evenly); 16-bit floats as they are, but under
    "float32"."""
    if isinstance(tensor, CodesTensor) and tensor.order is not None:
        raise ConfigError("an act-order embedding or LM head is not supported")
    if isinstance(tensor, (QuantizedTensor, CodesTensor)):
        piece: Shard = tensor.decode()
    else:
        piece = float_shard(tensor, quantization)
    if isinstance(piece, Codes):
        return piece.pad_rows(rows)
    missing = rows - piece.shape[0]
    return torch.cat([piece, piece.new_zeros(missing, piece.shape[1])]) if missing > 0 else piece
