"""GGUF experts on CUDA in two fused launches, read as the file stores them.

A quantized GGUF MoE keeps each expert's gate|up and down in codes (quant/cuda.py's
`CudaWeight`: codes input-major, a scale and an offset per group of 16 or 32 inputs). Run
expert by expert, a decode step made a launch or more per chosen expert and read the group
sizes on the host, so no CUDA graph could hold it: a small MoE decoded 24x slower than in the
fused float kernels (bench/NOTES.md). Here a layer's experts, stacked once at load into one
tensor per part, go through the block layout of `align_blocks` as the fused float kernels
do (aserve/layers/moe_triton.py): every program multiplies a tile of one expert's rows by
that expert's weights, expanded from the codes tile by tile in registers (`code * scale +
offset`) for the tensor cores, the gate and up tiles side by side so that `silu(gate) * up`
is written directly; then the down pass scales each row by its routing weight. Experts in
book entries (IQ1, IQ2, IQ3_XXS) are multiplied by quant/cuda.py's `book_dots` instead, a
dot per position of a run's 8 inputs. Nothing reads the host, so decode is captured.
Imported only on CUDA and under Triton's interpreter (it imports Triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from aserve.config import PLAIN_EXPERTS, ExpertStyle
from aserve.layers.moe_layout import BlockLayout
from aserve.layers.moe_triton import (
    WIDE_BLOCK_M,
    WIDE_BLOCK_N,
    WIDE_WARPS,
    block_pairs,
    expert_epilogue,
    two_passes,
)
from aserve.quant.codes import Codes
from aserve.quant.cuda import CudaWeight, book_dots, group_codes


@dataclass(frozen=True)
class StackedCodes:
    """Every expert's weight of one part in `CudaWeight`'s layout with the expert first:
    `codes` uint8 `[E, K / 2 or K, N]` (or book entries' planes, `[E, K / 8 * planes, N]`,
    with the `book` and its `low_bits` and `signs_at`), `scales` and `offsets` (None where
    all zero) `[E, K / group, N]`, and the `levels` the codes stand for, if they do
    (`level_asm`: their byte permutes). `rows` is N (of gate|up, an expert's gate rows then
    its up rows), `cols` K."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    levels: torch.Tensor | None
    level_asm: str
    group: int
    four_bit: bool
    book: torch.Tensor | None
    low_bits: int
    signs_at: int

    @property
    def experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def rows(self) -> int:
        return int(self.codes.shape[2])

    @property
    def cols(self) -> int:
        return int(self.scales.shape[1]) * self.group

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.offsets)
        return sum(t.nbytes for t in tensors if t is not None)


def stack_experts(
    codes: Codes, experts: int, device: torch.device, dtype: torch.dtype
) -> StackedCodes | None:
    """A MoE part decoded for every expert at once (`[E * N, K]`, expert after expert) packed
    for the fused kernels in one go, then each expert's columns made contiguous (kept in the
    columns of one matrix, a tile's rows lay E * N bytes apart and decode was 1.5x slower on
    the 30B-A3B shape). A product an expert made the start of a 30B-A3B-shaped file take
    minutes: each small op waited for the interpreter lock, held by the kernel builds that
    run beside the load. None for formats the CUDA products do not take."""
    try:
        whole = CudaWeight(codes, device, dtype)
    except ValueError:
        return None

    def by_expert(matrix: torch.Tensor) -> torch.Tensor:
        return matrix.view(matrix.shape[0], experts, -1).transpose(0, 1).contiguous()

    return StackedCodes(
        by_expert(whole.codes),
        by_expert(whole.scales),
        None if whole.offsets is None else by_expert(whole.offsets),
        whole.levels,
        whole.level_asm,
        whole.group,
        whole.four_bit,
        whole.book,
        whole.low_bits,
        whole.signs_at,
    )


