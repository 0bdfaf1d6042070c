"""The attention-backend interface: plan once per batch, then run every layer."""

from __future__ import annotations

from typing import Protocol

import torch

from aserve.forward import ForwardBatch
from aserve.kvcache.pool import KVPool


class AttentionBackend(Protocol):
    """Paged attention over the KV pool.

    `prepare` builds the batch's metadata once (index tensors, masks, kernel plans) and stores
    it in `batch.attn_metadata`; `forward` is then called by every layer with that batch,
    with Q `[tokens, num_heads, head_dim]` and the new tokens' K and V side by side
    `[tokens, 2, kv_heads, head_dim]`. It writes K/V into the pool at `batch.out_slots` and
    returns the attention output `[tokens, num_heads * head_dim]`. K/V None means the
    caller has written them into the pool already (the fused RoPE kernel on CUDA does).
    `sinks` (float32 `[num_heads]`, gpt-oss): each head's softmax also sums e^sink, a
    weight on no value.
    """

    pool: KVPool

    def prepare(self, batch: ForwardBatch) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor | None,
        layer: int,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class LatentBackend(Protocol):
    """A backend that runs DeepSeek's latent attention (models/mla.py): `prepare` as
    `AttentionBackend`'s, then `forward_latent` with each head's query in the latent
    `[tokens, heads, kv_lora_rank]` and its rotated part `[tokens, heads, rope]` apart
    (either may be a strided view) and the new tokens' cache rows `[tokens, 1, 1,
    kv_lora_rank + rope]` (one part a slot: kvcache/pool.py); it returns each head's mix of
    latent rows `[tokens, heads, kv_lora_rank]` (perhaps a strided view)."""

    pool: KVPool

    def prepare(self, batch: ForwardBatch) -> None: ...

    def forward_latent(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...


class SplitBackend:
    """Prefill through one backend and decode through another (`--attention-backend a,b`)."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill = prefill
        self.decode = decode
        self.pool = prefill.pool

    def _pick(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.is_decode else self.prefill

    def prepare(self, batch: ForwardBatch) -> None:
        self._pick(batch).prepare(batch)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor | None,
        layer: int,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._pick(batch).forward(q, kv, layer, batch, sinks)

    def forward_latent(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        backend = self._pick(batch)
        assert hasattr(backend, "forward_latent"), "this backend runs no latent attention"
        return backend.forward_latent(q_latent, q_rope, kv, layer, batch)


def visible_keys(
    prefix: int,
    total: int,
    window: int,
    device: torch.device,
    both_ways: list[tuple[int, int]],
) -> torch.Tensor:
    """Which of a request's `total` positions each of its new queries (the last `total -
    prefix`) reads, `[queries, total]`: up to itself (bottom-right aligned after a cached
    prefix), or within a `both_ways` block `[first, last)` the whole block (Gemma 3's image
    features, a bidirectional model's whole prompt), and with a window (0: none) only
    positions less than `window` away on either side, as transformers composes the two
    (its blocks of image features are shorter than the window; EmbeddingGemma's windowed
    layers read less than the window away both ways)."""
    q_pos = torch.arange(prefix, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    limits = torch.arange(prefix + 1, total + 1, device=device)
    for first, last in both_ways:
        limits[max(first, prefix) - prefix : max(last, prefix) - prefix] = last
    mask = k_pos < limits[:, None]
    if not 0 < window < total:
        return mask
    return mask & (k_pos > q_pos - window) & (k_pos < q_pos + window)
