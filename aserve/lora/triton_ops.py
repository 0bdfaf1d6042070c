"""LoRA products of decode-sized batches in two Triton kernels a layer (CUDA, and Triton's
interpreter in the tests).

Each token takes only its own adapter's matrices, picked by its adapter id (0: none): the
shrink multiplies the token by its adapter's A of every part (Q, K and V; gate and up), the
expand adds its adapter's B times that to the base layer's output, in place, every part in
one launch. The dense form in layers.py (every adapter's A for every token, a one-hot, one
product with B a part) costs five kernels on a fused QKV layer where these cost two, which in
a decode step is where the time went: on an H200, 4 adapters of rank 16 on the 8B shape took
a single stream from 4.06 to 6.15 ms a token that way, 5.13 with these. A first shrink whose
programs each looped over a row's inputs gave nothing (6.19: one loop over the down
projection's 14,336 inputs is ~20 us of latency); it is now spread over the inputs, each
program one tile, and the expand adds the splits up. Sums are in float32; the base output
is read, added to and rounded back once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EXPAND_BLOCK_N = 128
SHRINK_TILE = 8192  # A's elements a shrink program reads: rank x its slice of the inputs


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
    SPLITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[token, part, split] = A[part, slot] x[token] over the split's BLOCK_K inputs, every
    rank at once: one tile a program, so that a token's product is spread over many programs
    (one program looping over 14,336 inputs took ~20 us). Nothing is read for a token of no
    adapter (its sums are zeros)."""
    token = tl.program_id(0)
    part = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(ids_ptr + token)
    cols = split * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = cols < tl.where(slot > 0, K, 0)
    ranks = tl.arange(0, RANK)
    rows = (part * SLOTS + tl.maximum(slot - 1, 0)) * RANK + ranks
    x = tl.load(x_ptr + token * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=ok[None, :], other=0.0)
    sums = tl.sum(a.to(tl.float32) * x[None, :], 1)
    tl.store(out_ptr + ((token * PARTS + part) * SPLITS + split) * RANK + ranks, sums)


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
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[token, n] += B[n, slot] . (the shrink's splits of the part of n, summed in order),
    for tokens of an adapter."""
    token = tl.program_id(0)
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(ids_ptr + token)
    ok = outputs < tl.where(slot > 0, N, 0)
    part = (outputs >= second_part).to(tl.int32) + (outputs >= third_part).to(tl.int32)
    ranks = tl.arange(0, RANK)
    splits = tl.arange(0, SPLITS_P2)
    taken = splits < tl.where(slot > 0, SPLITS, 0)
    xa = tl.zeros((BLOCK_N, RANK), dtype=tl.float32)
    for p in tl.static_range(PARTS):
        rows = (token * PARTS + p) * SPLITS + splits
        parts = tl.load(
            xa_ptr + rows[:, None] * RANK + ranks[None, :], mask=taken[:, None], other=0.0
        )
        xa = tl.where((part == p)[:, None], tl.sum(parts, 0)[None, :], xa)
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
    in place: `a` `[parts * slots * rank, K]`, `b` `[N, slots, rank]` (rank a power of two),
    `ids` `[T]`, `offsets` where each part's outputs start in `y`."""
    tokens, k = x.shape
    n, slots, rank = b.shape
    parts = len(offsets)
    block_k = max(16, min(SHRINK_TILE // rank, triton.next_power_of_2(k)))
    splits = triton.cdiv(k, block_k)
    xa = torch.empty(tokens, parts, splits, rank, dtype=torch.float32, device=x.device)
    _shrink[(tokens, parts, splits)](
        x, a, ids, xa, k, x.stride(0), parts, slots, rank, splits, block_k
    )
    starts = [*offsets[1:], n, n][:2]
    _expand[(tokens, triton.cdiv(n, EXPAND_BLOCK_N))](
        xa,
        b,
        ids,
        y,
        n,
        y.stride(0),
        starts[0],
        starts[1],
        parts,
        slots,
        rank,
        splits,
        triton.next_power_of_2(splits),
        EXPAND_BLOCK_N,
    )
    return y