@triton.jit
def _expanded_dot(
    acc,
    x,
    codes_ptr,
    levels_ptr,
    scales_ptr,
    offsets_ptr,
    start,
    cols,
    N,
    K,
    FOUR_BIT: tl.constexpr,
    LEVELS: tl.constexpr,
    PERMUTE: tl.constexpr,
    LEVEL_ASM: tl.constexpr,
    OFFSETS: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """`acc` plus the dot of `x` (BLOCK_K inputs from `start`) with the weights expanded in
    the tile, `code * scale + offset` rounded to x's dtype (as a de-quantized twin holds
    them). A dot a group of 16 or 32 inputs, its float32 sum then scaled and offset (as
    quant/cuda.py's `quantized_gemm` does), was 1.0-1.5x slower at 1-128 tokens and up to
    5x at 8,192 (bench/NOTES.md). Codes that stand for levels take them by byte permutes
    where PERMUTE, through the tiled dense product's loader (quant/cuda.py's `group_codes`)."""
    tile_ok = (cols < N)[None, :]
    code = group_codes(
        codes_ptr, levels_ptr, None, start, cols, N, K, BLOCK_K, BLOCK_N, FOUR_BIT, LEVELS,
        PERMUTE, LEVEL_ASM, 0, 0,
    )  # fmt: skip
    # each group's scale and offset loaded once, then repeated over its GROUP inputs
    groups: tl.constexpr = BLOCK_K // GROUP
    at = (start // GROUP + tl.arange(0, groups))[:, None] * N + cols[None, :]
    shape: tl.constexpr = (groups, GROUP, BLOCK_N)
    scale = tl.load(scales_ptr + at, mask=tile_ok, other=0.0).to(tl.float32)
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], shape), (BLOCK_K, BLOCK_N))
    weight = code.to(tl.float32) * scale
    if OFFSETS:
        offset = tl.load(offsets_ptr + at, mask=tile_ok, other=0.0).to(tl.float32)
        weight += tl.reshape(tl.broadcast_to(offset[:, None, :], shape), (BLOCK_K, BLOCK_N))
    return tl.dot(x, weight.to(x.dtype), acc, input_precision=PRECISION)


