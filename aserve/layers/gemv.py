"""One-row products (a decode step at batch 1) in one Triton kernel (CUDA only), for float
weights and for FP8 ones (read as they are, the activations left unrounded).

At one row a linear layer is a matrix-vector product that only has to stream its weight
once. cuBLAS picks GEMM tiles for it, some with a split-K reduction kernel after; on an H200
the products of a Llama-3.1-8B single-stream step took 3.79 ms that way and 3.69 ms here,
and the whole step went 4.89 -> 4.58 ms (programs of 8 rows x 1,024 columns; the settings
below, measured after, took it to 4.37). With `gated` the kernel also takes over
SiLU-and-mul: it reads a fused gate|up row and multiplies by SiLU(gate) * up, rounded to
the model dtype first as the separate kernel would store it, so the MLP's down projection
needs no activation kernel before it.

FP8 rows of bf16 activations that fill its blocks take a second kernel when the weight is
wide (a gate|up projection, an LM head): it reads four FP8 bytes as one 32-bit word and
widens them with bit operations in place of conversion instructions (an e4m3 byte moved
into a bfloat16's bits is its value times 2^-120, denormals included; the row scale takes
the 2^120 back), for 4 rows x 64 words a warp: gate_up 28672x4096 31.3 against 34.4 us for
the best setting of the first kernel (3.75 TB/s of FP8; H200, weights not in L2). A kernel
that skipped the widening read no faster, so memory, not instructions, bounds both now. For a
fused gate|up weight it can also end with SiLU(gate) * up (`fp8_silu_gemv`): a program
then reads gate and up rows in turn and writes their activations, the same bits as the
gated down projection computes, which then reads them plainly. In one 8B FP8 step the gated
GEMV had recomputed the whole activation row in each of its 512 programs: 2.69 -> 2.62
ms/token (H200, alternating in one command). The same ending in `_gemv_kernel`, for bf16
weights, made the bf16 8B step slower (4.05 -> 4.09 ms), so it is not there.

Both load the first tiles of their rows before the PDL wait (layers/pdl.py): the weight is
the host's alone, and those bytes arrive while the kernel before still runs (its tail, or
small kernels such as the attention merge and the norms that read little memory). A single
8B FP8 step: 2.620 -> 2.559 ms/token (H200; `_preload_tiles` has the settings tried).

Both read the weight with L2's evict-first policy, since a step streams it once: a single
8B FP8 step of the engine's kernels in a CUDA graph took 2.682 ms with it against 2.751
without (H200, bench/NOTES.md; why it helps was not measured, `.cg` loads and evict-last
did not).

Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.layers.pdl import pdl_options, wait_for_previous


@triton.jit
def _inputs(x, k, cols, EVEN: tl.constexpr, GATED: tl.constexpr, dtype: tl.constexpr):
    """The input row's values at `cols` in float32; with GATED, SiLU(gate) * up rounded to
    `dtype` as the separate activation kernel would store it."""
    if EVEN:
        v = tl.load(x + cols).to(tl.float32)
        if GATED:
            up = tl.load(x + k + cols).to(tl.float32)
    else:
        v = tl.load(x + cols, mask=cols < k, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(x + k + cols, mask=cols < k, other=0.0).to(tl.float32)
    if GATED:
        v = (v * tl.sigmoid(v) * up).to(dtype).to(tl.float32)
    return v


@triton.jit
def _gemv_kernel(
    x,
    weight,
    scales,
    bias,
    out,
    n,
    k,
    weight_stride,
    GATED: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_cols = tl.arange(0, BLOCK_K)
    tile = weight + rows[:, None] * weight_stride + first_cols[None, :]
    # The weight is the host's alone: its first PRELOAD tiles (EVEN only) load before the
    # wait, while the kernel before this one still runs.
    if PRELOAD >= 1:
        first = tl.load(tile, eviction_policy="evict_first")
    if PRELOAD >= 2:
        second = tl.load(tile + BLOCK_K, eviction_policy="evict_first")
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    dtype = out.dtype.element_ty
    if PRELOAD >= 1:
        acc += first.to(tl.float32) * _inputs(x, k, first_cols, EVEN, GATED, dtype)[None, :]
    if PRELOAD >= 2:
        v = _inputs(x, k, BLOCK_K + first_cols, EVEN, GATED, dtype)
        acc += second.to(tl.float32) * v[None, :]
    for start in range(PRELOAD * BLOCK_K, k, BLOCK_K):
        cols = start + first_cols
        tile = weight + rows[:, None] * weight_stride + cols[None, :]
        if EVEN:
            w = tl.load(tile, eviction_policy="evict_first")
        else:
            w = tl.load(
                tile,
                mask=(rows[:, None] < n) & (cols[None, :] < k),
                other=0.0,
                eviction_policy="evict_first",
            )
        acc += w.to(tl.float32) * _inputs(x, k, cols, EVEN, GATED, dtype)[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:
        y *= tl.load(scales + rows, mask=rows < n, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=rows < n, other=0.0).to(tl.float32)
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=rows < n)


@triton.jit
def _bf16_halves(words):
    """The two bfloat16 values packed in each 32-bit word, as float32: (lower, upper)."""
    return (words << 16).to(tl.float32, bitcast=True), (words & 0xFFFF0000).to(
        tl.float32, bitcast=True
    )


@triton.jit
def _words_product(acc, w, x_words, cols):
    """`acc` plus the FP8 bytes of the 32-bit words `w` (as bf16 bits: times 2^-120) times
    the activations of their columns."""
    # bf16 bits of bytes 1 and 3 (high byte of each half) and of bytes 0 and 2: sign to
    # the half's top bit, exponent and mantissa shifted under the bf16 exponent's.
    w = w.to(tl.uint32, bitcast=True)
    odd = (w & 0x80008000) | ((w >> 4) & 0x07F007F0)
    even = ((w << 8) & 0x80008000) | ((w << 4) & 0x07F007F0)
    # Four activations: two bf16 pairs, a bf16 the top half of a float32.
    x0, x1 = _bf16_halves(tl.load(x_words + 2 * cols).to(tl.uint32, bitcast=True))
    x2, x3 = _bf16_halves(tl.load(x_words + 2 * cols + 1).to(tl.uint32, bitcast=True))
    even_low, even_high = _bf16_halves(even)
    odd_low, odd_high = _bf16_halves(odd)
    acc += even_low * x0[None, :]
    acc += odd_low * x1[None, :]
    acc += even_high * x2[None, :]
    acc += odd_high * x3[None, :]
    return acc


@triton.jit
def _fp8_words_kernel(
    x_words,
    words,
    scales,
    bias,
    out,
    word_count,
    word_stride,
    half_rows,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    if SILU:  # gate and up rows in turn: gate row i, then row i of the up half
        pairs = tl.arange(0, BLOCK_N)
        rows = tl.program_id(0) * (BLOCK_N // 2) + pairs // 2 + (pairs % 2) * half_rows
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_cols = tl.arange(0, BLOCK_W)
    tile = words + rows[:, None] * word_stride + first_cols[None, :]
    first = tl.load(tile, eviction_policy="evict_first")  # before the wait: `_gemv_kernel`
    wait_for_previous(PDL)
    acc = _words_product(tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32), first, x_words, first_cols)
    for start in range(BLOCK_W, word_count, BLOCK_W):
        cols = start + first_cols
        at = words + rows[:, None] * word_stride + cols[None, :]
        acc = _words_product(acc, tl.load(at, eviction_policy="evict_first"), x_words, cols)
    y = tl.sum(acc, axis=1) * (tl.load(scales + rows) * 1.329227995784916e36)  # 2^120
    if HAS_BIAS:
        y += tl.load(bias + rows).to(tl.float32)
    if SILU:
        # Rounded as the gate|up output would be stored, then SiLU(gate) * up as the gated
        # GEMV computes it from there: the same bits as the two kernels.
        rounded = y.to(out.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(rounded, [BLOCK_N // 2, 2]))
        at = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out + at, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty))
    else:
        tl.store(out + rows, y.to(out.dtype.element_ty))


def _preload_tiles(k: int, block_k: int, even: bool) -> int:
    """Tiles of each program's rows that the one-row kernels load before their PDL wait:
    one, and two over a long input row (a down projection's), where blocks fill the weight.
    On an H200, a single 8B FP8 stream (bench/latency.py, one command): 2.620 ms/token with
    none, 2.577 with one everywhere, 2.559 with two for down; two for gate|up or the others,
    or three or four for down, made it 2.58-2.79 (why the deeper ones lose was not
    measured)."""
    if not even:
        return 0
    return min(k // block_k, 2 if k > 8192 else 1)


FP8_WORDS_SETTING = (32, 64, 4)
"""Rows and 32-bit words a program reads at a time, and warps, of `_fp8_words_kernel`."""

FP8_WORDS_MIN_ROWS = 16384
"""Weights of at least this many rows take `_fp8_words_kernel`: on the 8B shape it won on
gate_up (28,672 rows) and an LM head, and lost to the first kernel on qkv, o and down."""


def _fp8_words(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scales: torch.Tensor,
    silu: bool = False,
) -> torch.Tensor | None:
    """The product through `_fp8_words_kernel` where it applies, else None; with `silu`,
    `weight` holds gate rows then as many up rows, and the result is SiLU(gate) * up."""
    n, k = weight.shape
    block_n, block_w, warps = FP8_WORDS_SETTING
    if (
        x.dtype != torch.bfloat16
        or n < FP8_WORDS_MIN_ROWS
        or n % block_n
        or k % (4 * block_w)
        or weight.stride(0) % 4
    ):
        return None
    out = torch.empty((1, n // 2 if silu else n), dtype=x.dtype, device=x.device)
    words = weight.view(torch.int32)
    _fp8_words_kernel[(n // block_n,)](
        x.view(torch.int32),
        words,
        scales,
        weight if bias is None else bias,
        out,
        k // 4,
        words.stride(0),
        n // 2,
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_N=block_n,
        BLOCK_W=block_w,
        num_warps=warps,
        **pdl_options(out.device, 1),
    )
    return out


def fp8_silu_gemv(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor | None:
    """SiLU(gate) * up for one row `x` `[1, K]` and an FP8 gate|up weight (gate rows, then up
    rows, one scale a row), in one kernel, or None where `_fp8_words_kernel` does not apply.
    Where it does, the MLP's down projection then reads the activation plainly: at one row
    the gated GEMV recomputed it in each of its programs."""
    assert x.shape == (1, weight.shape[1]) and scales.numel() == weight.shape[0]
    return _fp8_words(x.contiguous(), weight, None, scales, silu=True)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool = False,
    scales: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x W^T + bias` for one row `x` `[1, K]`; with `gated`, `x` is `[1, 2K]` (gate | up)
    and the row multiplied is SiLU(gate) * up. With `scales` (an FP8 `weight`, one float32
    scale per row: quant/fp8.py) each output is scaled by its row's. `config` (rows and
    columns a program reads at a time, warps, stages) overrides the measured choice, for
    bench/quant_kernels.py's sweep."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if gated else k) and weight.stride(1) == 1
    assert scales is None or scales.numel() == n
    x = x.contiguous()
    if scales is not None and config is None and not gated:
        words_out = _fp8_words(x, weight, bias, scales)
        if words_out is not None:
            return words_out
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # Rows and columns a program reads at a time, warps and pipeline stages, measured on an
    # H200 (whole 8B steps: 2 x 2,048 took 4.37 ms where 8 x 1,024 took 4.41; narrow inputs,
    # Qwen3-0.6B's 1,024, do best with 2 x 512). `gated` keeps 8 rows: each program computes
    # the activation of the whole input row (one row a program made the step 5.54 ms). FP8
    # rows: 8 x 1,024 with 4 warps was the fastest of seven settings on all of the 8B shape's
    # products and its LM head (bench/quant_kernels.py --fp8; gate_up 35.5 us, 3.3 TB/s,
    # where the bf16 GEMV takes 54.5); with weights read from memory and not L2, 32 x 512
    # with 8 warps beat it above 4,096 rows (qkv 6144x4096 9.7 against 10.6 us), and 8 x 512
    # with 8 warps beats that (8.10 against 8.76 us, weights rotating past L2, PDL-chained
    # in a graph; 16 x 512 8.30, 4 x 512 11.3, rows whole in one tile 11.2-14.0; the 8B FP8
    # single stream 2.506 -> 2.495 -> 2.488 ms/token, each step alternating in one command).
    # The o projection (4,096 rows) keeps 8 x 1,024 with 4 warps (8 x 512 with 8: 7.39 us
    # against 5.83).
    if config is not None:
        block_n, block_k, warps, stages = config
    elif scales is not None and n > 4096 and not gated:
        block_n, block_k, warps, stages = 8, 512, 8, 2
    elif scales is not None:
        block_n, block_k, warps, stages = 8, 1024, 4, 2
    elif k < 2048:
        block_n, block_k, warps, stages = 2, 512, 2, 2
    elif gated:
        block_n, block_k, warps, stages = 8, 1024, 4, 4
    elif k % 2048 == 0:
        block_n, block_k, warps, stages = 2, 2048, 8, 2
    else:
        block_n, block_k, warps, stages = 2, 1024, 4, 2
    even = n % block_n == 0 and k % block_k == 0
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        weight if scales is None else scales,
        weight if bias is None else bias,
        out,
        n,
        k,
        weight.stride(0),
        GATED=gated,
        SCALED=scales is not None,
        HAS_BIAS=bias is not None,
        EVEN=even,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRELOAD=_preload_tiles(k, block_k, even),
        num_warps=warps,
        num_stages=stages,
        **pdl_options(x.device, 1),
    )
    return out
