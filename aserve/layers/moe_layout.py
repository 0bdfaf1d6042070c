"""Where each (token, expert) pair of a MoE batch goes: grouped by expert, or laid out in
blocks of one expert's rows for the fused kernels. Torch ops only, with sizes known from the
shapes, so it runs on CPU for the tests and inside a captured CUDA graph on the GPU. Its own
module so that the kernels (layers/moe_triton.py, layers/moe_codes_triton.py) and the layer
that picks them (layers/moe.py) import it without importing each other."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertGroups(NamedTuple):
    """The (token, slot) pairs of `topk_ids.flatten()` grouped by expert.

    `order` lists pair ids expert by expert (stable, so token order is kept inside a group);
    `counts[e]` is how many pairs expert `e` got, zero included."""

    order: torch.Tensor
    counts: torch.Tensor


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort pairs by expert without a host sync (bincount would read the max id on the host)."""
    flat = topk_ids.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    return ExpertGroups(torch.argsort(flat, stable=True), counts)


class BlockLayout(NamedTuple):
    """Pairs laid out for a grouped GEMM that works on `block` rows at a time.

    Each expert's pairs start at a multiple of `block` and are padded to one with the value
    `num_pairs` (no pair), so every block of `sorted_pairs` belongs to one expert:
    `block_expert[b]`, or `num_experts` for blocks past the last expert's run. Sizes depend
    only on the shapes (the worst case), so the layout is built without a host sync."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor


def max_blocks(num_pairs: int, num_experts: int, block: int) -> int:
    """Blocks enough for any routing: every pair, plus a partly filled block for each expert
    that can get pairs."""
    return -(-(num_pairs + min(num_pairs, num_experts) * (block - 1)) // block)


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block: int) -> BlockLayout:
    """Torch ops only (sort, scatter, cumsum, searchsorted): it runs on CPU for the tests and
    inside a captured CUDA graph on the GPU."""
    num_pairs = topk_ids.numel()
    groups = group_by_expert(topk_ids, num_experts)
    padded = (groups.counts + block - 1) // block * block
    ends = padded.cumsum(0)
    blocks = max_blocks(num_pairs, num_experts, block)
    device = topk_ids.device
    experts = topk_ids.flatten().long()[groups.order]
    first = groups.counts.cumsum(0) - groups.counts
    rank_in_group = torch.arange(num_pairs, device=device) - first[experts]
    dest = (ends - padded)[experts] + rank_in_group
    sorted_pairs = torch.full((blocks * block,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, groups.order.to(torch.int32))
    starts = torch.arange(0, blocks * block, block, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return BlockLayout(sorted_pairs, block_expert)
