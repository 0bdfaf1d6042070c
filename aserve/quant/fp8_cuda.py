"""FP8 products on CUDA and the kernels that feed them: the per-token quantization of
activations in one kernel (quant/fp8.py's `quantize_tokens` in five elementwise PyTorch
kernels otherwise), the same quantization fused into the RMSNorm before a product
(`norm_fp8`), and the products themselves for a few rows (`few_rows`) and for up to a few
hundred (`token_scaled`). Imported only on CUDA
(it imports Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.layers.cuda_ops import row_warps, silu_mul
from aserve.layers.pdl import launch_next, pdl_options, wait_for_previous, wait_only
from aserve.layers.tickets import last_of_splits, split_tickets
from aserve.quant.fp8_activations import Fp8Activations

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _quantize_tokens_kernel(
    x_ptr, values_ptr, scales_ptr, cols, x_stride, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """One token a program: the largest magnitude of its row, then the row divided by
    amax / 448, saturated and rounded to float8_e4m3fn (the same operations as the PyTorch
    version)."""
    wait_for_previous(PDL)
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
        block, warps = _row_block(cols)
        _quantize_tokens_kernel[(tokens,)](
            x,
            values,
            scales,
            cols,
            x.stride(0),
            BLOCK=block,
            num_warps=warps,
            **pdl_options(x.device, tokens),
        )
    return values, scales


def _row_block(cols: int) -> tuple[int, int]:
    """(block, warps) for the quantization, which takes a whole row a program in two passes
    (its largest magnitude, then its FP8 values): rows up to 16,384 wide in one block each
    pass, so a program waits for memory twice and not once per 1,024 columns. A gated row of
    Llama-3.1-8B (14,336) took 14 dependent loads; SiLU-and-mul fused into this kernel lost
    to the two kernels below 256 rows, whose first one splits each row over programs
    (bench/quant_kernels.py --fp8-feeds on the H200, us: 5.3 against 4.2 at 16 rows, 9.3
    against 7.7 at 256)."""
    block = min(16384, triton.next_power_of_2(cols))
    return block, min(16, max(4, block // 512))


@triton.jit
def _norm_fp8_kernel(
    x,
    residual,
    weight,
    values,
    scales,
    eps,
    x_stride,
    residual_stride,
    size,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program a row: (`residual += x`, rounded, then) the RMSNorm of layers/cuda_ops.py
    rounded as it rounds, then that row quantized as `_quantize_tokens_kernel` quantizes it:
    the same FP8 bytes and scale as the two kernels, in one pass and without the bf16 row."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < size
    dtype = x.dtype.element_ty
    total = tl.load(x + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_row = residual + row * residual_stride
        total += tl.load(residual_row + cols, mask=inside, other=0.0).to(tl.float32)
        rounded = total.to(dtype)
        tl.store(residual_row + cols, rounded, mask=inside)
        total = rounded.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(total * total, axis=0) / size + eps)
    normed = (total * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    y = (normed * w).to(dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / FP8_MAX
    tl.store(scales + row, scale)
    q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    tl.store(values + row * size + cols, q.to(tl.float8e4nv), mask=inside)


def norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> Fp8Activations:
    """RMSNorm of the rows of `x` (of `residual += x` with `residual`, updated in place) in
    FP8 with a scale per row, for an FP8 product to take as it is."""
    rows, size = x.shape
    values = torch.empty(rows, size, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(size)
        _norm_fp8_kernel[(rows,)](
            x,
            x if residual is None else residual,
            weight,
            values,
            scales,
            eps,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            size,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=row_warps(block),
            **pdl_options(x.device, rows),
        )
    return Fp8Activations(values, scales, x.dtype)


@triton.jit
def _silu_fp8_kernel(
    gate_up, values, scales, in_stride, size, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """One program a row: SiLU(gate) * up as layers/cuda_ops.py's kernel computes it (its
    `silu_mul`), then quantized as `_quantize_tokens_kernel` quantizes: the same FP8 bytes
    and scale as the two kernels, without writing and reading back the bf16 row."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < size
    source = gate_up + row * in_stride
    gate = tl.load(source + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(source + size + cols, mask=inside, other=0.0).to(tl.float32)
    y = silu_mul(gate, up, gate_up.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / FP8_MAX
    tl.store(scales + row, scale)
    q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    tl.store(values + row * size + cols, q.to(tl.float8e4nv), mask=inside)


SILU_FP8_MIN_ROWS = 17
"""From this many rows `silu_fp8` replaces the activation kernel and the quantization kernel
(bench/quant_kernels.py --fp8-feeds on the H200, 8B shape, us: 3.7 against 4.8 at 64 rows,
5.8 against 7.7 at 256, 296 against 554 at 16,384); up to 16 rows `few_rows` takes the
activation in bf16 and rounds it to FP8 itself."""


def silu_fp8(gate_up: torch.Tensor) -> Fp8Activations:
    """SiLU(gate) * up of fused gate|up rows `[rows, 2 * size]` in FP8 with a scale per row,
    for an FP8 product to take as it is. Rows up to 16,384 wide."""
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    assert size <= 16384 and gate_up.stride(1) == 1
    values = torch.empty(rows, size, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    if rows:
        block = triton.next_power_of_2(size)
        _silu_fp8_kernel[(rows,)](
            gate_up,
            values,
            scales,
            gate_up.stride(0),
            size,
            BLOCK=block,
            num_warps=16,
            **pdl_options(gate_up.device, rows),
        )
    return Fp8Activations(values, scales, gate_up.dtype)


FEW_ROWS_MAX = 16  # the tile of rows of `few_rows`'s tensor-core product


# One compile for every row count: each captured batch size would otherwise
# add variants (Triton specializes integers equal to 1 and multiples of 16).
@triton.jit(do_not_specialize=["m"])
def _few_rows_kernel(
    x,
    x_stride,
    weight,
    weight_stride,
    weight_scales,
    bias,
    out,
    out_stride,
    partial,
    tickets,
    m,
    n,
    k,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """`BLOCK_N` outputs for every row: the weight tile is the product's first operand
    ("swap AB": its outputs fill the tensor cores' 64-row side, the few rows the narrow one).
    Each `BLOCK_K` columns of the activations are quantized with their own scale (the block's
    largest magnitude to 448) as they are read, so no kernel runs before this one. Split
    over K, the last program of a tile adds up the splits' partial sums (layers/tickets.py):
    at 2-16 rows the 8B shape's o and down projections (bf16 inputs; qkv takes FP8 ones from
    the norm, unsplit) split K in 4, two kernels a layer fewer than with a sum kernel. On the
    H200, 8 requests of the 8B shape (FP8 weights and cache, 1,000-token prompts, 512 new
    tokens each) ran at 2,189 tok/s against 2,132-2,144 with the sum kernel; 32 requests (the
    down projection split in 4) and the offline workload did not move (bench/NOTES.md)."""
    wait_for_previous(PDL)
    outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    first = tl.program_id(1) * k_per_split
    for start in range(first, tl.minimum(first + k_per_split, k), BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x_tile = tl.load(
            x + tokens[:, None] * x_stride + cols[None, :],
            mask=(tokens[:, None] < m) & (cols[None, :] < k),
            other=0.0,
        ).to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x_tile), axis=1), 1e-12) / FP8_MAX
        x_fp8 = tl.clamp(x_tile / x_scale[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        w_tile = tl.load(
            weight + outputs[:, None] * weight_stride + cols[None, :],
            mask=(outputs[:, None] < n) & (cols[None, :] < k),
            other=0.0,
        )
        acc += tl.dot(w_tile, tl.trans(x_fp8)) * x_scale[None, :]
    ok = (outputs[:, None] < n) & (tokens[None, :] < m)
    last = True
    if SPLIT > 1:
        at = tokens[None, :] * n + outputs[:, None]
        tl.store(partial + tl.program_id(1) * BLOCK_M * n + at, acc, mask=ok)
        last = last_of_splits(tickets, tl.program_id(0), SPLIT)
        if last:
            acc = _sum_of_splits(partial + at, BLOCK_M * n, ok, SPLIT)
    if last:
        y = acc * tl.load(weight_scales + outputs, mask=outputs < n, other=0.0)[:, None]
        if HAS_BIAS:
            y += tl.load(bias + outputs, mask=outputs < n, other=0.0).to(tl.float32)[:, None]
        dest = out + tokens[None, :] * out_stride + outputs[:, None]
        tl.store(dest, y.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _sum_of_splits(at, split_stride, ok, SPLIT: tl.constexpr):
    """The tile's partial sums at `at` (split s at `at + s * split_stride`) added in split
    order (the same sum whichever program is last), read from L2 (`.cg`: other SMs wrote
    them)."""
    total = tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLIT):
        total += tl.load(at + split * split_stride, mask=ok, other=0.0, cache_modifier=".cg")
    return total


def few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x W^T + bias` for up to `FEW_ROWS_MAX` rows `x` `[m, K]` and an FP8 `weight` with one
    float32 scale per row. `config` (outputs and columns a program reads at a time, splits of
    K, warps, stages) overrides the measured choice, for bench/quant_kernels.py's sweep."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= FEW_ROWS_MAX and x.stride(1) == 1 and weight.stride(1) == 1
    # Settings measured on an H200 (bench/quant_kernels.py --fp8, 4 and 16 rows): products
    # of few outputs split K in 4 (an 8B shape's o, qkv and down projections: 9.0, 10.5 and
    # 24.3 us, where `_scaled_mm` takes 15.0, 20.9 and 50.4), wide ones take 128 outputs a
    # program and 8 warps (gate_up: 32.9 against 51.7).
    if config is None:
        wide = triton.cdiv(n, 64) >= 256
        config = (128, 128, 1, 8, 4) if wide else (64, 128, 4, 4, 4)
    block_n, block_k, split, warps, stages = config
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = (
        torch.empty((split, FEW_ROWS_MAX, n), dtype=torch.float32, device=x.device)
        if split > 1
        else out
    )
    _few_rows_kernel[(triton.cdiv(n, block_n), split)](
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        weight_scales,
        weight if bias is None else bias,
        out,
        out.stride(0),
        partial,
        split_tickets(x.device, triton.cdiv(n, block_n)),
        m,
        n,
        k,
        k_per_split,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_N=block_n,
        BLOCK_M=FEW_ROWS_MAX,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **pdl_options(x.device, m),
    )
    return out


@triton.jit(do_not_specialize=["m"])
def _token_scaled_kernel(
    x,
    x_scales,
    weight,
    weight_scales,
    bias,
    out,
    partial,
    tickets,
    m,
    n,
    k,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """`x W^T` for activations already in FP8 with a scale per token: one tile of `BLOCK_M`
    tokens by `BLOCK_N` outputs, scaled once at the end (the product is exact in FP8 blocks,
    so there is no per-block rescaling as in `_few_rows_kernel`). With `SWAP` the weight tile
    is the first operand, so that a few tokens take the tensor cores' narrow side. Split over
    K, the last program of a tile adds up the splits' partial sums (layers/tickets.py). With
    `SILU` the weight is a fused gate|up one (gate rows, then as many up rows): a program
    takes gate row i and up row i in turn and writes SiLU(gate) * up, `[m, n / 2]`, and the
    next kernel (the down projection) may launch only once each program has stored its
    part. Let launch at the start, the down product's programs took the SMs' room left
    beside this kernel's, unevenly, and the 8B FP8 step at 8 requests went 3.44 -> 3.65 ms;
    launched late, 2-16 requests decode 0.5-3.6% faster than with the activation kernel
    (bench/NOTES.md)."""
    if SILU:
        wait_only(PDL)
    else:
        wait_for_previous(PDL)
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if SILU:  # gate row i, then up row i
        pairs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        outputs = pairs + (tl.arange(0, BLOCK_N) % 2) * (n // 2)
        output_ok = pairs < n // 2
    else:
        outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        output_ok = outputs < n
    cols = tl.program_id(2) * k_per_split + tl.arange(0, BLOCK_K)
    x_at = x + tokens[:, None] * k + cols[None, :]
    w_at = weight + outputs[:, None] * k + cols[None, :]
    token_ok = tokens < m
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):  # k_per_split is a multiple of BLOCK_K
        x_tile = tl.load(x_at, mask=token_ok[:, None], other=0.0)
        w_tile = tl.load(w_at, mask=output_ok[:, None], other=0.0)
        if SWAP:
            acc = tl.dot(w_tile, tl.trans(x_tile), acc)
        else:
            acc = tl.dot(x_tile, tl.trans(w_tile), acc)
        x_at += BLOCK_K
        w_at += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    ok = token_ok[:, None] & output_ok[None, :]
    last = True
    if SPLIT > 1:
        at = tokens[:, None] * n + outputs[None, :]
        tl.store(partial + tl.program_id(2) * m * n + at, acc, mask=ok)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        last = last_of_splits(tickets, tile, SPLIT)
        if last:
            acc = _sum_of_splits(partial + at, m * n, ok, SPLIT)
    if last:
        y = acc * tl.load(x_scales + tokens, mask=token_ok, other=0.0)[:, None]
        y *= tl.load(weight_scales + outputs, mask=output_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(bias + outputs, mask=output_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:  # as the gate|up output is stored, then `silu_and_mul`: the same bits
            rounded = y.to(out.dtype.element_ty).to(tl.float32)
            gate, up = tl.split(tl.reshape(rounded, [BLOCK_M, BLOCK_N // 2, 2]))
            halves = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            dest = out + tokens[:, None] * (n // 2) + halves[None, :]
            done = token_ok[:, None] & (halves < n // 2)[None, :]
            tl.store(dest, silu_mul(gate, up, out.dtype.element_ty), mask=done)
            launch_next(PDL)
        else:
            dest = out + tokens[:, None] * n + outputs[None, :]
            tl.store(dest, y.to(out.dtype.element_ty), mask=ok)


TokenScaledConfig = tuple[int, int, int, int, int, int, bool]
"""(tokens, outputs and columns a program takes at a time, splits of K, warps, stages, swap)."""


def token_scaled(
    values: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: TokenScaledConfig,
    silu: bool = False,
) -> torch.Tensor:
    """`x W^T + bias` for FP8 activations `values` `[m, K]` with one float32 scale per token
    (`scales`, `[m]` or `[m, 1]`) and an FP8 `weight` `[n, K]` with one per row, as
    `torch._scaled_mm` computes it with row-wise scales. K must be a multiple of the
    config's columns and of its splits' columns. With `silu` (a fused gate|up weight, the
    config's K whole) the result is SiLU(gate) * up, `[m, n / 2]`."""
    m, k = values.shape
    n = weight.shape[0]
    block_m, block_n, block_k, split, warps, stages, swap = config
    assert k % (block_k * split) == 0 and values.is_contiguous() and weight.is_contiguous()
    assert not silu or (split == 1 and n % 2 == 0)
    out = torch.empty((m, n // 2 if silu else n), dtype=out_dtype, device=values.device)
    partial = (
        torch.empty((split, m, n), dtype=torch.float32, device=values.device) if split > 1 else out
    )
    scales = scales.reshape(-1)
    bias_or_any = weight_scales if bias is None else bias
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)  # with silu: pairs too
    _token_scaled_kernel[grid](
        values,
        scales,
        weight,
        weight_scales,
        bias_or_any,
        out,
        partial,
        split_tickets(values.device, grid[0] * grid[1]),
        m,
        n,
        k,
        k // split,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        SWAP=swap,
        SILU=silu,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **pdl_options(values.device, m),
    )
    return out


def token_scaled_config(
    m: int, n: int, k: int, shared_memory: int = 227 * 1024
) -> TokenScaledConfig | None:
    """The setting of `token_scaled` for `m` tokens and an `[n, k]` weight, or None where
    `torch._scaled_mm` (fast accumulation) was as fast. From bench/quant_kernels.py --fp8-gemm
    --chosen on the H200 (weights rotating so that they stream from memory as in a forward;
    us, Llama-3.1-8B's products, Triton against `_scaled_mm`): wide products (gate_up, 28672 x
    4096) win up to 64 tokens (31.6-33.3 against 36.4-39.3; from 128 on cuBLAS is faster:
    48.5 against 60.2 at 192); deep ones (down, 4096 x 14336) up to 256 (19.6-35.3 against
    36.6-36.8); qkv (6144 x 4096) up to 128 (10.4-13.1 against 13.7-13.9; 15.6 against 14.2
    at 192) and o (4096 x 4096), whose outputs are no more than its inputs, up to 256
    (10.5-14.3 against 14.6-18.5). `shared_memory`: the bytes a block may use on this GPU
    (the settings were measured with Hopper's 227 KB; smaller GPUs get fewer pipeline
    stages)."""
    if k % 128:
        return None
    config: TokenScaledConfig | None = None
    if n >= 4 * k:
        if m <= 32:
            config = (32, 128, 128, 1, 4, 4, True)
        elif m <= 64:
            config = (64, 128, 128, 1, 4, 4, False)
    elif k >= 2 * n:
        if m <= 64:
            config = (64, 64, 128, 4, 4, 4, False)
        elif m <= 192:
            config = (64, 128, 128, 2, 4, 4, False)
        elif m <= 256:
            config = (128, 64, 128, 2, 4, 4, False)
    elif m <= 64:
        config = (32, 64, 128, 1, 4, 5, True)
    elif m <= 128 or (m <= 192 and n <= k):
        config = (64, 64, 128, 1, 4, 4, False)
    elif m <= 256 and n <= k:
        config = (64, 128, 256, 1, 4, 3, False)
    if config is None:
        return None
    block_m, block_n, block_k, split, warps, stages, swap = config
    if k % (block_k * split):
        if k % block_k:
            return None
        split = 1
    # Each pipeline stage holds an FP8 tile of both operands: fewer stages where the GPU
    # has less shared memory a block (99 KB on Ada and consumer Ampere, aserve/engine/gpu.py).
    while stages > 2 and stages * (block_m + block_n) * block_k > shared_memory:
        stages -= 1
    if stages * (block_m + block_n) * block_k > shared_memory:
        return None
    return (block_m, block_n, block_k, split, warps, stages, swap)
