"""ModernBERT (Answer.AI's encoder, 8,192 positions): gte-modernbert, modernbert-embed,
Granite Embedding R2 and the rerankers trained on it, for embeddings and classification.

It shares little with BERT beyond attending both ways: rotary positions (a base for the
whole layers, another for the windowed ones), every third layer whole and the others
within 64 tokens either way, pre-norm LayerNorms without biases (none before the first
layer's attention: the embeddings' own norm precedes it), a fused QKV and a GeGLU MLP
(GELU of the first half times the second; SiLU in Granite Embedding R2's smaller models),
no biases on the products, and a final norm.
Its classifier pools [CLS] or the mean, then a dense layer, GELU and a LayerNorm before the
logits. Loading, pooling and the quantized products are `EncoderModel`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.attention.base import AttentionBackend
from aserve.config import ModelConfig
from aserve.distributed.group import TPGroup
from aserve.forward import ForwardBatch
from aserve.layers.embedding import VocabParallelEmbedding
from aserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aserve.layers.rotary import RotaryEmbedding
from aserve.layers.weight import WeightSource
from aserve.models.encoder import Dense, EncoderModel, LayerNorm
from aserve.models.pooling import Pooler, Pooling


class ModernBertLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, tp: TPGroup, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.layer, self.head_dim, self.rotary = layer, config.head_dim, rotary
        hidden, quantization, eps = config.hidden_size, config.quantization, config.rms_norm_eps
        heads = config.num_heads
        self.attn_norm = LayerNorm(hidden, eps, config.norm_bias) if layer else None
        self.qkv_proj = QKVParallelLinear(
            hidden, config.head_dim, heads, heads, config.qkv_bias, tp, quantization
        )
        self.q_size, self.kv_size = self.qkv_proj.local_sizes[0], self.qkv_proj.local_sizes[1]
        width = heads * config.head_dim
        self.o_proj = RowParallelLinear(width, hidden, config.o_bias, tp, quantization=quantization)
        self.mlp_norm = LayerNorm(hidden, eps, config.norm_bias)
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [inter, inter], config.mlp_bias, tp, quantization
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, config.mlp_bias, tp, quantization=quantization
        )
        self.activation = F.silu if config.hidden_act == "silu" else F.gelu

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        normed = hidden if self.attn_norm is None else self.attn_norm(hidden)
        qkv = self.qkv_proj(normed)
        self.rotary(batch.positions, qkv[:, : self.q_size + self.kv_size], self.q_size)
        q, kv = qkv.split([self.q_size, 2 * self.kv_size], -1)
        tokens = q.shape[0]
        new_kv = kv.view(tokens, 2, -1, self.head_dim)
        out = attn.forward(q.view(tokens, -1, self.head_dim), new_kv, self.layer, batch, None)
        hidden = hidden + self.o_proj(out)
        gate, up = self.gate_up_proj(self.mlp_norm(hidden)).chunk(2, -1)
        return hidden + self.down_proj(self.activation(gate) * up)


class ModernBert(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp)
        self.embedding_norm = LayerNorm(hidden, eps, config.norm_bias)
        positions = config.max_position_embeddings + 1  # the placeholder slot past them
        rotary = RotaryEmbedding(config.head_dim, positions, config.rope_theta, None)
        local_theta = config.local_rope_theta or config.rope_theta
        local = RotaryEmbedding(config.head_dim, positions, local_theta, None)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i, tp, local if config.layer_window(i) else rotary)
            for i in range(config.num_layers)
        )
        self.final_norm = LayerNorm(hidden, eps, config.norm_bias)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        hidden = self.embedding_norm(self.embed_tokens(batch.input_ids))
        for layer in self.layers:
            hidden = layer(hidden, batch, attn)
        return self.final_norm(hidden)


class PredictionHead(nn.Module):
    """The classifier: the pooled state through a dense layer, GELU and a LayerNorm, then a
    logit a label."""

    def __init__(self, config: ModelConfig, bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.dense = Dense(hidden, hidden, bias)
        self.norm = LayerNorm(hidden, config.rms_norm_eps, config.norm_bias)
        self.out = Dense(config.num_labels, hidden)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(F.gelu(self.dense(pooled))))


FUSED = {"attn.Wqkv": ("qkv_proj", 3), "mlp.Wi": ("gate_up_proj", 2)}
"""ModernBERT's fused checkpoint tensors -> ours and the parts they hold, of equal rows (Q,
K and V; GELU's half, then the other)."""
LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn.Wo": "o_proj",
    "mlp_norm": "mlp_norm",
    "mlp.Wo": "down_proj",
}
TOP_NAMES = {
    "embeddings.tok_embeddings": "model.embed_tokens",
    "embeddings.norm": "model.embedding_norm",
    "final_norm": "model.final_norm",
    "head.dense": "head.dense",
    "head.norm": "head.norm",
    "classifier": "head.out",
}
"""Hugging Face's names of ModernBERT's modules -> ours."""


class ModernBertModel(EncoderModel):
    """The engine's model for ModernBERT: `embed`, or `classify` for its classifier."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = ModernBert(config, tp)
        self.head = PredictionHead(config, config.classifier_bias) if config.num_labels else None
        self.pooler: Pooler | None = None
        self.first_token = Pooler(Pooling("cls"), torch.device("cpu"))
        self.classifier_pooler = Pooler(Pooling(config.classifier_pooling), torch.device("cpu"))

    def classify(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits `[batch, labels]` in float32, from [CLS]'s final state or the mean."""
        assert self.head is not None
        return self.head(self.classifier_pooler(self.model(batch, attn), batch))

    def _parts(
        self, module_name: str, tensor: WeightSource
    ) -> list[tuple[str | None, int, WeightSource]]:
        if module_name in TOP_NAMES:
            return [(TOP_NAMES[module_name], 0, tensor)]
        pieces = module_name.split(".", 2)
        if len(pieces) != 3 or pieces[0] != "layers":
            return [(None, 0, tensor)]
        prefix, leaf = f"model.layers.{pieces[1]}", pieces[2]
        if leaf in LAYER_NAMES:
            return [(f"{prefix}.{LAYER_NAMES[leaf]}", 0, tensor)]
        if leaf not in FUSED:
            return [(None, 0, tensor)]
        ours, count = FUSED[leaf]
        config = self.config
        rows = config.hidden_size if ours == "qkv_proj" else config.intermediate_size
        return [(f"{prefix}.{ours}", i, tensor[i * rows : (i + 1) * rows]) for i in range(count)]
