"""A step's token masks applied to CUDA logits by one Triton kernel (CUDA only).

The same -inf masking as the torch path in masks.py took nine small kernels and two copies
a step; with a constrained request in a batch whose steps are bound by the host, their
launches were a measurable share of the step. Here one program masks one block of one row,
reading its batch row from the mask buffer itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _mask_kernel(logits, row_stride, buffer, rows_at, words, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    batch_row = tl.load(buffer + rows_at + r).to(tl.int64)
    word = tl.load(buffer + r * words + tokens // 32, mask=tokens < words * 32, other=0)
    forbidden = ((word >> (tokens % 32)) & 1) == 0
    tl.store(logits + batch_row * row_stride + tokens, float("-inf"), mask=inside & forbidden)


def apply_masks_cuda(logits: torch.Tensor, buffer: torch.Tensor, count: int, words: int) -> None:
    """`buffer` (masks.py's `StepMasks`: `count` bitmask rows of `words` words, then their batch
    rows) already on the logits' device; `logits` [batch, vocab] with unit column stride."""
    assert logits.stride(-1) == 1
    vocab = logits.shape[-1]
    grid = (count, triton.cdiv(vocab, BLOCK))
    _mask_kernel[grid](logits, logits.stride(0), buffer, count * words, words, vocab, BLOCK)
