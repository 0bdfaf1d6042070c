"""Q/K norm, RoPE and the KV write of one layer in a single Triton kernel (CUDA only).

Between the QKV projection and attention a layer otherwise runs up to four small kernels:
Qwen3's Q norm and K norm, RoPE on Q and K, and the indexed write of K and V into the pool.
At batch 1 each is a few microseconds of launch-bound work, a layer's worth adds up to more
than the attention kernel itself. Here one program per token and part (Q, K or V) loads
the part's heads once, normalises and rotates them in float32 as FlashInfer's kernels do
(rounding to the model dtype after the norm, as their two kernels in a row would), writes Q
back in place and K and V to their slot of the pool. An FP8 pool gets K and V divided by the
layer's scales and saturated, from the values rounded to the model dtype: the same bytes
`KVPool.store` writes from the unfused path's output.

Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.layers.pdl import pdl_options, wait_for_previous


@triton.jit
def _to_fp8(x, scale):
    """`x / scale` saturated at e4m3's largest finite value, +-448, as float8_e4m3fn. The
    division rounds as IEEE's (and PyTorch's) does; plain `/` may be approximate."""
    scaled = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(scaled, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def _norm_rope_heads(
    src,
    num_heads,
    BLOCK_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    ACROSS: tl.constexpr,
    weight,
    eps,
    cos,
    sin,
    dst,
    dst_scale,
    TO_FP8: tl.constexpr,
):
    """Rotate `num_heads` heads at `src`, after an RMSNorm with NORM (one a head, or with
    ACROSS one over all of them, OLMo 2's, whose weight is as wide), into `dst` (in FP8 over
    `dst_scale` with TO_FP8). A half head that is no power of two (48 of Phi-3-mini's 96) is
    read padded to HALF_PAD, the padding masked."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = heads < num_heads
    if HALF_PAD != HALF:
        mask = mask & (cols < HALF)
    first = heads * (2 * HALF) + cols
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM and ACROSS:
        squares = tl.sum(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), axis=0)
        scale = tl.rsqrt(squares / (num_heads * 2 * HALF) + eps)
        w1 = tl.load(weight + first, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight + first + HALF, mask=mask, other=0.0).to(tl.float32)
        x1 = (x1 * scale * w1).to(src.dtype.element_ty).to(tl.float32)
        x2 = (x2 * scale * w2).to(src.dtype.element_ty).to(tl.float32)
    elif NORM:
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        scale = tl.rsqrt(mean_square + eps)[:, None]
        if HALF_PAD == HALF:
            w1 = tl.load(weight + cols).to(tl.float32)
            w2 = tl.load(weight + HALF + cols).to(tl.float32)
        else:
            w1 = tl.load(weight + cols, mask=cols < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(weight + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * scale * w1).to(src.dtype.element_ty).to(tl.float32)
        x2 = (x2 * scale * w2).to(src.dtype.element_ty).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(src.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(src.dtype.element_ty)
    if TO_FP8:
        y1 = _to_fp8(y1, dst_scale)
        y2 = _to_fp8(y2, dst_scale)
    tl.store(dst + first, y1, mask=mask)
    tl.store(dst + first + HALF, y2, mask=mask)


# `positions` and `slots` are slices of the batch's packed index tensor, aligned to 16 bytes
# or not by the rows before them: one compile for both (a second one otherwise ran inside a
# server's first requests).
@triton.jit(do_not_specialize_on_alignment=["positions", "slots"])
def _norm_rope_store_kernel(
    qkv,
    row_stride,
    positions,
    cos_sin,
    q_weight,
    k_weight,
    eps,
    cache,
    slots,
    k_scale,
    v_scale,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    ACROSS: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    row = qkv + token * row_stride
    # Slots, positions and the cos/sin table come from the host, not from a kernel before
    # this one: read before the wait, they are not on the chain of dependent loads.
    slot = tl.load(slots + token)
    cache_row = cache + slot * (2 * NUM_KV * HEAD_DIM)
    position = tl.load(positions + token)
    half = tl.arange(0, HALF_PAD)[None, :]
    if HALF_PAD == HALF:
        cos = tl.load(cos_sin + position * HEAD_DIM + half)
        sin = tl.load(cos_sin + position * HEAD_DIM + HALF + half)
    else:
        cos = tl.load(cos_sin + position * HEAD_DIM + half, mask=half < HALF, other=0.0)
        sin = tl.load(cos_sin + position * HEAD_DIM + HALF + half, mask=half < HALF, other=0.0)
    wait_for_previous(PDL)
    if part == 2:
        kv_heads = tl.arange(0, BLOCK_KV)[:, None]
        dims = tl.arange(0, 2 * HALF_PAD)[None, :]
        offsets = kv_heads * HEAD_DIM + dims
        v_mask = kv_heads < NUM_KV
        if HALF_PAD != HALF:
            v_mask = v_mask & (dims < HEAD_DIM)
        v = tl.load(row + (NUM_Q + NUM_KV) * HEAD_DIM + offsets, mask=v_mask)
        if FP8:
            v = _to_fp8(v, v_scale)
        tl.store(cache_row + NUM_KV * HEAD_DIM + offsets, v, mask=v_mask)
    else:
        if part == 0:
            _norm_rope_heads(
                row,
                NUM_Q,
                BLOCK_Q,
                HALF,
                HALF_PAD,
                NORM,
                ACROSS,
                q_weight,
                eps,
                cos,
                sin,
                row,
                1.0,
                False,
            )
        else:
            k = row + NUM_Q * HEAD_DIM
            _norm_rope_heads(
                k,
                NUM_KV,
                BLOCK_KV,
                HALF,
                HALF_PAD,
                NORM,
                ACROSS,
                k_weight,
                eps,
                cos,
                sin,
                cache_row,
                k_scale,
                FP8,
            )


def norm_rope_store(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: torch.Tensor,
    slots: torch.Tensor,
    head_dim: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    across_heads: bool = False,
) -> None:
    """Q `[T, heads * head_dim]` and KV `[T, 2 * kv_heads * head_dim]`, both views of one
    fused QKV output: norm (when weights are given) and rotate Q in place; norm and rotate
    K and write it with V into `cache` `[slots, 2, kv_heads, head_dim]` at `slots` (in the
    model dtype, or in FP8 over `kv_scales`). K in the QKV output is left as it was:
    attention reads K from the pool. With `across_heads` each norm spans all of its heads,
    its weight as wide (OLMo 2's, one rank's whole projection)."""
    tokens = q.shape[0]
    num_q, num_kv = q.shape[1] // head_dim, kv.shape[1] // (2 * head_dim)
    assert kv.data_ptr() == q.data_ptr() + q.shape[1] * q.element_size()
    assert q.stride(1) == 1 and kv.stride(0) == q.stride(0) and cache.is_contiguous()
    norm = q_weight is not None and k_weight is not None
    _norm_rope_store_kernel[(tokens, 3)](
        q,
        q.stride(0),
        positions,
        cos_sin,
        q_weight if norm else cos_sin,
        k_weight if norm else cos_sin,
        eps,
        cache,
        slots,
        *kv_scales,
        NUM_Q=num_q,
        NUM_KV=num_kv,
        BLOCK_Q=triton.next_power_of_2(num_q),
        BLOCK_KV=triton.next_power_of_2(num_kv),
        HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        NORM=norm,
        ACROSS=across_heads,
        FP8=cache.dtype == torch.float8_e4m3fn,
        **pdl_options(q.device, tokens),
    )
