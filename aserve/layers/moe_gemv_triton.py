"""A few tokens' FP8 experts as matrix-vector products: the fused MoE backend in decode.

At one token a layer's experts are top_k matrix-vector products, each streaming its expert's
weight once. The grouped GEMM (moe_triton.py) pads every expert's one row into a tile of 16,
and with FP8 weights widens each tile for the tensor cores: on an H200 (bench/moe_kernels.py,
weights from memory) a GLM-4.5-Air layer's FP8 experts took 85 us for one token, 1.6 TB/s,
where its bf16 experts (twice the bytes) took 82. Here a program reads `BLOCK_N` rows of one
pair's expert in long runs of columns, as the one-row GEMV does (layers/gemv.py): 51 us (2.7
TB/s) for one token, 338 against 422 for 8, 626 against 609 for 16; Qwen3-30B-A3B's experts
25 against 39 us for one. bf16 experts lost here from 2 tokens on (GLM-4.5-Air's from one:
106 against 82 us), so they keep the grouped GEMM. The gate|up pass writes each pair's
SiLU(gate) * up, rounded as the grouped kernel stores it; the down pass gives each program a
token's `BLOCK_N` outputs and runs over its top_k experts, each product scaled by its
routing weight and rounded as the grouped pass stores a pair's row, then summed in float32:
the token's sum over its experts needs no kernel of its own.

Plain experts only (SiLU(gate) * up, no biases), FP8 with a scale a row (float weights too,
as the tests run them). The expert of each pair is the routing kernel's output, so nothing
is loaded before the PDL wait. Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.layers.pdl import pdl_options, wait_for_previous

GEMV_TOKENS = 8
"""Batches of up to this many tokens take these kernels; larger ones the grouped GEMM, which
reads an expert chosen by several tokens once (it won from 16 tokens on, above)."""


@triton.jit
def _gate_up_kernel(
    x,
    w13,
    scales,
    ids,
    act,
    inter,
    k,
    stride_e,
    stride_n,
    stride_se,
    TOP_K: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Pair `program_id(0)`'s SiLU(gate) * up for its expert's rows `program_id(1)`."""
    wait_for_previous(PDL)
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < inter
    expert = tl.load(ids + pair).to(tl.int64)
    gate_rows = w13 + expert * stride_e + rows[:, None] * stride_n
    up_rows = gate_rows + inter * stride_n
    row = x + (pair // TOP_K) * k
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < k)
        v = tl.load(row + cols, mask=cols < k, other=0.0).to(tl.float32)[None, :]
        g = tl.load(gate_rows + cols[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        u = tl.load(up_rows + cols[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        gate += g.to(tl.float32) * v
        up += u.to(tl.float32) * v
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    if SCALED:
        row_scales = scales + expert * stride_se + rows
        g *= tl.load(row_scales, mask=row_ok, other=0.0)
        u *= tl.load(row_scales + inter, mask=row_ok, other=0.0)
    out = act + pair * inter + rows
    tl.store(out, (g * tl.sigmoid(g) * u).to(act.dtype.element_ty), mask=row_ok)


@triton.jit
def _down_kernel(
    act,
    w2,
    scales,
    ids,
    weights,
    out,
    hidden,
    inter,
    stride_e,
    stride_n,
    stride_se,
    TOP_K: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token `program_id(0)`'s outputs `program_id(1)`: its pairs' down products, each
    weighted and rounded as a pair's row, summed."""
    wait_for_previous(PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids + pair).to(tl.int64)
        weight_rows = w2 + expert * stride_e + rows[:, None] * stride_n
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for start in range(0, inter, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (cols[None, :] < inter)
            v = tl.load(act + pair * inter + cols, mask=cols < inter, other=0.0)
            w = tl.load(
                weight_rows + cols[None, :], mask=ok, other=0.0, eviction_policy="evict_first"
            )
            acc += w.to(tl.float32) * v.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if SCALED:
            y *= tl.load(scales + expert * stride_se + rows, mask=row_ok, other=0.0)
        y *= tl.load(weights + pair).to(tl.float32)
        total += y.to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + token * hidden + rows, total.to(out.dtype.element_ty), mask=row_ok)


def gemv_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`MoEBackend.experts` for plain experts (see aserve/layers/moe.py) over a few tokens."""
    tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w2.shape[2]
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    fp8 = w13_scale is not None
    block_n, block_k, warps = (8, 512, 4) if fp8 else (4, 512, 4)
    pdl = pdl_options(x.device, tokens)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, block_n))](
        x,
        w13,
        w13 if w13_scale is None else w13_scale,
        ids,
        act,
        inter,
        hidden,
        w13.stride(0),
        w13.stride(1),
        0 if w13_scale is None else w13_scale.stride(0),
        TOP_K=top_k,
        SCALED=fp8,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        **pdl,
    )
    _down_kernel[(tokens, triton.cdiv(hidden, block_n))](
        act,
        w2,
        w2 if w2_scale is None else w2_scale,
        ids,
        topk_weights.reshape(-1).contiguous(),
        out,
        hidden,
        inter,
        w2.stride(0),
        w2.stride(1),
        0 if w2_scale is None else w2_scale.stride(0),
        TOP_K=top_k,
        SCALED=fp8,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        **pdl,
    )
    return out
