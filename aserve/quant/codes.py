"""Group-quantized weights in one common form: integer codes with a scale and an offset per
group of consecutive inputs, `w = code * scale + offset`.

Every GGUF block format that aserve runs decodes into this form exactly (aserve/quant/gguf.py),
and every matmul backend packs from it (aserve/quant/cpu.py), so formats and kernels meet in
one place instead of each pair needing its own code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Codes(NamedTuple):
    """A `[rows, cols]` weight: `codes` uint8 `[rows, cols]` (each below 2**bits), and
    float32 `scales` / `offsets` `[rows, cols // group]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.shape
        grouped = self.codes.view(rows, cols // self.group, self.group).to(torch.float32)
        weight = grouped * self.scales[..., None] + self.offsets[..., None]
        return weight.view(rows, cols).to(dtype)

    def pad_rows(self, rows: int) -> Codes:
        """Zero rows (weights of 0) appended up to `rows`."""
        missing = rows - self.shape[0]
        if missing <= 0:
            return self
        zeros = Codes(
            self.codes.new_zeros(missing, self.shape[1]),
            self.scales.new_zeros(missing, self.scales.shape[1]),
            self.offsets.new_zeros(missing, self.offsets.shape[1]),
            self.group,
            self.bits,
        )
        return Codes.concat_rows([self, zeros])

    def signed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes as int8 and the offsets that keep `w`: 8-bit codes 0..255 become
        -128..127 and the offset takes the difference; narrower codes fit as they are."""
        if self.bits < 8:
            return self.codes.to(torch.int8), self.offsets
        shifted = (self.codes.to(torch.int16) - 128).to(torch.int8)
        return shifted, self.offsets + 128 * self.scales

    @staticmethod
    def concat_rows(parts: list[Codes]) -> Codes:
        """Stack weights of one format (a fused projection's shards) into one."""
        first = parts[0]
        if any((p.group, p.bits) != (first.group, first.bits) for p in parts):
            raise ValueError("only weights of one group size and width stack")
        return Codes(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.offsets for p in parts]),
            first.group,
            first.bits,
        )


def quantize(weight: torch.Tensor, bits: int, group: int = 32) -> Codes:
    """A float `[rows, cols]` weight in groups of `group` inputs (`--quantization int4|int8`
    on a float checkpoint). 8 bits: symmetric, scale max|w| / 127, as Q8_0; 4 bits: from the
    group's minimum in 15 steps to its maximum, as Q4_1. Works on the weight's device, one
    matrix at a time, so a checkpoint never needs its float copy whole."""
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    if cols % group:
        raise ValueError(f"{cols} inputs do not split into groups of {group}")
    grouped = weight.float().view(rows, cols // group, group)
    if bits == 8:
        scales = grouped.abs().amax(-1) / 127
        steps = grouped / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        codes = (steps.round().clamp(-127, 127) + 128).to(torch.uint8)
        return Codes(codes.view(rows, cols), scales, -128 * scales, group, 8)
    if bits == 4:
        low, high = grouped.amin(-1), grouped.amax(-1)
        scales = (high - low) / 15
        steps = (grouped - low[..., None]) / scales.clamp_min(torch.finfo(torch.float32).tiny)[
            ..., None
        ]
        codes = steps.round().clamp(0, 15).to(torch.uint8)
        return Codes(codes.view(rows, cols), scales, low, group, 4)
    raise ValueError(f"weights quantize to 4 or 8 bits, not {bits}")


def groups_of_at_most_32(codes: Codes) -> Codes:
    """Groups wider than 32 (no GGUF format has them) split into groups of 32 that repeat
    the scale and offset."""
    if codes.group <= 32:
        return codes
    repeat = codes.group // 32
    return Codes(
        codes.codes,
        codes.scales.repeat_interleave(repeat, 1),
        codes.offsets.repeat_interleave(repeat, 1),
        32,
        codes.bits,
    )
