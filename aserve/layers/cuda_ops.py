"""aserve's Triton kernels for a decoder's small steps on CUDA (RMSNorm, the residual add,
SiLU- or GELU-and-mul, RoPE) behind the names of FlashInfer's functions, as
layers/cpu_ops.py does on CPU. They used to be FlashInfer's own; its norm and activation
modules took 20-30 s to compile on a fresh machine, these take about a second each, and all
are bound by memory bandwidth, which Triton reaches as well.

The rounding follows Hugging Face's formulas: the residual sum is rounded to the model's
dtype before it is normalised, the normalised row before it is weighted (Llama's order; a
float32 weight, Gemma's 1 + w, weighs the float32 row and rounds once, Gemma's order),
SiLU's output before the product. Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.layers.pdl import pdl_options, wait_for_previous


@triton.jit
def _weighed_as_stored(normed, dtype: tl.constexpr, weight_dtype: tl.constexpr):
    """The normalised float32 row as the weight will multiply it: rounded to the row's dtype
    first under a weight of that dtype (Llama), kept in float32 under a float32 weight."""
    if weight_dtype == dtype:
        return normed.to(dtype).to(tl.float32)
    return normed


@triton.jit
def _rmsnorm_kernel(
    x,
    out,
    weight,
    eps,
    heads,
    token_stride,
    head_stride,
    out_token_stride,
    out_head_stride,
    size,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row; a row is one head of one token (`heads` per token)."""
    wait_for_previous(PDL, EARLY)
    row = tl.program_id(0)
    token, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    inside = cols < size
    source = x + token * token_stride + head * head_stride
    values = tl.load(source + cols, mask=inside, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(values * values, axis=0) / size + eps)
    normed = _weighed_as_stored(values * inv_rms, x.dtype.element_ty, weight.dtype.element_ty)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    target = out + token * out_token_stride + head * out_head_stride
    tl.store(target + cols, (normed * w).to(out.dtype.element_ty), mask=inside)


@triton.jit
def _add_rmsnorm_kernel(
    x,
    residual,
    weight,
    eps,
    x_stride,
    residual_stride,
    size,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """`residual += x` (rounded), then `x = norm(residual) * weight`, one program a row."""
    wait_for_previous(PDL, EARLY)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < size
    x_row = x + row * x_stride
    residual_row = residual + row * residual_stride
    total = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
    total += tl.load(residual_row + cols, mask=inside, other=0.0).to(tl.float32)
    rounded = total.to(residual.dtype.element_ty)
    tl.store(residual_row + cols, rounded, mask=inside)
    values = rounded.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(values * values, axis=0) / size + eps)
    normed = _weighed_as_stored(values * inv_rms, x.dtype.element_ty, weight.dtype.element_ty)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(x_row + cols, (normed * w).to(x.dtype.element_ty), mask=inside)


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """`silu(gate) * up` in `dtype` from float32 halves, SiLU's output rounded to `dtype`
    first (Hugging Face's order); quant/fp8_cuda.py's FP8 activation rounds the same way."""
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (activated * up).to(dtype)


@triton.jit
def gelu_tanh_mul(gate, up, dtype: tl.constexpr):
    """`gelu(gate, approximate="tanh") * up` in `dtype` from float32 halves, GELU's output
    rounded to `dtype` first; tanh(y) as 2 sigmoid(2y) - 1."""
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    activated = (0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))).to(dtype).to(tl.float32)
    return (activated * up).to(dtype)


