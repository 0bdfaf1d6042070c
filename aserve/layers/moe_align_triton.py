"""The fused MoE kernels' block layout (`moe_layout.align_blocks`) in one Triton program.

`align_blocks` in torch ops is about twenty small kernels. At decode they cost a MoE layer
about as much as its two products (an H100, the 30B-A3B shape, one token: ~50 of ~90 us).
Here one program builds the same layout, while a batch's pairs fit in one program. It counts
the pairs of each expert (a histogram), pads the counts to whole blocks and sums them up.
Sorting the keys `expert * PAIRS + pair` gives every pair its place in its expert's run, in
pair order as the stable torch sort gives it. Larger batches keep the torch ops. Imported
only on CUDA and under Triton's interpreter (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.layers.moe_layout import BlockLayout, align_blocks, max_blocks

MAX_PAIRS = 512
"""Batches of up to this many (token, expert) pairs take the one-program layout."""


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    shift_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    PAIRS: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """One program: `sorted_pairs` (padding holds `num_pairs`) and each block's expert
    (`num_experts` past the last run), as `align_blocks` lays them out."""
    pair = tl.arange(0, PAIRS)
    ok = pair < num_pairs
    ids = tl.load(ids_ptr + pair, mask=ok, other=0).to(tl.int32)
    expert = tl.arange(0, EXPERTS)
    # the PAIRS - num_pairs lanes past the batch counted as expert 0, then taken out
    counts = tl.histogram(ids, EXPERTS) - tl.where(expert == 0, PAIRS - num_pairs, 0)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    ends = tl.cumsum(padded, 0)
    firsts = tl.cumsum(counts, 0) - counts  # where each expert's pairs start, unpadded
    # place j of the sorted pairs goes to slot j + (padded start - unpadded start) of its expert
    tl.store(shift_ptr + expert, ends - padded - firsts)
    keys = tl.sort(tl.where(ok, ids * PAIRS + pair, num_experts * PAIRS + pair))
    slots: tl.constexpr = BLOCKS * BLOCK
    for start in tl.static_range(0, slots, PAIRS):
        at = start + tl.arange(0, PAIRS)
        tl.store(sorted_pairs_ptr + at, num_pairs, mask=at < num_blocks * BLOCK)
    tl.debug_barrier()  # the shifts and the padding stored before they are read or overwritten
    rank = tl.arange(0, PAIRS)
    sorted_ok = rank < num_pairs
    owner = tl.where(sorted_ok, keys // PAIRS, 0)
    dest = rank + tl.load(shift_ptr + owner, mask=sorted_ok, other=0)
    tl.store(sorted_pairs_ptr + dest, keys % PAIRS, mask=sorted_ok)
    block = tl.arange(0, BLOCKS)
    # a block's expert: how many experts' padded runs end at or before its first slot
    before = (ends[None, :] <= (block * BLOCK)[:, None]) & (expert < num_experts)[None, :]
    owners = tl.sum(before.to(tl.int32), axis=1)
    tl.store(block_expert_ptr + block, owners, mask=block < num_blocks)


def device_layout(topk_ids: torch.Tensor, num_experts: int, block: int) -> BlockLayout:
    """`align_blocks(topk_ids, num_experts, block)`, in one program where the batch fits."""
    num_pairs = topk_ids.numel()
    if num_pairs > MAX_PAIRS:
        return align_blocks(topk_ids, num_experts, block)
    blocks = max_blocks(num_pairs, num_experts, block)
    device = topk_ids.device
    sorted_pairs = torch.empty(blocks * block, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    shift = torch.empty(triton.next_power_of_2(num_experts), dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids.reshape(-1),
        sorted_pairs,
        block_expert,
        shift,
        num_pairs,
        num_experts,
        blocks,
        PAIRS=max(16, triton.next_power_of_2(num_pairs)),
        EXPERTS=shift.numel(),
        BLOCK=block,
        BLOCKS=max(16, triton.next_power_of_2(blocks)),
        num_warps=4,
    )
    return BlockLayout(sorted_pairs, block_expert)
