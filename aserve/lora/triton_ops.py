"""LoRA products of decode-sized batches in two Triton kernels a layer (CUDA, and Triton's
interpreter in the tests).

Each token takes only its own adapter's matrices, picked by its adapter id (0: none): the
shrink multiplies the token by its adapter's A of every part (Q, K and V; gate and up), the
expand adds its adapter's B times that to the base layer's output, in place, every part in
one launch. The dense form in layers.py (every adapter's A for every token, a one-hot, one
product with B a part) costs five kernels on a fused QKV layer where these cost two, which in
a decode step is where the time went: on an H200, 4 adapters of rank 16 on the 8B shape took
a single stream from 4.06 to 6.15 ms a token that way (bench/NOTES.md has what these give).
Sums are in float32; the base output is read, added to and rounded back once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SHRINK_BLOCK_K = 512
EXPAND_BLOCK_N = 128


@triton.jit
def _shrink(
    x_ptr,
    a_ptr,
    ids_ptr,
    out_ptr,
    K,
    x_stride,
    PARTS: tl.constexpr,
    SLOTS: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[token, part, r] = A[part, slot, r] . x[token] for the program's ranks (zeros for
    tokens of no adapter: their loads are masked off)."""
    token = tl.program_id(0)
    part = tl.program_id(1)
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(ids_ptr + token)
    limit = tl.where(slot > 0, K, 0)  # nothing read for a token of no adapter
    rows = (part * SLOTS + tl.maximum(slot - 1, 0)) * RANK + ranks
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        ok = cols < limit
        x = tl.load(x_ptr + token * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=ok[None, :], other=0.0)
        acc += a.to(tl.float32) * x[None, :]
    tl.store(out_ptr + (token * PARTS + part) * RANK + ranks, tl.sum(acc, 1))


@triton.jit
def _expand(
    xa_ptr,
    b_ptr,
    ids_ptr,
    y_ptr,
    N,
    y_stride,
    second_part,
    third_part,
    PARTS: tl.constexpr,
    SLOTS: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[token, n] += B[n, slot] . xa[token, part of n], for tokens of an adapter."""
    token = tl.program_id(0)
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(ids_ptr + token)
    ok = outputs < tl.where(slot > 0, N, 0)
    part = (outputs >= second_part).to(tl.int32) + (outputs >= third_part).to(tl.int32)
    ranks = tl.arange(0, RANK)
    xa_rows = (token * PARTS + part) * RANK
    xa = tl.load(xa_ptr + xa_rows[:, None] + ranks[None, :], mask=ok[:, None], other=0.0)
    b_rows = outputs * SLOTS + tl.maximum(slot - 1, 0)
    b = tl.load(b_ptr + b_rows[:, None] * RANK + ranks[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(xa * b.to(tl.float32), 1)
    at = y_ptr + token * y_stride + outputs
    y = tl.load(at, mask=ok, other=0.0)
    tl.store(at, (y.to(tl.float32) + delta).to(y.dtype), mask=ok)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: list[int],
) -> torch.Tensor:
    """`y` (`[T, N]`, the base output of `x` `[T, K]`) plus each token's adapter's product,
    in place: `a` `[parts * slots * rank, K]`, `b` `[N, slots, rank]`, `ids` `[T]`, `offsets`
    where each part's outputs start in `y`."""
    tokens, k = x.shape
    n, slots, rank = b.shape
    parts = len(offsets)
    xa = torch.empty(tokens, parts, rank, dtype=torch.float32, device=x.device)
    block_r = min(rank, 4)
    _shrink[(tokens, parts, rank // block_r)](
        x, a, ids, xa, k, x.stride(0), parts, slots, rank, block_r, SHRINK_BLOCK_K
    )
    starts = [*offsets[1:], n, n][:2]
    _expand[(tokens, triton.cdiv(n, EXPAND_BLOCK_N))](
        xa, b, ids, y, n, y.stride(0), starts[0], starts[1], parts, slots, rank, EXPAND_BLOCK_N
    )
    return y
