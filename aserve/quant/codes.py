"""Group-quantized weights in one common form: integer codes with a scale and an offset per
group of consecutive inputs, `w = code * scale + offset` (or `table[code] * scale + offset`
for formats whose levels are not evenly spaced).

Every GGUF block format that aserve runs decodes into this form exactly (aserve/quant/gguf.py),
and every matmul backend packs from it (aserve/quant/cpu.py), so formats and kernels meet in
one place instead of each pair needing its own code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch


class ScaleSteps(NamedTuple):
    """Scales (and offsets) that GGUF stores as a float16 a block of groups times a small
    integer a group (K-quants, IQ4_XS): `scales == scale_steps * scale_bases` exactly, each
    base repeated over its block's groups (likewise the offsets, where stored this way). The
    CPU kernels keep the int8 steps and the bases, not float32 scales: a one-row product is
    bound by reading the weight, and float32 took 4 bytes a group for each."""

    scale_steps: torch.Tensor  # int8 [rows, groups]
    scale_bases: torch.Tensor  # float32 [rows, blocks]
    offset_steps: torch.Tensor | None = None
    offset_bases: torch.Tensor | None = None

    def map_rows(self, change: Callable[[torch.Tensor], torch.Tensor]) -> ScaleSteps:
        """Every tensor changed alike along its rows (a slice, a padding, a join)."""
        return ScaleSteps(*(None if t is None else change(t) for t in self))

    @staticmethod
    def join(parts: list[ScaleSteps | None], cat: Callable[..., torch.Tensor]) -> ScaleSteps | None:
        """The parts' tensors joined by `cat` (a list of tensors -> one), or None unless every
        part has steps of one layout."""
        first = parts[0]
        if first is None or any(
            p is None
            or p.scale_bases.shape[1] != first.scale_bases.shape[1]
            or (p.offset_steps is None) != (first.offset_steps is None)
            for p in parts
        ):
            return None
        fields = zip(*parts, strict=True)
        return ScaleSteps(*(None if f[0] is None else cat(list(f)) for f in fields))


class Runs(NamedTuple):
    """The codes of a format that picks each run of 8 inputs from a fixed book of patterns
    (llama.cpp's IQ1, IQ2 and IQ3_XXS formats: grid indices and signs a run), as the file
    keeps them: `entries` int32 `[rows, cols // 8]`, each below 2**entry_bits, with
    `codes_of(entries)` (`[...]` -> uint8 `[..., 8]`) the codes they stand for. The CPU kernels
    keep an entry in 16 or 24 bits where codes would take 24 or 32 (csrc/cpu_kernels.cpp,
    `widen_book`), and read the book as `kernel_book`: the format's 16 level bytes, an int32
    `entry_bits`, then for 16-bit entries each pattern as one word of 8 nibble codes (input i
    in bits 4i..4i+3), for 24-bit ones (16 bits of a positive pattern, then 8 of signs) the
    65,536 patterns' words and 256 words of the nibbles to flip."""

    entries: torch.Tensor
    codes_of: Callable[[torch.Tensor], torch.Tensor]
    kernel_book: torch.Tensor
    entry_bits: int

    def map_rows(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Runs:
        return self._replace(entries=change(self.entries))

    @property
    def entry_limit(self) -> int:
        """One past the largest entry the kernels' book takes (they read it unchecked)."""
        return (self.kernel_book.numel() - 20) // 4 if self.entry_bits == 16 else 1 << 24

    @staticmethod
    def join(parts: list[Runs | None], cat: Callable[..., torch.Tensor]) -> Runs | None:
        """The parts' entries joined by `cat`, or None unless all share one book."""
        first = parts[0]
        if first is None or any(p is None or p.kernel_book is not first.kernel_book for p in parts):
            return None
        return first._replace(entries=cat([p.entries for p in parts if p is not None]))


class Codes(NamedTuple):
    """A `[rows, cols]` weight: `codes` uint8 `[rows, cols]` (each below 2**bits), and
    float32 `scales` / `offsets` `[rows, cols // group]`. With a `table` (float32, 2**bits
    levels) a code stands for its level instead of itself: IQ4_NL and IQ4_XS keep 16 levels
    that are denser near zero, which no scale and offset can map codes onto."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    bits: int
    table: torch.Tensor | None = None
    steps: ScaleSteps | None = None
    runs: Runs | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.shape
        grouped = self.levels().view(rows, cols // self.group, self.group)
        weight = grouped * self.scales[..., None] + self.offsets[..., None]
        return weight.view(rows, cols).to(dtype)

    def pad_rows(self, rows: int) -> Codes:
        """Zero rows (weights of 0) appended up to `rows`."""
        missing = rows - self.shape[0]
        if missing <= 0:
            return self
        codes = self.codes.new_zeros(missing, self.shape[1])
        if self.runs is not None:  # entry 0's pattern (under scales of zero)
            codes = self.runs.codes_of(torch.zeros(missing, self.shape[1] // 8, dtype=torch.long))
            codes = codes.view(missing, self.shape[1])
        zeros = Codes(
            codes,
            self.scales.new_zeros(missing, self.scales.shape[1]),
            self.offsets.new_zeros(missing, self.offsets.shape[1]),
            self.group,
            self.bits,
            self.table,
            None
            if self.steps is None
            else self.steps.map_rows(lambda t: t.new_zeros(missing, t.shape[1])),
            None
            if self.runs is None
            else self.runs.map_rows(lambda t: t.new_zeros(missing, t.shape[1])),
        )
        return Codes.concat_rows([self, zeros])

    def levels(self) -> torch.Tensor:
        """What each code stands for, as float32: the code itself, or its level in the table."""
        if self.table is None:
            return self.codes.to(torch.float32)
        return self.table[self.codes.long()]

    def packs_with(self, other: Codes) -> bool:
        """Whether the two stack into one weight: same groups, width and levels."""
        if (self.group, self.bits) != (other.group, other.bits):
            return False
        if self.table is None or other.table is None:
            return self.table is other.table
        return torch.equal(self.table, other.table)

    def centered(self) -> Codes:
        """Where every offset is -2**(bits - 1) times its scale (Q3_K, Q4_0, Q5_0, Q6_K), the
        same weight with codes standing for code - 2**(bits - 1) (a table) and no offsets:
        the CPU kernels then neither read offsets nor add their term. One-row products are
        bound by reading the weight, and Q4_0 takes 18 bytes a group of 32 instead of 20.
        Codes of up to 4 bits get a table of 16 levels, the kernels' one size."""
        center = 1 << (self.bits - 1)
        if self.table is not None or self.bits == 8:
            return self
        if not torch.equal(self.offsets, -center * self.scales):
            return self
        table = torch.arange(max(16, 1 << self.bits), dtype=torch.float32) - center
        zeros = torch.zeros_like(self.offsets)
        steps = (
            None
            if self.steps is None
            else self.steps._replace(offset_steps=None, offset_bases=None)
        )
        return Codes(self.codes, self.scales, zeros, self.group, self.bits, table, steps)

    def signed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes as int8 and the offsets that keep `w`: 8-bit codes 0..255 become
        -128..127 and the offset takes the difference; narrower codes fit as they are."""
        if self.bits < 8:
            return self.codes.to(torch.int8), self.offsets
        shifted = (self.codes.to(torch.int16) - 128).to(torch.int8)
        return shifted, self.offsets + 128 * self.scales

    def split_rows(self, count: int) -> list[Codes]:
        """`count` weights of equal rows (a MoE part decoded for every expert at once), as
        views."""
        rows = self.shape[0] // count
        return [
            Codes(
                self.codes[i * rows : (i + 1) * rows],
                self.scales[i * rows : (i + 1) * rows],
                self.offsets[i * rows : (i + 1) * rows],
                self.group,
                self.bits,
                self.table,
                None
                if self.steps is None
                else self.steps.map_rows(lambda t, i=i: t[i * rows : (i + 1) * rows]),
                None
                if self.runs is None
                else self.runs.map_rows(lambda t, i=i: t[i * rows : (i + 1) * rows]),
            )
            for i in range(count)
        ]

    def interleave_blocks(self, other: Codes, count: int) -> Codes:
        """Both weights cut into `count` blocks of rows, joined block by block: a MoE's gate
        rows and up rows of every expert into each expert's gate rows then up rows."""
        if not self.packs_with(other):
            raise ValueError("only weights of one group size, width and levels join")

        def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            joined = torch.cat([a.view(count, -1, a.shape[1]), b.view(count, -1, b.shape[1])], 1)
            return joined.view(-1, a.shape[1])

        return Codes(
            join(self.codes, other.codes),
            join(self.scales, other.scales),
            join(self.offsets, other.offsets),
            self.group,
            self.bits,
            self.table,
            ScaleSteps.join([self.steps, other.steps], lambda pair: join(*pair)),
            Runs.join([self.runs, other.runs], lambda pair: join(*pair)),
        )

    @staticmethod
    def concat_rows(parts: list[Codes]) -> Codes:
        """Stack weights of one format (a fused projection's shards) into one."""
        first = parts[0]
        if not all(first.packs_with(p) for p in parts):
            raise ValueError("only weights of one group size, width and levels stack")
        return Codes(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.offsets for p in parts]),
            first.group,
            first.bits,
            first.table,
            ScaleSteps.join([p.steps for p in parts], torch.cat),
            Runs.join([p.runs for p in parts], torch.cat),
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


@functools.cache
def split_book(kernel_book: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A `Runs.kernel_book` as two or three small tables whose words XOR to an entry's word
    of 8 nibble codes, for CUDA (quant/cuda.py): `(tables, low_bits, signs_at)`. The word of
    entry e is `tables[p & (2**low_bits - 1)] ^ tables[2**low_bits + (p >> low_bits)]`, p its
    low 16 bits, and for 24-bit entries also `^ tables[signs_at + (e >> 16)]` (signs_at is 0
    for 16-bit ones). Every format's book splits so (a grid index and a sign index, or two
    grid bytes): a few KiB that stay in the SMs' caches, where the whole book's 256 KiB
    would be gathered from L2. The split taken is the smallest that holds for every
    pattern, checked here. Once per book (books are shared: `iquants.runs_book`)."""
    entry_bits = int(kernel_book[16:20].view(torch.int32))
    words = kernel_book[20:].view(torch.int32)
    patterns = words
    if entry_bits == 24:  # patterns padded to 65,536 with words of 0, which none has (its
        # codes are of positive levels, 4 and up), then 256 words of signs
        used = int(words[: 1 << 16].nonzero().max()) + 1
        patterns = words[: 1 << (used - 1).bit_length()]
    span = max(1, (len(patterns) - 1).bit_length())
    index = torch.arange(len(patterns))
    best: tuple[int, torch.Tensor] | None = None
    for low_bits in range(1, span + 1):
        low = patterns[: 1 << low_bits]
        starts = (torch.arange(1 << (span - low_bits)) << low_bits).clamp(max=len(patterns) - 1)
        high = patterns[starts] ^ patterns[0]
        rebuilt = low[index & ((1 << low_bits) - 1)] ^ high[index >> low_bits]
        if torch.equal(rebuilt, patterns) and (best is None or len(low) + len(high) < len(best[1])):
            best = (low_bits, torch.cat([low, high]))
    assert best is not None  # one table of every pattern always splits
    low_bits, tables = best
    if entry_bits == 16:
        return tables, low_bits, 0
    return torch.cat([tables, words[1 << 16 :]]), low_bits, len(tables)


def split_book_codes(split: tuple[torch.Tensor, int, int], entries: torch.Tensor) -> torch.Tensor:
    """The 8 codes `[..., 8]` of each of `entries` (int64) through `split_book`'s tables, as
    the CUDA kernels look them up (quant/cuda.py's `book_words`)."""
    tables, low_bits, signs_at = split
    pattern = entries & 0xFFFF
    words = (
        tables[pattern & ((1 << low_bits) - 1)] ^ tables[(1 << low_bits) + (pattern >> low_bits)]
    )
    if signs_at:
        words = words ^ tables[signs_at + (entries >> 16)]
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    return (words[..., None] >> shifts) & 15


def level_bytes(table: torch.Tensor) -> torch.Tensor:
    """A code table as the CPU and CUDA kernels keep it: 16 integer levels in [-128, 127],
    each as level + 128 in a byte."""
    if table.numel() != 16 or not torch.equal(table, table.round().clamp(-128, 127)):
        raise ValueError("the kernels take 16 integer levels in [-128, 127]")
    return (table.to(torch.int16) + 128).to(torch.uint8)


def groups_of_at_most_32(codes: Codes) -> Codes:
    """Groups wider than 32 (no GGUF format has them) split into groups of 32 that repeat
    the scale and offset (as values: no scale steps)."""
    if codes.group <= 32:
        return codes
    repeat = codes.group // 32
    return Codes(
        codes.codes,
        codes.scales.repeat_interleave(repeat, 1),
        codes.offsets.repeat_interleave(repeat, 1),
        32,
        codes.bits,
        codes.table,
    )
