"""A step's token masks built from plain bitmask rows, for the CPU and CUDA masking tests
(its own module: the structured-output tests import pydantic, which a GPU box may lack)."""

from __future__ import annotations

import torch

from aserve.constrained.masks import StepMasks


def masks_of(full: torch.Tensor, rows: list[int]) -> StepMasks:
    """A step's masks for `rows`, their bitmask rows taken from `full` (one row per batch row)."""
    count, words = len(rows), full.shape[1]
    masks = StepMasks(torch.empty(count * words + count, dtype=torch.int32), count, words)
    masks.bitmask.copy_(full[rows])
    masks.rows.copy_(torch.tensor(rows))
    return masks
