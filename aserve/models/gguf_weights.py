"""The tensors of a GGUF file under Hugging Face names, read straight from the file.

Float tensors (F32, F16, BF16) come as torch tensors. Quantized ones stay in their blocks
(`QuantizedTensor`): the layers decode and pack them for their device, so a 4-bit file stays
4-bit in memory. With `dequantize` they come as float32 instead, the reference that the
quantized products are tested against (`--quantization none`). llama.cpp's converter
interleaves the two rotary halves of each Q/K head of llama models; the rows are put back
in Hugging Face's order here, quantized or not (rows are whole in every block format).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from aserve.config import ConfigError
from aserve.quant.gguf import QuantizedTensor, UnsupportedFormat, quantized_tensor

GGUF_POINTER = "gguf.json"
"""The file in a converted folder that names the GGUF its weights are read from."""
TOP_LEVEL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
}
SANDWICH_TENSORS = LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
"""Gemma 2's and 3's layer norms: `ffn_norm` is the norm before its MLP, with a norm after
each part. llama.cpp's converter stores each of its norms' weights plus one (the 1 + w they
weigh by); `iter_gguf` takes the one back off, so the loader sees Hugging Face's values."""
SANDWICH_FAMILIES = ("gemma2", "gemma3_text")
GPT_OSS_TENSORS = LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
}
"""gpt-oss's norm before its experts is llama.cpp's `post_attention_norm`; `attn_sinks` holds
each head's sink logit (Hugging Face's `self_attn.sinks`, a parameter, not a `.weight`)."""
OLMO2_TENSORS = LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
"""OLMo 2's and EXAONE 4's layers have the norms after attention and the MLP alone (as
plain RMSNorms: no one to take back off)."""
PHI3_TENSORS = LAYER_TENSORS | {
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
"""Phi-3's fused projections, as llama.cpp keeps them: Q|K|V, and gate|up under `ffn_up`."""
GLM4_TENSORS = LAYER_TENSORS | {
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}
"""GLM-4's four norms a layer under its own names (models/decoder.py's NORM_NAMES takes
them on), and its fused gate|up under `ffn_up`, as Phi-3's."""
QWEN2_MOE_TENSORS = LAYER_TENSORS | {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
"""Qwen2-MoE's shared expert (`_shexp`) and its gate, a `[hidden]` vector in the file."""
DOTS1_TENSORS = LAYER_TENSORS | {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
}
"""dots.llm1's shared experts are `_shexp` (no gate); `exp_probs_b` holds the router's choice
bias (a parameter, not a `.bias`)."""
GLM4_MOE_TENSORS = DOTS1_TENSORS | {"post_attention_norm": "post_attention_layernorm"}
"""GLM-4.5's are dots.llm1's, but its norm before the MLP is llama.cpp's
`post_attention_norm`."""
DEEPSEEK2_TENSORS = DOTS1_TENSORS | {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj.k_b",
    "attn_v_b": "self_attn.kv_b_proj.v_b",
}
"""DeepSeek's latent attention (models/mla.py), its experts as dots.llm1's. Newer files hold
`kv_b_proj`'s key and value rows apart, `attn_k_b` and `attn_v_b` (parameters of their own,
`LatentHeads.FILLS`)."""
QWEN35_TENSORS = LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",  # as -exp(A_log): `iter_gguf` takes the log back
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
"""Qwen3.5's names in llama.cpp's converter (its gated attention's `attn_q` holds queries and
gates as the checkpoint's `q_proj` does)."""
FAMILY_TENSORS = {
    "qwen2_moe": QWEN2_MOE_TENSORS,
    "deepseek_v2": DEEPSEEK2_TENSORS,
    "deepseek_v3": DEEPSEEK2_TENSORS,
    "glm4_moe": GLM4_MOE_TENSORS,
    "dots1": DOTS1_TENSORS,
    "phi3": PHI3_TENSORS,
    "gemma2": SANDWICH_TENSORS,
    "gemma3_text": SANDWICH_TENSORS,
    "gpt_oss": GPT_OSS_TENSORS,
    "olmo2": OLMO2_TENSORS,
    "olmo3": OLMO2_TENSORS,
    "exaone4": OLMO2_TENSORS,
    "glm4": GLM4_TENSORS,
    "qwen3_5_text": QWEN35_TENSORS,
    "qwen3_5_moe_text": QWEN35_TENSORS | QWEN2_MOE_TENSORS,
    # Qwen3-Next's betas and decays in one tensor, grouped by key head as its checkpoint has them
    "qwen3_next": QWEN35_TENSORS | QWEN2_MOE_TENSORS | {"ssm_ba": "linear_attn.in_proj_ba"},
}
"""The layer tensor names of the families (config.json's `model_type`) that differ from
LAYER_TENSORS."""
BERT_TOP_LEVEL = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
    "cls": "classifier.dense",  # a reranker's head (RoBERTa's dense, tanh, out_proj)
    "cls.output": "classifier.out_proj",
}
BERT_LAYER = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
"""llama.cpp's `bert` files (BERT, and XLM-RoBERTa with its positions' offset cut off by
the converter) under transformers' `BertModel` names (models/encoder.py loads them)."""
EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
"""Every expert of a layer in one 3-D tensor `[experts, rows, cols]` (and gpt-oss's biases
in a 2-D `[experts, rows]`), split into Hugging Face's per-expert names
(`mlp.experts.{e}.gate_proj.weight`, `.bias`) as it is read."""
FLOAT_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)