@triton.jit
def _gate_and_mul_kernel(
    gate_up, out, in_stride, size, BLOCK: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr
):
    """Grid (rows, column blocks): `silu(gate) * up`, or with `GELU` Gemma's
    `gelu_tanh(gate) * up`, for the halves of each row."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < size
    source = gate_up + row * in_stride
    gate = tl.load(source + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(source + size + cols, mask=inside, other=0.0).to(tl.float32)
    if GELU:
        gated = gelu_tanh_mul(gate, up, out.dtype.element_ty)
    else:
        gated = silu_mul(gate, up, out.dtype.element_ty)
    tl.store(out + row * size + cols, gated, mask=inside)


@triton.jit
def _rope_kernel(
    positions,
    query,
    key,
    cos_sin,
    q_heads,
    q_stride,
    k_stride,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (tokens, q_heads + k_heads): rotate the halves of one head in place."""
    wait_for_previous(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    is_query = head < q_heads
    if is_query:
        base = query + token * q_stride + head * 2 * HALF
    else:
        base = key + token * k_stride + (head - q_heads) * 2 * HALF
    cols = tl.arange(0, BLOCK)
    inside = cols < HALF
    position = tl.load(positions + token)
    cos = tl.load(cos_sin + position * 2 * HALF + cols, mask=inside, other=0.0)
    sin = tl.load(cos_sin + position * 2 * HALF + HALF + cols, mask=inside, other=0.0)
    first = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
    second = tl.load(base + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(base + cols, (first * cos - second * sin).to(base.dtype.element_ty), mask=inside)
    tl.store(
        base + HALF + cols, (second * cos + first * sin).to(base.dtype.element_ty), mask=inside
    )


def row_warps(block: int) -> int:
    """Warps for a kernel that takes a row of `block` columns a program."""
    return min(16, max(1, block // 256))


class CudaKernels:
    """The subset of FlashInfer's API that aserve's dense decoder calls."""

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of a 2-D `x`, or the heads of a 3-D `[tokens, heads, size]` view (Qwen3's
        Q/K norm on the fused QKV output, strided); `out` may be `x` itself."""
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        size = x.shape[-1]
        assert x.stride(-1) == 1 and out.stride(-1) == 1, "rows must be contiguous"
        x3, out3 = (x, out) if x.dim() == 3 else (x[:, None], out[:, None])
        tokens, heads = x3.shape[0], x3.shape[1]
        if tokens * heads == 0:
            return out
        block = triton.next_power_of_2(size)
        _rmsnorm_kernel[(tokens * heads,)](
            x3,
            out3,
            weight,
            eps,
            heads,
            x3.stride(0),
            x3.stride(1),
            out3.stride(0),
            out3.stride(1),
            size,
            BLOCK=block,
            EARLY=tokens * heads == 1,  # (pdl.py)
            num_warps=row_warps(block),
            **pdl_options(x.device, tokens),
        )
        return out

    def fused_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        rows, size = x.shape
        if rows == 0:
            return
        block = triton.next_power_of_2(size)
        _add_rmsnorm_kernel[(rows,)](
            x,
            residual,
            weight,
            eps,
            x.stride(0),
            residual.stride(0),
            size,
            BLOCK=block,
            EARLY=rows == 1,  # (pdl.py)
            num_warps=row_warps(block),
            **pdl_options(x.device, rows),
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gate_and_mul(gate_up, gelu=False)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gate_and_mul(gate_up, gelu=True)

    def _gate_and_mul(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        rows, size = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, size, dtype=gate_up.dtype, device=gate_up.device)
        if rows == 0:
            return out
        block = min(1024, triton.next_power_of_2(size))
        grid = (rows, triton.cdiv(size, block))
        _gate_and_mul_kernel[grid](
            gate_up,
            out,
            gate_up.stride(0),
            size,
            BLOCK=block,
            GELU=gelu,
            num_warps=4,
            **pdl_options(gate_up.device, rows),
        )
        return out

    def apply_rope_with_cos_sin_cache_inplace(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool = True,
    ) -> None:
        """`query` / `key` `[tokens, heads * head_size]` (strided views), `cos_sin_cache`
        `[positions, head_size]` float32 holding cos | sin halves."""
        assert is_neox, "aserve's models rotate the halves of each head (neox style)"
        tokens = query.shape[0]
        if tokens == 0:
            return
        q_heads, k_heads = query.shape[1] // head_size, key.shape[1] // head_size
        half = head_size // 2
        _rope_kernel[(tokens, q_heads + k_heads)](
            positions,
            query,
            key,
            cos_sin_cache,
            q_heads,
            query.stride(0),
            key.stride(0),
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
            num_warps=1,
            **pdl_options(query.device, tokens),
        )
