"""Attention in plain PyTorch (SDPA): the CPU backend and the GPU reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aserve.forward import ForwardBatch
from aserve.kvcache.pool import KVPool


@dataclass
class _PrefillSeq:
    q_start: int
    q_len: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class _PrefillMetadata:
    seqs: list[_PrefillSeq]


@dataclass
class _DecodeMetadata:
    """`mask` hides the padding of shorter contexts; None when all lengths are equal."""

    kv_slots: torch.Tensor
    flat_slots: torch.Tensor
    mask: torch.Tensor | None


class TorchNativeBackend:
    """Prefill runs one SDPA call per request (a cached prefix makes the mask bottom-right
    aligned); decode pads the batch to its longest context and runs one masked SDPA call."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            batch.attn_metadata = self._prepare_decode(batch)
        else:
            batch.attn_metadata = self._prepare_prefill(batch)

    def _prepare_prefill(self, batch: ForwardBatch) -> _PrefillMetadata:
        seqs, q_start = [], 0
        for row, prefix, extend, total in zip(
            batch.row_ids, batch.prefix_lens, batch.extend_lens, batch.seq_lens
        ):
            slots = batch.page_table[row, :total].long()
            mask = None
            if prefix > 0:
                q_pos = torch.arange(prefix, total, device=slots.device)[:, None]
                mask = torch.arange(total, device=slots.device)[None, :] <= q_pos
            seqs.append(_PrefillSeq(q_start, extend, slots, mask))
            q_start += extend
        return _PrefillMetadata(seqs)

    def _prepare_decode(self, batch: ForwardBatch) -> _DecodeMetadata:
        longest = max(batch.seq_lens)
        device = batch.page_table.device
        slots = batch.page_table[batch.rows, :longest].long()
        if min(batch.seq_lens) == longest:
            return _DecodeMetadata(slots, slots.flatten(), None)
        lens = torch.tensor(batch.seq_lens, device=device)
        mask = torch.arange(longest, device=device)[None, :] < lens[:, None]
        return _DecodeMetadata(slots, slots.flatten(), mask[:, None, None, :])

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor | None, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        if kv is not None:
            self.pool.store(layer, batch.out_slots, kv)
        q = q.view(-1, self.num_heads, self.head_dim)
        if batch.is_decode:
            out = self._decode(q, layer, batch.attn_metadata)
        else:
            out = self._prefill(q, layer, batch.attn_metadata)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _prefill(self, q: torch.Tensor, layer: int, meta: _PrefillMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        for seq in meta.seqs:
            q_seq = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1)
            k_seq = k_pool.index_select(0, seq.kv_slots).transpose(0, 1)
            v_seq = v_pool.index_select(0, seq.kv_slots).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q_seq,
                k_seq,
                v_seq,
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                enable_gqa=True,
            )
            out[seq.q_start : seq.q_start + seq.q_len] = o.transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, layer: int, meta: _DecodeMetadata) -> torch.Tensor:
        shape = (*meta.kv_slots.shape, *self.pool.k[layer].shape[1:])
        k = self.pool.k[layer].index_select(0, meta.flat_slots).view(shape).transpose(1, 2)
        v = self.pool.v[layer].index_select(0, meta.flat_slots).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=meta.mask, enable_gqa=True
        )
        return o[:, :, 0, :]
