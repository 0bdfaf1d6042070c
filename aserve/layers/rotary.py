"""Rotary position embedding (the rotate-half layout of Hugging Face Llama / Qwen).

cos/sin are computed once for every position up to the engine's context length, in float32,
and looked up per token. Llama-3 frequency scaling and linear scaling are supported.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    blend = (original / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _base_inv_freq(head_dim, theta)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"rope scaling {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """With `ops` (FlashInfer), Q and K are rotated in place by one kernel reading a
    `[positions, head_dim]` cache of cos | sin halves."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        ops: ModuleType | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.register_buffer("cos_sin", torch.cat((self.cos, self.sin), -1), persistent=False)
        self.head_dim = head_dim
        self.ops = ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q `[tokens, heads * head_dim]` and k `[tokens, kv_heads * head_dim]` in place
        (they may be strided views into the fused QKV output)."""
        if self.ops is not None:
            self.ops.apply_rope_with_cos_sin_cache_inplace(
                positions, q, k, self.head_dim, self.cos_sin, is_neox=True
            )
            return
        q.copy_(self._rotate(positions, q))
        k.copy_(self._rotate(positions, k))

    def _rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], -1, self.head_dim)
        cos = self.cos[positions][:, None, :].to(x.dtype)
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = heads.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.view(x.shape)
