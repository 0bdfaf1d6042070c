"""Quantized weights on CUDA: Triton products that read the codes as they are.

The weight keeps its integer codes (4-bit two to a byte, or 8-bit) with a scale and offset per
group of 16 or 32 inputs, as on CPU (quant/codes.py); the scales are float16 beside 16-bit
activations (their rounding, 2^-11, is below that of the activations) and float32 beside
float32 ones. Nothing is de-quantized in memory for decode: codes are stored input-major so
that a tile loads along the outputs. In the first tiled kernel (`quantized_gemm`) each group
is one tensor-core dot of activations and codes (small integers, exact in 16 bits) scaled
and offset once per group in float32; in `dequantizing_gemm` each tile of codes becomes
`code * scale + offset` in registers and is the dot's first operand. Few rows split the
groups over several programs, so that a matrix of few output tiles still keeps every SM
reading weights; their float32 partial sums are added in a fixed order (no atomics: the
same batch gives the same bits). One row (a
single stream's decode) takes `gemv` instead, on the CUDA cores, codes widened by integer
operations: on an H200, us for the 8B shape's products with 4-bit codes (best setting a
shape) against the tiled kernel and bf16 cuBLAS, qkv 15.7 / 32.0 / 14.3, o 14.3 / 23.8 /
10.4, gate_up 41.2 / 90.9 / 56.7, down 27.5 / 51.1 / 32.0 (8-bit codes 1.6-1.8x the tiled
kernel, 3-bit 1.8-3.9x; codes that stand for levels, the IQ formats', 1.03-1.25x the plain
4-bit `gemv`, their levels picked by byte permutes). At 0.7-2.8 TB/s of codes
it is bound by instructions, not memory. Codes without levels beside 16-bit activations
take `int_gemv`, whose integer dot products need a third of the instructions: 4-bit codes
qkv 13.0, o 12.6, gate_up 26.0, down 22.1 us, a single stream of a 4-bit 8B model 3.09
ms/token where `gemv` gave 3.82 and bf16 3.89, in 8-bit codes 3.67 where it gave 4.12
(bench/NOTES.md); `int_rows` does the same for 2 rows, the codes read and spread once for
both. From 3 rows to 64 (128 for large weights) 16-bit rows of those codes take
`dequantizing_gemm`, whose dots chain over K with nothing done to their sums a group: on
an H200 the 8B shape's gate_up in 4-bit codes at 16 / 64 rows took 76.8 / 100.9 us where
`quantized_gemm` and the de-quantized slices below took 172.6 / 187.0 (bf16 cuBLAS 60.7 /
62.5: it is bound by the instructions that widen and scale the codes, not by their bytes).
`quantized_gemm` takes float32 rows and codes of levels or book entries up to 16 rows. From
17 rows for those, and past `dequantizing_gemm`'s rows for all, slices of the weight are
de-quantized to the activations' dtype and cuBLAS multiplies them: on an H200 that beat
tiles of 64 rows 2-4x over 17-63 rows (DEQUANTIZE_ROWS). The formats that pick each run
of 8 inputs from a book (IQ1, IQ2, IQ3_XXS) keep the file's entries instead of codes, 2.5-4
bits a weight where 4-bit codes took 5-6: `book_gemv` for one row, `book_dots` for the
tiles, and de-quantized slices spread them into codes in registers (`group_codes`).
Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from aserve.engine.gpu import gpu_capability
from aserve.layers.pdl import launch_next, pdl_options, wait_for_previous, wait_only
from aserve.quant.codes import (
    Codes,
    Runs,
    groups_of_at_most_32,
    level_bytes,
    split_book,
    split_book_codes,
)

GROUPS = (16, 32)
GEMV_ROWS = 1  # one row (a single stream's decode) takes `gemv`
# From this many rows, de-quantize and multiply with cuBLAS: on an H200 the tiles of 64 rows
# took 2-4x its time over 17-63 rows of 4-bit codes (the 8B shape's gate_up at 32 rows
# 753 against 187 us), and tiles of 16 rows still win below (175 against 185 at 16).
DEQUANTIZE_ROWS = 17
DEQUANTIZE_SLICE_BYTES = 64 << 20
BUSY_PROGRAMS = 2 * 132  # programs that keep an H100/H200's SMs reading weights
# Words (four outputs each) a program, warps, pipeline stages and programs to fill: of 36
# settings on the 8B shape's four products (H200, weights past L2), the one best or within
# 10% of the best for 4-, 8- and 3-bit codes on most of them.
GEMV_BLOCK_W, GEMV_WARPS, GEMV_STAGES, GEMV_PROGRAMS = 32, 1, 3, 8 * 132

# `int_gemv`'s words a program (one warp, GEMV_PROGRAMS programs to fill), and over rows
# longer than 8,192 inputs: of 9 settings on the 8B shape's four products (H200, weights
# past L2) the pair that decoded a single int4 stream fastest (3.09 ms/token; 64 words
# everywhere 3.20; bench/NOTES.md).
INT_GEMV_BLOCK_W, INT_GEMV_LONG_ROWS_W = 64, 32
# Rows that `int_rows` takes, up to: on an H200 the 8B shape's four products at 4 rows took
# 146 us in `dequantizing_gemm` against 171 (4-bit codes; 165 against 184 for 8-bit ones),
# at 2 rows 145 against 110.
INT_ROWS = 2
# Rows that `dequantizing_gemm` takes, up to: TILE_ROWS, or WIDE_TILE_ROWS for weights of at
# least WIDE_TILE_CODES codes. At 128 rows of the 8B shape (4-bit codes, H200) its gate_up
# and down took 154 and 81 us against 201 and 108 for de-quantized slices and cuBLAS, qkv and
# o 47 and 33 against 40 and 29; at 256 rows the slices win on all four.
TILE_ROWS, WIDE_TILE_ROWS, WIDE_TILE_CODES = 64, 128, 1 << 25
# `book_gemv`'s outputs a program and warps: of 4 settings on the 8B shape's products in
# IQ2_XXS (H200), best or within 4% of it on each (bench/NOTES.md)
BOOK_BLOCK_N, BOOK_WARPS, BOOK_PROGRAMS = 512, 4, 8 * 132


@triton.jit
def group_codes(
    codes_ptr, levels_ptr, book_ptr, start, cols, N, K, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, FOUR_BIT: tl.constexpr, LEVELS: tl.constexpr, PERMUTE: tl.constexpr,
    LEVEL_ASM: tl.constexpr, LOW_BITS: tl.constexpr, SIGNS_AT: tl.constexpr,
):  # fmt: skip
    """The codes of inputs [start, start + BLOCK_K) for outputs `cols`, `[BLOCK_K, BLOCK_N]`,
    from codes stored input-major (`[K (/ 2), N]`), so that a tile loads along N, coalesced
    (the two inputs of a byte load it twice, from cache), or from book entries (LOW_BITS,
    `book_words`); with LEVELS, the levels they stand for (with PERMUTE by byte permutes,
    `_byte_levels`)."""
    k = start + tl.arange(0, BLOCK_K)
    ok = (k[:, None] < K) & (cols[None, :] < N)
    if FOUR_BIT or LOW_BITS:
        # byte (j, n) holds input 2j of output n in its low nibble and 2j + 1 in its high one
        if LOW_BITS:
            runs = (start // 8 + tl.arange(0, BLOCK_K // 8))[:, None]
            run_ok = (runs < K // 8) & (cols[None, :] < N)
            words = book_words(
                codes_ptr, book_ptr, runs, cols[None, :], run_ok, N, LOW_BITS, SIGNS_AT
            )
            shifts = 8 * (tl.arange(0, 8) // 2)
            packed = (words[:, None, :] >> shifts[None, :, None]) & 255
            packed = tl.reshape(packed, (BLOCK_K, BLOCK_N)).to(tl.uint8)
        else:
            at = codes_ptr + (k[:, None] // 2) * N + cols[None, :]
            packed = tl.load(at, mask=ok, other=0)
        if LEVELS and PERMUTE:
            low, high = _byte_levels(packed, LEVEL_ASM)
            code = tl.where(k[:, None] % 2 == 0, low, high)
        else:
            code = level_of(levels_ptr, (packed >> ((k[:, None] % 2) * 4)) & 15, LEVELS)
    else:
        code = tl.load(codes_ptr + k[:, None] * N + cols[None, :], mask=ok, other=0)
        code = level_of(levels_ptr, code, LEVELS)
    return code


@triton.jit
def book_words(
    entries_ptr, book_ptr, runs, cols, ok, N, LOW_BITS: tl.constexpr, SIGNS_AT: tl.constexpr
):  # fmt: skip
    """The words of 8 nibble codes (input i in bits 4i..4i+3) that the book entries of runs
    `runs` (8 inputs each) and outputs `cols` stand for, shaped as `runs * cols` broadcasts:
    entries are stored as byte planes, `[K / 8 * planes, N]`, a run's low bytes, then its
    high bytes, then for 24-bit entries its sign bytes. The book as `split_book` splits it
    (quant/codes.py, `split_book_codes` its torch twin), a few KiB read from the SMs'
    caches."""
    planes: tl.constexpr = 3 if SIGNS_AT else 2
    at = entries_ptr + runs * (planes * N) + cols
    pattern = tl.load(at, mask=ok, other=0).to(tl.int32)
    pattern |= tl.load(at + N, mask=ok, other=0).to(tl.int32) << 8
    low_mask: tl.constexpr = (1 << LOW_BITS) - 1
    high_at: tl.constexpr = 1 << LOW_BITS
    word = tl.load(book_ptr + (pattern & low_mask))
    word ^= tl.load(book_ptr + high_at + (pattern >> LOW_BITS))
    if SIGNS_AT:
        signs = tl.load(at + 2 * N, mask=ok, other=0).to(tl.int32)
        word ^= tl.load(book_ptr + SIGNS_AT + signs)
    return word


@triton.jit
def book_dots(
    acc, x_rows, rows_ok, entries_ptr, book_ptr, levels_ptr, scales_ptr, offsets_ptr, start,
    cols, N, K, DTYPE: tl.constexpr, PERMUTE: tl.constexpr, LEVEL_ASM: tl.constexpr,
    LOW_BITS: tl.constexpr, SIGNS_AT: tl.constexpr, OFFSETS: tl.constexpr,
    GROUP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`acc` plus the product of the rows at `x_rows` (pointers, `rows_ok` those to read)
    over inputs [start, start + BLOCK_K) with a tile of weights in book entries, `code *
    scale + offset` rounded to DTYPE (as a de-quantized twin holds them): one tensor-core
    dot per position i of a run's 8 inputs, over the tile's BLOCK_K / 8 runs (at least 16),
    of the activations i, i + 8, ... with the runs' levels of nibble i. The runs' words stay
    a `[runs, outputs]` tile: spread into `[inputs, outputs]` they were 2-3x slower than
    4-bit codes (an H200, the 30B-A3B shape's experts)."""
    run_count: tl.constexpr = BLOCK_K // 8
    runs = start // 8 + tl.arange(0, run_count)
    tile_ok = (runs[:, None] < K // 8) & (cols[None, :] < N)
    words = book_words(
        entries_ptr, book_ptr, runs[:, None], cols[None, :], tile_ok, N, LOW_BITS, SIGNS_AT
    )
    groups = (runs * 8) // GROUP  # each run's group
    at = groups[:, None] * N + cols[None, :]
    scale = tl.load(scales_ptr + at, mask=tile_ok, other=0.0).to(tl.float32)
    if OFFSETS:
        offset = tl.load(offsets_ptr + at, mask=tile_ok, other=0.0).to(tl.float32)
    lows = words
    highs = words
    if PERMUTE:
        lows, highs = _word_levels(words, LEVEL_ASM)
    for i in tl.static_range(8):
        if PERMUTE:
            # byte i // 2 of `lows` holds nibble i's level + 128 for even i, of `highs` odd
            if i % 2 == 0:
                level = ((lows >> (8 * (i // 2))) & 255).to(tl.float32) - 128
            else:
                level = ((highs >> (8 * (i // 2))) & 255).to(tl.float32) - 128
        else:
            level = tl.load(levels_ptr + ((words >> (4 * i)) & 15)).to(tl.float32)
        weight = level * scale
        if OFFSETS:
            weight += offset
        x = tl.load(x_rows[:, None] + (runs * 8 + i)[None, :], mask=rows_ok[:, None], other=0.0)
        acc = tl.dot(x, weight.to(DTYPE), acc, input_precision=PRECISION)
    return acc


@triton.jit
def level_of(levels_ptr, code, LEVELS: tl.constexpr):
    """The level a 4-bit code stands for (IQ4_NL / IQ4_XS; 16 values read from cache), or the
    code itself."""
    if LEVELS:  # (one return: Triton wants a function's returns of one type)
        code = tl.load(levels_ptr + code.to(tl.int32))
    return code


# One compile for every row count: each captured batch size would otherwise
# add variants (Triton specializes integers equal to 1 and multiples of 16).
@triton.jit(do_not_specialize=["M"])
def quantized_gemm(
    x_ptr,
    x_sums_ptr,
    codes_ptr,
    levels_ptr,
    book_ptr,
    scales_ptr,
    offsets_ptr,
    y_ptr,
    M,
    N,
    K,
    FOUR_BIT: tl.constexpr,
    LEVELS: tl.constexpr,
    PERMUTE: tl.constexpr,
    LEVEL_ASM: tl.constexpr,
    LOW_BITS: tl.constexpr,
    SIGNS_AT: tl.constexpr,
    OFFSETS: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """y[pid_k] = this program's share of x @ w.T (steps pid_k, pid_k + SPLIT_K, ... of
    GROUPS_PER_STEP groups, a divisor of the groups): per group a tensor-core dot of the
    activations with the codes (small integers, exact in 16 bits), then
    `acc += part * scale + x_sum * offset` in float32, x_sum being the group's sum of x
    (x_sums, computed once per product); without OFFSETS (all zero) only the first term.
    Book entries (LOW_BITS) take `book_dots` over a step of 128 inputs instead. The engine
    launches tiles of 16 rows (from DEQUANTIZE_ROWS slices are de-quantized instead) for
    float32 rows and codes of levels or book entries; 16-bit rows of plain codes take
    `dequantizing_gemm`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    groups = K // GROUP
    step_size: tl.constexpr = GROUP * GROUPS_PER_STEP
    dots: tl.constexpr = LOW_BITS > 0  # book entries take `book_dots`
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(pid_k * step_size, K, step_size * SPLIT_K):
        if dots:
            acc = book_dots(
                acc, x_ptr + rows * K, row_ok, codes_ptr, book_ptr, levels_ptr, scales_ptr,
                offsets_ptr, step, cols, N, K, x_ptr.dtype.element_ty, PERMUTE, LEVEL_ASM,
                LOW_BITS, SIGNS_AT, OFFSETS, GROUP, PRECISION, step_size, BLOCK_N,
            )  # fmt: skip
        for j in tl.static_range(0 if dots else GROUPS_PER_STEP):
            start = step + j * GROUP
            group = start // GROUP
            if FOUR_BIT and GROUP == 32 and not LOW_BITS:
                # each byte loaded once: its low nibbles meet the even inputs, its high ones
                # the odd inputs, in two dots of half a group
                pairs = start // 2 + tl.arange(0, GROUP // 2)
                packed = tl.load(
                    codes_ptr + pairs[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0
                )
                even = x_ptr + rows[:, None] * K + (start + 2 * tl.arange(0, GROUP // 2))[None, :]
                x_even = tl.load(even, mask=row_ok[:, None], other=0.0)
                x_odd = tl.load(even + 1, mask=row_ok[:, None], other=0.0)
                if LEVELS and PERMUTE:
                    even_levels, odd_levels = _byte_levels(packed, LEVEL_ASM)
                    even_codes = even_levels.to(x_even.dtype)
                    odd_codes = odd_levels.to(x_odd.dtype)
                else:
                    even_codes = level_of(levels_ptr, packed & 15, LEVELS).to(x_even.dtype)
                    odd_codes = level_of(levels_ptr, packed >> 4, LEVELS).to(x_odd.dtype)
                part = tl.dot(x_even, even_codes, input_precision=PRECISION)
                part = tl.dot(x_odd, odd_codes, part, input_precision=PRECISION)
            else:
                # (a 4-bit group of 16 would make dots of 8 inputs, under tl.dot's 16)
                k = start + tl.arange(0, GROUP)
                x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None], other=0.0)
                code = group_codes(
                    codes_ptr, levels_ptr, book_ptr, start, cols, N, K, GROUP, BLOCK_N, FOUR_BIT,
                    LEVELS, PERMUTE, LEVEL_ASM, LOW_BITS, SIGNS_AT,
                )  # fmt: skip
                part = tl.dot(x, code.to(x.dtype), input_precision=PRECISION)
            scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
            if OFFSETS:
                at = group * N + cols
                offset = tl.load(offsets_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
                x_sum = tl.load(x_sums_ptr + rows * groups + group, mask=row_ok, other=0.0)
                acc += x_sum[:, None] * offset[None, :]
    tl.store(
        y_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _codes_plus_power(packed, SHIFT: tl.constexpr, MASK: tl.constexpr):
    """The codes `(packed >> SHIFT) & MASK` as float32 values `power + code`, without a
    conversion instruction: each put in the mantissa of 128.0, where bit 16 stands for 1
    (bytes in 256.0's, from bit 15)."""
    at: tl.constexpr = 16 if MASK < 128 else 15
    power: tl.constexpr = 0x43000000 if MASK < 128 else 0x43800000
    bits = (packed.to(tl.int32) << (at - SHIFT)) & (MASK << at)  # (SHIFT is 0 or 4)
    return (bits | power).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_tile(
    codes, scale, offset, GROUPS: tl.constexpr, LINES: tl.constexpr, DTYPE: tl.constexpr
):
    """`codes * scale + offset` (`[GROUPS * LINES, N]`; scale and offset `[GROUPS, N]`, the
    offset less `power * scale` for the codes' `power`) in float32, rounded to DTYPE."""
    n: tl.constexpr = codes.shape[1]
    grouped = tl.reshape(codes, (GROUPS, LINES, n))
    weights = grouped * scale[:, None, :] + offset[:, None, :]
    return tl.reshape(weights, (GROUPS * LINES, n)).to(DTYPE)


# One compile for every row count (see `quantized_gemm`).
@triton.jit(do_not_specialize=["M"])
def dequantizing_gemm(
    x_ptr,
    codes_ptr,
    scales_ptr,
    offsets_ptr,
    y_ptr,
    M,
    N,
    K,
    FOUR_BIT: tl.constexpr,
    OFFSETS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[pid_k] = this program's share of x @ w.T for 16-bit rows and codes without levels:
    each tile of codes `code * scale + offset` in registers, rounded to the rows' dtype as a
    de-quantized twin holds it, and the weight tile the tensor-core dot's first operand
    (its outputs fill the 64-row side, the few rows the narrow one), so the dots chain over
    K with nothing done to the sums a group. `quantized_gemm` scaled its float32 sums after
    every group's dot instead, over tiles of 16 rows: on an H200, 4-bit codes of the 8B
    shape's gate_up at 16 rows took 172.6 us there, 76.8 here (bf16 cuBLAS 60.7): about ten
    instructions a weight, byte loads in the operand's layout and Triton's shuffles among
    them. (A probe widening a word of codes by byte permutes and paired bf16 FMAs in PTX
    took 58-63 us there, 5-10% slower than this at 64 rows; not kept: bench/NOTES.md.)
    Rows past BLOCK_M take further programs (axis 2)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_for_previous(PDL)
    outputs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    output_ok = outputs < N
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    groups: tl.constexpr = BLOCK_K // GROUP
    power: tl.constexpr = 128.0 if FOUR_BIT else 256.0
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for start in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        at = (start // GROUP + tl.arange(0, groups))[:, None] * N + outputs[None, :]
        scale = tl.load(scales_ptr + at, mask=output_ok[None, :], other=0.0).to(tl.float32)
        offset = -power * scale
        if OFFSETS:
            offset += tl.load(offsets_ptr + at, mask=output_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(
            x_ptr + rows[:, None] * K + (start + tl.arange(0, BLOCK_K))[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        if FOUR_BIT:  # byte (j, n): input 2j of output n in its low nibble, 2j + 1 high
            lines = start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                codes_ptr + lines[:, None] * N + outputs[None, :], mask=output_ok[None, :], other=0
            )
            even = _codes_plus_power(packed, 0, 15)
            odd = _codes_plus_power(packed, 4, 15)
            w_even = _scaled_tile(even, scale, offset, groups, GROUP // 2, dtype)
            w_odd = _scaled_tile(odd, scale, offset, groups, GROUP // 2, dtype)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            acc = tl.dot(tl.trans(w_even), tl.trans(x_even), acc)
            acc = tl.dot(tl.trans(w_odd), tl.trans(x_odd), acc)
        else:
            lines = start + tl.arange(0, BLOCK_K)
            codes = tl.load(
                codes_ptr + lines[:, None] * N + outputs[None, :], mask=output_ok[None, :], other=0
            )
            w = _scaled_tile(_codes_plus_power(codes, 0, 255), scale, offset, groups, GROUP, dtype)
            acc = tl.dot(tl.trans(w), tl.trans(x), acc)
    tl.store(
        y_ptr + pid_k * M * N + rows[None, :] * N + outputs[:, None],
        acc.to(y_ptr.dtype.element_ty),
        mask=output_ok[:, None] & row_ok[None, :],
    )


@triton.jit
def _one_plus(words, AT: tl.constexpr, WIDTH: tl.constexpr):
    """The WIDTH-bit fields at bit AT of `words` as floats 1 + field / 2**WIDTH: the field
    moved to the top of a float32 mantissa under the exponent of 1.0, integer operations in
    place of conversions (which an H200 runs at a quarter of the rate, and which bounded a
    first version of `gemv` at 0.7-1.4 TB/s)."""
    top: tl.constexpr = 23 - WIDTH
    if top >= AT:  # noqa: SIM108 (a compile-time branch: each side a shift by a constant)
        moved = words << (top - AT)
    else:
        moved = words >> (AT - top)
    field: tl.constexpr = ((1 << WIDTH) - 1) << top
    return ((moved & field) | 0x3F800000).to(tl.float32, bitcast=True)


# Levels by byte permutes, for each byte of a 32-bit register its two 4-bit codes' levels
# (biased by 128): of the 16 levels (four words of immediates, a byte each), `prmt` picks
# bytes by the low three bits of each selector nibble (its top bit, sign replication, masked
# off): once among levels 0-7, once among 8-15, then per byte by the code's top bit. Twice
# for the register's eight codes, then the low nibbles' levels gathered into one register
# and the high nibbles' into another. Reading the levels from cache a code instead made
# one-row products about 3x slower than plain 4-bit codes (an H200, the 8B shape's).
_LEVEL_PERMUTES = """
{{
.reg .b32 sel, pick, lo, hi, first, second;
and.b32 sel, $2, 0x7777;
and.b32 pick, $2, 0x8888;
shr.b32 pick, pick, 1;
or.b32 pick, pick, 0x3210;
prmt.b32 lo, {0}, {1}, sel;
prmt.b32 hi, {2}, {3}, sel;
prmt.b32 first, lo, hi, pick;
shr.b32 sel, $2, 16;
and.b32 pick, sel, 0x8888;
and.b32 sel, sel, 0x7777;
shr.b32 pick, pick, 1;
or.b32 pick, pick, 0x3210;
prmt.b32 lo, {0}, {1}, sel;
prmt.b32 hi, {2}, {3}, sel;
prmt.b32 second, lo, hi, pick;
prmt.b32 $0, first, second, 0x6420;
prmt.b32 $1, first, second, 0x7531;
}}
"""


def level_permutes(table: torch.Tensor) -> str:
    """`_LEVEL_PERMUTES` for a table of 16 integer levels in [-128, 127] (`level_bytes`): the
    PTX that `_word_levels` and `_byte_levels` run (a constexpr, so each table is one
    compile)."""
    biased = level_bytes(table[:16]).view(torch.int32)
    return _LEVEL_PERMUTES.format(*(f"0x{w & 0xFFFFFFFF:08x}" for w in biased.tolist()))


@triton.jit
def _word_levels(words, LEVEL_ASM: tl.constexpr):
    """Each byte's two codes of int32 `words` as their levels biased by 128: (the low
    nibbles' levels, the high nibbles'), words of four bytes in the byte order of `words`."""
    return tl.inline_asm_elementwise(
        LEVEL_ASM, "=r,=r,r", [words], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
    )


@triton.jit
def _byte_levels(packed, LEVEL_ASM: tl.constexpr):
    """The same for a uint8 tile, four bytes a register: (the low nibbles' levels, the high
    nibbles'), each as float32 levels."""
    low, high = tl.inline_asm_elementwise(
        LEVEL_ASM, "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4
    )
    return low.to(tl.float32) - 128, high.to(tl.float32) - 128


@triton.jit
def _byte_dot(
    words, lows, highs, BYTE: tl.constexpr, x_even, x_odd, x_sum, levels_ptr, FOUR_BIT, LEVELS,
    PERMUTE,
):  # fmt: skip
    """Sum over a group's code lines of x * code for the outputs in byte BYTE of `words`
    (with PERMUTE, their levels biased by 128 in `lows` and `highs`)."""
    at: tl.constexpr = 8 * BYTE
    if LEVELS and PERMUTE:
        # each term is x * (1 + (level + 128) / 256)
        low = _one_plus(lows, at, 8)
        high = _one_plus(highs, at, 8)
        total = tl.sum(x_even[:, None] * low + x_odd[:, None] * high, axis=0)
        dot = 256 * (total - x_sum) - 128 * x_sum
    elif LEVELS:
        low = tl.load(levels_ptr + ((words >> at) & 15)).to(tl.float32)
        high = tl.load(levels_ptr + ((words >> (at + 4)) & 15)).to(tl.float32)
        dot = tl.sum(x_even[:, None] * low + x_odd[:, None] * high, axis=0)
    elif FOUR_BIT:
        low = _one_plus(words, at, 4)
        high = _one_plus(words, at + 4, 4)
        # each term is x * (1 + code / 16): their sum less x_sum is the dot over 16
        dot = 16 * (tl.sum(x_even[:, None] * low + x_odd[:, None] * high, axis=0) - x_sum)
    else:
        dot = 256 * (tl.sum(x_even[:, None] * _one_plus(words, at, 8), axis=0) - x_sum)
    return dot


@triton.jit
def _closed(acc, dot, x_sum, scales_ptr, offsets_ptr, at, ok, OFFSETS: tl.constexpr):
    """`acc` plus a group's part, `scale * dot + offset * x_sum`, for the outputs `at`
    (without OFFSETS, all zero, `scale * dot`)."""
    scale = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
    acc += scale * dot
    if OFFSETS:
        acc += tl.load(offsets_ptr + at, mask=ok, other=0.0).to(tl.float32) * x_sum
    return acc


@triton.jit
def _store_words(y_ptr, cols, ok, acc0, acc1, acc2, acc3):
    """Word column c's four outputs, 4c to 4c + 3, from the four accumulators."""
    y = y_ptr + 4 * cols
    tl.store(y, acc0.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(y + 1, acc1.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(y + 2, acc2.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(y + 3, acc3.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gemv(
    x_ptr,
    words_ptr,
    levels_ptr,
    scales_ptr,
    offsets_ptr,
    y_ptr,
    N,
    K,
    FOUR_BIT: tl.constexpr,
    LEVELS: tl.constexpr,
    PERMUTE: tl.constexpr,
    LEVEL_ASM: tl.constexpr,
    OFFSETS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[pid_k] = this program's share of x @ w.T for one row x (groups pid_k, pid_k +
    SPLIT_K, ...) on the CUDA cores, reading the codes as 32-bit words (four outputs each,
    `[code lines, N / 4]`). A thread holds every code line of a group for its words, so a
    group's dot per output is summed in the thread and scaled once. (`quantized_gemm` pads
    the row to a tensor-core tile of 16 and read about 1 TB/s of codes on an H200.)
    With PDL (layers/pdl.py) the kernel starts while the one before it ends, and lets the
    next one (`sum_splits`, or the next layer's kernel) launch once its programs have read
    their codes, not at their start, where the next product's programs, launched early,
    took the room on the SMs that this one's single-warp programs need. A single 8B stream
    in int4 on an H200: 4.13 ms/token without PDL, 3.82 with it; with the splits' sum taken
    by each tile's last program instead of `sum_splits` (layers/tickets.py), 4.14 without,
    3.89 with, and 4.95 letting the next kernel launch at the start."""
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_only(PDL)
    words_n = N // 4
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # word columns
    ok = cols < words_n
    width: tl.constexpr = GROUP // 2 if FOUR_BIT else GROUP  # code lines of a group
    lines = tl.arange(0, width)
    acc0 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for group in range(pid_k, K // GROUP, SPLIT_K):
        at = group * width + lines
        words = tl.load(
            words_ptr + at[:, None] * words_n + cols[None, :], mask=ok[None, :], other=0
        )
        if FOUR_BIT:
            # line j of the group: input 2j in each byte's low nibble, 2j + 1 in its high one
            x_even = tl.load(x_ptr + group * GROUP + 2 * lines).to(tl.float32)
            x_odd = tl.load(x_ptr + group * GROUP + 2 * lines + 1).to(tl.float32)
            x_sum = tl.sum(x_even, axis=0) + tl.sum(x_odd, axis=0)
        else:
            x_even = tl.load(x_ptr + group * GROUP + lines).to(tl.float32)
            x_odd = x_even
            x_sum = tl.sum(x_even, axis=0)
        outputs = group * N + 4 * cols
        lows = words
        highs = words
        if LEVELS and PERMUTE:
            lows, highs = _word_levels(words, LEVEL_ASM)
        dot = _byte_dot(
            words, lows, highs, 0, x_even, x_odd, x_sum, levels_ptr, FOUR_BIT, LEVELS, PERMUTE
        )
        acc0 = _closed(acc0, dot, x_sum, scales_ptr, offsets_ptr, outputs, ok, OFFSETS)
        dot = _byte_dot(
            words, lows, highs, 1, x_even, x_odd, x_sum, levels_ptr, FOUR_BIT, LEVELS, PERMUTE
        )
        acc1 = _closed(acc1, dot, x_sum, scales_ptr, offsets_ptr, outputs + 1, ok, OFFSETS)
        dot = _byte_dot(
            words, lows, highs, 2, x_even, x_odd, x_sum, levels_ptr, FOUR_BIT, LEVELS, PERMUTE
        )
        acc2 = _closed(acc2, dot, x_sum, scales_ptr, offsets_ptr, outputs + 2, ok, OFFSETS)
        dot = _byte_dot(
            words, lows, highs, 3, x_even, x_odd, x_sum, levels_ptr, FOUR_BIT, LEVELS, PERMUTE
        )
        acc3 = _closed(acc3, dot, x_sum, scales_ptr, offsets_ptr, outputs + 3, ok, OFFSETS)
    launch_next(PDL)
    _store_words(y_ptr + pid_k * N, cols, ok, acc0, acc1, acc2, acc3)


SPREAD_NIBBLES = tl.constexpr(
    """{
    .reg .b32 lo, hi;
    and.b32 lo, $2, 0x0F0F0F0F;
    shr.u32 hi, $2, 4;
    and.b32 hi, hi, 0x0F0F0F0F;
    prmt.b32 $0, lo, hi, 0x5140;
    prmt.b32 $1, lo, hi, 0x7362;
}"""
)
"""A word of 4-bit codes ($2: four outputs' bytes, each the codes of an even input (low
nibble) and an odd one) spread to a byte a code, an output's pair side by side: outputs 0
and 1 in $0, 2 and 3 in $1 (byte permutes)."""
SPREAD_BYTES = tl.constexpr(
    """{
    prmt.b32 $0, $2, $3, 0x5140;
    prmt.b32 $1, $2, $3, 0x7362;
}"""
)
"""The same for codes a byte each: byte b of $2 (an even input's line) and of $3 (the odd
input's) side by side."""
PAIR_DOTS = tl.constexpr(
    """{
    dp2a.lo.s32.u32 $0, $4, $5, 0;
    dp2a.hi.s32.u32 $1, $4, $5, 0;
    dp2a.lo.s32.u32 $2, $4, $6, 0;
    dp2a.hi.s32.u32 $3, $4, $6, 0;
}"""
)
"""Four outputs' `x_even * even code + x_odd * odd code`: the pair of 16-bit inputs in $4
(the even input in the low half) and the spread codes in $5 (outputs 0 and 1) and $6 (2
and 3), one integer dot each."""


@triton.jit
def _spread_codes(words, odd_words, FOUR_BIT: tl.constexpr, PTX: tl.constexpr):
    """`SPREAD_NIBBLES` of `words` or `SPREAD_BYTES` of `words` and `odd_words`; without PTX
    (Triton's interpreter) the same bits by shifts and masks."""
    if PTX and FOUR_BIT:
        return tl.inline_asm_elementwise(
            SPREAD_NIBBLES, "=r,=r,r", [words], (tl.int32, tl.int32), is_pure=True, pack=1
        )
    if PTX:
        return tl.inline_asm_elementwise(
            SPREAD_BYTES,
            "=r,=r,r,r",
            [words, odd_words],
            (tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    low, high = words, odd_words
    if FOUR_BIT:
        low, high = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
    even = (low & 255) | ((high & 255) << 8) | ((low & 0xFF00) << 8) | ((high & 0xFF00) << 16)
    low, high = (low >> 16) & 0xFFFF, (high >> 16) & 0xFFFF
    odd = (low & 255) | ((high & 255) << 8) | ((low & 0xFF00) << 8) | ((high & 0xFF00) << 16)
    return even, odd


@triton.jit
def _pair_dots(pairs, even, odd, PTX: tl.constexpr):
    """`PAIR_DOTS`, or the same integers by shifts and masks (Triton's interpreter)."""
    if PTX:
        return tl.inline_asm_elementwise(
            PAIR_DOTS,
            "=r,=r,=r,=r,r,r,r",
            [pairs, even, odd],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    x_even = (pairs << 16) >> 16
    x_odd = pairs >> 16
    return (
        x_even * (even & 255) + x_odd * ((even >> 8) & 255),
        x_even * ((even >> 16) & 255) + x_odd * ((even >> 24) & 255),
        x_even * (odd & 255) + x_odd * ((odd >> 8) & 255),
        x_even * ((odd >> 16) & 255) + x_odd * ((odd >> 24) & 255),
    )


@triton.jit
def _four_columns(ptr, at, ok, BLOCK_W: tl.constexpr):
    """The four float32 values at `at`, `at` + 1, `at` + 2, `at` + 3 of each word column, read
    together (the scales or offsets of a word's four outputs)."""
    four = tl.load(ptr + at[:, None] + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0.0)
    first, second = tl.split(tl.reshape(four.to(tl.float32), (BLOCK_W, 2, 2)))
    zero, two = tl.split(first)
    one, three = tl.split(second)
    return zero, one, two, three


@triton.jit
def _int_group(
    acc0, acc1, acc2, acc3, words, odd_words, group, x_ptr, scales_ptr, offsets_ptr, N, cols,
    ok, PTX: tl.constexpr, OFFSETS: tl.constexpr, FOUR_BIT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    """The accumulators plus group `group`'s part: its GROUP inputs rounded to 16-bit
    integers in pairs, the integer dots with its codes (`_spread_codes`, `_pair_dots`)
    summed over the pairs, scaled once, and the offsets' part."""
    x = tl.load(x_ptr + group * GROUP + tl.arange(0, GROUP)).to(tl.float32)
    x_sum = tl.sum(x, axis=0)
    top = tl.max(tl.abs(x), axis=0)
    step = top / 32767
    rounded = tl.floor(x * tl.where(top > 0, 32767 / top, 0.0) + 0.5).to(tl.int32)
    even, odd = tl.split(tl.reshape(rounded, (GROUP // 2, 2)))
    pairs = tl.broadcast_to(((even & 0xFFFF) | (odd << 16))[:, None], (GROUP // 2, BLOCK_W))
    even, odd = _spread_codes(words, odd_words, FOUR_BIT, PTX)
    dots0, dots1, dots2, dots3 = _pair_dots(pairs, even, odd, PTX)
    outputs = group * N + 4 * cols
    scale0, scale1, scale2, scale3 = _four_columns(scales_ptr, outputs, ok, BLOCK_W)
    acc0 += scale0 * (tl.sum(dots0, axis=0).to(tl.float32) * step)
    acc1 += scale1 * (tl.sum(dots1, axis=0).to(tl.float32) * step)
    acc2 += scale2 * (tl.sum(dots2, axis=0).to(tl.float32) * step)
    acc3 += scale3 * (tl.sum(dots3, axis=0).to(tl.float32) * step)
    if OFFSETS:
        offset0, offset1, offset2, offset3 = _four_columns(offsets_ptr, outputs, ok, BLOCK_W)
        acc0 += offset0 * x_sum
        acc1 += offset1 * x_sum
        acc2 += offset2 * x_sum
        acc3 += offset3 * x_sum
    return acc0, acc1, acc2, acc3


@triton.jit
def int_gemv(
    x_ptr,
    words_ptr,
    scales_ptr,
    offsets_ptr,
    y_ptr,
    N,
    K,
    PTX: tl.constexpr,
    OFFSETS: tl.constexpr,
    FOUR_BIT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """`gemv` for codes without levels (4-bit two to a byte, or a byte each), by integer dot
    products: each group of GROUP inputs of the row is rounded to 16-bit integers on a step
    of its own (its largest magnitude over 32,767: about 15 bits of it, as aserve's CPU
    kernels round a block), and each output's codes are multiplied with them two at a time
    (`dp2a`), summed exactly in int32 and scaled once a group. `gemv` spent about six
    instructions a weight widening 4-bit codes to floats; this about two. Every program
    rounds the group for itself (all the same integers), so nothing runs before it.
    (Reading two groups' codes before multiplying either, for more bytes in flight, made a
    single 8B stream slower: 3.09 -> 3.31 ms/token on an H200.)"""
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_only(PDL)
    words_n = N // 4
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # word columns
    ok = cols < words_n
    pairs = tl.arange(0, GROUP // 2)  # a group's input pairs
    # 4-bit codes: line j holds both inputs of pair j; 8-bit: lines 2j and 2j + 1
    at = words_ptr + (pairs if FOUR_BIT else 2 * pairs)[:, None] * words_n + cols[None, :]
    lines: tl.constexpr = GROUP // 2 if FOUR_BIT else GROUP
    acc0 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for group in range(pid_k, K // GROUP, SPLIT_K):
        words = tl.load(at + group * lines * words_n, mask=ok[None, :], other=0)
        odd_words = words
        if not FOUR_BIT:
            odd_words = tl.load(at + (group * lines + 1) * words_n, mask=ok[None, :], other=0)
        acc0, acc1, acc2, acc3 = _int_group(
            acc0, acc1, acc2, acc3, words, odd_words, group, x_ptr, scales_ptr, offsets_ptr,
            N, cols, ok, PTX, OFFSETS, FOUR_BIT, GROUP, BLOCK_W,
        )  # fmt: skip
    launch_next(PDL)
    _store_words(y_ptr + pid_k * N, cols, ok, acc0, acc1, acc2, acc3)


QUARTER_DOTS = tl.constexpr(
    """{
    dp2a.lo.s32.u32 $0, $4, $8, 0;
    dp2a.lo.s32.u32 $0, $5, $10, $0;
    dp2a.lo.s32.u32 $0, $6, $12, $0;
    dp2a.lo.s32.u32 $0, $7, $14, $0;
    dp2a.hi.s32.u32 $1, $4, $8, 0;
    dp2a.hi.s32.u32 $1, $5, $10, $1;
    dp2a.hi.s32.u32 $1, $6, $12, $1;
    dp2a.hi.s32.u32 $1, $7, $14, $1;
    dp2a.lo.s32.u32 $2, $4, $9, 0;
    dp2a.lo.s32.u32 $2, $5, $11, $2;
    dp2a.lo.s32.u32 $2, $6, $13, $2;
    dp2a.lo.s32.u32 $2, $7, $15, $2;
    dp2a.hi.s32.u32 $3, $4, $9, 0;
    dp2a.hi.s32.u32 $3, $5, $11, $3;
    dp2a.hi.s32.u32 $3, $6, $13, $3;
    dp2a.hi.s32.u32 $3, $7, $15, $3;
}"""
)
"""Four outputs' `x_even * even code + x_odd * odd code` over four input pairs of a group
(4i + q, q = 0 to 3: one from each quarter of its pairs), added up in the dots themselves:
the pairs of 16-bit inputs in $4 to $7 (the even input in each low half) and each one's
spread codes in $8 to $15 (even words, odd words by turns), one integer dot each."""


@triton.jit
def _quarter_dots(
    p0, p1, p2, p3, e0, o0, e1, o1, e2, o2, e3, o3, PTX: tl.constexpr
):  # fmt: skip
    """`QUARTER_DOTS` of quarter q's pairs `pq` and spread codes `eq`, `oq`, or the same
    integers by shifts and masks."""
    if PTX:
        return tl.inline_asm_elementwise(
            QUARTER_DOTS,
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
            [p0, p1, p2, p3, e0, o0, e1, o1, e2, o2, e3, o3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    a0, a1, a2, a3 = _pair_dots(p0, e0, o0, False)
    b0, b1, b2, b3 = _pair_dots(p1, e1, o1, False)
    c0, c1, c2, c3 = _pair_dots(p2, e2, o2, False)
    d0, d1, d2, d3 = _pair_dots(p3, e3, o3, False)
    return a0 + b0 + c0 + d0, a1 + b1 + c1 + d1, a2 + b2 + c2 + d2, a3 + b3 + c3 + d3


@triton.jit
def _spread_quarter(
    words_at, ok, words_n, QUARTER: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
    FOUR_BIT: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """The codes of a group's input pairs 4i + QUARTER (`words_at`: pair 4i's first line for
    each i) spread (`_spread_codes`) once for every row, broadcast to `[ROWS, pairs / 4,
    BLOCK_W]`: 4-bit codes hold a pair in a line, 8-bit ones in two."""
    if FOUR_BIT:
        words = tl.load(words_at + QUARTER * words_n, mask=ok[None, :], other=0)
        odd_words = words
    else:
        words = tl.load(words_at + 2 * QUARTER * words_n, mask=ok[None, :], other=0)
        odd_words = tl.load(words_at + (2 * QUARTER + 1) * words_n, mask=ok[None, :], other=0)
    even, odd = _spread_codes(words, odd_words, FOUR_BIT, PTX)
    shape: tl.constexpr = (ROWS, even.shape[0], BLOCK_W)
    return tl.broadcast_to(even[None, :, :], shape), tl.broadcast_to(odd[None, :, :], shape)


@triton.jit
def _rows_group(
    acc0, acc1, acc2, acc3, words_at, x_at, row_ok, scales_ptr, offsets_ptr, group, N,
    words_n, cols, ok, PTX: tl.constexpr, OFFSETS: tl.constexpr, FOUR_BIT: tl.constexpr,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """The accumulators (`[ROWS, BLOCK_W]`) plus group `group`'s part: each row's GROUP
    inputs rounded to 16-bit integers on a step of the row's own (its largest magnitude over
    32,767) and packed in pairs, the integer dots with the group's codes (each pair's four
    outputs; four pairs added up in the dots themselves, `QUARTER_DOTS`) summed, scaled
    once, and the offsets' part."""
    x = tl.load(x_at + tl.arange(0, GROUP)[None, :], mask=row_ok[:, None], other=0.0)
    x = x.to(tl.float32)
    x_sum = tl.sum(x, axis=1)
    top = tl.max(tl.abs(x), axis=1)
    step = top / 32767
    inverse = 32767 / tl.where(top > 0, top, 1.0)
    rounded = tl.floor(x * inverse[:, None] + 0.5).to(tl.int32)
    even_x, odd_x = tl.split(tl.reshape(rounded, (ROWS, GROUP // 2, 2)))
    pairs = (even_x & 0xFFFF) | (odd_x << 16)
    # pairs 4i + 2a + b
    b0, b1 = tl.split(tl.reshape(pairs, (ROWS, GROUP // 8, 2, 2)))
    p0, p2 = tl.split(b0)
    p1, p3 = tl.split(b1)
    shape: tl.constexpr = (ROWS, GROUP // 8, BLOCK_W)
    p0 = tl.broadcast_to(p0[:, :, None], shape)
    p1 = tl.broadcast_to(p1[:, :, None], shape)
    p2 = tl.broadcast_to(p2[:, :, None], shape)
    p3 = tl.broadcast_to(p3[:, :, None], shape)
    e0, o0 = _spread_quarter(words_at, ok, words_n, 0, ROWS, BLOCK_W, FOUR_BIT, PTX)
    e1, o1 = _spread_quarter(words_at, ok, words_n, 1, ROWS, BLOCK_W, FOUR_BIT, PTX)
    e2, o2 = _spread_quarter(words_at, ok, words_n, 2, ROWS, BLOCK_W, FOUR_BIT, PTX)
    e3, o3 = _spread_quarter(words_at, ok, words_n, 3, ROWS, BLOCK_W, FOUR_BIT, PTX)
    dots0, dots1, dots2, dots3 = _quarter_dots(p0, p1, p2, p3, e0, o0, e1, o1, e2, o2, e3, o3, PTX)
    outputs = group * N + 4 * cols
    scale0, scale1, scale2, scale3 = _four_columns(scales_ptr, outputs, ok, BLOCK_W)
    acc0 += scale0[None, :] * (tl.sum(dots0, axis=1).to(tl.float32) * step[:, None])
    acc1 += scale1[None, :] * (tl.sum(dots1, axis=1).to(tl.float32) * step[:, None])
    acc2 += scale2[None, :] * (tl.sum(dots2, axis=1).to(tl.float32) * step[:, None])
    acc3 += scale3[None, :] * (tl.sum(dots3, axis=1).to(tl.float32) * step[:, None])
    if OFFSETS:
        offset0, offset1, offset2, offset3 = _four_columns(offsets_ptr, outputs, ok, BLOCK_W)
        acc0 += offset0[None, :] * x_sum[:, None]
        acc1 += offset1[None, :] * x_sum[:, None]
        acc2 += offset2[None, :] * x_sum[:, None]
        acc3 += offset3[None, :] * x_sum[:, None]
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["M"])
def int_rows(
    x_ptr,
    words_ptr,
    scales_ptr,
    offsets_ptr,
    y_ptr,
    M,
    N,
    K,
    PTX: tl.constexpr,
    OFFSETS: tl.constexpr,
    FOUR_BIT: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """`int_gemv` for 2 to ROWS rows (M of them): each row's groups rounded on steps of
    their own as there, the codes read and spread once for all the rows (their loads and
    byte permutes are shared), each row's dots by `dp2a`, four input pairs added up in the
    dots themselves (`QUARTER_DOTS`). Decode batches of a few sequences took the tiled
    tensor-core product, which costs the same at 2 rows as at 16: on an H200, 4-bit codes
    of the 8B shape at 4 rows, us, qkv 21.9 against 34.9, gate_up 75.3 against 106.2
    (bench/NOTES.md). Past 2 rows (INT_ROWS) `dequantizing_gemm` wins: each row's dots
    are instructions of their own, where a tensor-core dot takes 16 rows at once."""
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_only(PDL)
    words_n = N // 4
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # word columns
    ok = cols < words_n
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    x_rows = x_ptr + rows[:, None] * K  # [ROWS, 1]
    # the first line of each fourth input pair (4-bit codes: a line a pair; 8-bit: two)
    lines: tl.constexpr = GROUP // 2 if FOUR_BIT else GROUP
    every_fourth = tl.arange(0, GROUP // 8) * (4 if FOUR_BIT else 8)
    at = words_ptr + every_fourth[:, None] * words_n + cols[None, :]
    acc0 = tl.zeros((ROWS, BLOCK_W), dtype=tl.float32)
    acc1 = tl.zeros((ROWS, BLOCK_W), dtype=tl.float32)
    acc2 = tl.zeros((ROWS, BLOCK_W), dtype=tl.float32)
    acc3 = tl.zeros((ROWS, BLOCK_W), dtype=tl.float32)
    for group in range(pid_k, K // GROUP, SPLIT_K):
        acc0, acc1, acc2, acc3 = _rows_group(
            acc0, acc1, acc2, acc3, at + group * lines * words_n, x_rows + group * GROUP,
            row_ok, scales_ptr, offsets_ptr, group, N, words_n, cols, ok, PTX, OFFSETS,
            FOUR_BIT, GROUP, ROWS, BLOCK_W,
        )  # fmt: skip
    launch_next(PDL)
    y_rows = y_ptr + pid_k * M * N + rows[:, None] * N
    _store_words(y_rows, cols[None, :], row_ok[:, None] & ok[None, :], acc0, acc1, acc2, acc3)


@triton.jit
def book_gemv(
    x_ptr,
    entries_ptr,
    book_ptr,
    levels_ptr,
    scales_ptr,
    offsets_ptr,
    y_ptr,
    N,
    K,
    PERMUTE: tl.constexpr,
    LEVEL_ASM: tl.constexpr,
    LOW_BITS: tl.constexpr,
    SIGNS_AT: tl.constexpr,
    OFFSETS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """`gemv` for weights in book entries (`book_words`): a thread looks up each run's word
    of 8 nibble codes for its outputs, permutes the nibbles into their levels (as `gemv`
    does codes of levels) and sums the group's products in float32 before its scale. Each
    run is a vector over the outputs: as a `[runs, outputs]` tile Triton spread the runs
    over threads, and the sums across them took shuffles and shared memory (an H200, the
    8B shape's gate_up in IQ2_XXS: 101 us against 55 so)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_only(PDL)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    run_count: tl.constexpr = GROUP // 8
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for group in range(pid_k, K // GROUP, SPLIT_K):
        x_sum = 0.0
        dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r in tl.static_range(run_count):
            run = group * run_count + r
            words = book_words(entries_ptr, book_ptr, run, cols, ok, N, LOW_BITS, SIGNS_AT)
            x_at = x_ptr + group * GROUP + 8 * r
            if PERMUTE:
                # byte b of `lows` is input 2b's level + 128, of `highs` input 2b + 1's; each
                # term is x * (1 + (level + 128) / 256), as in `_byte_dot`
                lows, highs = _word_levels(words, LEVEL_ASM)
                for b in tl.static_range(4):
                    x_even = tl.load(x_at + 2 * b).to(tl.float32)
                    x_odd = tl.load(x_at + 2 * b + 1).to(tl.float32)
                    x_sum += x_even + x_odd
                    dot += x_even * _one_plus(lows, 8 * b, 8) + x_odd * _one_plus(highs, 8 * b, 8)
            else:
                for i in tl.static_range(8):
                    level = tl.load(levels_ptr + ((words >> (4 * i)) & 15)).to(tl.float32)
                    x = tl.load(x_at + i).to(tl.float32)
                    x_sum += x
                    dot += x * level
        if PERMUTE:
            dot = 256 * (dot - x_sum) - 128 * x_sum
        acc = _closed(acc, dot, x_sum, scales_ptr, offsets_ptr, group * N + cols, ok, OFFSETS)
    launch_next(PDL)
    tl.store(y_ptr + pid_k * N + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def sum_splits(
    parts_ptr, y_ptr, SIZE, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """y = the sum of SPLITS float32 partial products, in a fixed order, in y's dtype."""
    wait_for_previous(PDL)
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < SIZE
    total = tl.load(parts_ptr + at, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(parts_ptr + split * SIZE + at, mask=ok, other=0.0)
    tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def dequantize_kernel(
    codes_ptr,
    levels_ptr,
    book_ptr,
    scales_ptr,
    offsets_ptr,
    w_ptr,
    N,
    K,
    FIRST,
    WIDTH,
    FOUR_BIT: tl.constexpr,
    LEVELS: tl.constexpr,
    LOW_BITS: tl.constexpr,
    SIGNS_AT: tl.constexpr,
    OFFSETS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One group of outputs [FIRST, FIRST + WIDTH) de-quantized into w, [K, WIDTH] (the
    codes' layout): w = code * scale + offset."""
    start = tl.program_id(0) * GROUP
    k = start + tl.arange(0, GROUP)
    cols = FIRST + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < FIRST + WIDTH
    code = group_codes(
        codes_ptr, levels_ptr, book_ptr, start, cols, N, K, GROUP, BLOCK_N, FOUR_BIT, LEVELS,
        False, "", LOW_BITS, SIGNS_AT,
    )  # fmt: skip
    code = code.to(tl.float32)
    where = (start // GROUP) * N + cols
    scale = tl.load(scales_ptr + where, mask=col_ok, other=0.0).to(tl.float32)
    w = code * scale[None, :]
    if OFFSETS:
        w += tl.load(offsets_ptr + where, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        w_ptr + k[:, None] * WIDTH + (cols - FIRST)[None, :],
        w.to(w_ptr.dtype.element_ty),
        mask=col_ok[None, :],
    )


def int_rows_words(n: int, k: int) -> int:
    """`int_rows`' words a program for INT_ROWS rows of a weight of `n` outputs and `k`
    inputs: H200 sweeps of 16-128 words over the 8B shape's products (bench/NOTES.md),
    rows longer than 8,192 inputs (down), wider than 16,384 outputs (gate_up) or neither."""
    if k > 8192:
        return 32
    return 128 if n > 16384 else 64


# `dequantizing_gemm`'s settings by rows, up to: rows, outputs and inputs a program, warps and
# pipeline stages. Hopper: of 8 settings timed on the 8B shape's four products (H200, 4- and
# 8-bit codes, weights past L2), the best or within 10% of it on most. Older GPUs (not timed):
# settings that ptxas (Triton 3.9's) compiles for sm_80 and sm_89 spilling at most 48 bytes a
# thread, where the Hopper ones spill up to 9 KB at 64 rows; past 64 rows, programs of 64.
HOPPER_TILES = ((16, (16, 128, 256, 4, 1)), (32, (32, 64, 128, 4, 1)), (64, (64, 128, 256, 4, 1)))
HOPPER_WIDE_TILES = (128, 64, 128, 4, 3)
OLDER_TILES = ((16, (16, 64, 128, 4, 1)), (32, (32, 64, 128, 4, 1)))
OLDER_WIDE_TILES = (64, 128, 64, 8, 1)


def dequantizing_tiles(
    rows: int, k: int, group: int, hopper: bool
) -> tuple[int, int, int, int, int]:
    """`dequantizing_gemm`'s settings for `rows` rows of `k` inputs in groups of `group`,
    the inputs a step halved until they divide `k`."""
    table, wide = (HOPPER_TILES, HOPPER_WIDE_TILES) if hopper else (OLDER_TILES, OLDER_WIDE_TILES)
    block_m, block_n, block_k, warps, stages = next(
        (setting for most, setting in table if rows <= most), wide
    )
    while k % block_k and block_k > max(group, 32):
        block_k //= 2
    return block_m, block_n, block_k, warps, stages


@functools.cache
def _on_device(tables: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A book's tables on `device`, one copy for the format's weights."""
    return tables.to(device)


def _split_k(tiles: int, steps: int, programs: int = BUSY_PROGRAMS, least: int = 4) -> int:
    """How many programs share each output tile's steps along K: enough for `programs` in
    all, and at least `least` steps each."""
    split = 1
    while tiles * split < programs and steps // (2 * split) >= least:
        split *= 2
    return split


class CudaWeight:
    """A `[rows, cols]` weight on CUDA in groups of 16 or 32 inputs: codes of up to 4 bits two
    to a byte, wider ones (up to 8 bits) a byte each, or the book entries of formats that
    pick runs of 8 inputs from a book (IQ1, IQ2, IQ3_XXS: 16 or 24 bits a run where 4-bit
    codes take 32). Offsets that are all zero (most formats of levels) are not kept."""

    def __init__(self, codes: Codes, device: torch.device, dtype: torch.dtype) -> None:
        codes = groups_of_at_most_32(codes)
        if codes.group not in GROUPS or codes.bits > 8:
            raise ValueError(f"CUDA products take groups of {GROUPS} and up to 8 bits")
        self.shape = codes.shape
        self.group = codes.group
        self.four_bit = codes.bits <= 4
        # `dequantizing_gemm`'s settings: Hopper's, or older GPUs' (`dequantizing_tiles`)
        self.hopper = (gpu_capability(device) or (0, 0)) >= (9, 0)
        scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
        # levels (IQ4's are integers of up to 8 significant bits) exact in 16-bit types
        self.levels = None if codes.table is None else codes.table.to(device, dtype)
        # and as `gemv` permutes them: 16 integer levels + 128, a byte each, in four words
        self.level_asm = ""
        if codes.table is not None and self.four_bit:
            self.level_asm = level_permutes(codes.table)
        # input-major, [K (/ 2), N] and [groups, N]: see `group_codes`
        self.book: torch.Tensor | None = None
        self.low_bits = self.signs_at = 0
        if codes.runs is not None and self.level_asm and self.shape[1] % 128 == 0:
            self.codes = self._entry_planes(codes.runs, device)
        else:
            values = codes.codes.to(device)
            packed = values[:, 0::2] | (values[:, 1::2] << 4) if self.four_bit else values
            self.codes = packed.t().contiguous()
        self.scales = codes.scales.to(device, scale_dtype).t().contiguous()
        self.offsets: torch.Tensor | None = None
        if bool(codes.offsets.any()):
            self.offsets = codes.offsets.to(device, scale_dtype).t().contiguous()

    def _entry_planes(self, runs: Runs, device: torch.device) -> torch.Tensor:
        """The entries as `book_words` reads them, `[K / 8 * planes, N]` bytes; the book's
        split tables on `device` (shared by the format's weights)."""
        if runs.entries.numel() and int(runs.entries.max()) >= runs.entry_limit:
            raise ValueError("book entries past the end of their book")
        tables, self.low_bits, self.signs_at = split_book(runs.kernel_book)
        self.book = _on_device(tables, device)
        planes = runs.entry_bits // 8
        entries = runs.entries.t().to(device)  # [K / 8, N]
        shifts = 8 * torch.arange(planes, dtype=torch.int32, device=device)
        fields = (entries[:, None, :] >> shifts[:, None]) & 255
        return fields.to(torch.uint8).reshape(-1, entries.shape[1]).contiguous()

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.offsets)
        return sum(t.nbytes for t in tensors if t is not None)

    def _book_args(self) -> dict[str, object]:
        """What every launch passes of the entries' book and the offsets."""
        return {
            "LOW_BITS": self.low_bits,
            "SIGNS_AT": self.signs_at,
            "OFFSETS": self.offsets is not None,
        }

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        n = self.shape[0]
        if self.takes_integer_dots(rows):
            y = self._int_gemv(rows)
        elif rows.shape[0] <= GEMV_ROWS and (n % 4 == 0 or self.book is not None):
            y = self._gemv(rows)
        elif self.takes_dequantizing_tiles(rows):
            y = self._dequantizing_tiles(rows)
        elif rows.shape[0] >= DEQUANTIZE_ROWS:
            y = self._dequantized_product(rows)
        else:
            y = self._fused(rows)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], n)

    def _dequantized_product(self, rows: torch.Tensor) -> torch.Tensor:
        """Many rows: cuBLAS on slices of outputs de-quantized to the activations' dtype, each
        at most DEQUANTIZE_SLICE_BYTES (an LM head would otherwise need a gigabyte more)."""
        n, k = self.shape
        width = max(128, DEQUANTIZE_SLICE_BYTES // (rows.element_size() * k) // 128 * 128)
        if width >= n:
            return rows @ self.dequantize(rows.dtype, 0, n)
        y = rows.new_empty(rows.shape[0], n)
        for first in range(0, n, width):
            last = min(n, first + width)
            y[:, first:last] = rows @ self.dequantize(rows.dtype, first, last)
        return y

    def _int_gemv(self, rows: torch.Tensor) -> torch.Tensor:
        """`int_gemv` for one row, `int_rows` for a few."""
        m, k = rows.shape
        n = self.shape[0]
        if m == 1:
            words = INT_GEMV_LONG_ROWS_W if k > 8192 else INT_GEMV_BLOCK_W
        else:
            words = int_rows_words(n, k)
        tiles = -(-n // (4 * words))
        # split K in steps of 32 inputs whatever the groups: by groups of 16, o of the 8B
        # shape took 128 splits and 20.6 us against 15.9 in `gemv`
        split = _split_k(tiles, k // max(self.group, 32), GEMV_PROGRAMS, least=2)
        dtype = torch.float32 if split > 1 else rows.dtype
        parts = torch.empty(split, m, n, dtype=dtype, device=rows.device)
        shared = {
            "PTX": rows.is_cuda,  # Triton's interpreter (tests on CPU) runs no PTX
            "OFFSETS": self.offsets is not None,
            "FOUR_BIT": self.four_bit,
            "GROUP": self.group,
            "BLOCK_W": words,
            "SPLIT_K": split,
            "num_warps": 1,
            **pdl_options(rows.device, m),
        }
        words_ptr = self.codes.view(torch.int32)
        if m == 1:
            int_gemv[(tiles, split)](
                rows, words_ptr, self.scales, self.offsets, parts, n, k, **shared
            )
        else:
            int_rows[(tiles, split)](
                rows,
                words_ptr,
                self.scales,
                self.offsets,
                parts,
                m,
                n,
                k,
                ROWS=triton.next_power_of_2(m),
                **shared,
            )
        return self._sum_splits(parts, rows)

    def _gemv(self, rows: torch.Tensor) -> torch.Tensor:
        k = rows.shape[1]
        n = self.shape[0]
        block, warps, programs = 4 * GEMV_BLOCK_W, GEMV_WARPS, GEMV_PROGRAMS
        if self.book is not None:
            block, warps, programs = BOOK_BLOCK_N, BOOK_WARPS, BOOK_PROGRAMS
        tiles = -(-n // block)
        split = _split_k(tiles, k // self.group, programs, least=2)
        dtype = torch.float32 if split > 1 else rows.dtype
        parts = torch.empty(split, 1, n, dtype=dtype, device=rows.device)
        shared = {
            "PERMUTE": rows.is_cuda,  # Triton's interpreter (tests on CPU) runs no PTX
            "LEVEL_ASM": self.level_asm,
            "OFFSETS": self.offsets is not None,
            "GROUP": self.group,
            "SPLIT_K": split,
            "num_warps": warps,
            "num_stages": GEMV_STAGES,
            **pdl_options(rows.device, 1),
        }
        if self.book is not None:
            book_gemv[(tiles, split)](
                rows,
                self.codes,
                self.book,
                self.levels,
                self.scales,
                self.offsets,
                parts,
                n,
                k,
                LOW_BITS=self.low_bits,
                SIGNS_AT=self.signs_at,
                BLOCK_N=block,
                **shared,
            )
        else:
            gemv[(tiles, split)](
                rows,
                self.codes.view(torch.int32),
                self.levels,
                self.scales,
                self.offsets,
                parts,
                n,
                k,
                FOUR_BIT=self.four_bit,
                LEVELS=self.levels is not None,
                BLOCK_W=GEMV_BLOCK_W,
                **shared,
            )
        return self._sum_splits(parts, rows)

    def _plain_codes_beside_16_bit(self, rows: torch.Tensor) -> bool:
        """Codes without levels or book entries and 16-bit rows: what the integer dots and
        `dequantizing_gemm` take (float32 rows keep `gemv` and the tiles, whose products
        round nothing)."""
        return (
            self.levels is None
            and self.book is None
            and rows.dtype in (torch.float16, torch.bfloat16)
        )

    def takes_integer_dots(self, rows: torch.Tensor) -> bool:
        """Whether rows go to `int_gemv` or `int_rows`: up to INT_ROWS of them, plain codes
        of a multiple of 4 outputs beside 16-bit rows."""
        return (
            self._plain_codes_beside_16_bit(rows)
            and self.shape[0] % 4 == 0
            and rows.shape[0] <= INT_ROWS
        )

    def takes_dequantizing_tiles(self, rows: torch.Tensor) -> bool:
        """Whether rows go to `dequantizing_gemm`: past INT_ROWS up to TILE_ROWS (or
        WIDE_TILE_ROWS for a large weight), plain codes beside 16-bit rows, in whole steps of
        32 inputs (every format's rows are)."""
        n, k = self.shape
        most = WIDE_TILE_ROWS if n * k >= WIDE_TILE_CODES else TILE_ROWS
        return self._plain_codes_beside_16_bit(rows) and k % 32 == 0 and rows.shape[0] <= most

    def _dequantizing_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        m, k = rows.shape
        n = self.shape[0]
        block_m, block_n, block_k, warps, stages = dequantizing_tiles(m, k, self.group, self.hopper)
        tiles_n, tiles_m = -(-n // block_n), -(-m // block_m)
        split = _split_k(tiles_n * tiles_m, k // block_k, least=2)
        dtype = torch.float32 if split > 1 else rows.dtype
        parts = torch.empty(split, m, n, dtype=dtype, device=rows.device)
        grid = (tiles_n, split, tiles_m)
        dequantizing_gemm[grid](
            rows,
            self.codes,
            self.scales,
            self.offsets,
            parts,
            m,
            n,
            k,
            FOUR_BIT=self.four_bit,
            OFFSETS=self.offsets is not None,
            GROUP=self.group,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SPLIT_K=split,
            num_warps=warps,
            num_stages=stages,
            **pdl_options(rows.device, m),
        )
        return self._sum_splits(parts, rows)

    @staticmethod
    def _sum_splits(parts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The rows' product from their SPLIT_K partial products (`parts`, [split, m, n])."""
        split, m, n = parts.shape
        if split == 1:
            return parts[0]
        y = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
        block = 1024
        sum_splits[(-(-(m * n) // block),)](
            parts, y, m * n, SPLITS=split, BLOCK=block, **pdl_options(rows.device, m)
        )
        return y

    def _fused(self, rows: torch.Tensor) -> torch.Tensor:
        m, k = rows.shape
        n = self.shape[0]
        block_m, block_n, per_step, warps, stages = 16, 64, 4, 4, 4  # up to 16 rows
        groups = k // self.group
        if self.book is not None:  # `book_dots`: steps of 128 inputs
            per_step = 128 // self.group
        while groups % per_step:
            per_step //= 2
        tiles_m, tiles_n = -(-m // block_m), -(-n // block_n)
        split = _split_k(tiles_m * tiles_n, groups // per_step)
        out_dtype = rows.dtype if split == 1 else torch.float32
        y = torch.empty(split, m, n, dtype=out_dtype, device=rows.device)
        x_sums = None
        if self.offsets is not None:
            x_sums = rows.float().view(m, groups, self.group).sum(-1)
        quantized_gemm[(tiles_m, tiles_n, split)](
            rows,
            x_sums,
            self.codes,
            self.levels,
            self.book,
            self.scales,
            self.offsets,
            y,
            m,
            n,
            k,
            FOUR_BIT=self.four_bit,
            LEVELS=self.levels is not None,
            PERMUTE=rows.is_cuda,
            LEVEL_ASM=self.level_asm,
            **self._book_args(),
            GROUP=self.group,
            PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            GROUPS_PER_STEP=per_step,
            SPLIT_K=split,
            num_warps=warps,
            num_stages=stages,
        )
        return y[0] if split == 1 else y.sum(0).to(rows.dtype)

    def dequantize(self, dtype: torch.dtype, first: int, last: int) -> torch.Tensor:
        """Outputs [first, last) de-quantized to `dtype`, transposed: `[cols, last - first]`."""
        k = self.shape[1]
        w = torch.empty(k, last - first, dtype=dtype, device=self.codes.device)
        block_n = 128
        dequantize_kernel[(k // self.group, -(-(last - first) // block_n))](
            self.codes,
            self.levels,
            self.book,
            self.scales,
            self.offsets,
            w,
            self.shape[0],
            k,
            first,
            last - first,
            FOUR_BIT=self.four_bit,
            LEVELS=self.levels is not None,
            **self._book_args(),
            GROUP=self.group,
            BLOCK_N=block_n,
        )
        return w

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` de-quantized, in float32 (embedding lookups)."""
        codes = self.codes[:, ids].t().contiguous()
        if self.book is not None:
            values = self._book_codes(codes)
        elif self.four_bit:
            values = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
        else:
            values = codes
        values = values.float() if self.levels is None else self.levels[values.long()].float()
        grouped = values.view(len(ids), -1, self.group)
        out = grouped * self.scales[:, ids].t().float()[..., None]
        if self.offsets is not None:
            out += self.offsets[:, ids].t().float()[..., None]
        return out.reshape(len(ids), -1).contiguous()

    def _book_codes(self, planes: torch.Tensor) -> torch.Tensor:
        """The codes of entry planes `[rows, K / 8 * planes]` (`_entry_planes`, transposed), as
        `book_words` finds them: `[rows, K]`."""
        assert self.book is not None
        count = 3 if self.signs_at else 2
        fields = planes.view(planes.shape[0], -1, count).long()
        entries = (fields << (8 * torch.arange(count, device=fields.device))).sum(-1)
        return split_book_codes((self.book, self.low_bits, self.signs_at), entries).flatten(-2)