ROPE_FACTORS = "rope_freqs.weight"
"""llama.cpp's rope frequency divisors (Llama 3.1-3.3): read into config.json at conversion
(aserve/models/source.py), not a weight of any layer."""
LONGROPE_FACTORS = {
    "long_factor": "rope_factors_long.weight",
    "short_factor": "rope_factors_short.weight",
}
"""Phi-3's LongRoPE factors as llama.cpp stores them, read into config.json the same way."""
ROPE_TENSORS = (ROPE_FACTORS, *LONGROPE_FACTORS.values())

GGUFWeight = torch.Tensor | QuantizedTensor
WHOLE_PARAMETERS = ("attn_sinks", "exp_probs_b", "attn_k_b", "attn_v_b", "ssm_a", "ssm_dt")
"""Layer tensors whose Hugging Face name is a parameter of its own: no `.weight` or `.bias`
after it."""


class GGUFTensorError(ConfigError):
    """A tensor aserve cannot load: the message names it, its type or its problem."""


def hf_tensor_name(name: str, model_type: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of a `model_type` file; for a layer's stacked
    experts a pattern with `{}` where the expert's index goes."""
    stem, _, kind = name.rpartition(".")
    if kind in WHOLE_PARAMETERS:  # named without `.weight` (Qwen3.5's `ssm_a`)
        stem, kind = name, ""
    if model_type in ENCODER_TENSORS:
        return _encoder_tensor_name(name, stem, kind, model_type)
    if stem in TOP_LEVEL_TENSORS:
        return f"{TOP_LEVEL_TENSORS[stem]}.{kind}"
    pieces = stem.split(".")
    if len(pieces) != 3:  # e.g. an expert a tensor (llama.cpp's older Mixtral files)
        raise GGUFTensorError(f"GGUF tensor {name!r} has no Hugging Face name that aserve knows")
    prefix, layer, part = pieces
    in_layer = FAMILY_TENSORS.get(model_type, LAYER_TENSORS)
    if prefix == "blk" and layer.isdigit() and part in WHOLE_PARAMETERS and part in in_layer:
        return f"model.layers.{layer}.{in_layer[part]}"
    if prefix == "blk" and layer.isdigit() and part in in_layer:
        return f"model.layers.{layer}.{in_layer[part]}.{kind}"
    experts_of = prefix == "blk" and layer.isdigit() and part in EXPERT_TENSORS
    if experts_of and kind in ("weight", "bias"):
        return f"model.layers.{layer}.mlp.experts.{{}}.{EXPERT_TENSORS[part]}.{kind}"
    raise GGUFTensorError(f"GGUF tensor {name!r} has no Hugging Face name that aserve knows")


MODERN_BERT_TOP_LEVEL = {
    "token_embd": "embeddings.tok_embeddings",
    "token_embd_norm": "embeddings.norm",
    "output_norm": "final_norm",
    "cls": "head.dense",  # a classifier's head: dense, GELU, LayerNorm, then its logits
    "cls.norm": "head.norm",
    "cls.output": "classifier",
}
MODERN_BERT_LAYER = {
    "attn_norm": "attn_norm",
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.Wo",
    "ffn_norm": "mlp_norm",
    "ffn_up": "mlp.Wi",  # GELU's half, then the other, as transformers stores it
    "ffn_down": "mlp.Wo",
}
"""llama.cpp's `modern-bert` files under transformers' ModernBERT names."""


NOMIC_BERT_TOP_LEVEL = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "emb_ln",
}
NOMIC_BERT_LAYER = {
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.out_proj",
    "attn_output_norm": "norm1",
    "ffn_up": "mlp.fc11",
    "ffn_gate": "mlp.fc12",
    "ffn_down": "mlp.fc2",
    "layer_output_norm": "norm2",
}
"""llama.cpp's `nomic-bert` files under nomic's own names."""
ENCODER_TENSORS = {
    "bert": (BERT_TOP_LEVEL, BERT_LAYER, "encoder.layer"),
    "modernbert": (MODERN_BERT_TOP_LEVEL, MODERN_BERT_LAYER, "layers"),
    "nomic_bert": (NOMIC_BERT_TOP_LEVEL, NOMIC_BERT_LAYER, "encoder.layers"),
}
"""An encoder family's GGUF names -> Hugging Face's: its top-level tensors, its layers'
and where its checkpoint puts layer N."""


