"""DeepSeek's multi-head latent attention (MLA), DeepSeek-V2's and V3's (Kimi K2's, Moonlight's).

A token's keys and values for every head come from one normalised latent row
(`kv_lora_rank` wide) and one rotated key part shared by all heads; the cache keeps just that
row (`LatentAttention.cache_width`, 576 columns for the published models, where a head's
keys and values would be 16 x 320 for V2-Lite). Attention runs on the latent itself, as
vLLM and SGLang run it in decode: each head's unrotated query is first multiplied by its
slice of `kv_b_proj`'s key rows (`w_uk`), so its scores against the latent are its scores
against the head's keys; the output, a mix of latent rows, is multiplied by the head's value
rows (`w_uv`) afterwards. The backends see one key head of the cache's width whose first
`kv_lora_rank` columns are the values (kvcache/pool.py, `value_dim`), and take each head's
query in two parts, its latent and its rotated part (`LatentBackend.forward_latent`).

Under tensor parallelism each rank holds its heads' query rows, `kv_b_proj` slices and
output columns, and the whole latent projection: every rank caches the same latent rows.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.attention.base import LatentBackend
from aserve.config import LatentAttention, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.forward import ForwardBatch
from aserve.layers.cpu_ops import CpuKernels
from aserve.layers.fused import FusedOps
from aserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from aserve.layers.norm import RMSNorm
from aserve.layers.rotary import RotaryEmbedding
from aserve.layers.weight import WeightSource, read_whole
from aserve.quant.codes import Codes
from aserve.quant.fp8 import Fp8Rows, Fp8Tensor
from aserve.quant.gguf import QuantizedTensor
from aserve.quant.int_checkpoints import CodesTensor
from aserve.quant.method import ProductGroup
from aserve.quant.native import Scratch

QUERY_PROJECTIONS = ("q_proj", "q_b_proj")
REORDERED_ROWS = (*QUERY_PROJECTIONS, "kv_a_proj_with_mqa")
"""Projections whose rows load in `latent_row_order`."""


def latent_row_order(latent: LatentAttention, leaf: str, rows: int) -> torch.Tensor:
    """The order in which projection `leaf`'s rows load. A query projection's heads (`nope`
    then `rope` rows each) become every head's unrotated rows, then every head's rotating
    ones (the two parts of `LatentAttentionLayer`'s query projection, which tensor
    parallelism splits part by part): each part is then one strided block, with no copy to
    gather it. With interleaved
    rotation (DeepSeek's pairs (2i, 2i + 1)) the rotating rows also go even members first,
    odd ones after, so that rotate-half (pairs (i, i + rope / 2)), what aserve's rope
    kernels compute, is the same rotation; the latent projection's key part (after the
    latent's rows) likewise. Scores are unchanged: queries and keys move alike."""
    rope = latent.qk_rope_head_dim
    rotating = torch.arange(rope)
    if latent.rope_interleaved:
        rotating = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    if leaf == "kv_a_proj_with_mqa":
        return torch.cat((torch.arange(latent.kv_lora_rank), latent.kv_lora_rank + rotating))
    head = latent.qk_nope_head_dim + rope
    starts = torch.arange(0, rows, head)[:, None]
    nope = starts + torch.arange(latent.qk_nope_head_dim)
    return torch.cat((nope.flatten(), (starts + latent.qk_nope_head_dim + rotating).flatten()))


def float_weight(tensor: WeightSource) -> torch.Tensor:
    """A checkpoint tensor in float32 whatever it is stored as: GGUF blocks, integer codes,
    FP8 with its scales, or floats."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.decode().dequantize(torch.float32)
    if isinstance(tensor, (CodesTensor, Fp8Tensor)):
        return tensor.dequantize()
    return read_whole(tensor).float()


class LatentHeads(nn.Module):
    """`kv_b_proj`, `[heads * (nope + v), kv_lora_rank]`, as this rank's heads' two slices:
    the key rows `w_uk` `[heads, nope, kv_lora_rank]`, which take queries into the latent,
    and the value rows `w_uv` `[heads, v, kv_lora_rank]`, which take latent outputs to
    values. A float model keeps them dense in its dtype. A quantized one (`quantization`)
    keeps each head's two matrices as weights of aserve's CPU kernels, in one `ProductGroup`
    each (a step's heads in one call, as a MoE layer's experts): a GGUF file's blocks stay
    as they are, where the float32 slices had been the largest bytes a CPU decode step read
    after the experts; on a GPU they are made dense at `finalize`, for one batched product
    each."""

    FILLS = {"weight": ("w_uk", "w_uv"), "k_b": ("w_uk",), "v_b": ("w_uv",)}
    """What each checkpoint tensor fills: Hugging Face's `kv_b_proj.weight` both slices;
    llama.cpp's newer GGUF files store them apart, `attn_k_b` `[heads, kv_lora_rank, nope]`
    (each head's key rows transposed) and `attn_v_b` `[heads, v, kv_lora_rank]`."""

    def __init__(
        self, latent: LatentAttention, heads: tuple[int, int], quantization: str | None
    ) -> None:
        super().__init__()
        self.latent = latent
        self.heads = heads
        local = heads[1] - heads[0]
        rank, nope, value = latent.kv_lora_rank, latent.qk_nope_head_dim, latent.v_head_dim
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None
        self.key_rows: ProductGroup | None = None
        self.value_rows: ProductGroup | None = None
        if quantization is None:
            self.w_uk = nn.Parameter(torch.empty(local, nope, rank), False)
            self.w_uv = nn.Parameter(torch.empty(local, value, rank), False)
        else:  # each head's key rows transposed: `[rank, nope]`, as a product's `[out, in]`
            self.key_rows = ProductGroup(local, [rank], nope, quantization)
            self.value_rows = ProductGroup(local, [value], rank, quantization)

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        latent = self.latent
        rank, nope, value = latent.kv_lora_rank, latent.qk_nope_head_dim, latent.v_head_dim
        if isinstance(tensor, torch.Tensor):  # a float GGUF's stacked heads, as blocks' are
            tensor = tensor.reshape(-1, tensor.shape[-1])
        if name == "weight":
            for local, head in enumerate(range(*self.heads)):
                rows = tensor[head * (nope + value) : (head + 1) * (nope + value)]
                self._load_keys(local, float_weight(rows[:nope]).T)
                self._load_values(local, rows[nope:])
        elif name == "k_b":
            for local, head in enumerate(range(*self.heads)):
                self._load_keys(local, tensor[head * rank : (head + 1) * rank])
        elif name == "v_b":
            for local, head in enumerate(range(*self.heads)):
                self._load_values(local, tensor[head * value : (head + 1) * value])
        else:
            raise ValueError(f"checkpoint tensor kv_b_proj.{name} has no place in this model")

    def _load_keys(self, local: int, rows: WeightSource) -> None:
        """Head `local`'s key rows transposed, `[rank, nope]`."""
        if self.key_rows is not None:
            self.key_rows.weights[local].load(0, _loadable(rows))
        else:
            assert self.w_uk is not None
            self.w_uk.data[local].copy_(float_weight(rows).T)

    def _load_values(self, local: int, rows: WeightSource) -> None:
        if self.value_rows is not None:
            self.value_rows.weights[local].load(0, _loadable(rows))
        else:
            assert self.w_uv is not None
            self.w_uv.data[local].copy_(float_weight(rows))

    def fill_random(self, std: float, generator: torch.Generator, device: torch.device) -> None:
        """Random heads (dummy weights) of a quantized model, from normal floats on `device`."""
        for group in (self.key_rows, self.value_rows):
            for weight in [] if group is None else group.weights:
                rows = torch.empty(weight.shard_rows[0], weight.cols, device=device)
                weight.load(0, rows.normal_(0.0, std, generator=generator))

    def finalize(self, device: torch.device, dtype: torch.dtype, scratch: Scratch) -> None:
        """The quantized heads' products for `device`: the CPU kernels' there, dense
        slices in `dtype` elsewhere."""
        if self.key_rows is None or self.value_rows is None:
            return
        if device.type == "cpu":
            self.key_rows.finalize(device, dtype, scratch)
            self.value_rows.finalize(device, dtype, scratch)
            return
        keys = torch.stack([_dense(w.shards[0]) for w in self.key_rows.weights])
        values = torch.stack([_dense(w.shards[0]) for w in self.value_rows.weights])
        self.w_uk = keys.transpose(1, 2).to(device, dtype).contiguous()
        self.w_uv = values.to(device, dtype)
        self.key_rows = self.value_rows = None

    def to_latent(self, q_nope: torch.Tensor) -> torch.Tensor:
        """Each head's unrotated query `[tokens, heads, nope]` in the latent, `[tokens,
        heads, kv_lora_rank]` (perhaps a strided view)."""
        if self.key_rows is None:
            assert self.w_uk is not None
            return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        heads = range(q_nope.shape[1])
        return torch.stack(self.key_rows.linear(list(heads), [q_nope[:, h] for h in heads]), 1)

    def to_values(self, mixed: torch.Tensor) -> torch.Tensor:
        """Each head's mix of latent rows `[tokens, heads, kv_lora_rank]` as its values,
        `[tokens, heads * v]`."""
        if self.value_rows is None:
            assert self.w_uv is not None
            values = torch.bmm(mixed.transpose(0, 1), self.w_uv.transpose(1, 2))
            return values.transpose(0, 1).reshape(mixed.shape[0], -1)
        heads = range(mixed.shape[1])
        return torch.cat(self.value_rows.linear(list(heads), [mixed[:, h] for h in heads]), -1)

    def products(self) -> list[object]:
        """The CPU kernels' weights these heads hold (none where dense)."""
        groups = [g for g in (self.key_rows, self.value_rows) if g is not None]
        return [p for g in groups for w in g.weights for p in w.products]


def _loadable(rows: WeightSource) -> QuantizedTensor | CodesTensor | Fp8Tensor | torch.Tensor:
    """What `QuantizedLinearWeight.load` takes: a checkpoint's blocks as they are, or floats."""
    if isinstance(rows, (QuantizedTensor, CodesTensor, Fp8Tensor, torch.Tensor)):
        return rows
    return read_whole(rows)


def _dense(shard: object) -> torch.Tensor:
    """A loaded shard in float32: decoded codes, FP8 rows times their scales, or floats."""
    if isinstance(shard, (Codes, Fp8Rows)):
        return shard.dequantize()
    assert isinstance(shard, torch.Tensor)
    return shard.float()


class LatentAttentionLayer(nn.Module):
    """One layer's MLA, named as Hugging Face's checkpoints name it: `q_proj` (or
    `q_a_proj`, `q_a_layernorm` and `q_b_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`,
    `kv_b_proj` and `o_proj`."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        ops: FusedOps | None,
    ) -> None:
        super().__init__()
        latent = config.latent
        assert latent is not None
        self.latent = latent
        self.layer = layer
        self.rotary = rotary
        first, last = self.heads = tp.shard(config.num_heads)
        self.local_heads = last - first
        hidden, eps, quantization = config.hidden_size, config.rms_norm_eps, config.quantization
        whole = TPGroup()  # replicated on every rank
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ColumnParallelLinear | None = None
        # every head's unrotated rows, then every head's rotating ones (`latent_row_order`)
        query_parts = [
            config.num_heads * latent.qk_nope_head_dim,
            config.num_heads * latent.qk_rope_head_dim,
        ]
        if latent.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(
                hidden, [latent.q_lora_rank], config.qkv_bias, whole, quantization
            )
            self.q_a_layernorm = RMSNorm(latent.q_lora_rank, eps, ops)
            self.q_b_proj = ColumnParallelLinear(
                latent.q_lora_rank, query_parts, False, tp, quantization
            )
        else:
            self.q_proj = ColumnParallelLinear(hidden, query_parts, False, tp, quantization)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, [latent.cache_width], config.qkv_bias, whole, quantization
        )
        # normalised in place, a strided view: the CPU kernels' norm writes new rows only
        in_place_ops = None if isinstance(ops, CpuKernels) else ops
        self.kv_a_layernorm = RMSNorm(latent.kv_lora_rank, eps, in_place_ops)
        self.kv_b_proj = LatentHeads(latent, self.heads, quantization)
        self.o_proj = RowParallelLinear(
            config.num_heads * latent.v_head_dim,
            hidden,
            config.o_bias,
            tp,
            reduce_results=False,
            quantization=quantization,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        attn: LatentBackend,
    ) -> torch.Tensor:
        """The latent row is normalised and its key part rotated in place, which makes the
        projection's output the new tokens' cache rows as they are; the queries' two parts
        are strided blocks of theirs (`latent_row_order`)."""
        latent, heads = self.latent, self.local_heads
        tokens = hidden.shape[0]
        if self.q_a_proj is not None:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            assert self.q_proj is not None
            query = self.q_proj(hidden)
        q_nope, q_rope = query.split(
            [heads * latent.qk_nope_head_dim, heads * latent.qk_rope_head_dim], -1
        )
        rows = self.kv_a_proj_with_mqa(hidden)
        self.kv_a_layernorm.norm_heads(rows[:, : latent.kv_lora_rank], latent.kv_lora_rank)
        self.rotary.rotate_apart(positions, q_rope, rows[:, latent.kv_lora_rank :], batch.rope_rows)
        q_latent = self.kv_b_proj.to_latent(q_nope.view(tokens, heads, -1))
        mixed = attn.forward_latent(
            q_latent, q_rope.view(tokens, heads, -1), rows.view(tokens, 1, 1, -1), self.layer, batch
        )
        return self.o_proj(self.kv_b_proj.to_values(mixed))
