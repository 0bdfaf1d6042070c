"""Rotary position embedding (the rotate-half layout of Hugging Face Llama / Qwen).

cos/sin are computed once for every position up to the engine's context length, in float32,
and looked up per token. Scalings: Llama-3's (as Hugging Face configs state it, or as GGUF
files store it: one divisor a frequency), YaRN, linear and Phi-3's LongRoPE.

Where only part of a head rotates (`rotary_dim`, Phi-4-mini's three quarters), the model
loads each head's query and key rows reordered (`partial_rotary_order`) so that the pairs
that rotate are the first rotary_dim / 2 of the whole head's rotate-half pairs; the other
pairs take frequency 0 (cos 1, sin 0). Every RoPE path then rotates whole heads as it does
for any model, and scores are unchanged: Q and K are reordered alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aserve.config import FREQ_FACTORS
from aserve.layers.fused import FusedOps

NO_ROPE = "none"
"""The scaling of a layer that takes no rotary position (SmolLM3's every fourth): its table
of cos 1 and sin 0 goes through every RoPE kernel, which then leaves Q and K as they are."""


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


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen's long-context setting): frequencies that turn more than `beta_fast` times
    over the original context are kept, those that turn fewer than `beta_slow` times are
    slowed by `factor`, with a linear ramp over the pairs between; cos and sin grow by the
    attention factor (0.1 ln(factor) + 1 unless the config states it), which keeps the
    softmax as sharp over the longer context."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:
        """The (fractional) pair index whose frequency turns `turns` times over `original`."""
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = (
        pair_turning(scaling.get("beta_fast") or 32),
        pair_turning(scaling.get("beta_slow") or 1),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    pairs = torch.arange(head_dim // 2, dtype=torch.float32)
    slowed = ((pairs - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * slowed + inv_freq * (1 - slowed)

    def sharpness(weight: float | None = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * (weight or 1.0) * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        weight, weight_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        both = weight and weight_all
        attention = sharpness(weight) / sharpness(weight_all) if both else sharpness()
    return inv_freq, float(attention)


def _longrope(
    inv_freq: torch.Tensor, scaling: dict[str, Any], context: int
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its own factor, the long ones where the
    context runs past the original one, else the short ones (llama.cpp's rule, by the
    context served; transformers switches by each forward's length, which gives the same
    for prompts that stay on one side); cos and sin grow by sqrt(1 + ln(factor) /
    ln(original)) unless the config states the attention factor."""
    original = int(scaling["original_max_position_embeddings"])
    factors = scaling["long_factor" if context > original else "short_factor"]
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return inv_freq / torch.tensor(factors, dtype=torch.float32), float(attention)


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, context: int = 0
) -> tuple[torch.Tensor, float]:
    """The inverse frequency of each rotary pair, and the factor cos and sin are scaled by.
    `context`: the positions served (LongRoPE picks its factors by it)."""
    inv_freq = _base_inv_freq(head_dim, theta)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == NO_ROPE:  # every angle 0: cos 1 and sin 0 leave Q and K as they are
        return torch.zeros_like(inv_freq), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == FREQ_FACTORS:
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    if kind == "longrope":
        return _longrope(inv_freq, scaling, context)
    raise ValueError(f"rope scaling {kind!r} is not supported")  # ModelConfig refuses it first


