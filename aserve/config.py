"""Configuration, resolved once at start-up into frozen dataclasses.

`ModelConfig` is read from a Hugging Face config.json. `EngineConfig`, `SchedulerConfig` and
`ServerConfig` hold the options of the command line; `build_config(**options)` turns the flat
keyword form (the CLI's option names with underscores, also used by `aserve.LLM`) into them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aserve.sampling_params import BOUNDS, DEFAULTABLE_FIELDS

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
"""What the API calls the embedded default model (no --model, no --served-model-name)."""
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "OlmoeForCausalLM": "olmoe",
    "Exaone4ForCausalLM": "exaone4",
    "Glm4ForCausalLM": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Dots1ForCausalLM": "dots1",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
VISION_LANGUAGE_ARCHITECTURES = (
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
"""Vision-language checkpoints whose language model aserve runs (`language_model_config`;
models/multimodal.py reads its weights), with images where models/vision.py encodes them:
Gemma 3 from 4B up, Mistral Small 3.1, LLaVA, Qwen2-VL, Qwen2.5-VL and Qwen3-VL publish their
models only so."""
LANGUAGE_MODEL_TYPES = {
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2ForCausalLM",
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
"""The language model's `model_type` in a vision-language config -> the text architecture
that runs it. Qwen2-VL's and Qwen3-VL's rotary positions (M-RoPE) give each section of a
head's frequencies its own position (time, height, width); a text token has the same
position in all three, which makes them the plain rotary embedding of Qwen2 and Qwen3.
(Older transformers keep Qwen2-VL's and Qwen2.5-VL's text settings at the top of the config,
under the model's own type.)"""
LANGUAGE_MODEL_SETTINGS = {"qwen3_vl_moe_text": {"norm_topk_prob": True}}
"""What a language model does that its config does not say: Qwen3-VL-MoE's router always
renormalises the chosen experts' weights (its config has no `norm_topk_prob`)."""
CLASSIFIER_SUFFIX = "ForSequenceClassification"
"""A classifier's architecture is its language model's with this in place of `ForCausalLM`
(transformers' `LlamaForSequenceClassification`, `Qwen3ForSequenceClassification`, ...): the
same decoder, a `score` layer in place of the LM head."""
BASE_MODEL_ARCHITECTURES = {"Gemma3TextModel": "Gemma3ForCausalLM"}
"""A decoder published without its head, as an embedding model (EmbeddingGemma's Gemma 3
text model, whose attention runs both ways: `bidirectional`) -> the architecture whose
decoder it is."""
ENCODER_ARCHITECTURES = {
    "BertModel": 0,
    "RobertaModel": 1,
    "XLMRobertaModel": 1,
    "ModernBertModel": 0,
    "NomicBertModel": 0,
}
"""Encoders (models/encoder.py, models/modernbert.py), which only embed or classify ->
whether their positions count from the padding id + 1 (RoBERTa's, XLM-RoBERTa's) rather
than from 0."""
MODERN_BERT = "ModernBertModel"
NOMIC_BERT = "NomicBertModel"
MOE_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "granitemoe",
    "glm4_moe",
    "dots1",
    "deepseek_v2",
    "deepseek_v3",
    "qwen3_5_moe",
    "qwen3_next",
)
"""Families whose experts `_moe_settings` reads (gpt-oss's are read with its own settings)."""
DEEPSEEK_MOE_FAMILIES = ("glm4_moe", "dots1", "deepseek_v2", "deepseek_v3")
"""Families whose experts are routed as DeepSeek's (`RouterStyle`)."""
LATENT_ATTENTION_FAMILIES = ("deepseek_v2", "deepseek_v3")
"""Families whose attention is DeepSeek's multi-head latent attention (`LatentAttention`)."""
LINEAR_HEADS_TILED = "linear_value_heads_tiled"
"""The config.json key by which a GGUF conversion says its value heads are llama.cpp's
order (`LinearAttention.tiled`)."""
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
"""Families whose layers are mostly linear attention with a recurrent state a request
(`LinearAttention`), with whole-context attention in a few."""
MOE_BACKENDS = ("auto", "torch", "fused")
QK_NORM_FAMILIES = (
    "qwen3",
    "qwen3_moe",
    "gemma3",
    "olmo2",
    "olmo3",
    "olmoe",
    "exaone4",
    "dots1",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
)
"""Families that normalise queries and keys (a head each, or across heads: OLMo's)."""
GELU_TANH = "gelu_pytorch_tanh"
ACTIVATIONS = ("silu", GELU_TANH)
"""The gated MLPs' activations: SiLU (Llama, Qwen, Mistral) and GELU's tanh form (Gemma)."""
# auto: the checkpoint's own (a quantized GGUF stays quantized); none: de-quantize to --dtype;
# int8 / int4: quantize a float checkpoint's linear layers at load.
CHECKPOINT_METHODS = {
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "compressed-tensors": "compressed-tensors",
}
"""vLLM's `--quantization` names for an integer checkpoint's own method: taken where the
checkpoint is of it, as `auto` (vLLM command lines carry them)."""
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8", *CHECKPOINT_METHODS)
# fp8: what vLLM and SGLang also accept for fp8_e4m3 (their FP8 cache on NVIDIA GPUs).
# float16 / float32: a float32 model's cache on CPU in half the bytes, as llama.cpp keeps it
# (what auto picks for quantized models there), or in full.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8", "float16", "float32")
SPECULATIVE_ALGORITHMS = ("ngram",)
FREQ_FACTORS = "freq_factors"
"""The rope scaling of a config converted from a GGUF that holds llama.cpp's `rope_freqs`:
each rotary frequency divided by its own factor (`factors`, head_dim / 2 of them), which is
how llama.cpp stores Llama 3.1's scaling in place of its four parameters."""
ROPE_SCALINGS = {
    "llama3": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor"),
    FREQ_FACTORS: ("factors",),
}
"""The rope scalings aserve runs (aserve/layers/rotary.py), each with the keys it needs."""
REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1", "deepseek_r1", "qwq", "glm45")
# vLLM's names, and SGLang's where they differ (qwen25, llama3); auto reads the chat template.
TOOL_CALL_PARSERS = (
    "auto",
    "hermes",
    "qwen25",
    "qwen3_coder",
    "llama3_json",
    "llama3",
    "mistral",
    "granite",
    "phi4_mini_json",
    "pythonic",
    "glm45",
    "glm47",
)
"""SGLang's and vLLM's names for parsers of `<think>` blocks (aserve/server/reasoning.py);
all read the same tags."""


class ConfigError(ValueError):
    """An option or a model config that aserve cannot run with; the message says why."""


@dataclass(frozen=True)
class ExpertStyle:
    """How an MoE layer's experts differ from Qwen3-MoE's (no biases, SiLU(gate) * up).
    gpt-oss adds a bias to the router's scores and to every expert product (`biases`), and
    with a `swiglu_limit` gates by a clamped SwiGLU: gate clamped above and up on both sides
    at the limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""

    biases: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None


PLAIN_EXPERTS = ExpertStyle()
"""Qwen3-MoE's experts: no biases, SiLU(gate) * up."""


@dataclass(frozen=True)
class RouterStyle:
    """How an MoE layer picks and weighs its experts where not by the softmax of the
    router's logits in the model's dtype (Qwen's, Mixtral's, gpt-oss's). DeepSeek's routers
    (`in_float32`) keep their weight in float32 and score float32 rows. DeepSeek-V3's way,
    which GLM-4.5 takes: each expert's score is the sigmoid of its logit (`sigmoid`); a
    learned bias of each expert (`e_score_correction_bias`, float32) is added to the scores
    only to choose the experts, which come from the `top_groups` of `groups` equal groups
    whose `group_best` (two) best biased scores sum highest; the chosen scores, renormalised
    where the layer says so, are then multiplied by `scaling` (`routed_scaling_factor`).
    DeepSeek-V2's: softmax scores, no bias, groups ranked by their best score (one)."""

    sigmoid: bool = False
    groups: int = 1
    top_groups: int = 1
    group_best: int = 2
    scaling: float = 1.0
    in_float32: bool = False


