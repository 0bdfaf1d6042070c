"""BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa, nomic-bert) for embeddings: all-MiniLM,
bge, e5, mxbai-embed, bge-m3, nomic-embed-text and the other sentence-transformers models
most embedding users run; and their classifiers, cross-encoder rerankers (bge-reranker,
ms-marco-MiniLM). nomic-bert's layers are BERT's with rotary positions in place of learned
ones, no biases and a SwiGLU MLP.

An encoder differs from the decoders of models/decoder.py in every layer: learned absolute
positions (RoBERTa's counted from its padding id + 1) and a token-type row added to the word
embeddings, then a LayerNorm; attention both ways with biases on every projection; each
sublayer's output added to its input and then normalised (post-norm); an MLP of one GELU.
Attention runs through the same backends as a decoder's, each prompt one block that attends
both ways (`ModelConfig.bidirectional`), so prompts run whole in one step and never from the
prefix cache. A folder without sentence-transformers files pools by the first token ([CLS]),
as vLLM pools an encoder; its files may say otherwise (models/pooling.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

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
from aserve.layers.weight import WeightSource, read_whole
from aserve.models.pooling import Pooler, Pooling
from aserve.models.weights import expected_tensors
from aserve.quant.native import Scratch

CHECKPOINT_PREFIXES = ("bert.", "roberta.", "model.")
"""What a task model's checkpoint puts before the encoder's names (`BertForMaskedLM`'s
`bert.`, XLM-RoBERTa's `roberta.`); a bare `BertModel` has none."""
UNUSED = ("lm_head.", "cls.", "embeddings.position_ids")
"""Checkpoint tensors no encoder here reads: a masked-LM head, a buffer of positions."""
HEAD = ("pooler.", "classifier")
"""A classifier's head (BERT's [CLS] pooler and classifier, RoBERTa's classifier); an
embedding model passes over them (sentence-transformers pools otherwise)."""


class Parameter(nn.Module):
    """A replicated tensor loaded whole (the position and token-type embeddings)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), False)

    def load_weight(self, param: str, tensor: WeightSource, shard: int = 0) -> None:
        self.weight.data.copy_(read_whole(tensor))


class Dense(nn.Module):
    """A replicated linear layer, with a bias unless told, computed in float32 (a
    classifier's head)."""

    def __init__(self, outputs: int, inputs: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs), False)
        self.bias = nn.Parameter(torch.empty(outputs), False) if bias else None

    def load_weight(self, param: str, tensor: WeightSource, shard: int = 0) -> None:
        getattr(self, param).data.copy_(read_whole(tensor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


class ClassifierHead(nn.Module):
    """[CLS]'s final state through a dense layer and tanh, then a logit a label: BERT's
    pooler then classifier, RoBERTa's classifier `dense` then `out_proj`, the same sums."""

    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = Dense(hidden, hidden)
        self.out = Dense(labels, hidden)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first)))


class LayerNorm(nn.Module):
    def __init__(self, width: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width), False)
        self.bias = nn.Parameter(torch.empty(width), False) if bias else None
        self.eps = eps

    def load_weight(self, param: str, tensor: WeightSource, shard: int = 0) -> None:
        getattr(self, param).data.copy_(read_whole(tensor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In `x`'s dtype (a classifier head's float32 too)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x, x.shape[-1:], self.weight.to(x.dtype), bias, self.eps)