def _encoder_tensor_name(name: str, stem: str, kind: str, model_type: str) -> str:
    top, in_layer, layers = ENCODER_TENSORS[model_type]
    if stem in top:
        return f"{top[stem]}.{kind}"
    prefix, _, rest = stem.partition(".")
    layer, _, part = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and part in in_layer:
        return f"{layers}.{layer}.{in_layer[part]}.{kind}"
    raise GGUFTensorError(f"GGUF tensor {name!r} has no Hugging Face name that aserve knows")


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """Hugging Face's row i is llama.cpp's row order[i]: each head's two rotary halves
    un-interleaved."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def has_quantized_matrices(tensors: list[StoredTensor]) -> bool:
    return any(t.tensor_type not in FLOAT_TYPES and len(t.shape) >= 2 for t in tensors)


def matrix_dtype(tensors: list[StoredTensor]) -> str:
    """The torch dtype a float file's matrices share ("float16" or "bfloat16"), else "float32"
    (the config's `torch_dtype`: a 16-bit file keeps its matrices in 16 bits on CPU)."""
    kinds = {t.tensor_type for t in tensors if len(t.shape) >= 2}
    if kinds == {gguf.GGMLQuantizationType.F16}:
        return "float16"
    return "bfloat16" if kinds == {gguf.GGMLQuantizationType.BF16} else "float32"


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a GGUF file (`data` a view of the file: float values, or a quantized
    matrix's rows of block bytes)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: list[int]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray


def stored_tensors(path: Path, table: list[dict[str, Any]]) -> list[StoredTensor]:
    """The tensors of a table (aserve/models/gguf_header.py reads it from the file's header
    at the conversion; gguf.json keeps it), as views of the memory-mapped file: later starts
    read the tensors without parsing the metadata again."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    return [
        StoredTensor(
            entry["name"],
            gguf.GGMLQuantizationType(entry["type"]),
            entry["shape"],
            np.ndarray(entry["dims"], np.dtype(entry["dtype"]), mapped, entry["offset"]),
        )
        for entry in table
    ]


def iter_gguf(
    path: Path,
    table: list[dict[str, Any]],
    config: dict[str, Any],
    dequantize: bool = False,
    progress: bool = True,
) -> Iterator[tuple[str, GGUFWeight]]:
    """(Hugging Face name, tensor) for every tensor of the file, found by its tensor table;
    `config` is the config.json built from the same file (head counts for the llama row
    order)."""
    tensors = stored_tensors(path, table)
    model_type = config["model_type"]
    # llama.cpp's converter permutes these families' query and key rows as Llama's
    permute = model_type in ("llama", "smollm3", "granite", "granitemoe", "mixtral")
    heads = (
        {
            "self_attn.q_proj": config["num_attention_heads"],
            "self_attn.k_proj": config["num_key_value_heads"],
        }
        if permute
        else {}
    )
    # norms weighing by 1 + w, stored as that sum (Qwen3.5's linear attention's own excepted)
    centred = model_type in (*SANDWICH_FAMILIES, "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
    for tensor in tqdm(tensors, desc="Loading weights", unit="tensor", disable=not progress):
        if tensor.name in ROPE_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, model_type)
        if "{}" in name:
            for expert in range(tensor.data.shape[0]):
                yield name.format(expert), _read(_expert(tensor, expert), dequantize)
            continue
        weight = _read(tensor, dequantize)
        own_weight = name.endswith("linear_attn.norm.weight")  # weighs by w
        if centred and name.endswith("norm.weight") and not own_weight:
            assert isinstance(weight, torch.Tensor)  # norms are float in every file
            weight = weight.float() - 1
        if name.endswith("linear_attn.A_log"):  # llama.cpp stores the decay rate, -exp(A_log)
            assert isinstance(weight, torch.Tensor)
            weight = (-weight.float()).log()
        module = ".".join(name.split(".")[-3:-1])
        if permute and module in heads and weight.shape[0] % (2 * heads[module]) == 0:
            order = rope_row_order(weight.shape[0], heads[module])
            weight = (
                weight.permute_rows(order) if isinstance(weight, QuantizedTensor) else weight[order]
            )
        yield name, weight


def block_of(name: str) -> int:
    """The layer a tensor name is of (`blk.N.`), -1 for the model's own."""
    prefix, _, rest = name.partition(".")
    layer = rest.partition(".")[0]
    return int(layer) if prefix == "blk" and layer.isdigit() else -1


def _expert(tensor: StoredTensor, index: int) -> StoredTensor:
    """Expert `index` of a layer's `[experts, rows, cols]` tensor (or `[experts, rows]`
    biases), as a tensor of its own (GGUF's shape lists the experts last)."""
    return StoredTensor(tensor.name, tensor.tensor_type, tensor.shape[:-1], tensor.data[index])


def read_float32(tensor: StoredTensor) -> torch.Tensor:
    """A tensor in float32 whatever its type in the file (the conversion's Dense modules)."""
    weight = _read(tensor, dequantize=True)
    assert isinstance(weight, torch.Tensor)
    return weight.float()


def _read(tensor: StoredTensor, dequantize: bool) -> GGUFWeight:
    shape = [int(size) for size in reversed(tensor.shape)]
    kind = tensor.tensor_type
    if kind == gguf.GGMLQuantizationType.F16:  # kept in 16 bits: CPU products take them so
        return torch.from_numpy(np.array(tensor.data, dtype=np.float16).reshape(shape))
    if kind == gguf.GGMLQuantizationType.BF16:
        bits = np.array(tensor.data, copy=True).view(np.int16).reshape(shape)
        return torch.from_numpy(bits).view(torch.bfloat16)
    if kind in FLOAT_TYPES:
        values = gguf.quants.dequantize(tensor.data, kind).astype(np.float32, copy=False)
        return torch.from_numpy(np.array(values, copy=True).reshape(shape))
    if len(shape) == 3:  # DeepSeek's `attn_k_b` and `attn_v_b`: one matrix a head, stacked
        rows = shape[0] * shape[1]
        data = tensor.data.reshape(rows, -1)
        return _read(StoredTensor(tensor.name, kind, [shape[2], rows], data), dequantize)
    if len(shape) != 2:
        raise GGUFTensorError(f"GGUF tensor {tensor.name}: a {kind.name} tensor of {shape}")
    try:
        quantized = quantized_tensor(tensor.data, kind, shape[0], shape[1])
    except UnsupportedFormat as error:
        raise GGUFTensorError(f"GGUF tensor {tensor.name}: {error}") from None
    return quantized.decode().dequantize() if dequantize else quantized