def mrope_pair_coordinates(pairs: int, section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """The coordinate (0 time, 1 height, 2 width) that each pair of a head rotates by:
    Qwen2-VL's `section[0]` pairs of time, then `section[1]` of height and `section[2]` of
    width; Qwen3-VL's in turn (time, height, width, time, ...) while a coordinate has pairs
    left, time after. Pairs past the sections keep time."""
    coordinates = torch.zeros(pairs, dtype=torch.int64)
    if not interleaved:
        runs = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        coordinates[: len(runs)] = runs
        return coordinates
    for coordinate in (1, 2):
        taken = torch.arange(coordinate, min(3 * section[coordinate], pairs), 3)
        coordinates[taken] = coordinate
    return coordinates


@dataclass
class RopeRows:
    """cos and sin rows of one step's tokens, one a token in the tables' layouts (Qwen-VL's
    prefill steps with images, whose tokens' pairs rotate by three coordinates): every RoPE
    path reads row i for token i (`positions`: 0 to tokens - 1)."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    head_cos: torch.Tensor
    head_sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """With `ops` (FlashInfer), Q and K are rotated in place by one kernel reading a
    `[positions, head_dim]` cache of cos | sin halves. In plain torch `x * cos + half * sin`
    with whole-head tables (`cos | cos`, `-sin | sin`) and `half` = x's halves swapped."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        ops: FusedOps | None = None,
        rotary_dim: int = 0,
        mrope_section: tuple[int, ...] = (),
        mrope_interleaved: bool = False,
    ) -> None:
        """`rotary_dim`: the dimensions of a head that rotate (0: all), in the first
        rotary_dim / 2 pairs (`partial_rotary_order`); the others keep cos 1 and sin 0.
        `mrope_section`: Qwen-VL's pairs by coordinate (`rows_at`), in runs, or taken in
        turn where `mrope_interleaved` (`mrope_pair_coordinates`)."""
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        inv_freq, attention = rope_frequencies(rotary_dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
        cos, sin = freqs.cos() * attention, freqs.sin() * attention
        still = torch.zeros(max_positions, (head_dim - rotary_dim) // 2)
        cos, sin = torch.cat((cos, still + 1), -1), torch.cat((sin, still), -1)
        self.register_buffer("cos_sin", torch.cat((cos, sin), -1), persistent=False)
        self.register_buffer("head_cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("head_sin", torch.cat((-sin, sin), -1), persistent=False)
        self.head_dim = head_dim
        self.ops = ops
        # Qwen-VL: the coordinate (time, height, width) that each column's pair rotates by
        self.column_coordinate: torch.Tensor | None = None
        if mrope_section:
            pairs = mrope_pair_coordinates(head_dim // 2, mrope_section, mrope_interleaved)
            self.column_coordinate = pairs[torch.arange(head_dim) % (head_dim // 2)]
        self._table_positions: torch.Tensor | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] = (self.head_cos, self.head_sin)

    def rows_at(self, coordinates: torch.Tensor) -> RopeRows:
        """Each token's rows from its three coordinates `[3, tokens]`, a column's value taken
        at the position of its pair's coordinate (text tokens' three are equal: their rows
        are the tables' own)."""
        assert self.column_coordinate is not None
        index = coordinates[self.column_coordinate.to(coordinates.device)].T.contiguous()
        return RopeRows(
            torch.arange(index.shape[0], device=index.device),
            self.cos_sin.gather(0, index),
            self.head_cos.gather(0, index),
            self.head_sin.gather(0, index),
        )

    def forward(
        self, positions: torch.Tensor, qk: torch.Tensor, q_size: int, rows: RopeRows | None = None
    ) -> None:
        """Rotate Q and K in place: `qk` `[tokens, (heads + kv_heads) * head_dim]` holds them
        side by side (a strided view into the fused QKV output), Q in the first `q_size`
        columns. Plain torch rotates all their heads in one pass. `rows`: the step's own
        rows in place of the tables' rows at `positions`."""
        if self.ops is not None:
            self.rotate_apart(positions, qk[:, :q_size], qk[:, q_size:], rows)
        else:
            self._rotate_in_torch(positions, qk, rows)

    def rotate_apart(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rows: RopeRows | None
    ) -> None:
        """`forward` for Q `[tokens, heads * head_dim]` and K `[tokens, kv_heads * head_dim]`
        in tensors of their own (latent attention's: each may be a strided view)."""
        if self.ops is None:
            self._rotate_in_torch(positions, q, rows)
            self._rotate_in_torch(positions, k, rows)
            return
        positions, cos_sin = (
            (positions, self.cos_sin) if rows is None else (rows.positions, rows.cos_sin)
        )
        self.ops.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, self.head_dim, cos_sin, is_neox=True
        )

    def _rotate_in_torch(
        self, positions: torch.Tensor, x: torch.Tensor, rows: RopeRows | None
    ) -> None:
        heads = x.unflatten(-1, (-1, self.head_dim))
        if rows is None:
            cos, sin = self._position_tables(positions, x.dtype)
        else:
            cos, sin = (
                rows.head_cos[:, None, :].to(x.dtype),
                rows.head_sin[:, None, :].to(x.dtype),
            )
        half = self.head_dim // 2
        swapped = torch.cat((heads[..., half:], heads[..., :half]), dim=-1)
        # In place: `heads * cos + swapped * sin` into a new tensor took 8x longer at prefill
        # sizes on CPU, with the same result.
        heads.mul_(cos).add_(swapped.mul_(sin))

    def _position_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of `positions`, looked up once per forward: every layer passes the
        same `positions` tensor, so the lookup of the first is kept for the rest."""
        if positions is not self._table_positions:
            self._table_positions = positions
            self._tables = (
                self.head_cos[positions][:, None, :].to(dtype),
                self.head_sin[positions][:, None, :].to(dtype),
            )
        return self._tables


def partial_rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """The order of a head's dimensions under which Hugging Face's partial rotation (pairs
    (i, i + rotary_dim / 2) of the first rotary_dim dimensions; with `interleaved`, GLM-4's,
    pairs (2i, 2i + 1)) is the whole head's rotate-half (pairs (j, j + head_dim / 2)) on its
    first rotary_dim / 2 pairs: each pair's first member goes to the front of the head's
    first half, its second to the front of the second half, the others' halves after
    them."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    firsts = torch.arange(0, rotary_dim, 2) if interleaved else torch.arange(half)
    seconds = torch.arange(1, rotary_dim, 2) if interleaved else torch.arange(half, rotary_dim)
    return torch.cat(
        (
            firsts,
            torch.arange(rotary_dim, rotary_dim + rest),
            seconds,
            torch.arange(rotary_dim + rest, head_dim),
        )
    )
