"""GGUF's block formats, decoded into `Codes` (aserve/quant/codes.py) without loss.

A GGUF tensor of a quantized type is a `[rows, cols]` matrix whose rows are runs of blocks;
each block holds the codes of 32 or 256 consecutive inputs and the scales that turn them into
weights. The layouts follow llama.cpp's ggml-common.h; the decoders here are checked against
the `gguf` package's de-quantization, bit for bit, in tests/test_quant.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from aserve.quant import iquants
from aserve.quant.codes import Codes, ScaleSteps

# Inputs per block and bytes per block.
BLOCKS: dict[QType, tuple[int, int]] = {
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q5_0: (32, 22),
    QType.Q5_1: (32, 24),
    QType.Q8_0: (32, 34),
    QType.Q2_K: (256, 84),
    QType.Q3_K: (256, 110),
    QType.Q4_K: (256, 144),
    QType.Q5_K: (256, 176),
    QType.Q6_K: (256, 210),
    QType.IQ4_NL: (32, 18),
    QType.IQ4_XS: (256, 136),
    QType.MXFP4: (32, 17),
    QType.IQ1_S: (256, 50),
    QType.IQ1_M: (256, 56),
    QType.IQ2_XXS: (256, 66),
    QType.IQ2_XS: (256, 74),
    QType.IQ2_S: (256, 82),
    QType.IQ3_XXS: (256, 98),
    QType.IQ3_S: (256, 110),
}
IQ4_LEVELS = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)
"""The 16 levels of IQ4_NL and IQ4_XS codes (llama.cpp's `kvalues_iq4nl`), denser near 0."""
MXFP4_LEVELS = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32
)
"""MXFP4's codes (an FP4 E2M1 value each: sign, two exponent bits, one mantissa bit) as
twice their values, integers; a block's power-of-two scale is halved to match."""


class UnsupportedFormat(ValueError):
    """A tensor type aserve cannot run; the message names it and what aserve takes."""


