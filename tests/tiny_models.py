"""Tiny random Hugging Face checkpoints of every supported family, written to disk.

Shapes are small enough for a 2-core CPU but keep what distinguishes the families: grouped
query attention, Qwen2's QKV bias, Qwen3's per-head Q/K norm and explicit head_dim, Llama-3
rope scaling, tied or untied embeddings, Qwen3-MoE's routed experts next to a dense MLP
layer (`mlp_only_layers`), Gemma 3's windowed and whole layers with their own ropes,
scaled scores, sandwich norms and GELU, Gemma 2's soft-capped scores and logits, gpt-oss's
attention sinks, biases, YaRN rope, windows and experts with biases and a clamped SwiGLU,
SmolLM3's layers without rope, Phi-3's fused projections, partial rotation and LongRoPE, Granite's
multipliers (on experts too, GraniteMoe's, stacked in the checkpoint), Mixtral's experts under
their own names, and GLM-4.5's and dots.llm1's sigmoid-routed experts (in groups: dots.llm1's)
beside shared ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3": {"rope_theta": 1000000.0, "tie_word_embeddings": True, "head_dim": 32},
    "mistral": {"rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": None},
    "gemma3": {
        # one windowed layer, one whole; prompts of tests run past the window of 4
        "head_dim": 32,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    },
    "gemma2": {
        # a windowed layer, a whole one; caps low enough that the random scores and logits
        # reach them (Gemma 2's own: 50 and 30)
        "head_dim": 32,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 0.5,
        "final_logit_softcapping": 2.0,
        "tie_word_embeddings": True,
    },
    "gpt_oss": {
        # a windowed layer, a whole one; a clamp low enough that gate and up values reach it
        "head_dim": 16,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "swiglu_limit": 1.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    "smollm3": {
        # the second layer takes no rotary position (SmolLM3's every fourth in its 36)
        "rope_theta": 2000000.0,
        "tie_word_embeddings": True,
        "no_rope_layers": [1, 0],
        "pad_token_id": 0,  # its default, 128004, is past the tiny vocabulary
    },
    "phi3": {
        # Phi-4-mini's quirks: fused projections, three quarters of a head rotating (heads of
        # 16), LongRoPE; the context served is the original one, so its short factors are
        # taken as by transformers (tests/test_phi3.py runs the long ones past 64 positions)
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 512,
        "rope_scaling": None,  # phi3_rope(16), set below
        "tie_word_embeddings": True,
        "pad_token_id": 0,  # its default, 32000, is past the tiny vocabulary
    },
    "granite": {
        # Granite 3's multipliers, away from 1 so that each shows
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.22,
        "logits_scaling": 4.0,
    },
    "granitemoe": {
        # Granite's multipliers on Mixtral-like experts: 4 of intermediate_size, 2 a token,
        # stacked in the checkpoint (input_linear, output_linear) under a `router.layer`
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.22,
        "logits_scaling": 4.0,
    },
    "glm4": {
        # GLM-4-0414's layers: norms before and after attention and the MLP (plain weights),
        # half of a head rotating in neighbouring pairs, Q/K/V biases, fused gate|up
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,  # its default, 151329, is past the tiny vocabulary
    },
    "olmoe": {
        # Llama's layers with OLMo's Q/K norms across heads and experts as wide as
        # `intermediate_size`, their softmax weights not renormalised
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
    "olmo2": {
        # norms after attention and the MLP only; Q and K norms across all heads
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "olmo3": {
        # OLMo 2's layers, three of four reading the last 4 positions with a plain rope;
        # YaRN on the whole one
        "num_hidden_layers": 4,
        "sliding_window": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    "exaone4": {
        # OLMo 2's norms with Q/K norms a head; three layers of four read the last 4
        # positions, the fourth takes no rotary position
        "num_hidden_layers": 4,
        "sliding_window": 4,
        "sliding_window_pattern": 4,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen2_moe": {
        # Qwen2's QKV biases; experts in layers 2 and 3 (every second, not the third: mlp_only),
        # each beside a shared expert weighed by its sigmoid gate; weights not renormalised
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "norm_topk_prob": False,
    },
    "mixtral": {
        # every layer sparse: 4 experts of intermediate_size, 2 a token
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    "glm4_moe": {
        # GLM-4.5's layers: a dense first layer, then 8 experts (2 a token, chosen by sigmoid
        # scores plus a bias, weighed by the scores times 2.5) beside an ungated shared one;
        # Q/K/V biases, Q/K norms (GLM-4.5's, not Air's), half of a head rotating in halves
        "head_dim": 16,
        "num_hidden_layers": 3,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    },
    "dots1": {
        # dots.llm1's layers: Qwen3's attention, a dense first layer, then 8 experts in 4
        # groups (2 a token from the best 2 groups, by sigmoid scores plus a bias, weighed
        # by the scores times 2.0, not renormalised) beside two shared ones, ungated
        "head_dim": 16,
        "num_hidden_layers": 3,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.0,
        "norm_topk_prob": False,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    },
    "deepseek_v2": {
        # DeepSeek-V2-Lite's layers: queries projected directly, a latent of 32 and a shared
        # rotating key part of 8 (interleaved pairs, YaRN with mscale), heads of 12 + 8
        # query dimensions and 16 of value; a dense first layer, then 8 experts (2 a token
        # from the best 2 of 4 groups by their best softmax score, weights times 1.5, not
        # renormalised) beside 2 shared ones
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,  # transformers' MLA repeats keys by the ratio to the heads
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "group_limited_greedy",
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    },
    "deepseek_v3": {
        # DeepSeek-V3's layers: queries through a normalised rank-24 row, the rest as V2's
        # but routed by sigmoid scores plus a bias within the best 2 of 4 groups, weights
        # renormalised then times 2.5, beside one shared expert
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    },
    "qwen3_5": {
        # linear attention (Gated DeltaNet) in two layers of three, its key heads each
        # serving two value heads of another width; gated attention with a quarter of a
        # head rotating in the third
        "head_dim": 32,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 24,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "head_dim": 32,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
}


FAMILIES["qwen3_5_moe"] = {
    **FAMILIES["qwen3_5"],
    # Qwen3.5's layers with Qwen2-MoE's kind of experts (renormalised) in each
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

FAMILIES["qwen3_next"] = {
    # Qwen3.5-MoE's layers with the linear attention's projections grouped by key head
    **{k: v for k, v in FAMILIES["qwen3_5_moe"].items() if k != "rope_parameters"},
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "norm_topk_prob": True,
}

MLA_GPU_SHAPES = {
    "hidden_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 8,  # every expert: bf16 rounding cannot flip a routing
}
"""The published latent widths that FlashInfer's MLA kernels are built for, on a tiny model."""


