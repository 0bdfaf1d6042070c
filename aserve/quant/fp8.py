"""FP8 weights (`--quantization fp8`): float8_e4m3fn values with one float32 scale per output
row, multiplied by activations quantized per token as they come (dynamic scales), through
`torch._scaled_mm` (cuBLASLt's FP8 GEMM on Hopper and Ada; a reference implementation on CPU,
which the tests use). Half the bytes of a bf16 weight, which is what decode reads.

A row's scale maps its largest magnitude to 448, the largest finite e4m3 value, so no weight
saturates; an activation row gets the same treatment at every product. Products whose sizes
are not multiples of 16 (what the FP8 GEMM takes) de-quantize the weight instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ALIGN = 16  # the FP8 GEMM's alignment of both weight dimensions


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


def quantize_rows(weight: torch.Tensor) -> Fp8Rows:
    """Per-row (per output channel) scales, the largest magnitude of a row mapped to 448."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    values = (weight / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Rows(values, scales)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[tokens, cols]` in FP8 with one float32 scale per token, `[tokens, 1]`."""
    scales = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    values = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scales


class Fp8Weight:
    """An FP8 weight on its device, multiplied with `torch._scaled_mm`."""

    def __init__(self, rows: Fp8Rows, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = rows.shape
        self.dtype = dtype
        self.values = rows.values.to(device)
        self.scales = rows.scales.to(device, torch.float32)[None, :].contiguous()
        self.aligned = self.shape[0] % ALIGN == 0 and self.shape[1] % ALIGN == 0

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not self.aligned:
            weight = (self.values.to(x.dtype) * self.scales.t().to(x.dtype)).to(x.dtype)
            out = torch.nn.functional.linear(rows, weight, bias)
        else:
            values, scales = quantize_tokens(rows)
            out = torch._scaled_mm(
                values,
                self.values.t(),
                scale_a=scales,
                scale_b=self.scales,
                bias=None if bias is None else bias.to(x.dtype),
                out_dtype=x.dtype,
            )
        return out.reshape(*x.shape[:-1], self.shape[0])
