"""Attention in plain PyTorch (SDPA; decode of quantized models on CPU through aserve's kernel):
the CPU backend and the GPU reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aserve.attention.base import visible_keys
from aserve.forward import ForwardBatch
from aserve.kvcache.pages import PageTable
from aserve.kvcache.pool import KVPool, zeros_on


@dataclass
class _PrefillSeq:
    """`kv_slots`: the context's slots, by whether a layer keeps its KV in the
    sliding-window pages; `masks`: by window (0: none), the boolean mask of this request's
    queries, or None where plain causal attention is the same."""

    q_start: int
    q_len: int
    kv_slots: dict[bool, torch.Tensor]
    masks: dict[int, torch.Tensor | None]


@dataclass
class _PrefillMetadata:
    seqs: list[_PrefillSeq]


@dataclass
class _NativeDecodeMetadata:
    """For the CPU kernel that reads the pool directly: the requests' context lengths (made
    a tensor once a step, not once a layer); for a prefill, one entry a new token, its
    request's page-table row (`rows`) and its own context, up to and with itself."""

    seq_lens: torch.Tensor
    rows: torch.Tensor | None = None


@dataclass
class _DecodeMetadata:
    """`kv_slots` as `_PrefillSeq`'s, `[batch, longest]`. `masks`, by window (0: none),
    hide the padding of shorter contexts and the positions before a window; None when
    nothing is hidden. With a `stage`, K/V are read from it: gathered into it this step when
    `append_at` is None, else only the new tokens are written, at these (request, position)
    indices."""

    kv_slots: dict[bool, torch.Tensor]
    masks: dict[int, torch.Tensor | None]
    stage: _DecodeStage | None
    append_at: tuple[torch.Tensor, torch.Tensor] | None


class _DecodeStage:
    """Dense copies of a decode batch's K/V, `[batch, 2, kv_heads, capacity, head_dim]` a
    layer, kept across steps while the batch keeps its requests. Gathering every context
    from the pool each step costs more on a CPU than the attention that reads it (it reads
    and writes the whole context); with the stage a step appends one token per request.
    Each head's K (and V) is contiguous, as SDPA reads it fastest (14% over the pool's
    token-major layout, cache-cold)."""

    HEADROOM = 64  # positions allocated past the longest context, so growth rarely rebuilds

    def __init__(
        self,
        key: tuple[int, ...],
        seq_lens: list[int],
        pool: KVPool,
        spare: list[torch.Tensor] | None = None,
    ) -> None:
        """`spare`: a predecessor's `buffers`, large enough, to reuse. Fresh memory took
        twice as long to fill (88 against 43 ms for 16 requests of ~240 tokens): the OS
        faults in and zeroes every page on first write."""
        self.key = key
        self.seq_lens = seq_lens
        longest = max(seq_lens)
        self.capacity = longest + self.HEADROOM
        parts, kv_heads, head_dim = pool.kv[0].shape[1:]
        shape = (len(seq_lens), parts, kv_heads, self.capacity, head_dim)
        numel = math.prod(shape)
        # (none for layers without KV: a hybrid model's linear attention layers)
        if spare is not None:
            self.buffers = spare
            self.kv = [_stage_view(buffer, numel, shape) for buffer in spare]
            for layer in self.kv:
                layer[:, :, :, longest:].zero_()  # the first step's gather fills the rest
        else:
            # Zeros (committed page by page as written): positions past a context are masked,
            # and a masked position must not hold a NaN that the softmax's zero weight keeps.
            self.buffers = [
                zeros_on((numel if layer.shape[0] else 0,), pool.dtype, layer.device)
                for layer in pool.kv
            ]
            self.kv = [_stage_view(buffer, numel, shape) for buffer in self.buffers]

    @staticmethod
    def numel(batch_size: int, longest: int, pool: KVPool) -> int:
        """Elements of one layer's stage."""
        slot = math.prod(pool.kv[0].shape[1:])
        return batch_size * (longest + _DecodeStage.HEADROOM) * slot

    def continues(self, key: tuple[int, ...], seq_lens: list[int]) -> bool:
        """True when `seq_lens` are this stage's requests one token further, within capacity."""
        return (
            key == self.key
            and all(n == m + 1 for n, m in zip(seq_lens, self.seq_lens))
            and max(seq_lens) <= self.capacity
        )