SOFTMAX_ROUTER = RouterStyle()
"""The softmax over every expert's logit, the chosen experts' probabilities as weights."""


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA). Keys and values come from one latent
    row a token, `kv_lora_rank` wide and normalised, and a key part of `qk_rope_head_dim`
    shared by every head, the only part that rotates. A head's query is `qk_nope_head_dim`
    unrotated dimensions (matched against its key of the latent, `kv_b_proj`'s K rows)
    and `qk_rope_head_dim` rotating ones; its value is `v_head_dim` wide. Queries come from
    the hidden state directly, or through a `q_lora_rank`-wide normalised row (0: directly).
    `rope_interleaved`: the rotating dimensions pair as neighbours (2i, 2i + 1), as V2's
    always do and V3's unless `rope_interleave` is false."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool = True

    @property
    def cache_width(self) -> int:
        """A token's cached row: the latent, then its rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttention:
    """Qwen3.5's linear attention layers (Gated DeltaNet, models/gated_deltanet.py): each
    keeps, a request, a `[value_heads, key_head_dim, value_head_dim]` state that every token
    decays and corrects (the gated delta rule), and the last `conv_kernel - 1` inputs of a
    causal depthwise convolution over its queries, keys and values. A key head (queries
    too) serves `value_heads // key_heads` value heads in turn. `layers`: the layers that
    run it; the others run whole-context attention. `tiled`: the value heads come in
    llama.cpp's order (GGUF files, where they differ in number from the key heads): value
    head j is served by key head j % key_heads, not j // (value_heads // key_heads), in
    every tensor that lists value heads alike."""

    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    tiled: bool = False

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_width(self) -> int:
        """Channels of the convolution: queries, keys, values."""
        return 2 * self.key_width + self.value_width


@dataclass(frozen=True)
class IntScheme:
    """How an integer checkpoint stores its linear weights, `w = (code - zero) * scale` per
    group of `group` inputs (0: one group a row), read by quant/int_checkpoints.py.
    `method`: "awq" (AutoAWQ's GEMM layout), "gptq" (AutoGPTQ / GPTQModel) or
    "compressed-tensors" (llm-compressor's integer formats). `symmetric`: no zero points
    stored, the middle code stands for zero. `zeros_less_one`: GPTQ's first format stores
    each zero point minus one. `packed`: codes packed into int32 words (every format but
    compressed-tensors' int-quantized, which keeps int8 values). `act_order`: a group
    gathers inputs from anywhere in the row (GPTQ's `desc_act`), as each weight's group
    index says."""

    method: str
    bits: int
    group: int
    symmetric: bool = False
    zeros_less_one: bool = False
    packed: bool = True
    act_order: bool = False


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope base and scaling, from `rope_parameters` (transformers >= 5 writes that) or the
    older `rope_theta` / `rope_scaling` keys. Scaling of type "default" means none."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # `_rotary_dim`'s
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind == "longrope":  # Phi-3: the original context may be the config's own key
        original = params.get("original_max_position_embeddings")
        original = original or config.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original
        if params.get("factor") is None and original:
            params["factor"] = int(config["max_position_embeddings"]) / int(original)
    if kind not in ROPE_SCALINGS:
        raise ConfigError(
            f"rope scaling {kind!r} is not supported; aserve runs {', '.join(ROPE_SCALINGS)}"
        )
    missing = [key for key in ROPE_SCALINGS[kind] if params.get(key) is None]
    if missing:
        raise ConfigError(f"{kind} rope scaling needs {' and '.join(missing)} in the config")
    return theta, params


def _layer_windows(config: dict[str, Any], num_layers: int, pattern: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: the whole context) from `layer_types`, or, where a
    config predates them, from a pattern: every `pattern`-th layer reads the whole context,
    the others `sliding_window` positions. Empty where no layer has a window."""
    window = int(config.get("sliding_window") or 0)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else ()


def _gemma_settings(config: dict[str, Any], num_layers: int, family: str) -> dict[str, Any]:
    """Gemma 2's and 3's quirks: the scores scaled by `query_pre_attn_scalar`, norms around
    attention and the MLP that weigh by 1 + w, embeddings scaled by the square root of the
    width, GELU, and windowed layers. Gemma 2 windows every other layer, from the first, and
    soft-caps its scores and its logits (cap * tanh(x / cap)); Gemma 3 windows five layers of
    six (`layer_types`, or the pattern that transformers 4 wrote) and gives them a rope of
    their own (`rope_parameters` keyed by layer type in transformers 5,
    `rope_local_base_freq` before)."""
    gemma2 = family == "gemma2"
    pattern = int(
        config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    )
    windows = _layer_windows(config, num_layers, 2 if gemma2 else pattern)
    if gemma2:
        rope = dict(zip(("rope_theta", "rope_scaling"), _rope_settings(config)))
    else:
        rope = _rope_by_layer_type(config, float(config.get("rope_local_base_freq", 10000.0)))
    head_dim = int(config.get("head_dim") or 256)
    return {
        **rope,
        "layer_windows": windows,
        "attention_scale": float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "embedding_scale": float(config["hidden_size"]) ** 0.5,
        "gemma_norms": True,
        "sandwich_norms": True,
        "hidden_act": config.get("hidden_activation") or config.get("hidden_act") or GELU_TANH,
        "attention_softcap": float(config.get("attn_logit_softcapping") or 0.0),
        "logit_softcap": float(config.get("final_logit_softcapping") or 0.0),
    }


def _rope_by_layer_type(config: dict[str, Any], local_theta: float) -> dict[str, Any]:
    """The ropes of a model whose windowed layers rotate unscaled by a base of their own
    (Gemma 3's, OLMo 3's): transformers 5 keys `rope_parameters` by layer type; before, the
    config's rope was the whole layers' and `local_theta` the windowed ones' base."""
    by_type = config.get("rope_parameters") or {}
    if "full_attention" in by_type:
        full, local = by_type["full_attention"], by_type.get("sliding_attention") or {}
        theta, scaling = _rope_settings({"rope_parameters": full})
        local_theta = float(local.get("rope_theta", local_theta))
    else:
        theta, scaling = _rope_settings(config)
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local_theta}


def _olmo_settings(config: dict[str, Any], num_layers: int, family: str) -> dict[str, Any]:
    """OLMo 2's norms (after attention and the MLP only, weighing the float32 row; Q/K norms
    across heads); OLMo 3 also windows three layers of four, which rotate unscaled by the
    same base."""
    settings: dict[str, Any] = {
        "post_norms": True,
        "norms_in_float32": True,
        "qk_norm_across_heads": True,
    }
    if family == "olmo3":
        settings["layer_windows"] = _layer_windows(config, num_layers, 4)
        theta = float(config.get("rope_theta") or 500000.0)
        settings |= _rope_by_layer_type(config, theta)
    return settings


def _olmoe_settings(config: dict[str, Any]) -> dict[str, Any]:
    """OLMoE: Llama's layers (norms before attention and the MLP) with OLMo's Q/K norms
    across all heads, and experts (`_moe_settings`). Its `clip_qkv` (None in the released
    models) is not run."""
    if config.get("clip_qkv") is not None:
        raise ConfigError("this OLMoE clips Q, K and V (clip_qkv), which aserve does not do")
    return {"qk_norm_across_heads": True}


def _exaone4_settings(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """EXAONE 4: OLMo 2's norms after attention and the MLP (plain RMSNorms; Q/K norms a
    head, as Qwen3's). With a window (the 32B) three layers of four read it
    (`sliding_window_pattern` 4 or "LLLG", or `layer_types`), and, as transformers has it,
    every layer that does not takes no rotary position."""
    settings: dict[str, Any] = {"post_norms": True}
    if not config.get("sliding_window"):
        return settings
    pattern = config.get("sliding_window_pattern") or 4
    if isinstance(pattern, str):
        config = {
            **config,
            "layer_types": [
                "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                for i in range(num_layers)
            ],
        }
        pattern = len(pattern)
    windows = _layer_windows(config, num_layers, int(pattern))
    settings["layer_windows"] = windows
    settings["rope_free_layers"] = tuple(
        i for i in range(num_layers) if not windows or not windows[i]
    )
    return settings


def _gpt_oss_settings(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss: every layer's MLP is 32 or 128 experts of `intermediate_size`, routed by
    a softmax over the top four scores (the softmax over all of them renormalised over the
    chosen: the same weights), each with biases and the clamped SwiGLU of
    `ExpertStyle`; the router and every projection have biases; each head has a learned
    sink logit in its softmax; even layers read a window of 128 positions."""
    theta, scaling = _rope_settings(config)
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "layer_windows": _layer_windows(config, num_layers, 2),
        "num_experts": int(config.get("num_local_experts") or config.get("num_experts") or 0),
        "num_experts_per_tok": int(
            config.get("num_experts_per_tok") or config.get("experts_per_token") or 4
        ),
        "moe_intermediate_size": int(config["intermediate_size"]),
        "norm_topk_prob": True,
        "expert_style": ExpertStyle(
            biases=True,
            swiglu_alpha=float(config.get("swiglu_alpha") or 1.702),
            swiglu_limit=float(config.get("swiglu_limit") or 7.0),
        ),
        "attention_sinks": True,
        "norms_in_float32": True,
    }


def _rotary_dim(config: dict[str, Any], head_dim: int, default: float = 1.0) -> int:
    """How many of a head's dimensions rotate (Phi-4-mini's first three quarters, by
    `partial_rotary_factor`, a config key or, in transformers 5, a rope parameter; GLM's
    configs may leave it out for their half)."""
    params = config.get("rope_parameters") or {}
    factor = config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or default
    rotary = int(head_dim * float(factor))
    if rotary % 2 or rotary <= 0 or (head_dim - rotary) % 2:
        raise ConfigError(f"a rotary part of {rotary} of {head_dim} dimensions is not supported")
    return rotary


def _granite_settings(config: dict[str, Any]) -> dict[str, Any]:
    """IBM Granite 3's four multipliers on Llama (and on Mixtral's experts, GraniteMoe): the
    embeddings, the scores (in place of 1 / sqrt(head_dim)), each block's output before it
    joins the residual stream, and the logits (divided)."""
    return {
        "embedding_scale": float(config.get("embedding_multiplier") or 1.0),
        "attention_scale": float(config.get("attention_multiplier") or 0.0) or None,
        "residual_multiplier": float(config.get("residual_multiplier") or 1.0),
        "logits_scaling": float(config.get("logits_scaling") or 1.0),
    }


def _check_longrope(scaling: dict[str, Any] | None, rotary_dim: int) -> None:
    """LongRoPE's factors: one a rotating pair, in each set."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "longrope":
        return
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != rotary_dim // 2:
            raise ConfigError(
                f"longrope {key} holds {len(scaling[key])} values; the {rotary_dim} rotating "
                f"dimensions of a head need {rotary_dim // 2}"
            )


def _rope_free_layers(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without rotary positions: `no_rope_layers` flags each layer (1: it
    rotates), or, where a config leaves them out (llama.cpp's files), every
    `no_rope_layer_interval`-th layer (4)."""
    flags = config.get("no_rope_layers")
    if flags:
        return tuple(layer for layer, rotates in enumerate(flags) if not rotates)
    interval = int(config.get("no_rope_layer_interval") or 4)
    return tuple(layer for layer in range(num_layers) if (layer + 1) % interval == 0)


def language_model_config(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """A vision-language config's language model as a text model's config.json would hold
    it. Transformers' own config class fills the defaults that published files leave out
    (Gemma 3 4B's `text_config` names six settings); the top level lends what it keeps for
    the whole model: end-of-sequence ids, dtype, quantization and tied embeddings."""
    from transformers import AutoConfig

    settings = {key: value for key, value in config.items() if key != "model_type"}
    try:
        whole = AutoConfig.for_model(str(config.get("model_type")), **settings)
    except (KeyError, ValueError, TypeError) as error:
        raise ConfigError(
            f"{architecture}'s config does not load in this transformers: {error}"
        ) from None
    text = whole.get_text_config().to_dict()
    kind = text.get("model_type")
    if kind not in LANGUAGE_MODEL_TYPES:
        raise ConfigError(
            f"{architecture} with a {kind!r} language model is not supported; aserve runs "
            f"the language models of types {', '.join(sorted(LANGUAGE_MODEL_TYPES))}"
        )
    text["architectures"] = [LANGUAGE_MODEL_TYPES[kind]]
    text |= LANGUAGE_MODEL_SETTINGS.get(kind, {})
    for key in ("tie_word_embeddings", "torch_dtype", "dtype", "quantization_config"):
        if config.get(key) is not None:
            text[key] = config[key]
    eos = _as_int_tuple(text.get("eos_token_id")) + _as_int_tuple(config.get("eos_token_id"))
    text["eos_token_id"] = sorted(set(eos))
    return text


def _classifier_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A classifier's labels: its `id2label` (else `num_labels` named as transformers names
    them), or vLLM's settings that make a causal LM one: `classifier_from_token` (a label a
    token), `method: from_2_way_softmax` or Qwen3-Reranker's `is_original_qwen3_reranker`
    (one label from the tokens "no" and "yes")."""
    original = bool(config.get("is_original_qwen3_reranker"))
    tokens = tuple(config.get("classifier_from_token") or (("no", "yes") if original else ()))
    two_way = original or config.get("method") == "from_2_way_softmax"
    if two_way and len(tokens) != 2:
        raise ConfigError(f"a two-way softmax classifier takes two tokens, not {list(tokens)}")
    if tokens:
        labels = (tokens[1],) if two_way else tokens
        return {"labels": labels, "classifier_tokens": tokens, "two_way_softmax": two_way}
    named = config.get("id2label") or {}
    if named:
        labels = tuple(str(named[key]) for key in sorted(named, key=int))
    else:
        labels = tuple(f"LABEL_{i}" for i in range(int(config.get("num_labels", 2))))
    return {"labels": labels}


def _moe_settings(config: dict[str, Any], family: str) -> dict[str, Any]:
    """Transformers 5 writes `num_local_experts` where Qwen's own configs say `num_experts`;
    the defaults are Qwen3MoeConfig's. Mixtral's, OLMoE's and Granite's experts are
    `intermediate_size` wide and every layer is sparse; Mixtral's and Granite's chosen
    experts' softmax weights are renormalised (Granite takes the softmax of the chosen
    logits, the same weights; Qwen3-MoE and OLMoE renormalise with `norm_topk_prob`).
    Qwen2-MoE adds a shared expert, `shared_expert_intermediate_size` wide, beside them, as
    Qwen3.5-MoE does, which always renormalises (its configs have no `norm_topk_prob`)."""
    mixtral = family in ("mixtral", "granitemoe")
    if family in DEEPSEEK_MOE_FAMILIES:
        return _deepseek_moe_settings(config, family)
    width = (
        config.get("moe_intermediate_size")
        if family in ("mixtral", "olmoe", "granitemoe")
        else config["moe_intermediate_size"]
    )
    return {
        "num_experts": int(config.get("num_experts") or config.get("num_local_experts") or 0),
        "num_experts_per_tok": int(config.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(width or config["intermediate_size"]),
        "norm_topk_prob": mixtral
        or family == "qwen3_5_moe"
        or bool(config.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(config.get("decoder_sparse_step") or 1),
        "mlp_only_layers": _as_int_tuple(config.get("mlp_only_layers")),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
    }


def _deepseek_moe_settings(config: dict[str, Any], family: str) -> dict[str, Any]:
    """DeepSeek-V2's and V3's experts, GLM-4.5's and dots.llm1's as V3 routes them
    (`RouterStyle`): the first `first_k_dense_replace` layers keep a dense MLP of
    `intermediate_size`, the others take `n_routed_experts` experts beside `n_shared_experts`
    shared ones, which are one dense MLP as wide as that many experts, added without a gate.
    The chosen weights are renormalised by default in GLM-4.5's and V3's configs, not in
    dots.llm1's; V2's `scoring_func` is the softmax, its `topk_method` greedy (one group) or
    `group_limited_greedy` (groups ranked by their best score)."""
    scoring = config.get("scoring_func", "softmax" if family == "deepseek_v2" else "sigmoid")
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"scoring_func {scoring!r} is not supported: softmax or sigmoid")
    sigmoid = scoring == "sigmoid"
    method = config.get("topk_method", "noaux_tc" if sigmoid else "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ConfigError(f"topk_method {method!r} is not supported")
    groups = int(config.get("n_group") or 1) if method != "greedy" else 1
    experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or 0)
    if experts % groups:
        raise ConfigError(f"{experts} experts do not split into n_group={groups} groups")
    width = int(config["moe_intermediate_size"])
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(config.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": width,
        "norm_topk_prob": bool(config.get("norm_topk_prob", family in ("glm4_moe", "deepseek_v3"))),
        "mlp_only_layers": tuple(range(int(config.get("first_k_dense_replace") or 0))),
        "shared_expert_intermediate_size": width * int(config.get("n_shared_experts") or 0),
        "shared_expert_gated": False,
        "router": RouterStyle(
            sigmoid=sigmoid,
            groups=groups,
            top_groups=int(config.get("topk_group") or 1) if groups > 1 else 1,
            group_best=2 if sigmoid else 1,
            scaling=float(config.get("routed_scaling_factor") or 1.0),
            in_float32=True,
        ),
        "mtp_layers": int(config.get("num_nextn_predict_layers") or 0),
    }


def _latent_settings(config: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any]:
    """DeepSeek's latent attention (`LatentAttention`). The backends see one key head as
    wide as the cached row and values that are its first `kv_lora_rank` columns (the
    attention layer turns queries and outputs to and from the latent), and the scores'
    scale of a whole query head, `qk_nope_head_dim + qk_rope_head_dim`, which YaRN's
    `mscale_all_dim` sharpens twice (transformers' `yarn_apply_mscale`)."""
    latent = LatentAttention(
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        rope_interleaved=bool(config.get("rope_interleave", True)),
    )
    scale = (latent.qk_nope_head_dim + latent.qk_rope_head_dim) ** -0.5
    params = scaling or {}
    weight_all, factor = params.get("mscale_all_dim"), float(params.get("factor") or 1.0)
    if weight_all and factor > 1:
        sharpness = 0.1 * float(weight_all) * math.log(factor) + 1.0
        scale *= sharpness * sharpness
    return {"latent": latent, "attention_scale": scale}


def _hybrid_settings(config: dict[str, Any], num_layers: int, head_dim: int) -> dict[str, Any]:
    """Qwen3.5: `LinearAttention` in the layers `layer_types` names so (else in three of
    every four), and in the others gated attention (`attention_output_gate`) whose first
    quarter of a head rotates; every norm weighs by 1 + w."""
    types = config.get("layer_types")
    if not types:
        interval = int(config.get("full_attention_interval", 4))
        types = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(num_layers)
        ]
    linear = LinearAttention(
        layers=tuple(i for i, kind in enumerate(types[:num_layers]) if kind == "linear_attention"),
        key_heads=int(config["linear_num_key_heads"]),
        value_heads=int(config["linear_num_value_heads"]),
        key_head_dim=int(config["linear_key_head_dim"]),
        value_head_dim=int(config["linear_value_head_dim"]),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        tiled=bool(config.get(LINEAR_HEADS_TILED, False)),
    )
    if linear.value_heads % linear.key_heads:
        raise ConfigError(
            f"{linear.value_heads} value heads do not share {linear.key_heads} key heads evenly"
        )
    return {
        "linear_attention": linear,
        "attention_output_gate": True,
        "gemma_norms": True,
        "rotary_dim": _rotary_dim(config, head_dim, 0.25),
    }


def _as_block(value: Any) -> tuple[int, int] | None:
    if isinstance(value, str):  # early compressed-tensors wrote "128x128"
        value = value.lower().split("x")
    return None if not value else (int(value[0]), int(value[1]))


# The `format` values under which compressed-tensors stores FP8 weights as float8_e4m3fn
# tensors beside their scales (no packing).
FP8_TENSOR_FORMATS = ("float-quantized", "naive-quantized")


def _quantization_settings(quantization: dict[str, Any]) -> dict[str, Any]:
    """`quantization`, `fp8_checkpoint` and `fp8_block` of a checkpoint's
    `quantization_config`. Three publishers' FP8 layouts are one to aserve: FP8 weights with
    a scale per tensor, per row or per block, read by `quant/fp8.py`'s `pair_scales`:
    "fp8" (transformers' own: Qwen's and DeepSeek's `*-FP8`, `weight_block_size`), "fbgemm_fp8"
    (Meta's: a scale per row) and "compressed-tensors" (llm-compressor's, as RedHat's
    `*-FP8` and `*-FP8-dynamic` checkpoints: a scale per tensor, row, block or column group).
    A compressed-tensors file that carries only a `kv_cache_scheme` has float weights. Other
    methods stay named as they are, for the runtime to refuse."""
    method = quantization.get("quant_method")
    if method in ("awq", "gptq"):
        return {"quantization": "gguf", "int_scheme": _awq_gptq_scheme(method, quantization)}
    if method == "fp8":
        return {
            "quantization": "fp8",
            "fp8_checkpoint": True,
            "fp8_block": _as_block(quantization.get("weight_block_size")),
        }
    if method == "fbgemm_fp8":
        return {"quantization": "fp8", "fp8_checkpoint": True}
    if method == "mxfp4":  # gpt-oss: its experts become GGUF's MXFP4 blocks (quant/mxfp4.py)
        return {"quantization": "gguf", "mxfp4_checkpoint": True}
    if method != "compressed-tensors":
        return {"quantization": method}
    groups = list((quantization.get("config_groups") or {}).values())
    if not groups:
        return {"quantization": None}
    if all((g.get("weights") or {}).get("type") == "int" for g in groups):
        return {"quantization": "gguf", "int_scheme": _compressed_int_scheme(quantization, groups)}
    blocks = {_compressed_fp8_block(g) for g in groups}
    if quantization.get("format") not in FP8_TENSOR_FORMATS:
        raise ConfigError(
            f"this compressed-tensors checkpoint's format is {quantization.get('format')!r}: "
            "aserve reads its FP8 weights (float-quantized), not packed or integer ones"
        )
    if len(blocks) > 1:
        raise ConfigError(
            "this compressed-tensors checkpoint scales its FP8 groups differently "
            f"({sorted(map(str, blocks))}): aserve reads one scale layout a checkpoint"
        )
    return {"quantization": "fp8", "fp8_checkpoint": True, "fp8_block": blocks.pop()}


INT_BITS = (4, 8)
"""Code widths of compressed-tensors integer checkpoints that aserve reads (its 2- and 3-bit
packing leaves bits of each word unused; few such files are published)."""
GPTQ_BITS = (2, 3, 4, 8)
"""GPTQ's code widths: its 3-bit codes run on across int32 words (quant/int_checkpoints.py);
2- and 3-bit codes run on the kernels that run GGUF's Q2_K and Q3_K."""


def _awq_gptq_scheme(method: str, quantization: dict[str, Any]) -> IntScheme:
    """AutoAWQ's and AutoGPTQ's `quantization_config`. AWQ's GEMM layout alone (its GEMV
    and Marlin layouts interleave codes differently; few files use them). GPTQ's act-order
    files (`desc_act`) gather scattered inputs into a group, as each weight's `g_idx` says,
    except with `static_groups`, whose groups stay runs of inputs."""
    bits = int(quantization.get("bits") or quantization.get("w_bit") or 0)
    group = int(quantization.get("group_size") or quantization.get("q_group_size") or 0)
    name = method.upper()
    if method == "awq" and bits != 4:
        raise ConfigError(f"this AWQ checkpoint has {bits}-bit weights: aserve runs AWQ's 4")
    if bits not in GPTQ_BITS:
        raise ConfigError(
            f"this {name} checkpoint has {bits}-bit weights: aserve runs 2, 3, 4 or 8"
        )
    if method == "awq":
        version = str(quantization.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(
                f"this AWQ checkpoint is in the {version!r} layout: aserve reads AWQ's GEMM one"
            )
        if quantization.get("zero_point") is False:
            raise ConfigError("this AWQ checkpoint has no zero points: aserve reads AWQ with them")
        return IntScheme("awq", 4, max(group, 0))
    act_order = bool(quantization.get("desc_act")) and not quantization.get("static_groups")
    stored = str(quantization.get("checkpoint_format") or "gptq").lower()
    if stored not in ("gptq", "gptq_v2"):
        raise ConfigError(f"this GPTQ checkpoint is in the {stored!r} format: aserve reads gptq")
    return IntScheme(
        "gptq", bits, max(group, 0), zeros_less_one=stored == "gptq", act_order=act_order
    )


def _compressed_int_scheme(quantization: dict[str, Any], groups: list[dict[str, Any]]) -> IntScheme:
    """llm-compressor's integer weights: `pack-quantized` (4 or 8 bits in int32 words; its
    W4A16 and W8A16 files) or `int-quantized` (int8 values; W8A8 files, whose activations
    aserve leaves in 16 bits: a weight-only product of the same weights). One scheme for every
    group, scales per row (`channel`) or per group of inputs."""
    schemes = {json.dumps(g.get("weights"), sort_keys=True) for g in groups}
    if len(schemes) > 1:
        raise ConfigError(
            "this compressed-tensors checkpoint quantizes its layers differently: aserve reads "
            "one scheme a checkpoint"
        )
    weights = groups[0]["weights"]
    bits = int(weights.get("num_bits") or 0)
    layout = quantization.get("format")
    if layout not in ("pack-quantized", "int-quantized", "naive-quantized"):
        raise ConfigError(
            f"this compressed-tensors checkpoint's format is {layout!r}: aserve reads integer "
            "weights pack-quantized or int-quantized"
        )
    if bits not in INT_BITS:
        raise ConfigError(
            f"this compressed-tensors checkpoint's weights are int {bits}-bit: aserve runs 4 or 8"
        )
    strategy = weights.get("strategy")
    if strategy not in ("channel", "group"):
        raise ConfigError(
            f"this compressed-tensors checkpoint scales its int weights by {strategy!r}: aserve "
            "reads scales per channel or per group"
        )
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    symmetric = weights.get("symmetric", True) is not False
    packed = layout == "pack-quantized"
    act_order = weights.get("actorder") == "group"  # "weight" keeps groups of the row's order
    return IntScheme(
        "compressed-tensors", bits, group, symmetric, packed=packed, act_order=act_order
    )


def _compressed_fp8_block(group: dict[str, Any]) -> tuple[int, int] | None:
    """The scale block of one compressed-tensors config group's FP8 weights: None for a
    scale per tensor or per row (`pair_scales` tells them apart by the scale's shape), a
    block's rows and columns, or one row by `group_size` columns."""
    weights = group.get("weights") or {}
    kind = f"{weights.get('type')} {weights.get('num_bits')}-bit"
    if kind != "float 8-bit" or weights.get("symmetric") is False:
        raise ConfigError(
            f"this compressed-tensors checkpoint's weights are {kind}"
            f"{'' if weights.get('symmetric', True) else ' asymmetric'}: aserve runs its FP8 "
            "ones (float, 8 bits, symmetric); GGUF files run 4- to 8-bit integer weights"
        )
    strategy = weights.get("strategy")
    if strategy in ("tensor", "channel"):
        return None
    if strategy == "block" and weights.get("block_structure"):
        return _as_block(weights["block_structure"])
    if strategy == "group" and weights.get("group_size"):
        return (1, int(weights["group_size"]))
    raise ConfigError(
        f"this compressed-tensors checkpoint scales its FP8 weights by {strategy!r}: aserve "
        "reads scales per tensor, channel, block or group"
    )


@dataclass(frozen=True)
class ModelConfig:
    """The shape and quirks of one decoder, read from a Hugging Face config.json.

    Mistral's (and Mixtral's and Phi-3's) sliding window is honoured by capping the context at
    the window: within it, sliding-window attention and full attention are the same
    computation. Gemma's layers alternate: `layer_windows` gives each layer's window (0: the
    whole context), and Gemma 3's windowed layers rotate with `local_rope_theta` unscaled.
    `sandwich_norms` (Gemma, GLM-4): the layer also normalises attention's and the MLP's
    outputs; `gemma_norms`: every norm weighs by 1 + w.
    `norms_in_float32`: norms weigh the float32 row before rounding (gpt-oss; Gemma's too).
    `rope_free_layers`: layers whose queries and keys take no rotary position (SmolLM3's
    every fourth). `rotary_dim`: how many of a head's dimensions rotate (0: all; Phi-4-mini
    rotates three quarters, GLM-4 half), `rotary_interleaved` (GLM-4): in pairs of neighbours
    (2i, 2i + 1), not halves. `o_bias`: the output projection has a bias (`attention_bias`,
    except Qwen2's and GLM-4's, which bias Q, K and V only). `attention_sinks`: each head's
    softmax also sums a learned logit of its own that weighs no value (gpt-oss).
    `attention_softcap` and `logit_softcap` (Gemma 2; 0: none) bound the scaled scores and the
    logits to (-cap, cap) by cap * tanh(x / cap). `post_norms` (OLMo 2, EXAONE 4): no norm
    before attention or the MLP; each one's output is normalised before it joins the residual
    stream.
    `qk_norm_across_heads` (OLMo 2): the Q and K norms (`qk_norm`) span all heads of the
    projection instead of one head.
    `residual_multiplier` scales each attention and MLP output before it joins the residual
    stream, and the logits are divided by `logits_scaling` (Granite). The MoE fields keep their
    defaults (no experts) for dense models; `expert_style` says how gpt-oss's experts
    differ.
    `quantization` is the checkpoint's format: its `quantization_config.quant_method`, "fp8"
    for every FP8 layout (`_quantization_settings`), "gguf" for weights that arrive as codes
    (a quantized GGUF file; gpt-oss's MXFP4 checkpoints, whose experts are read as GGUF's
    MXFP4 blocks; integer checkpoints, AWQ, GPTQ and compressed-tensors, whose `int_scheme`
    says how they pack codes), or None, until the runtime replaces it with what the weights
    run as; `fp8_checkpoint`, `fp8_block` (the scales' block), `mxfp4_checkpoint` and
    `int_scheme` stay: they say how the file is to be read.
    `language_model_of`: the vision-language architecture (`VISION_LANGUAGE_ARCHITECTURES`)
    whose language model this is; None for a text model. `image_token_id`: the token a
    chat template writes for an image, in such a checkpoint (models/vision.py).
    `labels`: a sequence classifier's, `num_labels` of them (`*ForSequenceClassification`: its
    decoder is the `*ForCausalLM`'s, then a `score` layer from the last token's final hidden
    state to a logit a label, in `id2label`'s order); 0 and () for a language model. A causal
    LM made a classifier by vLLM's `classifier_from_token` (`--hf-overrides`) takes its
    score rows from the LM head's rows of those tokens (`classifier_tokens`, whose ids the
    runtime looks up: `classifier_token_ids`), a label a token, or with `two_way_softmax`
    (Qwen3-Reranker's "no", "yes") one label, the second row minus the first: its sigmoid
    is the softmax of the two tokens' logits at the second.
    `bidirectional` (EmbeddingGemma, transformers' `use_bidirectional_attention`): every
    position of a prompt attends to every other, in windowed layers to those less than the
    window away on either side; such a model only embeds (`--is-embedding`).
    An encoder (`ENCODER_ARCHITECTURES`) is `bidirectional` too; its learned positions start
    at `position_offset` (RoBERTa's padding id + 1), its `type_vocab_size` token-type rows
    are added to the word embeddings (row 0: one segment), `rms_norm_eps` is its LayerNorms'
    eps. An encoder's classifier (`BertForSequenceClassification`, ...: a cross-encoder)
    reads a pair as its tokenizer joins it; where its types are more than one, the tokens
    after a sequence's first `segment_separator_id` ([SEP], the runtime looks it up) are of
    type 1, as the tokenizer's pair encoding types them.
    `linear_attention` (Qwen3.5): the layers that keep a recurrent state a request in place
    of a KV cache (`LinearAttention`); None where every layer attends over its KV.
    `attention_output_gate` (Qwen3.5): `q_proj` gives each head a gate beside its query
    (the head's query rows, then its gate rows), and the head's attention output is scaled
    by the gate's sigmoid before `o_proj`.
    `mrope_section`: Qwen-VL's rotary pairs by position coordinate (time, height, width; in
    runs of pairs, or taken in turn where `mrope_interleaved`): text positions give all three
    the same value, so only image positions see them (layers/rotary.py).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    quantization: str | None = None
    fp8_checkpoint: bool = False
    fp8_block: tuple[int, int] | None = None
    mxfp4_checkpoint: bool = False
    int_scheme: IntScheme | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE: a dense MLP every token takes beside its experts, weighed by a sigmoid gate
    # (GLM-4.5's shared experts: not weighed, `shared_expert_gated` False)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    router: RouterStyle = SOFTMAX_ROUTER
    latent: LatentAttention | None = None
    linear_attention: LinearAttention | None = None
    attention_output_gate: bool = False
    mtp_layers: int = 0  # GLM-4.5's next-token prediction layers after the last: not run
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)
    embedding_scale: float | None = None
    gemma_norms: bool = False
    sandwich_norms: bool = False
    norms_in_float32: bool = False
    o_bias: bool = False
    attention_sinks: bool = False
    attention_softcap: float = 0.0
    logit_softcap: float = 0.0
    expert_style: ExpertStyle = PLAIN_EXPERTS
    rope_free_layers: tuple[int, ...] = ()
    rotary_dim: int = 0
    rotary_interleaved: bool = False
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    post_norms: bool = False
    qk_norm_across_heads: bool = False
    language_model_of: str | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    labels: tuple[str, ...] = ()
    classifier_tokens: tuple[str, ...] = ()
    classifier_token_ids: tuple[int, ...] = ()
    two_way_softmax: bool = False
    bidirectional: bool = False
    position_offset: int = 0
    type_vocab_size: int = 0
    segment_separator_id: int | None = None
    norm_bias: bool = True  # ModernBERT's LayerNorms may have no bias
    mlp_bias: bool = True  # and its MLPs none
    classifier_pooling: str = "cls"  # ModernBERT's classifier may pool by the mean
    classifier_bias: bool = False  # and its dense layer may have a bias

    @property
    def classifies(self) -> bool:
        """Whether this is a sequence classifier (a reranker, a reward model)."""
        return self.num_labels > 0

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def keeps_kv(self, layer: int) -> bool:
        """Whether layer `layer` attends over a KV cache (not a linear attention layer's)."""
        return self.linear_attention is None or layer not in self.linear_attention.layers

    @property
    def kv_layers(self) -> int:
        return sum(self.keeps_kv(layer) for layer in range(self.num_layers))

    def layer_window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 where it reads the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Transformers' rule: every `decoder_sparse_step`-th layer is sparse unless listed
        in `mlp_only_layers`, which keep a dense MLP of `intermediate_size`."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        architectures = config.get("architectures") or []
        vision_language = next(
            (a for a in architectures if a in VISION_LANGUAGE_ARCHITECTURES), None
        )
        if vision_language is not None:
            text_config = language_model_config(config, vision_language)
            text = cls.from_hf(text_config, generation_config)
            rope = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
            image_token = config.get("image_token_index", config.get("image_token_id"))
            if vision_language == "Gemma3ForConditionalGeneration":  # its template writes
                image_token = config.get("boi_token_index", 255_999)  # the image's start
            return dataclasses.replace(
                text,
                language_model_of=vision_language,
                image_token_id=image_token,
                mrope_section=tuple(rope.get("mrope_section") or ()),
                mrope_interleaved=bool(rope.get("mrope_interleaved")),
            )
        encoder = next((a for a in architectures if a in ENCODER_ARCHITECTURES), None)
        if encoder is not None:
            return _encoder_config(cls, config, encoder)
        base_model = next((a for a in architectures if a in BASE_MODEL_ARCHITECTURES), None)
        if base_model is not None:
            decoder = {**config, "architectures": [BASE_MODEL_ARCHITECTURES[base_model]]}
            text = cls.from_hf(decoder, generation_config)
            if not config.get("use_bidirectional_attention", False):
                return text
            # transformers reads a window of w both ways as less than w // 2 + 1 away
            windows = tuple(w // 2 + 1 if w else 0 for w in text.layer_windows)
            return dataclasses.replace(text, bidirectional=True, layer_windows=windows)
        classifier = next((a for a in architectures if a.endswith(CLASSIFIER_SUFFIX)), None)
        encoder_of = f"{(classifier or '').removesuffix(CLASSIFIER_SUFFIX)}Model"
        if encoder_of in ENCODER_ARCHITECTURES:  # a cross-encoder (bge-reranker, ms-marco)
            encoder_config = _encoder_config(cls, config, encoder_of)
            return dataclasses.replace(encoder_config, **_classifier_settings(config))
        # (Gemma 3's text classifier is `Gemma3TextForSequenceClassification`)
        base = (classifier or "").removesuffix(CLASSIFIER_SUFFIX).removesuffix("Text")
        causal = f"{base}ForCausalLM" if classifier else ""
        if causal in SUPPORTED_ARCHITECTURES:
            text = cls.from_hf({**config, "architectures": [causal]}, generation_config)
            return dataclasses.replace(text, **_classifier_settings(config))
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {architectures or config.get('model_type')!r}; "
                f"aserve runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}, the language "
                f"models of {', '.join(VISION_LANGUAGE_ARCHITECTURES)} and the encoders "
                f"{', '.join(ENCODER_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden // num_heads
        eos = set(_as_int_tuple(config.get("eos_token_id")))
        if generation_config:
            eos |= set(_as_int_tuple(generation_config.get("eos_token_id")))
        max_positions = int(config.get("max_position_embeddings", 4096))
        if family in ("mistral", "mixtral", "phi3") and config.get("sliding_window"):
            max_positions = min(max_positions, int(config["sliding_window"]))
        quantization = config.get("quantization_config") or {}
        num_layers = int(config["num_hidden_layers"])
        if family in ("gemma2", "gemma3"):
            family_settings = _gemma_settings(config, num_layers, family)
        elif family == "gpt_oss":
            family_settings = _gpt_oss_settings(config, num_layers)
        else:
            family_settings = dict(zip(("rope_theta", "rope_scaling"), _rope_settings(config)))
        if family == "smollm3":
            family_settings["rope_free_layers"] = _rope_free_layers(config, num_layers)
        if family in ("granite", "granitemoe"):
            family_settings |= _granite_settings(config)
        if family in ("olmo2", "olmo3"):
            family_settings |= _olmo_settings(config, num_layers, family)
        if family == "exaone4":
            family_settings |= _exaone4_settings(config, num_layers)
        if family == "olmoe":
            family_settings |= _olmoe_settings(config)
        if family == "glm4":
            family_settings |= {
                "sandwich_norms": True,
                "rotary_dim": _rotary_dim(config, int(head_dim)),
                "rotary_interleaved": True,
            }
        if family == "glm4_moe":  # half of a head rotates, in halves (unlike GLM-4's pairs)
            family_settings["rotary_dim"] = _rotary_dim(config, int(head_dim), 0.5)
        if family == "dots1" and config.get("layer_types"):  # Qwen2's windows past a layer
            family_settings["layer_windows"] = _layer_windows(config, num_layers, 1)
        if family in LATENT_ATTENTION_FAMILIES:
            family_settings |= _latent_settings(config, family_settings.get("rope_scaling"))
            head_dim = family_settings["latent"].cache_width
        if family in HYBRID_FAMILIES:
            family_settings |= _hybrid_settings(config, num_layers, int(head_dim))
        if family == "phi3":
            family_settings["rotary_dim"] = _rotary_dim(config, int(head_dim))
            _check_longrope(family_settings["rope_scaling"], family_settings["rotary_dim"])
        settings = {"hidden_act": str(config.get("hidden_act", "silu")), **family_settings}
        if settings["hidden_act"] not in ACTIVATIONS:
            raise ConfigError(
                f"activation {settings['hidden_act']!r} is not supported; aserve runs "
                f"{', '.join(ACTIVATIONS)}"
            )
        return cls(
            architecture=arch,
            model_type=family,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(
                config.get("intermediate_size") or config["moe_intermediate_size"]
            ),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=1
            if family in LATENT_ATTENTION_FAMILIES
            else int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(
                config.get("qkv_bias", True)
                if family == "qwen2_moe"
                else config.get("attention_bias", family == "qwen2")
            ),
            o_bias=bool(config.get("attention_bias", False))
            and family not in ("qwen2", "qwen2_moe", "glm4", "glm4_moe"),
            qk_norm=family in QK_NORM_FAMILIES
            or (family == "glm4_moe" and bool(config.get("use_qk_norm"))),
            eos_token_ids=tuple(sorted(eos)),
            bos_token_id=config.get("bos_token_id"),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            **_quantization_settings(quantization),
            **_moe_settings(config, family) if family in MOE_FAMILIES else {},
            **settings,
        )


def _modern_bert_config(cls: type[ModelConfig], config: dict[str, Any]) -> ModelConfig:
    """ModernBERT's settings: every `global_attn_every_n_layers`-th layer whole (from the
    first), the others within `local_attention` // 2 tokens either way (transformers'
    inclusive window: less than that + 1 away), each kind with its own RoPE base; what
    models/modernbert.py does not compute is refused."""
    activation = config.get("hidden_activation", "gelu")
    if activation not in ("gelu", "silu"):
        raise ConfigError(
            f"ModernBERT with hidden_activation {activation!r}: aserve's gates by GELU or "
            "SiLU (Granite Embedding R2's)"
        )
    if config.get("classifier_activation", "gelu") != "gelu":
        raise ConfigError(
            f"ModernBERT with classifier_activation {config['classifier_activation']!r}: "
            "aserve's classifier takes GELU"
        )
    pooling = config.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ConfigError(f"ModernBERT's classifier_pooling {pooling!r}: aserve's is cls or mean")
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    every = int(config.get("global_attn_every_n_layers", 3))
    kinds = config.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention" for i in range(layers)
    ]
    window = int(config.get("local_attention", 128)) // 2 + 1
    rope = config.get("rope_parameters") or {}
    global_theta = rope.get("full_attention", {}).get("rope_theta")
    local_theta = rope.get("sliding_attention", {}).get("rope_theta")
    attention_bias = bool(config.get("attention_bias", False))
    return cls(
        architecture=MODERN_BERT,
        model_type="modernbert",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(config.get("norm_eps", 1e-5)),
        rope_theta=float(global_theta or config.get("global_rope_theta", 160000.0)),
        local_rope_theta=float(local_theta or config.get("local_rope_theta", 10000.0)),
        layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
        max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
        tie_word_embeddings=False,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=False,
        hidden_act=activation,
        torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        **_quantization_settings(config.get("quantization_config") or {}),
        bidirectional=True,
        norm_bias=bool(config.get("norm_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        classifier_pooling=pooling,
        classifier_bias=bool(config.get("classifier_bias", False)),
    )


NOMIC_BERT_FIXED = {
    "activation_function": "swiglu",
    "prenorm": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_scaling_factor": None,
    "moe_every_n_layers": None,
}
"""nomic-bert's settings that models/encoder.py computes as nomic-embed-text v1 and v1.5
set them (SwiGLU, post-norm, no biases, rotary over whole heads in halves, no scaling, no
experts); another value is refused."""


def _nomic_bert_config(cls: type[ModelConfig], config: dict[str, Any]) -> ModelConfig:
    """nomic-bert (nomic-embed-text v1 and v1.5): BERT's post-norm layers with rotary
    positions (`rotary_emb_base`), a fused QKV, SwiGLU, no biases, token type 0; its context
    the `max_trained_positions` it was trained for, as llama.cpp and vLLM take it."""
    for key, value in NOMIC_BERT_FIXED.items():
        if config.get(key, value) != value:
            raise ConfigError(
                f"NomicBertModel with {key} {config[key]!r}: aserve's takes {value!r}"
            )
    heads, hidden = int(config["n_head"]), int(config["n_embd"])
    positions = int(config.get("max_trained_positions") or config.get("n_positions", 2048))
    return cls(
        architecture=NOMIC_BERT,
        model_type="nomic_bert",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["n_inner"]),
        num_layers=int(config["n_layer"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-12)),
        rope_theta=float(config.get("rotary_emb_base", 1000.0)),
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        hidden_act="silu",
        torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        **_quantization_settings(config.get("quantization_config") or {}),
        bidirectional=True,
        type_vocab_size=int(config.get("type_vocab_size", 2)),
    )


def _encoder_config(
    cls: type[ModelConfig], config: dict[str, Any], architecture: str
) -> ModelConfig:
    """A BERT-style encoder's settings; what models/encoder.py does not compute is refused."""
    if architecture == MODERN_BERT:
        return _modern_bert_config(cls, config)
    if architecture == NOMIC_BERT:
        return _nomic_bert_config(cls, config)
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ConfigError(
            f"{architecture} with {kind} position embeddings: aserve's encoders take learned "
            "absolute ones"
        )
    if config.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(
            f"{architecture} with the activation {config['hidden_act']!r}: aserve's encoders "
            "take GELU"
        )
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    offset = int(config.get("pad_token_id") or 0) + 1 if ENCODER_ARCHITECTURES[architecture] else 0
    return cls(
        architecture=architecture,
        model_type=str(config.get("model_type", "bert")),
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        rope_theta=0.0,
        max_position_embeddings=int(config["max_position_embeddings"]) - offset,
        tie_word_embeddings=False,
        qkv_bias=True,
        qk_norm=False,
        hidden_act="gelu",
        o_bias=True,
        torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        **_quantization_settings(config.get("quantization_config") or {}),
        bidirectional=True,
        position_offset=offset,
        type_vocab_size=int(config.get("type_vocab_size", 2)),
    )


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to load a model and size its KV cache."""

    model_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    dummy_weight: bool = False
    tensor_parallel_size: int = 1
    disable_pynccl: bool = False
    max_running_requests: int = 256
    max_prefill_length: int = 8192
    max_seq_len_override: int | None = None
    memory_ratio: float = 0.9
    num_pages: int | None = None
    swa_full_tokens_ratio: float = 0.8
    page_size: int = 1
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None
    moe_backend: str = "auto"
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    seed: int = 0
    is_embedding: bool = False  # serve embeddings (the last token's final hidden state)
    hf_overrides: str = ""  # a JSON object merged into config.json (`with_overrides`)
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters' (name, folder) pairs
    max_lora_rank: int | None = None  # adapters of a larger rank are refused
    enable_lora: bool = False  # room for adapters loaded at run time
    max_loras: int | None = None  # adapter slots (default: --lora-modules', or 4 for room)

    @property
    def lora_slots(self) -> int:
        """How many adapters the model holds at once."""
        if self.max_loras is not None:
            return self.max_loras
        return max(len(self.lora_modules), 4 if self.enable_lora else 0)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching policy: how many requests run, how many prompt tokens one prefill takes."""

    max_running_requests: int = 256
    max_prefill_length: int = 8192
    cache_type: str = "radix"
    page_size: int = 1
    speculative_algorithm: str | None = None  # "ngram": drafts from the request's own text
    speculative_num_draft_tokens: int = 4  # drafted tokens a request verifies in one step
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12


@dataclass(frozen=True)
class ServerConfig:
    """Everything `aserve` was started with; engine and scheduler parts are nested."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    num_tokenizer: int = 1
    max_queued_requests: int | None = None
    shell_mode: bool = False
    silent_output: bool = False
    stream_interval: int | None = None  # None: auto (aserve/scheduler/request.py, StreamPace)
    generation_config: str = "auto"
    default_sampling: tuple[tuple[str, float], ...] = ()
    reasoning_parser: str | None = None  # split <think> blocks into reasoning_content
    tool_call_parser: str = "auto"  # how replies write tool calls (server/tool_syntax.py)
    chat_template: str | None = None  # a Jinja template (text) in place of the model's

    @property
    def model_name(self) -> str:
        """What the API calls the model: `--served-model-name`, else its path, else the
        embedded model's name."""
        return self.served_model_name or self.engine.model_path or EMBEDDED_MODEL_NAME


_SHARED_KEYS = {"max_running_requests", "max_prefill_length", "page_size"}


def chat_template_text(value: str) -> str:
    """`--chat-template`: a file's text, or the template itself (as vLLM reads the option)."""
    if "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"--chat-template: no file {value!r} (nor a template: it has no '{{')")
    return path.read_text(encoding="utf-8")


def build_config(**options: Any) -> ServerConfig:
    """Route flat option names (as the CLI spells them) into the nested config.

    Options that both the engine and the scheduler read (page size, running-request cap)
    are given once and copied into both, so the two can never disagree.
    """
    parts: dict[str, dict[str, Any]] = {"engine": {}, "scheduler": {}, "server": {}}
    owners = {
        "engine": {f.name for f in dataclasses.fields(EngineConfig)},
        "scheduler": {f.name for f in dataclasses.fields(SchedulerConfig)},
        "server": {f.name for f in dataclasses.fields(ServerConfig)} - {"engine", "scheduler"},
    }
    for key, value in options.items():
        if key == "model":
            key = "model_path"
        targets = [part for part, names in owners.items() if key in names]
        if not targets:
            raise ConfigError(f"unknown option {key!r}")
        if key == "default_sampling":
            value = sampling_overrides(value)
        if key == "chat_template" and value is not None:
            value = chat_template_text(value)
        if key == "hf_overrides":
            value = overrides_text(value)
        if key == "lora_modules":
            value = lora_module_pairs(value)
        for part in targets:
            parts[part][key] = value
    config = ServerConfig(
        engine=EngineConfig(**parts["engine"]),
        scheduler=SchedulerConfig(**parts["scheduler"]),
        **parts["server"],
    )
    validate(config)
    return config


def lora_module_pairs(
    values: Sequence[str] | Mapping[str, str] | None,
) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` as (name, path) pairs: `name=path` each, or vLLM's JSON form
    `{"name": ..., "path": ...}` (or, from the offline API, a mapping of names to paths);
    names must be unique."""
    if isinstance(values, Mapping):
        entries = [(str(name), str(path)) for name, path in values.items()]
    else:
        entries = [_lora_entry(value) for value in values or ()]
    pairs: list[tuple[str, str]] = []
    for name, path in entries:
        if not name or not path:
            raise ConfigError(f"--lora-modules: adapter {name!r} needs a name and a path")
        if name in (n for n, _ in pairs):
            raise ConfigError(f"--lora-modules names adapter {name!r} twice")
        pairs.append((name, path))
    return tuple(pairs)


def _lora_entry(value: str) -> tuple[str, str]:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON object."""
    if not value.lstrip().startswith("{"):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(
                f"--lora-modules takes NAME=PATH entries, e.g. sql=/adapters/sql; got {value!r}"
            )
        return name, path
    try:
        spec = json.loads(value)
    except ValueError as error:
        raise ConfigError(f"--lora-modules: {value!r} is not valid JSON: {error}") from None
    name = spec.get("name") if isinstance(spec, dict) else None
    path = spec.get("path") if isinstance(spec, dict) else None
    if not isinstance(name, str) or not isinstance(path, str):
        raise ConfigError(
            '--lora-modules: a JSON entry needs "name" and "path" strings, e.g. '
            '{"name": "sql", "path": "/adapters/sql"}'
        )
    return name, path


def overrides_text(value: str | Mapping[str, Any] | None) -> str:
    """`--hf-overrides` as JSON text (the CLI) or a mapping (`LLM(hf_overrides=...)`): checked
    to be a JSON object, kept as text."""
    if not value:
        return ""
    example = '{"max_position_embeddings": 8192}'
    return json.dumps(_json_object(value, "--hf-overrides", example))


def _json_object(value: str | Mapping[str, Any], option: str, example: str) -> Mapping[str, Any]:
    """An option's JSON object, from JSON text (the CLI) or a mapping (the offline API); a
    one-line ConfigError (with `example`) for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ConfigError(f"{option} is not valid JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{option} must be a JSON object, e.g. {example}")
    return value


def with_overrides(config: dict[str, Any], overrides: str) -> dict[str, Any]:
    """config.json with `--hf-overrides` merged in, as vLLM merges them: an object into the
    object it replaces, key by key; anything else in place of the value."""
    merged = dict(config)
    for key, value in (json.loads(overrides) if overrides else {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = with_overrides(merged[key], json.dumps(value))
        else:
            merged[key] = value
    return merged


def sampling_overrides(value: str | Mapping[str, Any] | None) -> tuple[tuple[str, float], ...]:
    """`--default-sampling` as JSON text (the CLI) or a mapping (`LLM(default_sampling=...)`),
    checked against the API's ranges, as sorted (field, value) pairs."""
    if value is None or value == "":
        return ()
    value = _json_object(value, "--default-sampling", '{"temperature": 0.7}')
    pairs = []
    for name, number in sorted(value.items()):
        if name not in DEFAULTABLE_FIELDS:
            raise ConfigError(
                f"--default-sampling: unknown field {name!r}; "
                f"it sets {', '.join(DEFAULTABLE_FIELDS)}"
            )
        integral = name in ("top_k", "max_tokens")
        kinds = (int,) if integral else (int, float)
        if isinstance(number, bool) or not isinstance(number, kinds):
            kind = "an integer" if integral else "a number"
            raise ConfigError(f"--default-sampling: {name} must be {kind}")
        if not BOUNDS[name].admits(number):
            raise ConfigError(f"--default-sampling: {name} must be {BOUNDS[name].describe()}")
        pairs.append((name, number))
    return tuple(pairs)


def validate(config: ServerConfig) -> None:
    """Refuse option values that cannot work, with a message that names the option."""
    engine, sched = config.engine, config.scheduler
    checks = [
        (
            all(name != config.model_name for name, _ in engine.lora_modules),
            f"--lora-modules: an adapter named {config.model_name!r} takes the model's own "
            "name; name it otherwise (or set --served-model-name)",
        ),
        (
            engine.dtype in ("auto", "float16", "bfloat16", "float32"),
            "--dtype must be auto, float16, bfloat16 or float32",
        ),
        (engine.page_size >= 1, "--page-size must be at least 1"),
        (engine.max_running_requests >= 1, "--max-running-requests must be at least 1"),
        (sched.max_prefill_length >= 1, "--max-prefill-length must be at least 1"),
        (sched.cache_type in ("radix", "naive"), "--cache-type must be radix or naive"),
        (
            sched.speculative_algorithm in (None, *SPECULATIVE_ALGORITHMS),
            f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}",
        ),
        (
            sched.speculative_num_draft_tokens >= 1,
            "--speculative-num-draft-tokens must be at least 1",
        ),
        (
            1
            <= sched.speculative_ngram_min_match_window_size
            <= sched.speculative_ngram_max_match_window_size,
            "--speculative-ngram-min-match-window-size must be at least 1 and at most "
            "--speculative-ngram-max-match-window-size",
        ),
        (
            sched.speculative_algorithm is None or not engine.is_embedding,
            "--speculative-algorithm drafts generated tokens: an --is-embedding server "
            "generates none",
        ),
        (0.0 < engine.memory_ratio <= 1.0, "--memory-ratio must be in (0, 1]"),
        (engine.num_pages is None or engine.num_pages >= 2, "--num-pages must be at least 2"),
        (
            0.0 < engine.swa_full_tokens_ratio <= 1.0,
            "--swa-full-tokens-ratio must be in (0, 1]",
        ),
        (engine.tensor_parallel_size >= 1, "--tp must be at least 1"),
        (
            engine.max_lora_rank is None or engine.max_lora_rank >= 1,
            "--max-lora-rank must be at least 1",
        ),
        (
            engine.max_loras is None or engine.max_loras >= max(1, len(engine.lora_modules)),
            f"--max-loras must be at least 1 and hold the {len(engine.lora_modules)} "
            "--lora-modules",
        ),
        (
            engine.max_seq_len_override is None or engine.max_seq_len_override >= 2,
            "--max-seq-len-override must be at least 2",
        ),
        (config.num_tokenizer >= 1, "--num-tokenizer must be at least 1"),
        (engine.moe_backend in MOE_BACKENDS, "--moe-backend must be auto, torch or fused"),
        (
            engine.quantization in QUANTIZATIONS,
            f"--quantization must be one of {', '.join(QUANTIZATIONS)}",
        ),
        (
            engine.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}",
        ),
        (
            config.max_queued_requests is None or config.max_queued_requests >= 0,
            "--max-queued-requests must be at least 0",
        ),
        (
            config.reasoning_parser in (None, *REASONING_PARSERS),
            f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}",
        ),
        (
            config.tool_call_parser in TOOL_CALL_PARSERS,
            f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if engine.model_path is not None and not Path(engine.model_path).expanduser().exists():
        # Checked here too, so that the command refuses it before torch loads (~4 s).
        raise ConfigError(missing_model_message(Path(engine.model_path).expanduser()))


def missing_model_message(path: Path) -> str:
    return (
        f"model path does not exist: {path} (aserve loads local folders and GGUF files; "
        "it never downloads)"
    )


def cache_root(cache_dir: Path | None = None) -> Path:
    """cache_dir, else $ASERVE_CACHE_DIR, else $XDG_CACHE_HOME/aserve, else ~/.cache/aserve."""
    if cache_dir is not None:
        return Path(cache_dir)
    if configured := os.environ.get("ASERVE_CACHE_DIR"):
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "aserve"
