"""FP8 kernels in Triton (imported only on CUDA): the per-token quantization of activations
in one kernel (quant/fp8.py's `quantize_tokens` in five elementwise PyTorch kernels
otherwise, twice per layer and product), and a one-row product that reads FP8 weights as
they are. At one row `torch._scaled_mm` plus the token quantization lost to the bfloat16
GEMV (an 8B step 5.33 ms against 4.34): the GEMV here streams half the bytes and multiplies
the bfloat16 activations as they come, with no activation rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _quantize_tokens_kernel(x_ptr, values_ptr, scales_ptr, cols, x_stride, BLOCK: tl.constexpr):
    """One token a program: the largest magnitude of its row, then the row divided by
    amax / 448, saturated and rounded to float8_e4m3fn (the same operations as the PyTorch
    version)."""
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        ok = start + offsets < cols
        x = tl.load(x_ptr + row * x_stride + start + offsets, mask=ok, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
    tl.store(scales_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        ok = start + offsets < cols
        x = tl.load(x_ptr + row * x_stride + start + offsets, mask=ok, other=0.0)
        q = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        tl.store(values_ptr + row * cols + start + offsets, q.to(tl.float8e4nv), mask=ok)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[tokens, cols]` in FP8 with one float32 scale per token, `[tokens, 1]`."""
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens, cols = x.shape
    values = torch.empty(tokens, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    if tokens:
        _quantize_tokens_kernel[(tokens,)](x, values, scales, cols, x.stride(0), BLOCK=1024)
    return values, scales


@triton.jit
def _fp8_gemv_kernel(
    x,
    weight,
    scales,
    bias,
    out,
    n,
    k,
    weight_stride,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        tile = weight + rows[:, None] * weight_stride + cols[None, :]
        if EVEN:
            w = tl.load(tile)
            v = tl.load(x + cols).to(tl.float32)
        else:
            w = tl.load(tile, mask=(rows[:, None] < n) & (cols[None, :] < k), other=0.0)
            v = tl.load(x + cols, mask=cols < k, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * v[None, :]
    y = tl.sum(acc, axis=1) * tl.load(scales + rows, mask=rows < n, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=rows < n, other=0.0).to(tl.float32)
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=rows < n)


def fp8_gemv(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x (values * scales)^T + bias` for one row `x` `[1, K]`: FP8 `values` `[N, K]`, one
    float32 scale per output row. `config` (rows and columns a program reads at a time,
    warps, stages) overrides the measured choice, for bench/quant_kernels.py's sweep."""
    n, k = values.shape
    assert x.shape == (1, k) and values.stride(1) == 1 and scales.numel() == n
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # 8 rows x 1,024 columns, 4 warps: the fastest of seven settings on all of the 8B
    # shape's products and its LM head (H200, bench/quant_kernels.py --fp8; gate_up 35.5 us,
    # 3.3 TB/s, where the bf16 GEMV takes 54.5).
    block_n, block_k, warps, stages = config or (8, 1024, 4, 2)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        values,
        scales,
        values if bias is None else bias,
        out,
        n,
        k,
        values.stride(0),
        HAS_BIAS=bias is not None,
        EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out