def _stage_view(buffer: torch.Tensor, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A layer's stage `shape` in `buffer`, or none of its requests where it is empty."""
    if not buffer.numel():
        return buffer.view(0, *shape[1:])
    return buffer[:numel].view(shape)


class TorchNativeBackend:
    """Prefill runs one SDPA call per request (a cached prefix makes the mask bottom-right
    aligned); decode pads the batch to its longest context and runs one masked SDPA call.
    On CPU, decode reads K/V from a `_DecodeStage` when it fits `STAGE_MAX_BYTES`, or, with
    `native_decode` (where aserve's CPU kernels run the model: quantized weights in float32),
    through `aserve_cpu.decode_attention`, straight from the pool. With `native_decode` a
    prefill takes that kernel too, each new token as a request of its own length: every query
    is then computed by one sequence of operations whatever its chunk, batch or cached
    prefix, which the CPU kernels' 16-bit activations need (a last-bit difference between
    SDPA over a whole prompt and over its last token, rounded to the next integer step, had
    changed a greedy token on a cache hit; bench/NOTES.md).

    `windows`: each layer's sliding window (0 or none given: the whole context), the last
    that many positions a query reads, its own included; `scale` multiplies the scores
    (default 1 / sqrt(head_dim)); `softcap` (Gemma 2; 0: none) bounds the scaled scores by
    softcap * tanh(score / softcap). A layer's `sinks` (gpt-oss) and a soft cap take float32
    scores in place of SDPA (`_attend_in_float32`), or the CPU kernel's own."""

    STAGE_MAX_BYTES = 256 << 20

    def __init__(
        self,
        pool: KVPool,
        page_table: PageTable,
        num_heads: int,
        head_dim: int,
        native_decode: bool = False,
        windows: tuple[int, ...] = (),
        scale: float | None = None,
        softcap: float = 0.0,
    ) -> None:
        self.pool = pool
        self.page_table = page_table
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.windows = windows or (0,) * len(pool.kv)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        on_cpu = pool.kv[0].device.type == "cpu"
        self.native_decode = (
            native_decode
            and on_cpu
            and pool.dtype == torch.float32
            and pool.storage_dtype in (torch.float32, torch.float16)
        )
        self.value_dim = pool.value_dim
        self.use_stage = on_cpu and not self.native_decode
        self._stage: _DecodeStage | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode and self.native_decode:
            batch.attn_metadata = _NativeDecodeMetadata(torch.tensor(batch.seq_lens))
        elif self.native_decode and batch.both_ways is None:
            batch.attn_metadata = self._prepare_native_prefill(batch)
        elif batch.is_decode:
            batch.attn_metadata = self._prepare_decode(batch)
        else:
            batch.attn_metadata = self._prepare_prefill(batch)

    def _prepare_prefill(self, batch: ForwardBatch) -> _PrefillMetadata:
        seqs, q_start = [], 0
        blocks = batch.both_ways or [[] for _ in batch.row_ids]
        for row, prefix, extend, total, both_ways in zip(
            batch.row_ids, batch.prefix_lens, batch.extend_lens, batch.seq_lens, blocks
        ):
            slots = {w: batch.table_of(w)[row, :total].long() for w in set(self.pool.windowed)}
            device = batch.page_table.device
            masks = {
                w: _prefill_mask(prefix, total, w, device, both_ways) for w in set(self.windows)
            }
            seqs.append(_PrefillSeq(q_start, extend, slots, masks))
            q_start += extend
        return _PrefillMetadata(seqs)

    @staticmethod
    def _prepare_native_prefill(batch: ForwardBatch) -> _NativeDecodeMetadata:
        rows = torch.tensor(batch.row_ids, dtype=torch.long)
        extends = torch.tensor(batch.extend_lens, dtype=torch.long)
        ends = torch.tensor(batch.seq_lens, dtype=torch.long)
        # token t of a request's new ones sees prefix + t + 1 slots
        first = torch.cumsum(extends, 0) - extends
        within = torch.arange(int(extends.sum())) - torch.repeat_interleave(first, extends)
        starts = torch.repeat_interleave(ends - extends, extends)
        return _NativeDecodeMetadata(starts + within + 1, torch.repeat_interleave(rows, extends))

    def _prepare_decode(self, batch: ForwardBatch) -> _DecodeMetadata:
        longest = max(batch.seq_lens)
        device = batch.page_table.device
        slots = {w: batch.table_of(w)[batch.rows, :longest].long() for w in set(self.pool.windowed)}
        masks = {w: self._decode_mask(batch.seq_lens, w, device) for w in set(self.windows)}
        stage, append = self._pick_stage(batch, longest)
        append_at = None
        if append:
            append_at = (torch.arange(batch.batch_size), torch.tensor(batch.seq_lens) - 1)
        return _DecodeMetadata(slots, masks, stage, append_at)

    def _decode_mask(
        self, seq_lens: list[int], window: int, device: torch.device
    ) -> torch.Tensor | None:
        """Additive, built once a step (SDPA would turn a boolean mask into this per layer):
        the padding past each shorter context, and the positions before a window."""
        longest = max(seq_lens)
        windowed = 0 < window < longest
        if min(seq_lens) == longest and not windowed:
            return None
        lens = torch.tensor(seq_lens, device=device)[:, None]
        positions = torch.arange(longest, device=device)[None, :]
        hidden = positions >= lens
        if windowed:
            hidden |= positions < lens - window
        mask = torch.zeros(hidden.shape, dtype=self.pool.dtype, device=device)
        return mask.masked_fill_(hidden, float("-inf"))[:, None, None]

    def _pick_stage(self, batch: ForwardBatch, longest: int) -> tuple[_DecodeStage | None, bool]:
        """The stage to read this step, and whether it only needs the new tokens appended."""
        if not self.use_stage:
            return None, False
        rows = batch.row_ids
        key = (*rows, *self.page_table.row_generations[rows].tolist())
        stage, self._stage = self._stage, None
        if stage is not None and stage.continues(key, batch.seq_lens):
            stage.seq_lens = batch.seq_lens
            self._stage = stage
            return stage, True
        old = None if stage is None else stage.buffers
        del stage
        numel = _DecodeStage.numel(batch.batch_size, longest, self.pool)
        if numel * torch.finfo(self.pool.dtype).bits // 8 > self.STAGE_MAX_BYTES:
            return None, False
        # Reuse the old stage's memory when the new one needs between half and all of it;
        # otherwise it is freed here, before its successor is allocated.
        held = 0 if old is None else max(buffer.numel() for buffer in old)
        spare = old if old is not None and numel <= held <= 2 * numel else None
        del old
        self._stage = _DecodeStage(key, batch.seq_lens, self.pool, spare)
        return self._stage, False

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor | None,
        layer: int,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        windowed = self.pool.windowed[layer]
        if kv is not None:
            self.pool.store(layer, batch.slots_of(windowed), kv)
        if isinstance(batch.attn_metadata, _NativeDecodeMetadata):
            meta = batch.attn_metadata
            out = torch.ops.aserve_cpu.decode_attention(
                q,
                self.pool.kv[layer],
                batch.table_of(windowed),
                batch.rows if meta.rows is None else meta.rows,
                meta.seq_lens,
                self.scale,
                self.windows[layer],
                sinks,
                self.softcap,
            )
            # one-part slots (latent attention) read the keys as values: keep the values' width
            return out[..., : self.value_dim].reshape(q.shape[0], self.num_heads * self.value_dim)
        if batch.is_decode:
            out = self._decode(q, kv, layer, batch, sinks)
        else:
            out = self._prefill(q, layer, batch.attn_metadata, sinks)
        return out.reshape(q.shape[0], self.num_heads * self.value_dim)

    def forward_latent(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Latent attention (`LatentBackend`): one key head of the cache's width, whose first
        `value_dim` columns are the values."""
        q = torch.cat((q_latent, q_rope), -1)
        return self.forward(q, kv, layer, batch).view(q.shape[0], self.num_heads, -1)

    def _prefill(
        self, q: torch.Tensor, layer: int, meta: _PrefillMetadata, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """Inputs get a batch dimension: with three, SDPA on CPU takes its slow math path."""
        out = q.new_empty(*q.shape[:2], self.value_dim)
        for seq in meta.seqs:
            q_seq = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1)
            kv_seq = self.pool.gather(layer, seq.kv_slots[self.pool.windowed[layer]])
            mask = seq.masks[self.windows[layer]]
            keys, values = (part[None].transpose(1, 2) for part in self.pool.split(kv_seq))
            latent = self.pool.parts == 1
            if sinks is not None or self.softcap or latent:
                if mask is None:  # SDPA's causal mask: a whole prompt, nothing cached
                    mask = torch.ones(seq.q_len, seq.q_len, dtype=torch.bool, device=q.device)
                    mask = mask.tril_()
                if latent:
                    o = _attend_latent(q_seq[None], keys, values, mask, self.scale)
                else:
                    o = _attend_in_float32(
                        q_seq[None], keys, values, mask, self.scale, sinks, self.softcap
                    )
            else:
                o = F.scaled_dot_product_attention(
                    q_seq[None],
                    keys,
                    values,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=self.scale,
                    # Only where heads share K/V: on CUDA (torch 2.13) the flag with as many
                    # K/V heads as query heads costs a ~5 ms build at each new prompt length.
                    enable_gqa=keys.shape[1] != q_seq.shape[0],
                )
            out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        new_kv: torch.Tensor | None,
        layer: int,
        batch: ForwardBatch,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """`new_kv`: this step's K/V, already in the pool (None: only there)."""
        meta: _DecodeMetadata = batch.attn_metadata
        windowed = self.pool.windowed[layer]
        kv_slots = meta.kv_slots[windowed]
        batch_size, longest = kv_slots.shape
        slot_shape = self.pool.kv[layer].shape[1:]
        if meta.stage is None:
            kv = self.pool.gather(layer, kv_slots.flatten())
            # [batch, 2, kv_heads, longest, head_dim], strided
            kv = kv.view(batch_size, longest, *slot_shape).permute(0, 2, 3, 1, 4)
        else:
            stage = meta.stage.kv[layer]
            token_major = stage.permute(0, 3, 1, 2, 4)  # [batch, capacity, 2, kv_heads, dim]
            if meta.append_at is not None:
                if new_kv is None or self.pool.quantized:  # the stage holds what the pool reads
                    new_kv = self.pool.gather(layer, batch.slots_of(windowed))
                token_major.index_put_(meta.append_at, new_kv)
            else:
                gathered = self.pool.gather(layer, kv_slots.flatten())
                token_major[:, :longest] = gathered.view(batch_size, longest, *slot_shape)
            kv = stage[:, :, :, :longest]
        mask = meta.masks[self.windows[layer]]
        keys, values = self.pool.split(kv)
        if self.pool.parts == 1:
            q_heads = q.view(batch_size, self.num_heads, 1, self.head_dim)
            o = _attend_latent(q_heads, keys, values, mask, self.scale)
            return o.reshape(batch_size, self.num_heads, self.value_dim)
        if sinks is not None or self.softcap:
            q_heads = q.view(batch_size, self.num_heads, 1, self.head_dim)
            o = _attend_in_float32(q_heads, keys, values, mask, self.scale, sinks, self.softcap)
            return o.reshape(batch_size, self.num_heads, self.value_dim)
        # A KV head's group of query heads as its queries: K/V are read once per KV head.
        kv_heads = kv.shape[2]
        o = F.scaled_dot_product_attention(
            q.view(batch_size, kv_heads, -1, self.head_dim),
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
        )
        return o.reshape(batch_size, self.num_heads, self.value_dim)


def _prefill_mask(
    prefix: int,
    total: int,
    window: int,
    device: torch.device,
    both_ways: list[tuple[int, int]] | None = None,
) -> torch.Tensor | None:
    """`visible_keys`, or None where SDPA's own causal mask is the same."""
    if prefix == 0 and not 0 < window < total and not both_ways:
        return None
    return visible_keys(prefix, total, window, device, both_ways or [])


SCORES_BYTES = 64 << 20
"""Float32 scores that `_attend_in_float32` holds at once: it takes queries in blocks."""


def _attend_in_float32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    """Attention that SDPA cannot take: a softmax that also sums each head's e^sink
    (gpt-oss), or scores soft-capped before it (Gemma 2). Scores in float32, as the sinks
    are, a block of queries at a time. `q` `[batch, heads, queries, dim]`, `k`/`v` `[batch,
    kv_heads, keys, dim]`, `mask` boolean (True: read) or additive, broadcast over `[batch,
    heads, queries, keys]`, or None."""
    batch, heads, queries, _ = q.shape
    group = heads // k.shape[1]
    keys = k.float().repeat_interleave(group, 1).transpose(-1, -2)
    values = v.float().repeat_interleave(group, 1)
    block = max(1, SCORES_BYTES // (4 * batch * heads * k.shape[2]))
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=q.device)
    for start in range(0, queries, block):
        rows = slice(start, start + block)
        scores = (q[:, :, rows].float() @ keys) * scale
        if softcap:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        if mask is not None:
            part = mask[..., rows, :] if mask.shape[-2] > 1 else mask
            if part.dtype == torch.bool:
                scores.masked_fill_(~part, float("-inf"))
            else:
                scores += part
        if sinks is None:
            weights = scores.softmax(-1)
        else:
            sink = sinks.float().view(1, heads, 1, 1).expand(batch, heads, scores.shape[2], 1)
            weights = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        out[:, :, rows] = (weights @ values).to(v.dtype)
    return out


def _attend_latent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Latent attention's (one key head, keys wider than values): every query head against
    the one key head, the heads folded into the rows of one product, a block of queries at
    a time. SDPA takes its math path for keys wider than values, which scales a copy of the
    keys at every call and repeats them for every head. `q` `[batch, heads, queries, dim]`,
    `k` `[batch, 1, keys, dim]`, `v` `[batch, 1, keys, value_dim]`, `mask` as
    `_attend_in_float32`'s. The softmax in float32, as transformers' eager attention."""
    batch, heads, queries, _ = q.shape
    keys, values = k[:, 0].transpose(1, 2), v[:, 0]
    out = q.new_empty(batch, heads, queries, values.shape[-1])
    block = max(1, SCORES_BYTES // (4 * batch * heads * keys.shape[-1]))
    for start in range(0, queries, block):
        rows = slice(start, start + block)
        part = q[:, :, rows] * scale
        count = part.shape[2]
        scores = torch.bmm(part.reshape(batch, heads * count, -1), keys)
        scores = scores.view(batch, heads, count, -1)
        if mask is not None:
            limit = mask[..., rows, :] if mask.shape[-2] > 1 else mask
            if limit.dtype == torch.bool:
                scores.masked_fill_(~limit, float("-inf"))
            else:
                scores += limit
        weights = scores.softmax(-1, dtype=torch.float32).to(values.dtype)
        mixed = torch.bmm(weights.view(batch, heads * count, -1), values)
        out[:, :, rows] = mixed.view(batch, heads, count, -1)
    return out
