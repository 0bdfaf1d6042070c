"""One dense decoder for Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM3, Phi-3, Granite and
Gemma 2 and 3.

The families differ only in flags read from the config: Qwen2 adds a bias to the Q/K/V
projections, Qwen3 normalises each head of Q and K, Llama-3 scales its rope frequencies, and
small models tie the LM head to the embedding. Gemma 3 also normalises attention's and the
MLP's outputs ("sandwich" norms, weighing by 1 + w), gates with GELU, scales the
embeddings, and gives five layers of six a sliding window and a rope of their own; Gemma 2
windows every other layer and soft-caps its scores (the attention backends' `softcap`) and
its logits.
Checkpoint names are Hugging Face's; the fused projections (qkv_proj, gate_up_proj) load
their parts by shard.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from aserve.attention.base import AttentionBackend
from aserve.config import GELU_TANH, ConfigError, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.forward import ForwardBatch
from aserve.layers.cpu_gemm import can_pack
from aserve.layers.cpu_ops import CpuKernels
from aserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aserve.layers.fused import FusedOps
from aserve.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    active_lora,
)
from aserve.layers.moe import QuantizedExperts
from aserve.layers.norm import AcrossHeadsNorm, Float32RMSNorm, GemmaRMSNorm, RMSNorm
from aserve.layers.rotary import NO_ROPE, RotaryEmbedding, partial_rotary_order
from aserve.layers.weight import WeightSource, read_whole
from aserve.models.gated_deltanet import GatedDeltaNet
from aserve.models.mla import (
    QUERY_PROJECTIONS,
    REORDERED_ROWS,
    LatentAttentionLayer,
    LatentHeads,
    latent_row_order,
)
from aserve.models.multimodal import DECODER_PARTS, checkpoint_names, language_model_name
from aserve.models.pooling import Pooler
from aserve.models.weights import expected_tensors, map_checkpoint_tensor
from aserve.quant.fp8 import Fp8Tensor
from aserve.quant.fp8_activations import Fp8Activations
from aserve.quant.gguf import QuantizedTensor
from aserve.quant.huge_pages import WeightBlocks
from aserve.quant.int_checkpoints import CodesTensor
from aserve.quant.native import KernelTensors, Scratch

if TYPE_CHECKING:
    from aserve.lora.layers import LoraRows
    from aserve.models.cpu_decode import DecodeStack


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        ops: FusedOps | None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            tp,
            quantization=config.quantization,
            gated=config.attention_output_gate,
        )
        self.q_size, self.kv_size = self.qkv_proj.local_sizes[0], self.qkv_proj.local_sizes[1]
        self.gated = config.attention_output_gate
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            config.o_bias,
            tp,
            reduce_results=False,
            quantization=config.quantization,
        )
        eps = self.eps = config.rms_norm_eps
        norm = _norm_class(config)
        self.heads = tp.shard(config.num_heads)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm and config.qk_norm_across_heads:  # OLMo 2's span all heads
            q_rows = (self.heads[0] * self.head_dim, self.heads[1] * self.head_dim)
            kv_index = tp.rank // self.qkv_proj.kv_replicas
            k_rows = (kv_index * self.kv_size, (kv_index + 1) * self.kv_size)
            q_width, k_width = config.num_heads * self.head_dim, config.num_kv_heads * self.head_dim
            self.q_norm = AcrossHeadsNorm(q_width, q_rows, eps, tp)
            self.k_norm = AcrossHeadsNorm(k_width, k_rows, eps, tp, self.qkv_proj.kv_replicas)
        elif config.qk_norm:
            self.q_norm, self.k_norm = (
                norm(config.head_dim, eps, ops),
                norm(config.head_dim, eps, ops),
            )
        self.norm_rope_store = _fused_norm_rope_store(ops, config.head_dim)
        # OLMo 2's norms in the CUDA kernel itself, where one rank holds every head
        self.fused_across_heads = (
            isinstance(self.q_norm, AcrossHeadsNorm)
            and tp.size == 1
            and self.norm_rope_store is not None
            and not isinstance(ops, CpuKernels)
        )
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:  # this rank's heads'
            local_heads = self.heads[1] - self.heads[0]
            self.sinks = nn.Parameter(torch.zeros(local_heads, dtype=torch.float32), False)

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        """gpt-oss's `self_attn.sinks`, one logit a head."""
        if name != "sinks" or self.sinks is None:
            raise ValueError(f"checkpoint tensor self_attn.{name} has no place in this model")
        self.sinks.data.copy_(tensor[self.heads[0] : self.heads[1]].float())

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Q/K norm and RoPE work in place on the fused QKV output, so K and V stay side by
        side there and reach the KV pool in one write. On CUDA one kernel does all three
        (norms across heads, OLMo 2's, too, where one rank holds every head; else they go
        first)."""
        qkv = self.qkv_proj(hidden)
        q, kv = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + 2 * self.kv_size]
        tokens = q.shape[0]
        new_kv: torch.Tensor | None = None  # None: already in the pool
        head_norms = q_norm, k_norm = self.q_norm, self.k_norm
        across = {"across_heads": True} if self.fused_across_heads else {}
        if (
            not across
            and isinstance(q_norm, AcrossHeadsNorm)
            and isinstance(k_norm, AcrossHeadsNorm)
        ):
            q_norm.norm_in_place(q)
            k_norm.norm_in_place(kv[:, : self.kv_size])
            head_norms = None, None
        rows = batch.rope_rows
        if self.norm_rope_store is not None:
            self.norm_rope_store(
                q,
                kv,
                positions if rows is None else rows.positions,
                self.rotary.cos_sin if rows is None else rows.cos_sin,
                None if head_norms[0] is None else head_norms[0].weight,
                None if head_norms[1] is None else head_norms[1].weight,
                self.eps,
                attn.pool.kv[self.layer],
                batch.slots_of(attn.pool.windowed[self.layer]),
                self.head_dim,
                attn.pool.scale_pairs[self.layer],
                **across,
            )
        else:
            k = kv[:, : self.kv_size]
            if head_norms[0] is not None and head_norms[1] is not None:
                head_norms[0].norm_heads(q, self.head_dim)
                head_norms[1].norm_heads(k, self.head_dim)
            self.rotary(positions, qkv[:, : self.q_size + self.kv_size], self.q_size, rows)
            new_kv = kv.view(tokens, 2, -1, self.head_dim)
        out = attn.forward(q.view(tokens, -1, self.head_dim), new_kv, self.layer, batch, self.sinks)
        if self.gated:  # Qwen3.5: each head's output scaled by its gate's sigmoid
            gate = qkv[:, self.q_size + 2 * self.kv_size :]
            out = out.reshape(tokens, -1) * torch.sigmoid(gate)
        return self.o_proj(out)


def _norm_class(config: ModelConfig) -> type[RMSNorm]:
    if config.gemma_norms:
        return GemmaRMSNorm
    return Float32RMSNorm if config.norms_in_float32 else RMSNorm


def use_fp8_activations(model: nn.Module, adapters: LoraRows | None = None) -> None:
    """Where an FP8 weight follows a norm, have the norm write FP8 rows with their scales
    (quant/fp8_cuda.py) instead of bf16 rows that the product would quantize in a kernel of
    its own: two of a layer's four quantization kernels go. CUDA only; batches of one row
    keep bf16 for the one-row GEMV, and steps of LoRA `adapters` too."""
    from aserve.quant import fp8_cuda

    def takes_fp8(layer: ColumnParallelLinear | RowParallelLinear) -> bool:
        return layer.quantized is not None and layer.quantized.fp8_product() is not None

    for module in model.modules():
        # the FP8 norm kernel takes the model dtype's weight, not a float32 one (Gemma's,
        # gpt-oss's)
        if not isinstance(module, DecoderLayer) or module.post_norms:
            continue  # no norm before the products (OLMo 2)
        if isinstance(module.input_layernorm, Float32RMSNorm) or module.linear_attn is not None:
            continue
        attention = module.self_attn
        if isinstance(attention, DecoderAttention) and takes_fp8(attention.qkv_proj):
            module.input_layernorm.fp8_norm = fp8_cuda.norm_fp8
            module.input_layernorm.adapters = adapters
        mlp = module.mlp
        if isinstance(mlp, DecoderMLP) and takes_fp8(mlp.gate_up_proj):
            module.post_attention_layernorm.fp8_norm = fp8_cuda.norm_fp8
            module.post_attention_layernorm.adapters = adapters


def _fused_norm_rope_store(ops: FusedOps | None, head_dim: int) -> Callable[..., None] | None:
    """The one-kernel Q/K norm, RoPE and KV write: `layers/rope_store.py` where the layers
    use the Triton kernels of layers/cuda_ops.py (CUDA, half precision), its C++ twin where
    they use the CPU kernels (quantized models on CPU), else None."""
    if isinstance(ops, CpuKernels):
        return ops.norm_rope_store
    if ops is None or head_dim % 16 or not 32 <= head_dim <= 256:  # 96 is read padded
        return None
    from aserve.layers.rope_store import norm_rope_store

    return norm_rope_store


MLPFactory = Callable[[int], nn.Module]
"""Builds the MLP of layer number `i`: families with expert layers swap some or all."""


REORDERED_BY_ROTATION = ("q_proj", "k_proj", "q_norm", "k_norm")
"""Layers whose rows (or weights) follow a head's dimensions: where part of a head rotates,
loaded in `partial_rotary_order` (the Q/K norms' weights too, GLM-4.5's)."""


class DecoderMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, tp: TPGroup, ops: FusedOps | None, inter: int = 0
    ) -> None:
        """`inter`: the width, if not `intermediate_size` (Qwen2-MoE's shared expert)."""
        super().__init__()
        self.ops = ops
        inter = inter or config.intermediate_size
        quantization = config.quantization
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [inter, inter], False, tp, quantization
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, False, tp, reduce_results=False, quantization=quantization
        )
        self.gelu = config.hidden_act == GELU_TANH

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        """Up to 16 rows of an FP8 model on CUDA take the activation from the gate|up
        kernel, the down projection then reads it plainly; otherwise the down projection's
        kernels take the activation over (`forward_gated`). Those gate with SiLU: Gemma's
        GELU is its own kernel before the down projection."""
        if self.gelu:
            assert isinstance(x, torch.Tensor)
            gate_up = self.gate_up_proj(x)
            if self.ops is not None:
                return self.down_proj(self.ops.gelu_tanh_and_mul(gate_up))
            gate, up = gate_up.chunk(2, -1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        gate_up = self.gate_up_proj.quantized
        adapted = active_lora(self.gate_up_proj.lora) is not None
        if gate_up is not None and not adapted:
            activation = gate_up.silu(x)
            if activation is not None:
                return self.down_proj(activation)
        return self.down_proj.forward_gated(self.gate_up_proj(x), self.ops)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        ops: FusedOps | None,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.linear_attn: GatedDeltaNet | None = None
        if config.keeps_kv(layer):
            self.self_attn: DecoderAttention | LatentAttentionLayer = (
                LatentAttentionLayer(config, layer, rotary, tp, ops)
                if config.latent
                else DecoderAttention(config, layer, rotary, tp, ops)
            )
        else:
            self.linear_attn = GatedDeltaNet(config, layer, tp)
        self.mlp = mlp
        self.sandwich = config.sandwich_norms
        self.post_norms = config.post_norms
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1 elsewhere
        norm = _norm_class(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        if not self.post_norms:
            self.input_layernorm = norm(size, eps, ops)
        self.post_attention_layernorm = norm(size, eps, ops)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(size, eps, ops)
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = norm(size, eps, ops)
        self.tp = tp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention and the MLP return partial sums over tensor-parallel ranks; each norm
        after them reduces (`add_and_norm` with the group). The layer's output is partial
        too: the next layer's input norm, or the model's final one, reduces it. With
        sandwich norms (Gemma, GLM-4) the norms right after attention and the MLP reduce,
        and the layer's output is whole, as with post norms alone (OLMo 2)."""
        if self.post_norms:
            return self._post_normed(positions, hidden, residual, batch, attn)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            group = None if self.sandwich else self.tp
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, group)
        mixer = self.self_attn if self.linear_attn is None else self.linear_attn
        hidden = mixer(positions, hidden, batch, attn)
        if not self.sandwich:
            hidden, residual = self.post_attention_layernorm.add_and_norm(
                self._scaled(hidden), residual, self.tp
            )
            return self._scaled(self.mlp(hidden)), residual
        hidden = self.post_attention_layernorm(self._whole(hidden))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self._whole(self.mlp(hidden))), residual

    def _post_normed(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2: the stream itself goes into attention and the MLP, whose outputs are
        normalised before each joins it. Returns (MLP output, stream before it), the pair the
        next layer (or the final norm) adds."""
        stream = hidden if residual is None else hidden.add_(residual)
        attended = self.post_attention_layernorm(
            self._whole(self.self_attn(positions, stream, batch, attn))
        )
        stream = attended.add_(stream)
        return self.post_feedforward_layernorm(self._whole(self.mlp(stream))), stream

    def _scaled(self, output: torch.Tensor) -> torch.Tensor:
        """An attention or MLP output as it joins the residual stream (Granite scales it;
        partial sums under TP scale alike)."""
        multiplier = self.residual_multiplier
        return output if multiplier == 1.0 else output.mul_(multiplier)

    def _whole(self, partial: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(partial) if self.tp.size > 1 else partial


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        tp: TPGroup,
        ops: FusedOps | None,
        make_mlp: MLPFactory,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp, config.quantization
        )
        self.embedding_scale = config.embedding_scale
        # Latent attention rotates through this module, the CPU kernels' layers through
        # their own one-kernel norm, RoPE and KV write: torch's rope for it there.
        latent_on_cpu = config.latent is not None and isinstance(ops, CpuKernels)
        rotary = RotaryEmbedding(
            config.latent.qk_rope_head_dim if config.latent else config.head_dim,
            max_positions,
            config.rope_theta,
            config.rope_scaling,
            None if latent_on_cpu else ops,
            config.rotary_dim,
            config.mrope_section,
            config.mrope_interleaved,
        )
        self.rotary = rotary
        local_rotary = rotary
        if config.local_rope_theta is not None:
            local_rotary = RotaryEmbedding(
                config.head_dim, max_positions, config.local_rope_theta, None, ops
            )
        unrotated = rotary
        if config.rope_free_layers:  # SmolLM3
            unrotated = RotaryEmbedding(
                config.head_dim, max_positions, config.rope_theta, {"rope_type": NO_ROPE}, ops
            )

        def layer_rotary(layer: int) -> RotaryEmbedding:
            if layer in config.rope_free_layers:
                return unrotated
            return local_rotary if config.layer_window(layer) else rotary

        self.layers = nn.ModuleList(
            DecoderLayer(config, i, layer_rotary(i), tp, ops, make_mlp(i))
            for i in range(config.num_layers)
        )
        norm = _norm_class(config)
        self.norm = norm(config.hidden_size, config.rms_norm_eps, ops)
        self.tp = tp
        # what the last layer's output needs before the final norm: partial sums reduced
        self.final_group = None if config.sandwich_norms or config.post_norms else tp
        # The layers in C++ for CPU decode steps (models/cpu_decode.py), set after loading.
        self.decode_stack: DecodeStack | None = None

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        ids = batch.input_ids
        if batch.image_rows is not None:  # image positions hold ids past the vocabulary
            ids = ids.clamp(max=self.embed_tokens.vocab_size - 1)
        hidden = self.embed_tokens(ids)
        if self.embedding_scale is not None:  # in the embeddings' dtype, as transformers does
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        if batch.image_rows is not None:  # unscaled, as transformers places them
            assert batch.image_embeds is not None
            hidden = hidden.index_copy(0, batch.image_rows, batch.image_embeds.to(hidden.dtype))
        residual: torch.Tensor | None = None
        stack = self.decode_stack
        if stack is not None and batch.adapter_ids is None and stack.takes(batch, attn):
            hidden, residual = stack.run(hidden, batch, attn)
        else:
            positions = batch.positions  # one tensor for all layers: rope looks tables up once
            if batch.mrope_positions is not None:  # Qwen-VL images: each token's own rows
                batch.rope_rows = self.rotary.rows_at(batch.mrope_positions)
            middle = len(self.layers) // 2
            inner = batch.image_layer_embeds
            if self.final_group is not None and self.tp.rank != 0:
                inner = None  # a layer's output is a partial sum: rank 0's part takes them
            for i, layer in enumerate(self.layers):
                if i == middle and batch.halfway is not None:
                    batch.halfway.record()
                hidden, residual = layer(positions, hidden, residual, batch, attn)
                if inner is not None and i < len(inner):  # Qwen3-VL: into the residual stream
                    assert batch.image_rows is not None
                    hidden = hidden.index_add(0, batch.image_rows, inner[i].to(hidden.dtype))
        assert residual is not None
        hidden, _ = self.norm.add_and_norm(hidden, residual, self.final_group)
        return hidden


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "q_gate_proj": ("qkv_proj", 3),  # Qwen3.5's gates, which its q_proj holds beside queries
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # Qwen3.5's linear attention: one product for its queries, keys, values, gates,
    # betas and decays
    "in_proj_q": ("in_proj", 0),
    "in_proj_k": ("in_proj", 1),
    "in_proj_v": ("in_proj", 2),
    "in_proj_z": ("in_proj", 3),
    "in_proj_b": ("in_proj", 4),
    "in_proj_a": ("in_proj", 5),
}
NORM_NAMES = {
    "glm4": {
        "post_self_attn_layernorm": "post_attention_layernorm",
        "post_attention_layernorm": "pre_feedforward_layernorm",
        "post_mlp_layernorm": "post_feedforward_layernorm",
    }
}
"""Families whose layers' norms are named otherwise than Gemma's four (before and after
attention, before and after the MLP), in checkpoint name -> ours."""
LATENT_FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
"""`_FUSED` for latent attention, whose `q_proj` is a projection of its own."""
_FUSED_IN_CHECKPOINT = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkv": ("in_proj_q", "in_proj_k", "in_proj_v"),
    "in_proj_qkvz": ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z"),  # Qwen3-Next's,
    "in_proj_ba": ("in_proj_b", "in_proj_a"),  # each grouped by key head (`_key_head_order`)
}
"""Checkpoints that store a layer's projections fused (Phi-3's, Qwen3.5's linear
attention's), split into names of their own parts."""


class ScoreHead(nn.Module):
    """A classifier's `score` layer `[labels, hidden]`, whole on every rank (a few rows)."""

    def __init__(self, labels: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(labels, hidden), requires_grad=False)

    def load_weight(self, param: str, tensor: WeightSource, shard: int) -> None:
        whole = read_whole(tensor)
        if param != "weight" or whole.shape != self.weight.shape:
            raise ValueError(f"score.{param} of shape {list(whole.shape)} does not fit")
        self.weight.data.copy_(whole)

    def load_token_rows(self, head: WeightSource, config: ModelConfig) -> None:
        """A causal LM's head made a classifier (vLLM's `classifier_from_token`): its rows of
        the classifier's tokens, or with a two-way softmax the second minus the first."""
        if isinstance(head, (QuantizedTensor, CodesTensor)):
            raise ValueError("classifier_from_token reads a float LM head (not a GGUF file's)")
        rows = [read_whole(head[i : i + 1])[0].float() for i in config.classifier_token_ids]
        weight = torch.stack([rows[1] - rows[0]] if config.two_way_softmax else rows)
        self.weight.data.copy_(weight)


class DecoderForCausalLM(nn.Module):
    """`ops` is FlashInfer's module for fused norm / rope / activation kernels, or None.
    `make_mlp` replaces the dense MLP of some layers (see models/moe.py)."""

    graph_capturable = True
    """Whether a decode step may be captured in a CUDA graph (no host syncs inside)."""
    addresses_from_host = True
    """Whether every address a forward's kernels read comes from the host (pages, slots,
    token ids) rather than from another kernel: then the warm-up's kernel census
    (engine/kernel_census.py), which skips some kernels and runs those compiled before on
    the garbage they leave, reads no garbage address."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        tp: TPGroup,
        ops: FusedOps | None = None,
        make_mlp: MLPFactory | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.rotary_order: torch.Tensor | None = None  # a head's rows, where part rotates
        # Whether a forward reads `ForwardBatch.rows` on the device (linear attention's
        # recurrent states are a row's): CUDA graphs then copy each step's rows into theirs.
        self.reads_rows = config.linear_attention is not None
        self.fused = LATENT_FUSED if config.latent else _FUSED
        if config.rotary_dim and config.rotary_dim < config.head_dim:
            self.rotary_order = partial_rotary_order(
                config.head_dim, config.rotary_dim, config.rotary_interleaved
            )
        mlps = make_mlp or (lambda _: DecoderMLP(config, tp, ops))
        self.model = DecoderModel(config, max_positions, tp, ops, mlps)
        self.lm_head = (
            self.model.embed_tokens
            if config.tie_word_embeddings
            else ParallelLMHead(config.vocab_size, config.hidden_size, tp, config.quantization)
        )
        self.score = ScoreHead(config.num_labels, config.hidden_size) if config.classifies else None
        # An embedding model's pooling and Dense modules (models/pooling.py), set by the
        # engine; None pools at the last token.
        self.pooler: Pooler | None = None

    def embed(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Embeddings `[batch, width]` in float32, unit length: the last layer's normalised
        output at each request's `logit_indices` token (its last one in the prompt's last
        chunk), as Qwen3-Embedding, gte-Qwen2 and e5-mistral pool it, or as `pooler` pools
        (EmbeddingGemma's mean, then its Dense modules)."""
        hidden = self.model(batch, attn)
        if self.pooler is None:
            return F.normalize(hidden[batch.logit_indices].float(), dim=-1)
        return F.normalize(self.pooler(hidden, batch), dim=-1)

    def classify(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """A sequence classifier's logits `[batch, labels]` in float32, from the last layer's
        normalised output at each request's `logit_indices` token, as transformers'
        `*ForSequenceClassification` scores the last token."""
        assert self.score is not None
        hidden = self.model(batch, attn)[batch.logit_indices].float()
        return F.linear(hidden, self.score.weight.float())

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits `[batch, vocab]` at each request's `logit_indices` token, in the model's
        dtype: the sampler's kernels and log-softmax widen them as they read them, where a
        float32 copy first cost a kernel and 0.10 ms of a 256-request step on the H200.
        Gemma 2's soft cap works in place in that dtype, as transformers caps them."""
        hidden = self.model(batch, attn)[batch.logit_indices]
        logits = self.lm_head.logits(hidden)
        if self.config.logits_scaling != 1.0:  # Granite
            logits.div_(self.config.logits_scaling)
        cap = self.config.logit_softcap
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits

    def pack_lm_head(self, checkpoint: Path | None) -> None:
        """On CPU, pack the LM head (`VocabParallelEmbedding.pack`). A head tied to the
        embedding keeps serving lookups from the checkpoint's table; without a checkpoint
        (dummy weights) it stays plain."""
        head = self.lm_head
        if head.tp.size != 1 or head.weight is None or not can_pack(head.weight):
            return
        if head is not self.model.embed_tokens:
            head.pack()
            return
        table = None
        if checkpoint is not None:
            names = checkpoint_names(
                "model.embed_tokens.weight", self.config.language_model_of is not None
            )
            table = map_checkpoint_tensor(checkpoint, names)
        if table is not None and table.shape == head.weight.shape:
            head.pack(table)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy Hugging Face-named tensors into this rank's (fused, sharded) parameters."""
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        renamed = NORM_NAMES.get(self.config.model_type, {})
        rows_from = None  # where a classifier's token rows came from: the head, or a tied one
        for name, tensor in weights:
            if self._classifier_rows_in(name, rows_from):
                assert self.score is not None
                self.score.load_token_rows(tensor, self.config)
                rows_from = name
                loaded.add("score.weight")
            if (
                "rotary_emb" in name
                or (name == "lm_head.weight" and self.config.tie_word_embeddings)
                or name.startswith("mtp.")  # Qwen3.5's next-token prediction layer: not run
            ):
                continue
            module, _, param = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            if leaf in renamed:
                name = f"{parent}.{renamed[leaf]}.{param}"
            loaded.update(self.load_tensor(modules, name, tensor))
        missing = self.expected_tensors() - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _classifier_rows_in(self, name: str, rows_from: str | None) -> bool:
        """Whether tensor `name` holds a `classifier_from_token` classifier's rows: the LM
        head, or the embedding where the head is tied to it (none seen yet)."""
        if self.score is None or not self.config.classifier_tokens:
            return False
        head = "lm_head.weight"
        return name == head or (name == "model.embed_tokens.weight" and rows_from != head)

    def load_tensor(
        self, modules: dict[str, nn.Module], name: str, tensor: WeightSource
    ) -> list[str]:
        """Load one checkpoint tensor; returns the names of what it filled, which
        `expected_tensors` must cover once every tensor is in."""
        module_name, _, param = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in ("in_proj_qkvz", "in_proj_ba") and param == "weight":
            tensor = _permute_rows(tensor, lambda rows: self._key_head_order(leaf, rows))
        if leaf in _FUSED_IN_CHECKPOINT and param in ("weight", "bias"):
            loaded: list[str] = []
            for part, rows in zip(_FUSED_IN_CHECKPOINT[leaf], self._fused_rows(leaf), strict=True):
                part_name = f"{parent}.{part}.{param}"
                loaded += self.load_tensor(modules, part_name, tensor[rows])
            return loaded
        latent = self.config.latent
        gates: list[str] = []
        if leaf == "q_proj" and self.config.attention_output_gate and param == "weight":
            tensor, gate_rows = self._queries_and_gates(tensor)
            gates = self.load_tensor(modules, f"{parent}.q_gate_proj.{param}", gate_rows)
        target, shard = self.fused.get(leaf, (leaf, 0))
        shards = [(tensor, shard)]
        if leaf in REORDERED_BY_ROTATION and self.rotary_order is not None:
            shards = [(self._reorder_head_rows(tensor), shard)]
        elif latent and leaf in REORDERED_ROWS and param == "weight":
            tensor = _permute_rows(tensor, lambda rows: latent_row_order(latent, leaf, rows))
            shards = [(tensor, 0)]
            if leaf in QUERY_PROJECTIONS:  # its two parts: `LatentAttentionLayer`'s
                nope = self.config.num_heads * latent.qk_nope_head_dim
                shards = [(tensor[:nope], 0), (tensor[nope:], 1)]
        module_name = f"{parent}.{target}" if parent else target
        module = modules.get(module_name)
        if module is None or not hasattr(module, "load_weight"):
            raise ValueError(f"checkpoint tensor {name} has no place in {self.config.architecture}")
        for part, part_shard in shards:
            module.load_weight(param, part, part_shard)
        if isinstance(module, LatentHeads):
            return [f"{module_name}.{filled}" for filled in module.FILLS[param]]
        return [f"{module_name}.{param}", *gates]

    def lora_targets(self, name: str, b: torch.Tensor) -> list[tuple[str, int, torch.Tensor]]:
        """Where a LoRA adapter's B of checkpoint layer `name` goes (aserve/lora/): (our
        layer, its part, the part's rows of B, ordered as `load_tensor` orders weights).
        Names are the checkpoint's, a vision-language model's or a bare decoder's too."""
        if self.config.language_model_of is not None:
            name = language_model_name(name) or name
        if name.partition(".")[0] in DECODER_PARTS:
            name = f"model.{name}"
        parent, _, leaf = name.rpartition(".")
        if leaf in _FUSED_IN_CHECKPOINT:
            places = []
            for part, rows in zip(_FUSED_IN_CHECKPOINT[leaf], self._fused_rows(leaf), strict=True):
                places += self.lora_targets(f"{parent}.{part}", b[rows])
            return places
        if leaf in ("q_proj", "k_proj") and self.rotary_order is not None:
            b = read_whole(self._reorder_head_rows(b))
        if self.config.attention_output_gate and leaf == "q_proj":
            raise ConfigError(
                "LoRA adapters on gated attention's q_proj are not supported (its rows load "
                "as queries and gates apart); its other projections take them"
            )
        if self.config.latent and leaf in (*REORDERED_ROWS, "q_a_proj", "kv_b_proj"):
            raise ConfigError(
                f"LoRA adapters on latent attention's {leaf} are not supported (its rows load "
                "reordered or as heads' slices); its o_proj and the dense MLPs take them"
            )
        target, part = self.fused.get(leaf, (leaf, 0))
        return [(f"{parent}.{target}" if parent else target, part, b)]

    def _fused_rows(self, leaf: str) -> list[slice]:
        """The row ranges of a fused checkpoint tensor's parts (Q, K, V or gate, up)."""
        config = self.config
        if leaf in ("in_proj_qkv", "in_proj_qkvz", "in_proj_ba"):
            linear = config.linear_attention
            assert linear is not None
            if leaf == "in_proj_ba":
                return [slice(0, linear.value_heads), slice(linear.value_heads, None)]
            keys, values = linear.key_width, linear.value_width
            ends = [keys, 2 * keys, 2 * keys + values, 2 * keys + 2 * values]
            parts = len(_FUSED_IN_CHECKPOINT[leaf])
            return [slice(start, end) for start, end in zip([0, *ends], ends[:parts])]
        if leaf == "qkv_proj":
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)]
        inter = config.intermediate_size
        return [slice(0, inter), slice(inter, 2 * inter)]

    def _key_head_order(self, leaf: str, rows: int) -> torch.Tensor:
        """Qwen3-Next's `in_proj_qkvz` (a key head's query, key, its value heads' values and
        gates, then the next key head's) and `in_proj_ba` (a key head's value heads' betas,
        then their decays) as each part whole, in `_fused_rows`' order."""
        linear = self.config.linear_attention
        assert linear is not None
        shared = linear.value_heads // linear.key_heads
        widths = [shared, shared]
        if leaf == "in_proj_qkvz":
            values = shared * linear.value_head_dim
            widths = [linear.key_head_dim, linear.key_head_dim, values, values]
        assert rows == linear.key_heads * sum(widths)
        return _parts_apart(linear.key_heads, widths)

    def _queries_and_gates(self, q_proj: WeightSource) -> tuple[WeightSource, WeightSource]:
        """Qwen3.5's `q_proj` rows, a head's query then its gate, as every query row then
        every gate row (each as `load_tensor` takes a query projection alone)."""
        head_dim, heads = self.config.head_dim, self.config.num_heads

        def order(rows: int) -> torch.Tensor:
            assert rows == 2 * heads * head_dim
            return _parts_apart(heads, [head_dim, head_dim])

        whole = _permute_rows(q_proj, order)
        return whole[: heads * head_dim], whole[heads * head_dim :]

    def _reorder_head_rows(self, tensor: WeightSource) -> WeightSource:
        """A query or key projection's rows (or bias) in `rotary_order` within each head."""
        return _permute_rows(tensor, self._head_order)

    def _head_order(self, rows: int) -> torch.Tensor:
        assert self.rotary_order is not None
        # made on the host: the model may be built under a GPU default device, loaded apart
        starts = torch.arange(0, rows, self.config.head_dim, device="cpu")
        return (starts[:, None] + self.rotary_order.cpu()).flatten()

    def expected_tensors(self) -> set[str]:
        """Latent attention's `kv_b_proj` slices too, which a quantized model keeps as
        products rather than parameters."""
        expected = expected_tensors(self)
        for name, module in self.named_modules():
            if isinstance(module, LatentHeads):
                expected |= {f"{name}.{part}" for part in LatentHeads.FILLS["weight"]}
        return expected

    def finalize_quantized(self, device: torch.device, dtype: torch.dtype) -> None:
        """Pack the quantized weights for products on `device` in `dtype` (embeddings and
        the LM head only where the file quantized them: `--quantization int8|int4` leaves
        them in `dtype`, as vLLM does)."""
        if self.config.quantization is None:
            return
        scratch = Scratch()
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.quantized:
                module.quantized.finalize(device, dtype, scratch)
            elif isinstance(module, (QuantizedExperts, LatentHeads)):
                module.finalize(device, dtype, scratch)
        embed, head = self.model.embed_tokens, self.lm_head
        if embed.quantized:
            embed.finalize_quantized(device, dtype, True, head is embed, scratch)
        if head is not embed and head.quantized:
            head.finalize_quantized(device, dtype, False, True, scratch)
        if device.type == "cpu":
            blocks = WeightBlocks()
            for weight in cpu_kernel_weights(self):
                weight.move_to(blocks)


