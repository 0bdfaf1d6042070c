"""The `fused` MoE backend: two Triton grouped-GEMM launches over the pairs of a batch.

The (token, expert) pairs are laid out by `align_blocks` in blocks of `BLOCK_M` rows that each
belong to one expert, so every program multiplies a tile of one expert's rows by that expert's
weights. The first launch gathers the tokens' hidden rows, multiplies them by gate and up in
the same program and writes `silu(gate) * up` (the activation never makes a round trip through
memory at full gate_up width); the second multiplies that by down and scales each row by its
routing weight. Each token's k rows are then summed. Everything runs on the device with sizes
known from the shapes, so a decode step can be captured in a CUDA graph.

Imported only by `aserve.layers.moe.moe_backend` on CUDA: Triton is not installed everywhere.
float32 runs with IEEE products (no TF32), so it can be compared token for token with the
torch backend.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import triton
import triton.language as tl

from aserve.config import PLAIN_EXPERTS, ExpertStyle
from aserve.engine.gpu import HOPPER_SHARED_MEMORY, gpu_capability, shared_memory_limit
from aserve.layers.moe_align_triton import device_layout
from aserve.layers.moe_gemv_triton import GEMV_TOKENS, gemv_experts
from aserve.layers.moe_layout import BlockLayout


@triton.jit
def block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """The pair ids of layout block `block` and which are real (padding holds `num_pairs`)."""
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pairs, pairs < num_pairs


@triton.jit
def expert_epilogue(
    acc,
    acc_up,
    expert,
    pairs,
    row_ok,
    cols,
    col_ok,
    n_size,
    weight_ptr,
    bias_ptr,
    stride_bias,
    swiglu_alpha,
    swiglu_limit,
    GATED: tl.constexpr,
    BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
):
    """A tile's end in both fused backends: the expert's bias row (gate's then up's in the
    gated pass), then the gated activation (SiLU, or with CLAMPED gpt-oss's
    `(up + 1) * gate * sigmoid(alpha * gate)`, gate clamped above and up on both sides at
    the limit), or in the down pass each row scaled by its pair's routing weight."""
    if BIAS:
        biases = bias_ptr + expert * stride_bias + cols
        acc += tl.load(biases, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(biases + n_size, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED and CLAMPED:
        gate = tl.minimum(acc, swiglu_limit)
        up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * swiglu_alpha))
    if GATED:
        return acc * tl.sigmoid(acc) * acc_up
    weight = tl.load(weight_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    return acc * weight[:, None]


@triton.jit
def _moe_gemm(
    a_ptr,
    b_ptr,
    c_ptr,
    weight_ptr,
    scale_ptr,
    bias_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    n_size,
    k_size,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_se,
    stride_bias,
    swiglu_alpha,
    swiglu_limit,
    ROWS_PER_A: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,
    BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One `[BLOCK_M, BLOCK_N]` tile of `C[pair] = A[pair // ROWS_PER_A] @ B[expert]^T`.

    GATED (the gate_up pass): B holds gate rows `[0, n_size)` then up rows `[n_size, 2 n_size)`
    and the tile is `silu(A @ gate^T) * (A @ up^T)`. Otherwise (the down pass) each row is
    scaled by its pair's routing weight. FP8 (B in float8_e4m3fn): B's values are widened to
    A's dtype for the dot and each output column is scaled by its expert row's scale. BIAS
    and CLAMPED (gpt-oss): `expert_epilogue`.
    Padding rows (pair id `num_pairs`) load zeros and store nothing. PRECISION applies to
    float32 inputs only: "ieee" keeps full products there."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs, row_ok = block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < n_size
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + (pairs // ROWS_PER_A)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, k_size, BLOCK_K):
        k_ok = offs_k < k_size - k_start
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            up = tl.load(
                b_ptrs + n_size * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            if FP8:
                up = up.to(a.dtype)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if FP8:
        scales = scale_ptr + expert * stride_se + offs_n
        acc = acc * tl.load(scales, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scales + n_size, mask=col_ok, other=0.0)[None, :]
    acc = expert_epilogue(
        acc, acc_up, expert, pairs, row_ok, offs_n, col_ok, n_size, weight_ptr, bias_ptr,
        stride_bias, swiglu_alpha, swiglu_limit, GATED, BIAS, CLAMPED,
    )  # fmt: skip
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: small when experts get few rows each (decode), so padding stays small."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


# Long prefill batches of wide experts take 128 x 128 tiles on 8 warps in both fused backends
# (the same bits: K is summed in the same order). H100, us a Qwen3-30B-A3B layer (768 rows
# an expert) at 4,096 / 8,192 / 16,384 tokens, 64 x 64 tiles -> these: bf16 1,562 / 2,771 /
# 5,165 -> 1,218 / 2,070 / 3,758; FP8 (128 inputs a step) 1,669 / 3,102 / 5,970 -> 1,574 /
# 2,725 / 4,931; GGUF codes 2,111 / 3,949 / 7,630 -> 1,976 / 3,301 / 5,842. At 2,048 tokens
# (128 pairs an expert) FP8 and codes lost, and codes experts of 192 rows lost at every size.
# Their pipeline stages fill Hopper's shared memory, so smaller GPUs keep the narrow tiles.
WIDE_BLOCK_M, WIDE_BLOCK_N, WIDE_WARPS = 128, 128, 8
WIDE_PAIRS = 256  # pairs an expert on average
WIDE_INTER = 512  # rows of an expert's gate (or up)


@cache
def wide_tiles_fit(device: torch.device) -> bool:
    capability = gpu_capability(device)
    return capability is not None and shared_memory_limit(capability) >= HOPPER_SHARED_MEMORY


def takes_wide_tiles(num_pairs: int, num_experts: int, inter: int, device: torch.device) -> bool:
    return inter >= WIDE_INTER and num_pairs >= WIDE_PAIRS * num_experts and wide_tiles_fit(device)


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights: torch.Tensor,
    layout_pairs: torch.Tensor,
    layout_experts: torch.Tensor,
    rows_per_a: int,
    gated: bool,
    block_m: int,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    style: ExpertStyle = PLAIN_EXPERTS,
) -> None:
    n_size = c.shape[1]
    ieee = a.dtype == torch.float32
    block_n, block_k, warps = 64, 32 if ieee else 64, 4
    if block_m == WIDE_BLOCK_M:
        block_n, warps = WIDE_BLOCK_N, WIDE_WARPS
        block_k = 128 if scale is not None else block_k
    grid = (layout_experts.numel(), triton.cdiv(n_size, block_n))
    _moe_gemm[grid](
        a,
        b,
        c,
        weights,
        weights if scale is None else scale,
        weights if bias is None else bias,
        layout_pairs,
        layout_experts,
        weights.numel(),
        b.shape[0],
        n_size,
        a.shape[1],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        0 if scale is None else scale.stride(0),
        0 if bias is None else bias.stride(0),
        style.swiglu_alpha,
        style.swiglu_limit or 0.0,
        ROWS_PER_A=rows_per_a,
        GATED=gated,
        FP8=scale is not None,
        BIAS=bias is not None,
        CLAMPED=style.swiglu_limit is not None,
        PRECISION="ieee" if ieee else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=2 if ieee else 3,
    )


PassLaunch = Callable[[torch.Tensor, torch.Tensor, bool, torch.Tensor, BlockLayout, int, int], None]
"""One pass's launch: (a, c, gated, routing weights, layout, pairs a row of a, block rows)."""


def two_passes(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    inter: int,
    launch: PassLaunch,
) -> torch.Tensor:
    """The frame of both fused backends (float and FP8 experts here, GGUF codes in
    moe_codes_triton.py): the block layout (`block_rows`, or WIDE_BLOCK_M rows where
    `takes_wide_tiles`), the gate|up pass into `silu(gate) * up`, the down pass weighted by
    the routing weights, and each token's sum over its k rows."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    wide = takes_wide_tiles(num_pairs, num_experts, inter, x.device)
    block_m = WIDE_BLOCK_M if wide else block_rows(num_pairs, num_experts)
    layout = device_layout(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    x = x.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    launch(x, act, True, weights, layout, top_k, block_m)
    out = torch.empty(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)
    launch(act, out, False, weights, layout, 1, block_m)
    return out.view(tokens, top_k, -1).sum(dim=1)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    style: ExpertStyle = PLAIN_EXPERTS,
) -> torch.Tensor:
    """The `MoEBackend.experts` contract (see aserve/layers/moe.py), on CUDA; a few tokens
    of plain FP8 experts as matrix-vector products (moe_gemv_triton.py)."""
    plain = w13_bias is None and w2_bias is None and style == PLAIN_EXPERTS
    if plain and w13_scale is not None and topk_ids.shape[0] <= GEMV_TOKENS:
        return gemv_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)

    def launch(
        a: torch.Tensor,
        c: torch.Tensor,
        gated: bool,
        weights: torch.Tensor,
        layout: BlockLayout,
        rows_per_a: int,
        block_m: int,
    ) -> None:
        b, scale = (w13, w13_scale) if gated else (w2, w2_scale)
        bias = w13_bias if gated else w2_bias
        _launch(a, b, c, weights, *layout, rows_per_a, gated, block_m, scale, bias, style)

    return two_passes(x, topk_weights, topk_ids, w13.shape[0], w13.shape[1] // 2, launch)