def phi3_rope(head_dim: int) -> dict[str, Any]:
    """LongRoPE factors for the tiny Phi-3's three quarters of a `head_dim` head, rising
    from 1 over the rotating pairs (short) and further (long)."""
    pairs = torch.linspace(0, 1, head_dim * 3 // 8)
    return {
        "rope_type": "longrope",
        "short_factor": (1 + 1.5 * pairs).tolist(),
        "long_factor": (1 + 8 * pairs).tolist(),
    }


FAMILIES["phi3"]["rope_scaling"] = phi3_rope(16)


def make_tiny_model(
    family: str, folder: Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Random weights for `family`, saved as safetensors with its config.json; `overrides`
    change shapes (GPU kernels want head dims of 64 or more). With `num_labels` or
    `id2label` among them, transformers' `*ForSequenceClassification` of the family."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "smollm3": transformers.SmolLM3Config,
        "phi3": transformers.Phi3Config,
        "granite": transformers.GraniteConfig,
        "granitemoe": transformers.GraniteMoeConfig,
        "mixtral": transformers.MixtralConfig,
        "olmo2": transformers.Olmo2Config,
        "olmoe": transformers.OlmoeConfig,
        "glm4": transformers.Glm4Config,
        "glm4_moe": transformers.Glm4MoeConfig,
        "dots1": transformers.Dots1Config,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
        "olmo3": transformers.Olmo3Config,
        "exaone4": transformers.Exaone4Config,
        "gpt_oss": transformers.GptOssConfig,
        "qwen3_5": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
    }[family]
    config = config_cls(**{**COMMON, **FAMILIES[family], **(overrides or {})})
    torch.manual_seed(seed)
    if {"num_labels", "id2label"} & set(overrides or {}):  # a classifier's labels
        kind = transformers.AutoModelForSequenceClassification
    else:
        kind = transformers.AutoModelForCausalLM
    model = kind.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name == "score.weight":  # a classifier's: logits that tell labels apart
                param.normal_(0.0, 1.0)
            elif ".mlp.gate." in name or ".router." in name or name.endswith("sinks"):
                param.normal_(0.0, 0.5)
            elif any(p in name for p in (".mlp.experts.", ".block_sparse_moe.experts.", "shared_")):
                param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # moves the choice, not the weights
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def hf_greedy_tokens(
    hf: torch.nn.Module, prompt: list[int], max_new_tokens: int, **inputs: Any
) -> list[int]:
    """Transformers' greedy continuation of one prompt, EOS ignored (the reference tokens);
    `inputs` go to `generate` too (a vision-language model's `pixel_values`, a penalty)."""
    out = hf.generate(  # type: ignore[operator]
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **inputs,
    )
    return out[0, len(prompt) :].tolist()


VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
"""A one-layer vision encoder's shared settings."""


def vision_language_config(architecture: str, overrides: dict[str, Any] | None = None) -> Any:
    """Transformers' config of a tiny vision-language model whose language model is the
    tiny text family it is built on (Qwen's with M-RoPE sections over its head); `overrides`
    change the language model's settings."""
    import transformers

    def text(family: str, model_type: str, **extra: Any) -> dict[str, Any]:
        base = {**COMMON, **FAMILIES.get(family, {}), "model_type": model_type, **extra}
        return {**base, **(overrides or {})}

    encoder = {**VISION, "num_hidden_layers": 1, "image_size": 28, "patch_size": 14}
    qwen_encoder = {"depth": 1, "num_heads": 2, "hidden_size": 32, "intermediate_size": 64}
    special = {"image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302}
    if architecture == "Gemma3ForConditionalGeneration":
        return transformers.Gemma3Config(  # images of 2 x 2 patches, one feature each
            text_config=text("gemma3", "gemma3_text"),
            vision_config=encoder,
            mm_tokens_per_image=4,
            image_token_index=300,
            boi_token_index=310,
            eoi_token_index=315,
        )
    if architecture == "Mistral3ForConditionalGeneration":
        return transformers.Mistral3Config(
            text_config=text("mistral", "mistral"),
            vision_config={**encoder, "head_dim": 16},
            image_token_index=300,
        )
    if architecture == "LlavaForConditionalGeneration":
        return transformers.LlavaConfig(
            text_config=text("llama", "llama"),
            vision_config={**encoder, "model_type": "clip_vision_model", "projection_dim": 32},
            image_token_index=300,
        )
    if architecture == "Qwen2VLForConditionalGeneration":
        sections = {"type": "mrope", "mrope_section": [2, 3, 3]}  # heads of 16
        language = text("qwen2", "qwen2_vl_text", rope_scaling=sections)
        width = language["hidden_size"]  # the tower's features are the language model's width
        return transformers.Qwen2VLConfig(
            text_config=language,
            vision_config={"depth": 1, "embed_dim": 32, "hidden_size": width, "num_heads": 2},
            **special,
        )
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        sections = {"type": "mrope", "mrope_section": [2, 3, 3]}
        language = text("qwen2", "qwen2_5_vl_text", rope_scaling=sections)
        width = language["hidden_size"]
        return transformers.Qwen2_5_VLConfig(
            text_config=language,
            vision_config={**qwen_encoder, "out_hidden_size": width, "fullatt_block_indexes": [0]},
            **special,
        )
    if architecture == "Qwen3VLForConditionalGeneration":
        # heads of 32 (FAMILIES' Qwen3): 16 pairs, 4 of each spatial coordinate in turn
        sections = {"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True}
        language = text("qwen3", "qwen3_vl_text", rope_scaling=sections)
        tower = {
            **qwen_encoder,
            "depth": 2,
            "out_hidden_size": language["hidden_size"],
            "patch_size": 14,  # (16 as published) the Qwen2-VL tests' image sizes
            "num_position_embeddings": 64,  # an 8 x 8 grid, interpolated to each image's
            "deepstack_visual_indexes": [0, 1],  # added after the language model's layers 0, 1
        }
        return transformers.Qwen3VLConfig(text_config=language, vision_config=tower, **special)
    if architecture == "Qwen3VLMoeForConditionalGeneration":
        base = vision_language_config("Qwen3VLForConditionalGeneration", overrides).to_dict()
        experts = {k: v for k, v in FAMILIES["qwen3_moe"].items() if k != "norm_topk_prob"}
        # experts of 16: gate_up [E, 32, 64] tells its orientation (publish_transposed_experts)
        experts["moe_intermediate_size"] = 16
        language = {**base["text_config"], **experts, "model_type": "qwen3_vl_moe_text"}
        return transformers.Qwen3VLMoeConfig(
            text_config={**language, **(overrides or {})},
            vision_config=base["vision_config"],
            **special,
        )
    if architecture in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        # a quarter of each 32-wide head rotates: 4 pairs, 2 of time, 1 each of height, width
        rope = {
            **FAMILIES["qwen3_5"]["rope_parameters"],
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        moe = architecture.startswith("Qwen3_5Moe")
        family, kind = ("qwen3_5_moe", "qwen3_5_moe_text") if moe else ("qwen3_5", "qwen3_5_text")
        language = text(family, kind, rope_parameters=rope)
        tower = {
            **qwen_encoder,
            "out_hidden_size": language["hidden_size"],
            "patch_size": 14,
            "num_position_embeddings": 64,
        }
        whole = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        return whole(text_config=language, vision_config=tower, **special)
    raise ValueError(f"no tiny {architecture}")


def save_llava(text: dict[str, Any], vision: dict[str, Any], folder: Path) -> torch.nn.Module:
    """A tiny LLaVA of these language and vision settings, its tower's last layer and every
    patch kept (LLaVA-Interleave's and Pixtral 12B's layouts), matrices and biases drawn
    wide as `make_tiny_vision_language` draws them, saved; returns the model."""
    import transformers

    config = transformers.LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=300,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" not in name and (param.dim() == 2 or name.endswith("bias")):
                param.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    return hf.eval()


def make_tiny_vision_language(
    architecture: str, folder: Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> torch.nn.Module:
    """A tiny random vision-language checkpoint saved as transformers saves it (the names
    its publishers use); returns the model, the reference for its language model. Matrices
    are drawn wider than transformers' default (std 0.02), with which the language model's
    greedy tokens repeat one id and an image barely moves the logits."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(vision_language_config(architecture, overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias") or param.dim() in (2, 3):  # 3: stacked experts
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model.eval()


def publish_transposed_experts(folder: Path) -> None:
    """Rewrite a saved Qwen3-VL-MoE's stacked experts as Qwen publishes them: each expert's
    products transposed (`gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`; transformers
    saves its modules' `[E, 2I, H]` / `[E, H, I]` and loads either)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor.transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image> {% else %}{{ p['text'] }} {% endif %}"
    "{% endfor %}{% endif %} </s> {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)
"""A LLaVA-like template for the word-level tokenizer: an image part becomes `<image>`."""


def write_word_tokenizer(
    folder: Path,
    vocab_size: int,
    image_token: int | None = None,
    specials: dict[int, str] | None = None,
) -> None:
    """A word-level tokenizer of `vocab_size` words `w0`... (`<s>` and `</s>` at the tiny
    models' BOS and EOS ids 1 and 2, `<image>` at `image_token` and `user`, `assistant`,
    `system` after it, `specials` at their ids), words split at spaces, and
    `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size)]
    words[1], words[2] = "<s>", "</s>"
    if image_token is not None:
        words[image_token] = "<image>"
        for offset, role in enumerate(("user", "assistant", "system"), start=1):
            words[image_token + offset] = role
    for token, word in (specials or {}).items():
        words[token] = word
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="w0"
    )
    if image_token is not None:
        special = ["<image>", *(specials or {}).values()]
        tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