def _parts_apart(groups: int, widths: list[int]) -> torch.Tensor:
    """The row order that takes rows stored as `groups` blocks, each block its parts of
    `widths` rows one after another, to each part's rows of every block, part after part
    (made on the host)."""
    starts = torch.arange(groups, device="cpu")[:, None] * sum(widths)
    offsets = [0, *itertools.accumulate(widths)][:-1]
    parts = [starts + offset + torch.arange(width) for offset, width in zip(offsets, widths)]
    return torch.cat([part.flatten() for part in parts])


def _permute_rows(tensor: WeightSource, order_of: Callable[[int], torch.Tensor]) -> WeightSource:
    """`tensor`'s rows in `order_of(rows)` (made on the host), kept in the form it arrived
    in: GGUF blocks, integer codes, FP8 with its scales (GLM-4.5-Air-FP8's), or floats on the
    weights' device (where they load onto a GPU)."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.permute_rows(order_of(tensor.shape[0]).to(tensor.raw.device))
    if isinstance(tensor, CodesTensor):
        return tensor.permute_rows(order_of(tensor.shape[0]).to(tensor.device))
    if isinstance(tensor, Fp8Tensor):
        return tensor.permute_rows(order_of(tensor.shape[0]))
    whole = read_whole(tensor)
    return whole[order_of(whole.shape[0]).to(whole.device)]


def cpu_kernel_weights(model: nn.Module) -> list[KernelTensors]:
    """Every weight of `model` that aserve's CPU kernels multiply, once each (a tied table
    is the embedding's and the head's): linear layers' products, quantized tables' and MoE
    layers' expert stacks."""
    found: dict[int, KernelTensors] = {}
    for module in model.modules():
        held: list[object] = []
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.quantized:
            held = [getattr(p, "product", p) for p in module.quantized.products]
        elif isinstance(module, VocabParallelEmbedding) and module.table is not None:
            held = [module.table.head, module.table.lookups]
        elif isinstance(module, QuantizedExperts) and module.cpu_stacks is not None:
            held = list(module.cpu_stacks)
        elif isinstance(module, LatentHeads):
            held = module.products()
        found.update((id(weight), weight) for weight in held if isinstance(weight, KernelTensors))
    return list(found.values())
