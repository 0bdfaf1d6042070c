"""What a layer's `load_weight` receives: a checkpoint tensor, possibly not read yet."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class WeightSource(Protocol):
    """A torch tensor, or a safetensors slice that reads from disk only the part indexed
    (`t[a:b]`, `t[:, a:b]`, `t[:]`), so a tensor-parallel rank reads just its shard."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def read_whole(tensor: WeightSource) -> torch.Tensor:
    """A tensor, or a lazy safetensors slice read now (`t[:]`, which a 0-dim torch tensor
    does not take)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
