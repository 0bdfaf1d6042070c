"""Hugging Face checkpoints written as GGUF files the way llama.cpp's converter writes them.

The names, the metadata keys, the Q/K row order of llama models, the `rope_freqs` of
Llama-3 rope scaling, Gemma's norms stored as 1 + w, Gemma 2's soft caps and gpt-oss's
experts split into gate, up and down (with their biases) are spelled out here from
llama.cpp's conventions, not taken from aserve's loader, so that a test through these files
checks the loader against them.
Tensors stay float32 (GGUF's F32): the files are the float reference of their checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.torch import load_file

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_vl_text": "qwen2vl",
    "qwen2_5_vl_text": "qwen2vl",
    "qwen3_vl_text": "qwen3vl",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt-oss",
    "smollm3": "smollm3",
    "phi3": "phi3",
    "granite": "granite",
    "granitemoe": "granitemoe",
    "mixtral": "llama",
    "olmo2": "olmo2",
    "olmo3": "olmo2",  # llama.cpp's olmo2, with a window: three layers of four, YaRN on the rest
    "olmoe": "olmoe",
    "exaone4": "exaone4",
    "glm4": "glm4",
    "glm4_moe": "glm4moe",
    "dots1": "dots1",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
}
TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
IN_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
OLMO2_IN_LAYER = IN_LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA_IN_LAYER = IN_LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
"""gguf-py's names for Gemma 2's and 3's four layer norms (MODEL_TENSOR.ATTN_POST_NORM,
FFN_PRE_NORM, FFN_POST_NORM)."""
GPT_OSS_IN_LAYER = IN_LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
    "self_attn.sinks": "attn_sinks",
}
"""gpt-oss's names in llama.cpp's converter: the norm before the experts is ATTN_POST_NORM,
the router FFN_GATE_INP, the sinks ATTN_SINKS (given a `.weight`)."""
PHI3_IN_LAYER = IN_LAYER | {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
GLM4_IN_LAYER = IN_LAYER | {
    "post_self_attn_layernorm": "post_attention_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "mlp.gate_up_proj": "ffn_up",
}
"""Phi-3's fused projections keep their checkpoint layout under llama.cpp's names."""
DOTS1_IN_LAYER = IN_LAYER | {
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.gate.e_score_correction": "exp_probs_b",
}
"""dots.llm1's names in llama.cpp's converter: the router's bias is FFN_EXP_PROBS_B (renamed
`e_score_correction.bias` first)."""
GLM4_MOE_IN_LAYER = DOTS1_IN_LAYER | {"post_attention_layernorm": "post_attention_norm"}
"""GLM-4.5's: the norm before the MLP is ATTN_POST_NORM."""
DEEPSEEK2_IN_LAYER = DOTS1_IN_LAYER | {
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
}
"""DeepSeek's latent attention under llama.cpp's names (its experts as dots.llm1's)."""
QWEN35_IN_LAYER = IN_LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "linear_attn.in_proj_ba": "ssm_ba",
}
"""Qwen3.5's names in llama.cpp's converter (`A_log` and `dt_bias`: `qwen35_tensor`)."""
NEXTN_PARTS = ("eh_proj", "enorm", "hnorm", "shared_head_norm")
"""A GLM-4.5 file's next-token prediction layer's own tensors (after a whole layer's)."""
EXPERT_PARTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama's q_proj/k_proj rows."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(config: dict[str, Any], head_dim: int) -> np.ndarray:
    """Llama-3 scaling as llama.cpp stores it: the divisor of each rotary frequency (1 for
    short wavelengths, `factor` for long ones, a blend between), worked out in Python floats."""
    scaling = config["rope_scaling"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    divisors = []
    for pair in range(head_dim // 2):
        wavelength = 2 * math.pi * config["rope_theta"] ** (2 * pair / head_dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


def mixtral_as_qwen3_moe(name: str) -> str:
    """Mixtral's checkpoint names (`block_sparse_moe`, experts' w1 / w2 / w3) in the MoE
    names this writer maps: its router and experts become the same GGUF tensors (and
    GraniteMoe's router, `router.layer`)."""
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.layer.", ".mlp.gate.")
    for mixtral, part in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        name = name.replace(f".{mixtral}.weight", f".{part}.weight")
    return name


def granite_experts(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """GraniteMoe's stacked experts as llama.cpp's converter splits them: `input_linear`
    `[E, 2I, H]` into gate and up (the first I rows of each expert are its gate), and
    `output_linear` `[E, H, I]` as the down projection."""
    layer = name.split(".")[2]
    if name.endswith("output_linear.weight"):
        return {f"blk.{layer}.ffn_down_exps.weight": array}
    gate, up = np.split(array, 2, axis=1)
    return {f"blk.{layer}.ffn_gate_exps.weight": gate, f"blk.{layer}.ffn_up_exps.weight": up}


def gguf_name(hf_name: str, in_layer: dict[str, str] = IN_LAYER) -> str:
    if hf_name in TOP_LEVEL:
        return TOP_LEVEL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest in in_layer:  # a parameter of its own (gpt-oss's sinks)
        return f"blk.{layer}.{in_layer[rest]}.weight"
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{in_layer[module]}.{kind}"


def gpt_oss_experts(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """A layer's stacked gpt-oss experts tensor (transformers' layout: products transposed,
    gate and up interleaved column by column) as llama.cpp's converter splits it."""
    layer, part = name.split(".")[2], name.split(".")[-1]
    prefix = f"blk.{layer}."
    if part == "gate_up_proj":
        gate, up = array[..., 0::2].swapaxes(1, 2), array[..., 1::2].swapaxes(1, 2)
        return {prefix + "ffn_gate_exps.weight": gate, prefix + "ffn_up_exps.weight": up}
    if part == "gate_up_proj_bias":
        return {
            prefix + "ffn_gate_exps.bias": array[:, 0::2],
            prefix + "ffn_up_exps.bias": array[:, 1::2],
        }
    if part == "down_proj":
        return {prefix + "ffn_down_exps.weight": array.swapaxes(1, 2)}
    return {prefix + "ffn_down_exps.bias": array}


def nextn_layer(tensors: dict[str, np.ndarray], layers: int, hidden: int) -> dict[str, np.ndarray]:
    """A GLM-4.5 file's prediction layer, block `layers`: the last layer's tensors again, and
    its own projection and norms (random; nothing reads them)."""
    rng = np.random.default_rng(0)
    last = f"blk.{layers - 1}."
    copied = {
        f"blk.{layers}.{name.removeprefix(last)}": array
        for name, array in tensors.items()
        if name.startswith(last)
    }
    for part in NEXTN_PARTS:
        shape = (hidden, 2 * hidden) if part == "eh_proj" else (hidden,)
        copied[f"blk.{layers}.nextn.{part}.weight"] = rng.standard_normal(shape, np.float32)
    return copied


def embedding_gemma_pooling(folder: Path, writer: gguf.GGUFWriter) -> dict[str, np.ndarray]:
    """An EmbeddingGemma folder's pooling as llama.cpp's converter writes it with
    `--sentence-transformers-dense-modules`: the pooling type (mean: 1) and its Dense
    modules' weights as `dense_2` and `dense_3` with their sizes."""
    modules = json.loads((folder / "modules.json").read_text())
    dense_folders = [m["path"] for m in modules if m["type"].endswith(".Dense")]
    assert len(dense_folders) == 2, "EmbeddingGemma's layout: two Dense modules"
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    tensors = {}
    for number, path in zip((2, 3), dense_folders, strict=True):
        weight = load_file(folder / path / "model.safetensors")["linear.weight"].float().numpy()
        tensors[f"dense_{number}.weight"] = weight
        writer.add_uint32(f"gemma-embedding.dense_{number}_feat_in", weight.shape[1])
        writer.add_uint32(f"gemma-embedding.dense_{number}_feat_out", weight.shape[0])
    return tensors


def add_deepseek2(writer: gguf.GGUFWriter, config: dict[str, Any], split_kv_b: bool) -> None:
    """DeepSeek's settings as llama.cpp's DeepseekV2Model writes them: since its MLA rework
    (`split_kv_b`) one key head as wide as the latent and its rotating part, values the
    latent's width, a query head's and a value's widths as `*_mla`; before it, those two as
    the key and value lengths, one key head a query head. Experts by softmax (V2) or sigmoid
    (V3) scores in groups, YaRN's `mscale_all_dim` times 0.1 as the log multiplier."""
    rope, latent = config["qk_rope_head_dim"], config["kv_lora_rank"]
    query, value = config["qk_nope_head_dim"] + rope, config["v_head_dim"]
    writer.add_head_count_kv(1 if split_kv_b else config["num_attention_heads"])
    if split_kv_b:
        writer.add_key_length(latent + rope)
        writer.add_value_length(latent)
        writer.add_key_length_mla(query)
        writer.add_value_length_mla(value)
    else:
        writer.add_key_length(query)
        writer.add_value_length(value)
    writer.add_kv_lora_rank(latent)
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_rope_dimension_count(rope)
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    v3 = config["model_type"] == "deepseek_v3"
    gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    writer.add_expert_gating_func(gating)
    if config.get("n_group"):
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    mscale = (config.get("rope_scaling") or {}).get("mscale_all_dim")
    if mscale:
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale)


def split_kv_b(name: str, array: np.ndarray, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """`kv_b_proj` as llama.cpp's converter splits it: each head's key rows transposed
    (`attn_k_b` `[heads, latent, nope]`) and its value rows (`attn_v_b` `[heads, v, latent]`)."""
    layer = name.split(".")[2]
    nope, value = config["qk_nope_head_dim"], config["v_head_dim"]
    heads = array.reshape(config["num_attention_heads"], nope + value, -1)
    return {
        f"blk.{layer}.attn_k_b.weight": heads[:, :nope].transpose(0, 2, 1),
        f"blk.{layer}.attn_v_b.weight": heads[:, nope:],
    }


def add_qwen35(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """Qwen3.5's linear attention as llama.cpp's converter describes it (SSM keys)."""
    value_heads = config["linear_num_value_heads"]
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(value_heads)
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * value_heads)
    full = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    writer.add_full_attention_interval(full[0] + 1)
    writer.add_rope_dimension_sections([11, 11, 10, 0])  # what its converter writes for text


def tiled_value_heads(
    array: np.ndarray, axis: int, config: dict[str, Any], width: int
) -> np.ndarray:
    """`array`'s value heads (each `width` along `axis`) from the checkpoint's order, a key
    head's value heads together, to llama.cpp's, the key heads' first value heads first."""
    key_heads = config["linear_num_key_heads"]
    shared = config["linear_num_value_heads"] // key_heads
    moved = np.moveaxis(array, axis, 0)
    rest = moved.shape[1:]
    grouped = moved.reshape(key_heads, shared, width, *rest)
    tiled = grouped.transpose(1, 0, *range(2, grouped.ndim)).reshape(moved.shape)
    return np.moveaxis(tiled, 0, axis)


def qwen3_next_qkvz(name: str, array: np.ndarray, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Qwen3-Next's `in_proj_qkvz` (a key head's query, key, values and gates, then the next
    key head's) as llama.cpp's converter splits it: every query, key and value row in
    `attn_qkv`, every gate row in `attn_gate`."""
    key_heads, key_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
    values = config["linear_num_value_heads"] // key_heads * config["linear_value_head_dim"]
    grouped = array.reshape(key_heads, 2 * key_dim + 2 * values, -1)
    q, k, v, z = np.split(grouped, np.cumsum([key_dim, key_dim, values]), axis=1)
    layer = name.split(".")[2]
    qkv = np.concatenate([part.reshape(-1, array.shape[-1]) for part in (q, k, v)])
    return {
        f"blk.{layer}.attn_qkv.weight": qkv,
        f"blk.{layer}.attn_gate.weight": z.reshape(-1, array.shape[-1]),
    }


def qwen35_tensor(
    name: str, array: np.ndarray, config: dict[str, Any], tiled: bool = True
) -> tuple[str, np.ndarray]:
    """A Qwen3.5 checkpoint tensor as llama.cpp's converter writes it: zero-centred norms as
    1 + w (not the linear attention's own), `A_log` as -exp(A_log) (`ssm_a`), `dt_bias` as
    `ssm_dt.bias`, the convolution `[channels, kernel]`, value heads in its order where
    `tiled` (Qwen3.5's, not Qwen3-Next's, whose `in_proj_ba` stays grouped: `ssm_ba`)."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        array = array + 1
    if ".linear_attn." not in name:
        return gguf_name(name, QWEN35_IN_LAYER), array
    layer = name.split(".")[2]
    part = name.split(".linear_attn.")[1]
    if part == "conv1d.weight":
        array = array.reshape(array.shape[0], -1)
    if tiled:
        array = in_tiled_order(part, array, config)
    if part == "A_log":
        return f"blk.{layer}.ssm_a", -np.exp(array)
    if part == "dt_bias":
        return f"blk.{layer}.ssm_dt.bias", array
    return gguf_name(name, QWEN35_IN_LAYER), array


def in_tiled_order(part: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """A linear attention tensor (`part` of `linear_attn.`) with its value heads, wherever
    it lists them, in llama.cpp's order."""
    keys = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_value_head_dim"]
    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        values = tiled_value_heads(array[2 * keys :], 0, config, value_dim)
        return np.concatenate([array[: 2 * keys], values])
    if part == "in_proj_z.weight":
        return tiled_value_heads(array, 0, config, value_dim)
    if part in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return tiled_value_heads(array, 0, config, 1)
    if part == "out_proj.weight":
        return tiled_value_heads(array, 1, config, value_dim)
    return array


def add_sizes(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """A checkpoint's layers, positions, width and MLP width, as every architecture has them."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])


def add_tensor(
    writer: gguf.GGUFWriter, name: str, array: np.ndarray, kind: gguf.GGMLQuantizationType | None
) -> None:
    """`array` under `name`: float32, or quantized to `kind`."""
    array = np.ascontiguousarray(array)
    if kind is None:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def write_and_close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_hf_as_gguf(
    folder: Path,
    path: Path,
    rope_factors: bool = True,
    qtype: gguf.GGMLQuantizationType | None = None,
    qtype_of: dict[str, gguf.GGMLQuantizationType] | None = None,
    vocabulary: Callable[[gguf.GGUFWriter], None] | None = None,
    kv_b_apart: bool = True,
) -> Path:
    """`folder`'s checkpoint (config.json + model.safetensors) as a GGUF at `path`, without a
    tokenizer. `rope_factors=False` leaves a Llama-3 scaling's `rope_freqs` out, as files
    converted before llama.cpp wrote it are. `qtype` quantizes the matrices (experts too,
    each a `[experts, rows, cols]` tensor a layer, as llama.cpp stacks them; the router and
    the norms stay float32). `qtype_of` gives tensors whose GGUF name holds a key that
    key's type instead (a Q4_K_M file's Q6_K `attn_v` beside Q4_K queries). `vocabulary`
    writes a tokenizer's metadata (all but the BOS and EOS ids, which come from the config)."""
    config = json.loads((folder / "config.json").read_text())
    embedding_gemma = config.get("use_bidirectional_attention", False)
    gemma3 = config["model_type"] == "gemma3_text"
    gemma = gemma3 or config["model_type"] == "gemma2"
    gpt_oss = config["model_type"] == "gpt_oss"
    phi3 = config["model_type"] == "phi3"
    olmo3 = config["model_type"] == "olmo3"
    if gemma3 or olmo3:  # the whole layers' rope is the file's; llama.cpp fixes the windowed
        config["rope_parameters"] = config["rope_parameters"]["full_attention"]
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    config["rope_theta"] = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    partial = config.get("partial_rotary_factor") or rope.pop("partial_rotary_factor", None)
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    arch = "gemma-embedding" if embedding_gemma else GGUF_ARCH[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, arch)
    if vocabulary is not None:
        vocabulary(writer)
    glm4_moe = config["model_type"] == "glm4_moe"
    # GLM-4.5's files count its prediction layer after the last (`nextn_layer`)
    add_sizes(writer, {**config, "num_hidden_layers": config["num_hidden_layers"] + glm4_moe})
    writer.add_head_count(heads)
    deepseek = arch == "deepseek2"
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        add_qwen35(writer, config)
    if deepseek:
        add_deepseek2(writer, config, kv_b_apart)
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(int(head_dim * (partial or 1.0)))
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"]  # one id in the file, the first of a config's list
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    scaling = config["rope_scaling"] or {}
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if gpt_oss:
            writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    elif scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("rope_type") == "llama3" and rope_factors:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config, head_dim))
    elif scaling.get("rope_type") == "longrope":  # Phi-3: as llama.cpp's converter writes it
        original = config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(attention)
        for kind in ("long", "short"):
            factors = np.array(scaling[f"{kind}_factor"], np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if "mrope_section" in rope:  # Qwen-VL's M-RoPE sections, padded to four as llama.cpp's
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0][:4])
    if arch == "qwen3vl":
        writer.add_num_deepstack_layers(0)
    if gemma or gpt_oss or olmo3:
        writer.add_sliding_window(config["sliding_window"])
    if config["model_type"] == "exaone4" and config.get("sliding_window"):  # as its converter
        writer.add_sliding_window(config["sliding_window"])
        types = config["layer_types"]
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in types])
    if config["model_type"] in ("granite", "granitemoe"):
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    if config["model_type"] == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if glm4_moe:  # as Glm4MoeModel writes it, with one prediction layer after the last
        writer.add_nextn_predict_layers(1)
    if config["model_type"] in ("glm4_moe", "dots1"):  # and Dots1Model (llama.cpp's files
        writer.add_expert_shared_count(config["n_shared_experts"])  # hold no expert groups)
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
    num_experts = next(
        (
            config[key]
            for key in ("num_experts", "num_local_experts", "n_routed_experts")
            if config.get(key)
        ),
        0,
    )
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        wide = gpt_oss or config["model_type"] in ("mixtral", "olmoe", "granitemoe")
        expert_rows = config["intermediate_size" if wide else "moe_intermediate_size"]
        # llama.cpp's olmoe and granitemoe files have only feed_forward_length
        if config["model_type"] not in ("olmoe", "granitemoe"):
            writer.add_expert_feed_forward_length(expert_rows)
        if config.get("shared_expert_intermediate_size"):  # Qwen2-MoE's
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    in_layer = GEMMA_IN_LAYER if gemma else GPT_OSS_IN_LAYER if gpt_oss else IN_LAYER
    in_layer = PHI3_IN_LAYER if phi3 else in_layer
    in_layer = GLM4_IN_LAYER if config["model_type"] == "glm4" else in_layer
    in_layer = GLM4_MOE_IN_LAYER if glm4_moe else in_layer
    in_layer = DOTS1_IN_LAYER if config["model_type"] == "dots1" else in_layer
    in_layer = DEEPSEEK2_IN_LAYER if deepseek else in_layer
    post_norms = config["model_type"] in ("olmo2", "olmo3", "exaone4")
    in_layer = OLMO2_IN_LAYER if post_norms else in_layer
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    if embedding_gemma:
        tensors |= embedding_gemma_pooling(folder, writer)
    for name, tensor in load_file(folder / "model.safetensors").items():
        array = tensor.float().numpy()
        name = mixtral_as_qwen3_moe(f"model.{name}" if embedding_gemma else name)
        permuted = arch in ("llama", "smollm3", "granite", "granitemoe")  # as LlamaModel does
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = llama_cpp_permute(array, heads if "q_proj" in name else kv_heads)
        if gemma and name.endswith("norm.weight"):  # Gemma's RMSNorm weighs by 1 + w
            array = array + 1
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if gpt_oss and ".mlp.experts." in name:
            tensors |= gpt_oss_experts(name, array)
        elif name.endswith((".mlp.input_linear.weight", ".mlp.output_linear.weight")):
            tensors |= granite_experts(name, array)
        elif ".mlp.experts." in name:
            layer, expert, part = name.split(".")[2], name.split(".")[5], name.split(".")[6]
            experts.setdefault(f"blk.{layer}.{EXPERT_PARTS[part]}.weight", {})[int(expert)] = array
        elif name.endswith("shared_expert_gate.weight"):  # a [hidden] vector in the file
            tensors[gguf_name(name, in_layer)] = array.reshape(-1)
        elif kv_b_apart and name.endswith("kv_b_proj.weight"):
            tensors |= split_kv_b(name, array, config)
        elif arch == "qwen3next" and name.endswith("in_proj_qkvz.weight"):
            tensors |= qwen3_next_qkvz(name, array, config)
        elif arch in ("qwen35", "qwen35moe", "qwen3next"):
            stored, array = qwen35_tensor(name, array, config, tiled=arch != "qwen3next")
            tensors[stored] = array
        else:
            tensors[gguf_name(name, in_layer)] = array
    for name, by_index in experts.items():
        tensors[name] = np.stack([by_index[e] for e in sorted(by_index)])
    if glm4_moe:
        tensors |= nextn_layer(tensors, config["num_hidden_layers"], config["hidden_size"])
    for name, array in tensors.items():
        kind = next((t for key, t in (qtype_of or {}).items() if key in name), qtype)
        quantizable = name.endswith(".weight") and "ffn_gate_inp" not in name and array.ndim >= 2
        if kind is not None and array.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            quantizable = False
        add_tensor(writer, name, array, kind if quantizable else None)
    write_and_close(writer)
    return path


BERT_TOP_LEVEL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
    "classifier.dense": "cls",  # a RoBERTa classifier's head
    "classifier.out_proj": "cls.output",
    "classifier": "cls.output",  # a BERT classifier's (its pooler left out)
}
BERT_IN_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
"""gguf-py's names of BERT's tensors (MODEL_ARCH.BERT)."""


def write_bert_as_gguf(
    folder: Path,
    path: Path,
    pooling: gguf.PoolingType,
    qtype: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """A `BertModel` folder (config, weights, WordPiece vocab.txt) as llama.cpp's converter
    writes it: arch `bert`, non-causal, its pooling type, the vocabulary in llama.cpp's
    WordPiece spelling (a word start with a leading U+2581, a continuation without `##`,
    control tokens as they are) with the special ids; `qtype` quantizes the matrices. An
    XLM-RoBERTa folder (its sentencepiece.bpe.model) goes likewise, its classifier's head
    (`*ForSequenceClassification`) as `cls` and `cls.output`, the label names with it."""
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "bert")
    # XLM-RoBERTa's positions start past its padding id: the converter cuts those rows off
    offset = config["pad_token_id"] + 1 if config["model_type"] == "xlm-roberta" else 0
    add_sizes(
        writer, {**config, "max_position_embeddings": config["max_position_embeddings"] - offset}
    )
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    writer.add_token_type_count(config["type_vocab_size"])
    if offset:
        add_unigram_vocabulary(writer, folder / "sentencepiece.bpe.model", config["vocab_size"])
    else:
        add_wordpiece_vocabulary(writer, folder, config["vocab_size"])
    if config["architectures"][0].endswith("ForSequenceClassification"):
        labels = config["id2label"]
        writer.add_array(
            "bert.classifier.output_labels", [labels[str(i)] for i in range(len(labels))]
        )
    for name, tensor in load_file(folder / "model.safetensors").items():
        module, _, kind = name.removeprefix("roberta.").removeprefix("bert.").rpartition(".")
        if module in BERT_TOP_LEVEL:
            stored = BERT_TOP_LEVEL[module]
        elif module.startswith("encoder.layer."):
            layer, _, rest = module.removeprefix("encoder.layer.").partition(".")
            stored = f"blk.{layer}.{BERT_IN_LAYER[rest]}"
        else:
            continue  # the [CLS] pooler's dense layer: llama.cpp's converter leaves it out
        array = tensor.float().numpy()
        if module == "embeddings.position_embeddings":
            array = array[offset:]
        matrix = array.ndim == 2 and kind == "weight" and stored.startswith("blk.")
        add_tensor(writer, f"{stored}.{kind}", array, qtype if matrix else None)
    write_and_close(writer)
    return path


def add_wordpiece_vocabulary(writer: gguf.GGUFWriter, folder: Path, size: int) -> None:
    """A folder's vocab.txt in llama.cpp's WordPiece spelling, with BERT's special ids."""
    words = (folder / "vocab.txt").read_text().splitlines()
    words += [f"[unused{i}]" for i in range(size - len(words))]
    control = [w.startswith("[") and w.endswith("]") for w in words]
    spelled = [
        w if c else w[2:] if w.startswith("##") else "\u2581" + w
        for w, c in zip(words, control, strict=True)
    ]
    writer.add_tokenizer_model("bert")
    writer.add_token_list(spelled)
    kinds = [gguf.TokenType.CONTROL if c else gguf.TokenType.NORMAL for c in control]
    writer.add_token_types(kinds)
    for name, method in (("[CLS]", "add_bos_token_id"), ("[SEP]", "add_sep_token_id")):
        getattr(writer, method)(words.index(name))
    writer.add_pad_token_id(words.index("[PAD]"))
    writer.add_unk_token_id(words.index("[UNK]"))
    writer.add_mask_token_id(words.index("[MASK]"))


def add_unigram_vocabulary(writer: gguf.GGUFWriter, model: Path, size: int) -> None:
    """A SentencePiece unigram model (XLM-RoBERTa's sentencepiece.bpe.model) as llama.cpp's
    converter writes it (`t5`): fairseq's order (<s>, <pad>, </s>, <unk>, then the pieces
    past the model's own three, one place later), scores, types, the normaliser's
    precompiled character map and whitespace settings, XLM-R's special ids."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    pieces = [f"[PAD{i}]" for i in range(size)]
    scores = [-10000.0] * size
    kinds = [gguf.TokenType.UNUSED] * size
    for i in range(processor.vocab_size()):
        pieces[i], scores[i] = processor.id_to_piece(i), processor.get_score(i)
        kinds[i] = gguf.TokenType.CONTROL if processor.is_control(i) else gguf.TokenType.NORMAL
    control, unknown = gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN
    pieces = ["<s>", "<pad>", "</s>", "<unk>", *pieces[3:-1]]
    scores = [0.0] * 4 + scores[3:-1]
    kinds = [control, control, control, unknown, *kinds[3:-1]]
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_add_bos_token(True)  # as the converter reads XLM-R's <s> ... </s>
    writer.add_add_eos_token(True)
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
    writer.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
    for method, token in (("bos", 0), ("eos", 2), ("unk", 3), ("sep", 2), ("pad", 1)):
        getattr(writer, f"add_{method}_token_id")(token)


MODERN_BERT_TOP_LEVEL = {
    "embeddings.tok_embeddings": "token_embd",
    "embeddings.norm": "token_embd_norm",
    "final_norm": "output_norm",
    "head.dense": "cls",
    "head.norm": "cls.norm",
    "classifier": "cls.output",
}
MODERN_BERT_IN_LAYER = {
    "attn_norm": "attn_norm",
    "attn.Wqkv": "attn_qkv",
    "attn.Wo": "attn_output",
    "mlp_norm": "ffn_norm",
    "mlp.Wi": "ffn_up",
    "mlp.Wo": "ffn_down",
}
"""gguf-py's names of ModernBERT's tensors (MODEL_ARCH.MODERN_BERT)."""


def write_modern_bert_as_gguf(
    folder: Path,
    path: Path,
    pooling: gguf.PoolingType,
    qtype: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """A `ModernBertModel` folder (config, weights, a byte-level BPE tokenizer.json) as
    llama.cpp's converter writes it: arch `modern-bert`, its window and pattern, both rope
    bases, its activation, the vocabulary as `gpt2` pieces and merges (special tokens
    CONTROL) with [CLS] as BOS and [SEP] as EOS and separator; `qtype` quantizes the
    matrices. A classifier's head goes as `cls`, `cls.norm` and `cls.output`, with its
    pooling and label names."""
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "modern-bert")
    add_sizes(writer, config)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    writer.add_sliding_window(config["local_attention"])
    writer.add_sliding_window_pattern(config["global_attn_every_n_layers"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_string("modern-bert.hidden_activation", config["hidden_activation"])
    vocabulary = json.loads((folder / "tokenizer.json").read_text())
    pieces = sorted(vocabulary["model"]["vocab"], key=vocabulary["model"]["vocab"].get)
    specials = {t["content"]: t["id"] for t in vocabulary["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("modern-bert")
    writer.add_add_bos_token(True)  # as the converter flags ModernBERT's [CLS] ... [SEP]
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(True)
    writer.add_token_list(pieces)
    kinds = [gguf.TokenType.CONTROL if p in specials else gguf.TokenType.NORMAL for p in pieces]
    writer.add_token_types(kinds)
    merges = vocabulary["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for method, token in (("bos", "[CLS]"), ("eos", "[SEP]"), ("sep", "[SEP]"), ("pad", "[PAD]")):
        getattr(writer, f"add_{method}_token_id")(specials[token])
    writer.add_mask_token_id(specials["[MASK]"])
    if config["architectures"][0].endswith("ForSequenceClassification"):
        pooling_types = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}
        pooling_type = pooling_types[config["classifier_pooling"]]  # gguf 0.19 has no writer
        writer.add_uint32("modern-bert.classifier.pooling_type", int(pooling_type))
        labels = config["id2label"]
        names = [labels[str(i)] for i in range(len(labels))]
        writer.add_array("modern-bert.classifier.output_labels", names)
    for name, tensor in load_file(folder / "model.safetensors").items():
        module, _, kind = name.removeprefix("model.").rpartition(".")
        if module in MODERN_BERT_TOP_LEVEL:
            stored = MODERN_BERT_TOP_LEVEL[module]
        else:
            _, layer, rest = module.split(".", 2)
            stored = f"blk.{layer}.{MODERN_BERT_IN_LAYER[rest]}"
        array = tensor.float().numpy()
        matrix = array.ndim == 2 and stored.startswith("blk.")
        add_tensor(writer, f"{stored}.{kind}", array, qtype if matrix else None)
    write_and_close(writer)
    return path


NOMIC_BERT_TENSORS = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "emb_ln": "token_embd_norm",
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up",
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm2": "layer_output_norm",
}
"""gguf-py's names of nomic-bert's tensors (MODEL_ARCH.NOMIC_BERT)."""


def write_nomic_bert_as_gguf(
    folder: Path,
    path: Path,
    pooling: gguf.PoolingType,
    qtype: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """A nomic-bert folder (nomic's config and names, a WordPiece vocab.txt) as llama.cpp's
    converter writes it: arch `nomic-bert`, its trained context, rotary base and epsilon,
    non-causal, its pooling type, the WordPiece vocabulary in llama.cpp's spelling; `qtype`
    quantizes the matrices."""
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "nomic-bert")
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config["max_trained_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(config["n_inner"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_rope_freq_base(config["rotary_emb_base"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    writer.add_token_type_count(config["type_vocab_size"])
    add_wordpiece_vocabulary(writer, folder, config["vocab_size"])
    for name, tensor in load_file(folder / "model.safetensors").items():
        module, _, kind = name.rpartition(".")
        if module in NOMIC_BERT_TENSORS:
            stored = NOMIC_BERT_TENSORS[module]
        else:
            _, _, layer, rest = module.split(".", 3)
            stored = f"blk.{layer}.{NOMIC_BERT_TENSORS[rest]}"
        array = tensor.float().numpy()
        matrix = array.ndim == 2 and stored.startswith("blk.")
        add_tensor(writer, f"{stored}.{kind}", array, qtype if matrix else None)
    write_and_close(writer)
    return path
