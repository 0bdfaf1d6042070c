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

Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        tile = weight + rows[:, None] * weight_stride + cols[None, :]
        if EVEN:
            w = tl.load(tile)
            v = tl.load(x + cols).to(tl.float32)
            if GATED:
                up = tl.load(x + k + cols).to(tl.float32)
        else:
            w = tl.load(tile, mask=(rows[:, None] < n) & (cols[None, :] < k), other=0.0)
            v = tl.load(x + cols, mask=cols < k, other=0.0).to(tl.float32)
            if GATED:
                up = tl.load(x + k + cols, mask=cols < k, other=0.0).to(tl.float32)
        if GATED:
            v = (v * tl.sigmoid(v) * up).to(out.dtype.element_ty).to(tl.float32)
        acc += w.to(tl.float32) * v[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:
        y *= tl.load(scales + rows, mask=rows < n, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=rows < n, other=0.0).to(tl.float32)
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=rows < n)


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
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # Rows and columns a program reads at a time, warps and pipeline stages, measured on an
    # H200 (whole 8B steps: 2 x 2,048 took 4.37 ms where 8 x 1,024 took 4.41; narrow inputs,
    # Qwen3-0.6B's 1,024, do best with 2 x 512). `gated` keeps 8 rows: each program computes
    # the activation of the whole input row (one row a program made the step 5.54 ms). FP8
    # rows: 8 x 1,024 with 4 warps was the fastest of seven settings on all of the 8B shape's
    # products and its LM head (bench/quant_kernels.py --fp8; gate_up 35.5 us, 3.3 TB/s,
    # where the bf16 GEMV takes 54.5).
    if config is not None:
        block_n, block_k, warps, stages = config
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
        EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out
