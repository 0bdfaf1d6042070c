"""FP8 weights (`--quantization fp8`): float8_e4m3fn values with one float32 scale per output row,
multiplied by activations quantized per token as they come (dynamic scales), through
`torch._scaled_mm` (on Hopper cuBLASLt's row-wise-scaled FP8 kernels, `nvjet_*_ovscale` in a
trace; a reference implementation on CPU, which the tests use). Half the bytes of a bf16
weight, which is what decode reads. On CUDA a single row (decode at batch 1) takes the Triton
GEMV instead, which reads the FP8 weight as it is and leaves the activations in their own
precision (layers/gemv.py): at one row `_scaled_mm` plus the token quantization lost to the
bf16 GEMV (an 8B step 5.33 ms against 4.34). Two to 16 rows of float activations take
`fp8_cuda.few_rows` (FP8 tensor cores, activations rounded per 128 columns inside the kernel):
1.5-2x faster than `_scaled_mm` there. Activations in FP8 already (`Fp8Activations`, from the
norm before the product) and quantized ones of more rows take `fp8_cuda.token_scaled` where its
measured settings beat `_scaled_mm` (up to 64-256 rows, by shape), else `_scaled_mm`.

`_scaled_mm` adds up in the tensor cores' own accumulator ("fast accum", as vLLM's and
SGLang's FP8 GEMMs do and as Triton's FP8 products on Hopper always do) rather than promoting
to float32 every few products: on the H200 a 16k-token prefill's products of the 8B shape
took 7-19% less time (gate_up 3,542 -> 2,900 us; bench/quant_kernels.py --fp8-gemm), with
the same error against the promoting kernel as Triton's (~5e-3 of the largest output, the
bf16 output's rounding), and the offline 8B figure rose 13,883 -> 14,315 tok/s.

A row's scale maps its largest magnitude to 448, the largest finite e4m3 value, so no weight
saturates; an activation row gets the same treatment at every product. Products whose sizes
are not multiples of 16 (what the FP8 GEMM takes) de-quantize the weight instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from aserve.engine.gpu import gpu_capability, shared_memory_limit
from aserve.layers.weight import read_whole
from aserve.quant.fp8_activations import Fp8Activations

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ALIGN = 16  # the FP8 GEMM's alignment of both weight dimensions
FEW_ROWS_MAX = 16  # on CUDA, products of 2 to this many rows take fp8_cuda.few_rows


@dataclass
class Fp8Rows:
    """A weight's rows in FP8, `values[r] * scales[r]` approximating row r."""

    values: torch.Tensor  # [rows, cols] float8_e4m3fn
    scales: torch.Tensor  # [rows] float32

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.values.shape[0]), int(self.values.shape[1]))

    @staticmethod
    def concat_rows(pieces: list[Fp8Rows]) -> Fp8Rows:
        return Fp8Rows(torch.cat([p.values for p in pieces]), torch.cat([p.scales for p in pieces]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scales[:, None]).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[rows, cols]` in FP8 with one float32 scale per row, `[rows, 1]`, the largest
    magnitude of a row mapped to 448: activations per token, weights per output channel."""
    scales = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    values = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scales


def quantize_rows(weight: torch.Tensor) -> Fp8Rows:
    """A weight with per-row (per output channel) scales."""
    values, scales = quantize_tokens(weight)
    return Fp8Rows(values, scales.squeeze(1))


class Fp8Tensor:
    """An FP8 checkpoint's weight with its scale, as published: one scale for the tensor
    (`weight_scale`, a scalar), one per output row (`[rows, 1]`), or one per block of
    `block` = (rows, cols) (`weight_scale_inv`, `[ceil(rows / b0), ceil(cols / b1)]`); in
    each case w = value * scale. Layers slice it like a tensor (their rank's rows or
    columns, whole blocks), then take `rows()`."""

    def __init__(self, values: Any, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
        self.values = values  # a tensor or a lazy safetensors slice, [rows, cols]
        self.scale = scale.float()
        self.block = block
        self.shape = tuple(values.get_shape() if hasattr(values, "get_shape") else values.shape)

    def __getitem__(self, index: slice | tuple[slice, slice]) -> Fp8Tensor:
        rows, cols = (index, slice(None)) if isinstance(index, slice) else index
        r0, r1, _ = rows.indices(self.shape[0])
        c0, c1, _ = cols.indices(self.shape[1])
        values = self.values[r0:r1, c0:c1]
        if self.block is not None:
            b0, b1 = self.block
            if r0 % b0 or c0 % b1:
                raise ValueError(
                    f"a tensor-parallel shard starts inside a {b0}x{b1} scale block: use a "
                    "--tp that splits the layers at whole blocks"
                )
            scale = self.scale[r0 // b0 : -(-r1 // b0), c0 // b1 : -(-c1 // b1)]
        elif self.scale.numel() > 1:
            scale = self.scale.reshape(-1)[r0:r1]
        else:
            scale = self.scale
        return Fp8Tensor(values, scale, self.block)

    def permute_rows(self, order: torch.Tensor) -> Fp8Tensor:
        """Its rows in `order` (a partly rotating head's Q/K rows), with one scale a row as
        `rows()` gives them: what loading makes of them either way."""
        rows = self.rows()
        order = order.to(rows.values.device)
        return Fp8Tensor(rows.values[order], rows.scales[order].reshape(-1, 1), None)

    def rows(self) -> Fp8Rows:
        """Per-row scales: exact for a tensor's or a row's scale; block scales are applied and
        the rows quantized again (one scale a row is what the FP8 GEMM here takes)."""
        values = read_whole(self.values)
        rows = values.shape[0]
        if self.block is None:
            scales = self.scale.reshape(-1).expand(rows) if self.scale.numel() == 1 else self.scale
            return Fp8Rows(values, scales.reshape(-1).contiguous())
        return quantize_rows(self.dequantize(values))

    def dequantize(self, values: torch.Tensor | None = None) -> torch.Tensor:
        """The weight in float32."""
        values = read_whole(self.values) if values is None else values
        rows, cols = values.shape
        if self.block is None:
            scale = self.scale.reshape(-1, 1) if self.scale.numel() > 1 else self.scale
            return values.float() * scale
        b0, b1 = self.block
        scale = self.scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
        return values.float() * scale


SCALE_NAMES = (".weight_scale_inv", ".weight_scale")
DROPPED = (".input_scale",)


def pair_scales(
    weights: Iterable[tuple[str, Any]], block: tuple[int, int] | None, dequantize: bool
) -> Iterator[tuple[str, Any]]:
    """An FP8 checkpoint's tensors with each FP8 weight joined to its scale, whichever comes
    first: `Fp8Tensor`s, or float32 weights with `dequantize` (`--quantization none`).
    `block` is the config's `weight_block_size` (scales per block), else None (a scale per
    tensor or per row).
    Static activation scales (`input_scale`) are dropped: activations get a scale per token
    at every product, which is finer. KV-cache scales never reach here (kvcache/scales.py
    takes them out of the stream first)."""
    values: dict[str, Any] = {}
    scales: dict[str, torch.Tensor] = {}

    def joined(base: str) -> tuple[str, Any]:
        weight = Fp8Tensor(values.pop(base), scales.pop(base), block)
        return f"{base}.weight", weight.dequantize() if dequantize else weight

    for name, tensor in weights:
        scale_suffix = next((s for s in SCALE_NAMES if name.endswith(s)), None)
        if scale_suffix is not None:
            base = name[: -len(scale_suffix)]
            scales[base] = read_whole(tensor)
        elif name.endswith(DROPPED):
            continue
        elif name.endswith(".weight") and _is_fp8(tensor):
            base = name.removesuffix(".weight")
            # read now if it waits for its scale: it may outlive its file's handle
            values[base] = tensor if base in scales else read_whole(tensor)
        else:
            yield name, tensor
            continue
        if base in values and base in scales:
            yield joined(base)
    if values:
        raise ValueError(f"FP8 weight {sorted(values)[0]}.weight has no scale in the checkpoint")


def _is_fp8(tensor: Any) -> bool:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype == FP8
    return tensor.get_dtype() == "F8_E4M3"


class Fp8Weight:
    """An FP8 weight on its device, multiplied with `torch._scaled_mm`."""

    def __init__(self, rows: Fp8Rows, device: torch.device) -> None:
        self.shape = rows.shape
        self.values = rows.values.to(device)
        self.scales = rows.scales.to(device, torch.float32)[None, :].contiguous()
        self.aligned = self.shape[0] % ALIGN == 0 and self.shape[1] % ALIGN == 0
        self._quantize_tokens = quantize_tokens
        self._one_row: Callable[..., torch.Tensor] | None = None
        self._silu_one_row: Callable[..., torch.Tensor | None] | None = None
        self._few_rows: Callable[..., torch.Tensor] | None = None
        self._token_scaled: Callable[..., torch.Tensor] | None = None
        self._silu_fp8: Callable[[torch.Tensor], Fp8Activations] | None = None
        self._silu_fp8_min_rows = 0
        self._choose: Callable[[int, int, int], tuple | None] | None = None
        if device.type == "cuda":
            from aserve.layers.gemv import fp8_silu_gemv, gemv
            from aserve.layers.tickets import split_tickets
            from aserve.quant import fp8_cuda

            self._quantize_tokens = fp8_cuda.quantize_tokens
            self._one_row = gemv
            self._silu_one_row = fp8_silu_gemv
            self._few_rows = fp8_cuda.few_rows
            self._token_scaled = fp8_cuda.token_scaled
            split_tickets(device)  # now, not inside a CUDA graph's capture
            if self.aligned and self.shape[1] <= 16384:
                self._silu_fp8 = fp8_cuda.silu_fp8
                self._silu_fp8_min_rows = fp8_cuda.SILU_FP8_MIN_ROWS
            capability = gpu_capability(device)
            assert capability is not None
            self._choose = partial(
                fp8_cuda.token_scaled_config, shared_memory=shared_memory_limit(capability)
            )
            self._row_scales = self.scales.reshape(-1)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def silu(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor | None:
        """SiLU(gate) * up of this gate|up weight's product with `x` in one kernel, or None
        where there is none (the caller multiplies, then activates): one row `x` in the
        one-row kernel; FP8 activations of 2 to `FEW_ROWS_MAX` rows in `token_scaled`,
        whose activation the down projection's `few_rows` then takes as it takes the
        activation kernel's (from 17 rows that kernel writes FP8, `silu_fp8`)."""
        if isinstance(x, Fp8Activations):
            rows = x.values.shape[0]
            if self._token_scaled is None or self._choose is None or rows > FEW_ROWS_MAX:
                return None
            config = self._choose(rows, *self.shape)
            if config is None or config[3] != 1:  # split over K
                return None
            return self._token_scaled(
                x.values, x.scales, self.values, self._row_scales, None, x.dtype, config, True
            )
        if self._silu_one_row is None or x.shape[0] != 1:
            return None
        return self._silu_one_row(x, self.values, self.scales)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """The product of SiLU(gate) * up for fused gate|up rows with one kernel fewer, or
        None where there is none: one row in one kernel (the GEMV computes the activation
        as it reads it), many with the activation written in FP8 (`fp8_cuda.silu_fp8`)."""
        rows = gate_up.shape[0]
        if self._one_row is not None and rows == 1:
            return self._one_row(gate_up, self.values, None, gated=True, scales=self.scales)
        if self._silu_fp8 is not None and rows >= self._silu_fp8_min_rows:
            return self.linear(self._silu_fp8(gate_up), None)
        return None

    def linear(self, x: torch.Tensor | Fp8Activations, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Fp8Activations):  # only aligned weights take them (method.py)
            assert self.aligned
            values, scales, dtype = x.values, x.scales, x.dtype
        else:
            rows = x.reshape(-1, x.shape[-1])
            if self._one_row is not None and rows.shape[0] == 1:
                out = self._one_row(rows, self.values, bias, scales=self.scales)
                return out.reshape(*x.shape[:-1], self.shape[0])
            if self._few_rows is not None and rows.shape[0] <= FEW_ROWS_MAX:
                out = self._few_rows(rows, self.values, self._row_scales, bias)
                return out.reshape(*x.shape[:-1], self.shape[0])
            if not self.aligned:
                weight = self.values.to(x.dtype) * self.scales.t().to(x.dtype)
                return torch.nn.functional.linear(x, weight, bias)
            values, scales = self._quantize_tokens(rows)
            dtype = x.dtype
        config = None
        if self._choose is not None:
            config = self._choose(values.shape[0], self.shape[0], self.shape[1])
        if config is not None and self._token_scaled is not None:
            out = self._token_scaled(
                values, scales, self.values, self._row_scales, bias, dtype, config
            )
        else:
            out = torch._scaled_mm(
                values,
                self.values.t(),
                scale_a=scales,
                scale_b=self.scales,
                bias=None if bias is None else bias.to(dtype),
                out_dtype=dtype,
                use_fast_accum=True,
            )
        return out if isinstance(x, Fp8Activations) else out.reshape(*x.shape[:-1], -1)
