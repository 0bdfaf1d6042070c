"""GGUF's codebook formats (llama.cpp's i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS
and IQ3_S), decoded into `Codes` without loss.

These formats store, for each run of 8 inputs (4 for IQ3), an index into a fixed grid of
patterns, plus signs and a small integer scale a group. The patterns take few distinct
magnitudes (3 in IQ2's grids, 8 in IQ3's, -1 / 0 / 1 in IQ1's, which move each by an eighth),
so every weight is one of at most 16 signed levels times its group's scale: the form
of IQ4's levels, which every product already reads (CPU tiles, CUDA kernels, MoE paths).
In IQ1, IQ2 and IQ3_XXS a run of 8 inputs (grid indices and signs) is an entry of 16 or 24
bits into a book of the patterns they make (`Runs`): the CPU kernels keep those entries
and look the codes up as they multiply, two or three bits an input. IQ3_S's (26 bits) and
every format's on CUDA are codes of 4 bits an input, where the file spends 3.44.

The grids are the `gguf` package's (its de-quantizers' tables, so the two cannot disagree);
tests/test_quant.py checks every format against its de-quantization bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from gguf import quants

from aserve.quant.codes import Runs, level_bytes

LEVEL_COUNT = 16  # the kernels' table size


class Grid(NamedTuple):
    """A format's grid: each entry's inputs as indices (uint8 `[entries, inputs an entry]`)
    into `values`, the grid's distinct values ascending (magnitudes; IQ1's are -1, 0, 1)."""

    indices: torch.Tensor
    values: torch.Tensor


@functools.cache
def grid(quant: type) -> Grid:
    """`quant` (a class of gguf.quants) as a `Grid`, built once."""
    quant.init_grid()
    entries = torch.tensor(quant.grid.reshape(quant.grid_shape))
    values = torch.tensor(quant.grid_map, dtype=torch.float32)
    return Grid(torch.searchsorted(values, entries).to(torch.uint8), values)


def signed_center(count: int) -> int:
    """The code of the smallest positive level of `count` magnitudes: 4 for up to 4, else 8,
    so that the code of -level is the code of level with its low 3 (or 4) bits flipped."""
    return 4 if count <= 4 else 8


def signed_table(magnitudes: torch.Tensor) -> torch.Tensor:
    """Levels -m[-1] .. -m[0], m[0] .. m[-1] around `signed_center`, zeros elsewhere, in the
    kernels' 16."""
    count = magnitudes.numel()
    levels = torch.cat([-magnitudes.flip(0), magnitudes])
    before = signed_center(count) - count
    return torch.nn.functional.pad(levels, (before, LEVEL_COUNT - levels.numel() - before))


def padded_table(levels: tuple[float, ...]) -> torch.Tensor:
    table = torch.tensor(levels, dtype=torch.float32)
    return torch.nn.functional.pad(table, (0, LEVEL_COUNT - table.numel()))


def signed_codes(magnitude: torch.Tensor, negative: torch.Tensor, count: int) -> torch.Tensor:
    """Codes into `signed_table` of `count` magnitudes."""
    center = signed_center(count)
    positive = center + magnitude.long()
    return torch.where(negative, 2 * center - 1 - positive, positive).to(torch.uint8)


def bits_of(fields: torch.Tensor, count: int = 8) -> torch.Tensor:
    """Bit i of each field for i < count, least significant first: bool `[..., count]`."""
    return (fields.long()[..., None] >> torch.arange(count)) & 1 == 1


def little_endian(fields: torch.Tensor) -> torch.Tensor:
    """Bytes `[..., n]` as the unsigned integers they store (n <= 4), int64 `[...]`."""
    shifts = 8 * torch.arange(fields.shape[-1])
    return (fields.long() << shifts).sum(-1)


