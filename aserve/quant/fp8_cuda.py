"""The per-token FP8 quantization of activations in one kernel (quant/fp8.py's
`quantize_tokens` in five elementwise PyTorch kernels otherwise, twice per layer and product).
Imported only on CUDA (it imports Triton)."""

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