@triton.jit
def _moe_codes_gemm(
    a_ptr,
    codes_ptr,
    levels_ptr,
    book_ptr,
    scales_ptr,
    offsets_ptr,
    c_ptr,
    weight_ptr,
    bias_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    n_size,
    N,
    K,
    stride_am,
    stride_cm,
    stride_bias,
    swiglu_alpha,
    swiglu_limit,
    ROWS_PER_A: tl.constexpr,
    GATED: tl.constexpr,
    BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
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
    BLOCK_K: tl.constexpr,
):
    """One `[BLOCK_M, BLOCK_N]` tile of `C[pair] = A[pair // ROWS_PER_A] @ W[expert]^T` with
    W in codes (N rows, K inputs). GATED (the gate|up pass): W's rows are gate `[0, n_size)`
    then up `[n_size, N)`, and the tile is `silu(A @ gate^T) * (A @ up^T)`; otherwise each
    row is scaled by its pair's routing weight (biases and gpt-oss's clamped SwiGLU:
    `expert_epilogue`). Padding rows (pair id `num_pairs`) read row 0 of A and store
    nothing."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs, row_ok = block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
    a_rows = a_ptr + tl.where(row_ok, pairs // ROWS_PER_A, 0) * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # (book entries: a run's 2 or 3 planes of bytes)
    lines = K // 8 * (3 if SIGNS_AT else 2) if LOW_BITS else (K // 2 if FOUR_BIT else K)
    codes_ptr += expert * lines * N
    scales_ptr += expert * (K // GROUP) * N
    if OFFSETS:
        offsets_ptr += expert * (K // GROUP) * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        if LOW_BITS:  # book entries: runs of 8 inputs (BLOCK_K is 128)
            acc = book_dots(
                acc, a_rows, row_ok, codes_ptr, book_ptr, levels_ptr, scales_ptr, offsets_ptr,
                start, cols, N, K, a_ptr.dtype.element_ty, PERMUTE, LEVEL_ASM, LOW_BITS,
                SIGNS_AT, OFFSETS, GROUP, PRECISION, BLOCK_K, BLOCK_N,
            )  # fmt: skip
            if GATED:
                acc_up = book_dots(
                    acc_up, a_rows, row_ok, codes_ptr, book_ptr, levels_ptr, scales_ptr,
                    offsets_ptr, start, cols + n_size, N, K, a_ptr.dtype.element_ty, PERMUTE,
                    LEVEL_ASM, LOW_BITS, SIGNS_AT, OFFSETS, GROUP, PRECISION, BLOCK_K, BLOCK_N,
                )  # fmt: skip
        else:
            x = tl.load(a_rows[:, None] + (start + tl.arange(0, BLOCK_K))[None, :])
            acc = _expanded_dot(
                acc, x, codes_ptr, levels_ptr, scales_ptr, offsets_ptr, start, cols, N, K,
                FOUR_BIT, LEVELS, PERMUTE, LEVEL_ASM, OFFSETS, GROUP, PRECISION, BLOCK_K, BLOCK_N,
            )  # fmt: skip
            if GATED:
                acc_up = _expanded_dot(
                    acc_up, x, codes_ptr, levels_ptr, scales_ptr, offsets_ptr, start,
                    cols + n_size, N, K, FOUR_BIT, LEVELS, PERMUTE, LEVEL_ASM, OFFSETS, GROUP,
                    PRECISION, BLOCK_K, BLOCK_N,
                )  # fmt: skip
    col_ok = cols < n_size
    acc = expert_epilogue(
        acc, acc_up, expert, pairs, row_ok, cols, col_ok, n_size, weight_ptr, bias_ptr,
        stride_bias, swiglu_alpha, swiglu_limit, GATED, BIAS, CLAMPED,
    )  # fmt: skip
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=ok)


# Of the settings tried on an H100 (bench/NOTES.md), best at every batch from 1 to 8,192
# tokens on Qwen3-30B-A3B's and a smaller expert shape (4-bit codes) with the fused float
# kernels' block rows (`block_rows`: at most 64).
BLOCK_N, BLOCK_K, WARPS, STAGES = 64, 128, 4, 3
# With `takes_wide_tiles` (moe_triton.py) 128 x 128 tiles on 8 warps; their stages by bytes
# an activation (3 overflowed Hopper's shared memory with float32 ones).
WIDE_STAGES = {2: 3, 4: 2}


def _launch(
    a: torch.Tensor,
    w: StackedCodes,
    c: torch.Tensor,
    weights: torch.Tensor,
    layout_pairs: torch.Tensor,
    layout_experts: torch.Tensor,
    rows_per_a: int,
    gated: bool,
    block_m: int,
    bias: torch.Tensor | None = None,
    style: ExpertStyle = PLAIN_EXPERTS,
) -> None:
    n_size = c.shape[1]
    block_k = next(b for b in (BLOCK_K, 64, 32, 16) if w.cols % b == 0 and b % w.group == 0)
    assert w.book is None or block_k == 128, "book entries take steps of 128 inputs"
    wide = block_m == WIDE_BLOCK_M
    block_n, warps = (WIDE_BLOCK_N, WIDE_WARPS) if wide else (BLOCK_N, WARPS)
    stages = WIDE_STAGES[a.element_size()] if wide else STAGES
    grid = (layout_experts.numel(), triton.cdiv(n_size, block_n))
    _moe_codes_gemm[grid](
        a,
        w.codes,
        w.levels,
        w.book,
        w.scales,
        w.offsets,
        c,
        weights,
        weights if bias is None else bias,
        layout_pairs,
        layout_experts,
        weights.numel(),
        w.experts,
        n_size,
        w.rows,
        w.cols,
        a.stride(0),
        c.stride(0),
        0 if bias is None else bias.stride(0),
        style.swiglu_alpha,
        style.swiglu_limit or 0.0,
        ROWS_PER_A=rows_per_a,
        GATED=gated,
        BIAS=bias is not None,
        CLAMPED=style.swiglu_limit is not None,
        FOUR_BIT=w.four_bit,
        LEVELS=w.levels is not None,
        PERMUTE=a.is_cuda,  # Triton's interpreter (tests on CPU) runs no PTX
        LEVEL_ASM=w.level_asm,
        LOW_BITS=w.low_bits,
        SIGNS_AT=w.signs_at,
        OFFSETS=w.offsets is not None,
        GROUP=w.group,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )


def fused_code_experts(
    x: torch.Tensor,
    gate_up: StackedCodes,
    down: StackedCodes,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    style: ExpertStyle = PLAIN_EXPERTS,
) -> torch.Tensor:
    """Each token's routing-weighted sum over its experts, `[tokens, hidden]`: the
    `MoEBackend.experts` contract (aserve/layers/moe.py) for experts in codes."""

    def launch(
        a: torch.Tensor,
        c: torch.Tensor,
        gated: bool,
        weights: torch.Tensor,
        layout: BlockLayout,
        rows_per_a: int,
        block_m: int,
    ) -> None:
        bias = w13_bias if gated else w2_bias
        codes = gate_up if gated else down
        _launch(a, codes, c, weights, *layout, rows_per_a, gated, block_m, bias, style)

    return two_passes(x, topk_weights, topk_ids, gate_up.experts, gate_up.rows // 2, launch)