def parity_signs(index: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS / IQ2_XS / IQ3_XXS signs of 8 inputs: a 7-bit index gives the first seven and
    the eighth makes the count of minus signs even."""
    first = bits_of(index, 7)
    last = first.sum(-1, keepdim=True) % 2 == 1
    return torch.cat([first, last], -1)


def base(blocks: torch.Tensor) -> torch.Tensor:
    """The float16 scale that every block of these formats but IQ1_M starts with, as float32."""
    return blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """4-bit fields two to a byte, low nibble first, as int64 `[..., 2 * bytes]`."""
    fields = (packed.long()[..., None] >> torch.tensor([0, 4])) & 15
    return fields.reshape(*packed.shape[:-1], -1)


Steps = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
Decoded = (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, Steps]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, Steps, torch.Tensor]
)
"""gguf.py's decoded form: with scale steps, and `Runs` entries in RUN_FORMATS."""


def odd_steps(
    codes: torch.Tensor,
    steps: torch.Tensor,
    block_scale: torch.Tensor,
    group: int,
    bits: int,
    entries: torch.Tensor | None = None,
) -> Decoded:
    """Codes with a scale `steps * block_scale` a group (steps odd integers) and no offsets,
    in gguf.py's decoded form (with their `Runs` entries, where the format has them)."""
    scales = steps.float() * block_scale[..., None]
    lead = codes.shape[:-2]
    decoded = (
        codes.reshape(*lead, -1, group),
        scales,
        torch.zeros_like(scales),
        group,
        bits,
        (steps.float(), block_scale, None, None),
    )
    return decoded if entries is None else (*decoded, entries)


def iq2_book(quant: type, index_bits: int) -> torch.Tensor:
    """Every IQ2_XXS / IQ2_XS entry's codes: a grid index, then a 7-bit sign index."""
    entries = torch.arange(1 << (index_bits + 7))
    magnitude = grid(quant).indices[entries & ((1 << index_bits) - 1)]
    return signed_codes(magnitude, parity_signs(entries >> index_bits), 3)


def iq1_book(quant: type) -> torch.Tensor:
    """Every IQ1 entry's codes: an 11-bit grid index, then the sign of the run's eighth."""
    entries = torch.arange(1 << 12)
    values = grid(quant).indices[entries & 2047]
    return one_bit_codes(values, (entries >> 11 == 1)[:, None])


def nibble_words(codes: torch.Tensor) -> torch.Tensor:
    """Codes `[n, k]` (k <= 8, each under 16) as int32 words, code i in bits 4i..4i+3."""
    words = (codes.long() << (4 * torch.arange(codes.shape[1]))).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class RunsBook(NamedTuple):
    """A format's book: what `Runs` takes besides the entries."""

    codes_of: Callable[[torch.Tensor], torch.Tensor]
    kernel_book: torch.Tensor
    entry_bits: int


def whole_book(name: str, book: torch.Tensor) -> RunsBook:
    """A book of every pattern, `book[entry]`, for entries of 16 bits."""
    header = torch.tensor([16], dtype=torch.int32).view(torch.uint8)
    kernel_book = torch.cat(
        [level_bytes(levels(name)), header, nibble_words(book).view(torch.uint8)]
    )
    return RunsBook(lambda entries: book[entries.long()], kernel_book, 16)


def signed_book(name: str, patterns: torch.Tensor, negative: torch.Tensor) -> RunsBook:
    """24-bit entries: 16 bits of a pattern of 8 inputs' positive codes (`patterns`, uint8
    `[up to 65536, 8]`), then 8 bits that index `negative` (bool `[256, 8]`), the inputs whose
    levels are negated. Signed levels are symmetric around the middle of the codes
    (`signed_codes`), so negating a level flips its code's low bits: the kernels look the
    pattern up in a book of 65,536 words (256 KiB, where the signs in it would take 32 MiB
    for IQ3_XXS) and flip the negative inputs' codes with a word of 256."""
    flip = 2 * signed_center(len(grid(getattr(quants, name)).values)) - 1
    patterns = torch.nn.functional.pad(patterns, (0, 0, 0, (1 << 16) - len(patterns)))

    def codes_of(entries: torch.Tensor) -> torch.Tensor:
        entries = entries.long()
        pattern = patterns[entries & 0xFFFF]
        return torch.where(negative[(entries >> 16) & 255], flip - pattern, pattern)

    header = torch.tensor([24], dtype=torch.int32)
    parts = [header, nibble_words(patterns), nibble_words(negative.long() * flip)]
    kernel_book = torch.cat([level_bytes(levels(name)), *(t.view(torch.uint8) for t in parts)])
    return RunsBook(codes_of, kernel_book, 24)


def iq3_xxs_book() -> RunsBook:
    """IQ3_XXS's entries: two grid bytes (4 inputs' magnitudes each), then a 7-bit sign index
    (the eighth bit of the 8 unused)."""
    positive = signed_center(8) + grid(quants.IQ3_XXS).indices  # uint8 [256, 4]
    pairs = torch.arange(1 << 16)
    patterns = torch.cat([positive[pairs & 255], positive[pairs >> 8]], -1)
    return signed_book("IQ3_XXS", patterns, parity_signs(torch.arange(256) & 127))


def iq2_s_book() -> RunsBook:
    """IQ2_S's entries: a 10-bit grid index, then a sign bit an input."""
    positive = signed_center(3) + grid(quants.IQ2_S).indices  # uint8 [1024, 8]
    return signed_book("IQ2_S", positive, bits_of(torch.arange(256)))


@functools.cache
def runs_book(name: str) -> RunsBook:
    """Format `name`'s book, built once and shared by every weight of the format."""
    if name == "IQ2_XXS":
        return whole_book(name, iq2_book(quants.IQ2_XXS, 8))
    if name == "IQ2_XS":
        return whole_book(name, iq2_book(quants.IQ2_XS, 9))
    if name == "IQ3_XXS":
        return iq3_xxs_book()
    if name == "IQ2_S":
        return iq2_s_book()
    return whole_book(name, iq1_book(getattr(quants, name)))


RUN_FORMATS = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS")
"""Formats whose runs of 8 inputs are entries of a book (`runs`)."""


def runs(name: str, entries: torch.Tensor, rows: int) -> Runs:
    """A weight's `Runs` from its decoder's entries (`rows` of them, in input order)."""
    book = runs_book(name)
    return Runs(entries.reshape(rows, -1).to(torch.int32).contiguous(), *book)


def iq2_xxs(blocks: torch.Tensor) -> Decoded:
    """Eight groups of 32, each four grid bytes then a 32-bit word of four 7-bit sign
    indices (bits 0, 7, 14, 21) and a 4-bit scale s (bits 28-31): d * (s + 1/2) / 4."""
    lead = blocks.shape[:-1]
    fields = blocks[..., 2:66].reshape(*lead, 8, 2, 4)
    word = little_endian(fields[..., 1, :])
    signs = (word[..., None] >> torch.tensor([0, 7, 14, 21])) & 127
    entries = fields[..., 0, :].long() | signs << 8
    codes = runs_book("IQ2_XXS").codes_of(entries)
    return odd_steps(codes, 2 * (word >> 28) + 1, base(blocks) / 8, 32, 3, entries)


def iq2_xs(blocks: torch.Tensor) -> Decoded:
    """32 16-bit fields, each a 9-bit grid index and a 7-bit sign index, then a 4-bit scale
    for each 16 inputs: d * (s + 1/2) / 4."""
    lead = blocks.shape[:-1]
    entries = little_endian(blocks[..., 2:66].reshape(*lead, 32, 2))
    codes = runs_book("IQ2_XS").codes_of(entries)
    steps = 2 * nibbles(blocks[..., 66:74]) + 1
    return odd_steps(codes, steps, base(blocks) / 8, 16, 3, entries)


def iq2_s(blocks: torch.Tensor) -> Decoded:
    """32 grid indices of 10 bits (low bytes, then their high two bits four to a byte), a
    sign bit an input, and a 4-bit scale for each 16 inputs: d * (s + 1/2) / 4."""
    lead = blocks.shape[:-1]
    high = (blocks[..., 66:74, None].long() >> torch.tensor([0, 2, 4, 6])) & 3
    indices = blocks[..., 2:34].long() | high.reshape(*lead, 32) << 8
    entries = indices | blocks[..., 34:66].long() << 16
    codes = runs_book("IQ2_S").codes_of(entries)
    steps = 2 * nibbles(blocks[..., 74:82]) + 1
    return odd_steps(codes, steps, base(blocks) / 8, 16, 3, entries)


def iq3_xxs(blocks: torch.Tensor) -> Decoded:
    """64 grid bytes of four inputs each, then a 32-bit word a group of 32 as in IQ2_XXS
    (four sign indices of 8 inputs and a scale): d * (s + 1/2) / 2."""
    lead = blocks.shape[:-1]
    word = little_endian(blocks[..., 66:98].reshape(*lead, 8, 4))
    signs = ((word[..., None] >> torch.tensor([0, 7, 14, 21])) & 127).reshape(*lead, 32)
    entries = little_endian(blocks[..., 2:66].reshape(*lead, 32, 2)) | signs << 16
    codes = runs_book("IQ3_XXS").codes_of(entries)
    return odd_steps(codes, 2 * (word >> 28) + 1, base(blocks) / 4, 32, 4, entries)


def iq3_s(blocks: torch.Tensor) -> Decoded:
    """64 grid indices of 9 bits (low bytes, then a high bit each), a sign bit an input and a
    4-bit scale a group of 32: d * (2s + 1)."""
    lead = blocks.shape[:-1]
    high = bits_of(blocks[..., 66:74]).reshape(*lead, 64).long()
    magnitude = grid(quants.IQ3_S).indices[blocks[..., 2:66].long() | high << 8]
    negative = bits_of(blocks[..., 74:106]).reshape(*lead, 64, 4)
    codes = signed_codes(magnitude, negative, 8)
    steps = 2 * nibbles(blocks[..., 106:110]) + 1
    return odd_steps(codes, steps, base(blocks), 32, 4)


ONE_BIT_LEVELS = (-9.0, -7.0, -1.0, 1.0, 7.0, 9.0)
"""IQ1's weights over an eighth of their scale: grid values -1, 0, 1 each plus or minus 1/8."""


def one_bit_codes(values: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """Codes into ONE_BIT_LEVELS of grid value codes 0, 1, 2 (for -1, 0, 1) whose eighth is
    taken off (`minus`) or added."""
    return (2 * values.long() + (~minus).long()).to(torch.uint8)


def iq1_s(blocks: torch.Tensor) -> Decoded:
    """32 grid indices of 11 bits (low bytes, then a 16-bit field a group of 32 holding four
    high parts of 3 bits, a 3-bit scale s and the sign of an eighth that every weight of the
    group is moved by): d * (2s + 1) * (v +- 1/8) for grid values v of -1, 0, 1."""
    lead = blocks.shape[:-1]
    word = little_endian(blocks[..., 34:50].reshape(*lead, 8, 2))
    high = (word[..., None] >> torch.tensor([0, 3, 6, 9])) & 7
    indices = blocks[..., 2:34].long().reshape(*lead, 8, 4) | high << 8
    entries = indices | (word >> 15)[..., None] << 11
    codes = runs_book("IQ1_S").codes_of(entries)
    steps = 2 * ((word >> 12) & 7) + 1
    return odd_steps(codes, steps, base(blocks) / 8, 32, 3, entries)


def iq1_m(blocks: torch.Tensor) -> Decoded:
    """32 grid indices of 11 bits (low bytes, then a nibble each: 3 high bits and the sign of
    its 8 inputs' eighth), a 3-bit scale s for each 16 inputs in four 16-bit fields whose top
    nibbles hold the block's float16 d: d * (2s + 1) * (v +- 1/8)."""
    lead = blocks.shape[:-1]
    high = nibbles(blocks[..., 32:48])
    entries = blocks[..., 0:32].long() | high << 8  # (the nibble's top bit: the eighth's sign)
    codes = runs_book("IQ1_M").codes_of(entries)
    fields = little_endian(blocks[..., 48:56].reshape(*lead, 4, 2))
    d_bits = ((fields >> 12) << torch.tensor([0, 4, 8, 12])).sum(-1)
    d = d_bits.to(torch.int16).view(torch.float16).float()  # the cast keeps the low 16 bits
    steps = 2 * ((fields[..., None] >> torch.tensor([0, 3, 6, 9])) & 7).reshape(*lead, 16) + 1
    return odd_steps(codes, steps, d / 8, 16, 3, entries)


@functools.cache
def levels(name: str) -> torch.Tensor:
    """The 16 levels that the codes of format `name` (e.g. "IQ2_XS") stand for."""
    if name.startswith("IQ1"):
        return padded_table(ONE_BIT_LEVELS)
    return signed_table(grid(getattr(quants, name)).values)