@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF tensor still in its blocks: `raw` uint8 `[rows, bytes per row]`. Selecting
    rows or block-aligned columns (a tensor-parallel rank's share) keeps the blocks."""

    raw: torch.Tensor
    qtype: QType
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.raw.shape[0]), self.cols)

    def __getitem__(self, index: slice | tuple[slice, slice]) -> QuantizedTensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        raw = self.raw[rows]
        start, stop, _ = cols.indices(self.cols)
        if (start, stop) == (0, self.cols):
            return QuantizedTensor(raw, self.qtype, self.cols)
        size, nbytes = BLOCKS[self.qtype]
        if start % size or stop % size:
            raise ValueError(f"columns {start}:{stop} split a {self.qtype.name} block of {size}")
        raw = raw[:, start // size * nbytes : stop // size * nbytes]
        return QuantizedTensor(raw, self.qtype, stop - start)

    def permute_rows(self, order: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.raw[order], self.qtype, self.cols)

    def decode(self) -> Codes:
        return decode(self.raw, self.qtype, self.cols)


def quantized_tensor(data: np.ndarray, qtype: QType, rows: int, cols: int) -> QuantizedTensor:
    """A GGUF reader's bytes of a `[rows, cols]` tensor (copied: the reader's are a read-only
    memory map)."""
    if qtype not in BLOCKS:
        raise UnsupportedFormat(
            f"{qtype.name} is not supported; aserve runs {', '.join(q.name for q in BLOCKS)}"
        )
    size, nbytes = BLOCKS[qtype]
    if cols % size:
        raise UnsupportedFormat(f"{cols} columns are not whole {qtype.name} blocks of {size}")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // size * nbytes)
    return QuantizedTensor(torch.from_numpy(raw.copy()), qtype, cols)


def decode(raw: torch.Tensor, qtype: QType, cols: int) -> Codes:
    size, nbytes = BLOCKS[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // size, nbytes)
    codes, scales, offsets, group, bits, *stepped = DECODERS[qtype](blocks)
    groups = cols // group
    runs = None
    if qtype.name in iquants.RUN_FORMATS:
        runs = iquants.runs(qtype.name, stepped[1], rows)

    def per_row(t: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        return t.reshape(rows, width).to(dtype).contiguous()

    steps = None
    if stepped:  # (scale steps, scale bases, offset steps or None, offset bases or None)
        scale_steps, scale_bases, offset_steps, offset_bases = stepped[0]
        blocks_in_row = scale_bases.shape[-1]
        steps = ScaleSteps(
            per_row(scale_steps, groups, torch.int8),
            per_row(scale_bases, blocks_in_row, torch.float32),
            None if offset_steps is None else per_row(offset_steps, groups, torch.int8),
            None if offset_bases is None else per_row(offset_bases, blocks_in_row, torch.float32),
        )
    return Codes(
        codes.reshape(rows, cols).contiguous(),
        scales.reshape(rows, groups).contiguous(),
        offsets.reshape(rows, groups).contiguous(),
        group,
        bits,
        level_table(qtype),
        steps,
        runs,
    )


Steps = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""A super-block format's scales as integers a group and a float16 base a block (and its
offsets likewise, or None): `ScaleSteps` before the reshape to rows."""
Decoded = (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, Steps]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, Steps, torch.Tensor]
)
"""Codes, scales, offsets, group and bits, then scale steps where the format has them, then
`Runs` entries where it has those (iquants.RUN_FORMATS)."""


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte `at` of every block, as float32 `[rows, blocks]`."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low nibbles first, then high ones: a 32-input block of 16 bytes, in input order."""
    return torch.cat([packed & 15, packed >> 4], -1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit i of a little-endian 32-bit field, for i < count, as `[..., count]`."""
    field = qh.to(torch.int64)
    word = field[..., 0] | field[..., 1] << 8 | field[..., 2] << 16 | field[..., 3] << 24
    shifts = torch.arange(count)
    return ((word[..., None] >> shifts) & 1).to(torch.uint8)


def _q4_0(blocks: torch.Tensor) -> Decoded:
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 2:18]), d, -8 * d, 32, 4


def _q4_1(blocks: torch.Tensor) -> Decoded:
    return _nibbles(blocks[..., 4:20]), _half(blocks, 0), _half(blocks, 2), 32, 4


def _q5_0(blocks: torch.Tensor) -> Decoded:
    d = _half(blocks, 0)
    codes = _nibbles(blocks[..., 6:22]) | _high_bits(blocks[..., 2:6], 32) << 4
    return codes, d, -16 * d, 32, 5


def _q5_1(blocks: torch.Tensor) -> Decoded:
    codes = _nibbles(blocks[..., 8:24]) | _high_bits(blocks[..., 4:8], 32) << 4
    return codes, _half(blocks, 0), _half(blocks, 2), 32, 5


def _q8_0(blocks: torch.Tensor) -> Decoded:
    d = _half(blocks, 0)
    codes = (blocks[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return codes, d, -128 * d, 32, 8


def _two_bit_runs(qs: torch.Tensor) -> torch.Tensor:
    """64 bytes of a Q2_K / Q3_K super-block as 16 groups of 16: each half of the block is
    32 bytes read four times, two bits further up each time."""
    runs = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    return ((runs >> shifts) & 3).reshape(*qs.shape[:-1], 16, 16)


def _q2_k(blocks: torch.Tensor) -> Decoded:
    packed = blocks[..., 0:16]  # a group's 4-bit scale low, its 4-bit min high
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    steps, mins = (packed & 15).float(), (packed >> 4).float()
    return (
        _two_bit_runs(blocks[..., 16:80]),
        d[..., None] * steps,
        -dmin[..., None] * mins,
        16,
        2,
        (steps, d, mins, -dmin),
    )


def _q3_k(blocks: torch.Tensor) -> Decoded:
    """Codes 0..7 are the stored value plus 4 (the high bit set means no minus 4), and the
    16 signed 6-bit scales keep their low nibbles in bytes 96-103 and two high bits in 104-107."""
    lead = blocks.shape[:-1]
    hmask, packed = blocks[..., 0:32], blocks[..., 96:108]
    high = (hmask[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    codes = _two_bit_runs(blocks[..., 32:96]) | high.reshape(*lead, 16, 16) << 2
    nibbles = (packed[..., None, 0:8] >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 15
    tops = (packed[..., None, 8:12] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    signed = (nibbles.reshape(*lead, 16) | tops.reshape(*lead, 16) << 4).float() - 32
    d = _half(blocks, 108)
    step = d[..., None] * signed
    return codes, step, -4 * step, 16, 3, (signed, d, None, None)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K / Q5_K super-block, from its 12 bytes."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 63, (high & 15) | ((low >> 2) & 48)], -1)
    mins = torch.cat([mid & 63, (high >> 4) | ((mid >> 2) & 48)], -1)
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of a K super-block as 8 groups of 32: byte runs of 32 hold two groups,
    low nibbles the first."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([runs & 15, runs >> 4], -2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(blocks: torch.Tensor) -> Decoded:
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales, mins = _k_scales(blocks[..., 4:16])
    codes = _k_nibbles(blocks[..., 16:144])
    return codes, d[..., None] * scales, -dmin[..., None] * mins, 32, 4, (scales, d, mins, -dmin)


def _q5_k(blocks: torch.Tensor) -> Decoded:
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales, mins = _k_scales(blocks[..., 4:16])
    qh = blocks[..., 16:48]
    high = (qh[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    codes = _k_nibbles(blocks[..., 48:176]) | high << 4
    return codes, d[..., None] * scales, -dmin[..., None] * mins, 32, 5, (scales, d, mins, -dmin)


def _q6_k(blocks: torch.Tensor) -> Decoded:
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = _half(blocks, 208)
    lead = ql.shape[:-1]
    low_runs = ql.reshape(*lead, 2, 1, 64)
    low = torch.cat([low_runs & 15, low_runs >> 4], -2).reshape(*lead, 8, 32)
    high_runs = qh.reshape(*lead, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = ((high_runs >> shifts) & 3).reshape(*lead, 8, 32)
    step = d[..., None] * scales
    return low | high << 4, step, -32 * step, 16, 6, (scales, d, None, None)


def _iq4_nl(blocks: torch.Tensor) -> Decoded:
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 2:18]), d, torch.zeros_like(d), 32, 4


def _iq4_xs(blocks: torch.Tensor) -> Decoded:
    """Eight groups of 32 a super-block, each with a signed 6-bit scale: its low four bits in
    bytes 4-7 (two a byte), its top two in the 16-bit field at bytes 2-3."""
    lead = blocks.shape[:-1]
    nibbles = (blocks[..., 4:8, None] >> torch.tensor([0, 4], dtype=torch.uint8)) & 15
    tops = (blocks[..., 2:4, None] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)) & 3
    signed = (nibbles.reshape(*lead, 8) | tops.reshape(*lead, 8) << 4).float() - 32
    d = _half(blocks, 0)
    scales = d[..., None] * signed
    codes = _nibbles(blocks[..., 8:136].reshape(*lead, 8, 16))
    return codes, scales, torch.zeros_like(scales), 32, 4, (signed, d, None, None)


def _mxfp4(blocks: torch.Tensor) -> Decoded:
    """OCP's MXFP4 as llama.cpp stores it (gpt-oss's experts): an E8M0 exponent byte e (the
    scale 2^(e - 127)), then 16 bytes of FP4 codes, nibbles ordered as IQ4_NL's. With the
    levels doubled (`MXFP4_LEVELS`) the scale is 2^(e - 128), exact in float32."""
    exponents = blocks[..., 0].to(torch.int32) - 128
    d = torch.ldexp(torch.ones(exponents.shape), exponents)
    return _nibbles(blocks[..., 1:17]), d, torch.zeros_like(d), 32, 4


DECODERS: dict[QType, Callable[[torch.Tensor], Decoded]] = {
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q8_0: _q8_0,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
    QType.MXFP4: _mxfp4,
    QType.IQ1_S: iquants.iq1_s,
    QType.IQ1_M: iquants.iq1_m,
    QType.IQ2_XXS: iquants.iq2_xxs,
    QType.IQ2_XS: iquants.iq2_xs,
    QType.IQ2_S: iquants.iq2_s,
    QType.IQ3_XXS: iquants.iq3_xxs,
    QType.IQ3_S: iquants.iq3_s,
}


def level_table(qtype: QType) -> torch.Tensor | None:
    """The levels that a format's codes stand for, or None where a code is its own value."""
    if qtype in (QType.IQ4_NL, QType.IQ4_XS):
        return IQ4_LEVELS
    if qtype == QType.MXFP4:
        return MXFP4_LEVELS
    if qtype.name.startswith("IQ"):
        return iquants.levels(qtype.name)
    return None