class EncoderLayer(nn.Module):
    """BERT's layer; nomic-bert's (`rotary`) rotates Q and K, has no biases on its products
    and gates its MLP by SiLU."""

    def __init__(
        self, config: ModelConfig, layer: int, tp: TPGroup, rotary: RotaryEmbedding | None
    ) -> None:
        super().__init__()
        self.layer, self.head_dim, self.rotary = layer, config.head_dim, rotary
        hidden, quantization = config.hidden_size, config.quantization
        heads, bias = config.num_heads, config.qkv_bias
        self.qkv_proj = QKVParallelLinear(
            hidden, config.head_dim, heads, heads, bias, tp, quantization
        )
        self.q_size, self.kv_size = self.qkv_proj.local_sizes[0], self.qkv_proj.local_sizes[1]
        width = heads * config.head_dim
        self.o_proj = RowParallelLinear(width, hidden, bias, tp, quantization=quantization)
        self.attention_norm = LayerNorm(hidden, config.rms_norm_eps)
        inter = config.intermediate_size
        self.gated = config.hidden_act == "silu"
        parts = [inter, inter] if self.gated else [inter]
        self.up_proj = ColumnParallelLinear(hidden, parts, bias, tp, quantization)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp, quantization=quantization)
        self.output_norm = LayerNorm(hidden, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.rotary is not None:
            self.rotary(batch.positions, qkv[:, : self.q_size + self.kv_size], self.q_size)
        q, kv = qkv.split([self.q_size, 2 * self.kv_size], -1)
        tokens = q.shape[0]
        new_kv = kv.view(tokens, 2, -1, self.head_dim)
        out = attn.forward(q.view(tokens, -1, self.head_dim), new_kv, self.layer, batch, None)
        hidden = self.attention_norm(hidden + self.o_proj(out))
        if self.gated:  # SiLU of the gate (shard 0) times the up projection (shard 1)
            gate, up = self.up_proj(hidden).chunk(2, -1)
            return self.output_norm(hidden + self.down_proj(F.silu(gate) * up))
        return self.output_norm(hidden + self.down_proj(F.gelu(self.up_proj(hidden))))


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.position_offset = config.position_offset
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp)
        positions = config.max_position_embeddings + config.position_offset
        rotary = None  # learned positions (BERT's), or rotary ones (nomic-bert's)
        self.position_embeddings: Parameter | None = Parameter(positions, hidden)
        if config.rope_theta:
            rotary = RotaryEmbedding(config.head_dim, positions + 1, config.rope_theta, None)
            self.position_embeddings = None
        self.token_type_embeddings = Parameter(config.type_vocab_size, hidden)
        self.embedding_norm = LayerNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            EncoderLayer(config, i, tp, rotary) for i in range(config.num_layers)
        )

    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, token_types: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every token's final hidden state; without `token_types` each text is one segment
        (type 0)."""
        positions = batch.positions + self.position_offset
        hidden = self.embed_tokens(batch.input_ids)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings.weight[positions]
        types = self.token_type_embeddings.weight
        hidden = hidden + (types[0] if token_types is None else types[token_types])
        hidden = self.embedding_norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, batch, attn)
        return hidden


CHECKPOINT_NAMES = {
    "embeddings.word_embeddings": "embed_tokens",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embedding_norm",
    "emb_ln": "embedding_norm",  # nomic-bert's
}
LAYER_NAMES = {
    "attention.self.query": ("qkv_proj", 0),
    "attention.self.key": ("qkv_proj", 1),
    "attention.self.value": ("qkv_proj", 2),
    "attention.output.dense": ("o_proj", 0),
    "attention.output.LayerNorm": ("attention_norm", 0),
    "intermediate.dense": ("up_proj", 0),
    "output.dense": ("down_proj", 0),
    "output.LayerNorm": ("output_norm", 0),
}
NOMIC_LAYER_NAMES = {
    "attn.out_proj": ("o_proj", 0),
    "norm1": ("attention_norm", 0),
    "mlp.fc12": ("up_proj", 0),  # the gate
    "mlp.fc11": ("up_proj", 1),
    "mlp.fc2": ("down_proj", 0),
    "norm2": ("output_norm", 0),
}
"""Hugging Face's names of an encoder's modules -> ours (and a fused layer's shard): BERT's
under `encoder.layer.N.`, nomic-bert's under `encoder.layers.N.` (its `attn.Wqkv` split into
Q, K and V)."""
HEAD_NAMES = {
    "pooler.dense": "head.dense",
    "classifier": "head.out",
    "classifier.dense": "head.dense",
    "classifier.out_proj": "head.out",
}
"""BERT's and RoBERTa's classifier heads -> ours."""


class EncoderModel(nn.Module):
    """The engine's model for an encoder: `embed`, or `classify` for a cross-encoder; it
    never generates, and takes no CUDA graphs (a step is always a prefill)."""

    graph_capturable = False
    addresses_from_host = True

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.config = config
        self.model = Encoder(config, tp)
        labels = config.num_labels
        self.head = ClassifierHead(config.hidden_size, labels) if labels else None
        # The engine sets the folder's pooling (models/pooling.py); without one, [CLS]'s.
        self.pooler: Pooler | None = None
        self.first_token = Pooler(Pooling("cls"), torch.device("cpu"))

    def embed(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Embeddings `[batch, width]` in float32, unit length."""
        hidden = self.model(batch, attn)
        pooler = self.first_token if self.pooler is None else self.pooler
        return F.normalize(pooler(hidden, batch), dim=-1)

    def classify(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """A cross-encoder's logits `[batch, labels]` in float32, from [CLS]'s final state."""
        assert self.head is not None
        hidden = self.model(batch, attn, self._token_types(batch))
        return self.head(self.first_token(hidden, batch))

    def _token_types(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Type 1 for the tokens of a prompt past its first separator (a pair's second
        sequence, its closing [SEP] included), as BERT's tokenizer types a pair; None where
        the model has one type."""
        separator = self.config.segment_separator_id
        if separator is None:
            return None
        assert not any(batch.prefix_lens), "token types are read from whole prompts"
        ids = batch.input_ids
        lengths = torch.tensor(batch.extend_lens, device=ids.device)
        request = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
        is_separator = (ids == separator).long()
        before = torch.cumsum(is_separator, 0) - is_separator  # separators before each token
        starts = torch.cumsum(lengths, 0) - lengths
        return (before - before[starts][request] > 0).long()

    def pack_lm_head(self, checkpoint: Path | None) -> None:
        """An encoder has no LM head to pack."""

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = next((name[len(p) :] for p in CHECKPOINT_PREFIXES if name.startswith(p)), name)
            if name.startswith(UNUSED) or (self.head is None and name.startswith(HEAD)):
                continue
            module_name, _, param = name.rpartition(".")
            for target, shard, part in self._parts(module_name, tensor):
                module = modules.get(target) if target else None
                if module is None or not hasattr(module, "load_weight"):
                    raise ValueError(
                        f"checkpoint tensor {name} has no place in {self.config.architecture}"
                    )
                module.load_weight(param, part, shard)
                loaded.add(f"{target}.{param}")
        missing = self.expected_tensors() - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _parts(
        self, module_name: str, tensor: WeightSource
    ) -> list[tuple[str | None, int, WeightSource]]:
        """Where a checkpoint tensor goes: our module, the shard it fills, and its part of
        the tensor (all of it here; ModernBERT's fused ones in parts)."""
        pieces = module_name.split(".", 3)
        if len(pieces) == 4 and pieces[:2] == ["encoder", "layers"] and pieces[3] == "attn.Wqkv":
            rows = self.config.hidden_size  # Q, K and V of as many heads
            target = f"model.layers.{pieces[2]}.qkv_proj"
            return [(target, i, tensor[i * rows : (i + 1) * rows]) for i in range(3)]
        target, shard = self._target(module_name)
        return [(target, shard, tensor)]

    @staticmethod
    def _target(module_name: str) -> tuple[str | None, int]:
        """Our module for a checkpoint module's name, and the shard it fills."""
        if module_name in CHECKPOINT_NAMES:
            return f"model.{CHECKPOINT_NAMES[module_name]}", 0
        if module_name in HEAD_NAMES:
            return HEAD_NAMES[module_name], 0
        pieces = module_name.split(".", 3)
        if len(pieces) == 4 and pieces[:2] == ["encoder", "layer"] and pieces[3] in LAYER_NAMES:
            ours, shard = LAYER_NAMES[pieces[3]]
            return f"model.layers.{pieces[2]}.{ours}", shard
        if len(pieces) == 4 and pieces[:2] == ["encoder", "layers"]:
            ours, shard = NOMIC_LAYER_NAMES.get(pieces[3], (None, 0))
            return (f"model.layers.{pieces[2]}.{ours}" if ours else None), shard
        return None, 0

    def expected_tensors(self) -> set[str]:
        return expected_tensors(self)

    def finalize_quantized(self, device: torch.device, dtype: torch.dtype) -> None:
        """Pack the linear layers' quantized weights (`--quantization int8|int4`)."""
        if self.config.quantization is None:
            return
        scratch = Scratch()
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.quantized:
                module.quantized.finalize(device, dtype, scratch)
