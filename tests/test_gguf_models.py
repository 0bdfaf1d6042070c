"""GGUF files of each family, written as llama.cpp writes them, against transformers on the
Hugging Face weights they came from; and the rope scalings those files and configs carry."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, ModelConfig
from aserve.layers.moe import QuantizedExperts
from aserve.layers.rotary import RotaryEmbedding
from aserve.models.source import ModelSourceError, resolve_model
from aserve.models.weights import load_hf_config
from tests.gguf_files import write_hf_as_gguf
from tests.test_models import PROMPTS, assert_logits_match, hf_model, our_logits
from tests.test_quant import needs_kernels
from tests.tiny_models import hf_greedy_tokens, make_tiny_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.fixture(autouse=True)
def conversions_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))


MOE_LAYERS = {"mlp_only_layers": []}
"""llama.cpp's qwen3moe has no dense layers among the sparse ones."""
GEMMA3_AS_LLAMA_CPP = {
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "query_pre_attn_scalar": 32,
}
"""llama.cpp's gemma3 windows five layers of six and scales scores by 1 / sqrt(head_dim)
(below 62 layers), whatever the checkpoint said: its files do not hold either."""
GEMMA2_AS_LLAMA_CPP = {"query_pre_attn_scalar": 32}
"""llama.cpp's gemma2 scales scores by 1 / sqrt(head_dim) below 46 layers (and windows every
other layer from the first, as the tiny model does)."""
SMOLLM3_AS_LLAMA_CPP = {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}
"""llama.cpp's SmolLM3 takes rope from every fourth layer, whatever the checkpoint said."""
DOTS1_AS_LLAMA_CPP = {"n_group": 1, "topk_group": 1}
"""llama.cpp's dots1 files hold no expert groups (dots.llm1's own config has one)."""
OVERRIDES = {
    "qwen3_moe": MOE_LAYERS,
    "dots1": DOTS1_AS_LLAMA_CPP,
    "qwen2_moe": MOE_LAYERS,
    "gemma2": GEMMA2_AS_LLAMA_CPP,
    "gemma3": GEMMA3_AS_LLAMA_CPP,
    "smollm3": SMOLLM3_AS_LLAMA_CPP,
}


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen2_moe",
        "gemma2",
        "gemma3",
        "smollm3",
        "phi3",
        "granite",
        "granitemoe",
        "mixtral",
        "olmo2",
        "olmo3",
        "olmoe",
        "exaone4",
        "glm4",
        "glm4_moe",
        "dots1",
        "deepseek_v2",
        "deepseek_v3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
    ],
)
def test_gguf_of_each_family_matches_transformers(family: str, tmp_path: Path) -> None:
    """The tiny llama has Llama-3 scaling, which reaches the file as `rope_freqs` only; the
    Qwen3-MoE file stacks each layer's experts into one tensor a part; the Gemma files'
    norms hold 1 + w, and Gemma 2's soft caps are metadata; the SmolLM3 file's queries and
    keys are in llama.cpp's row order and its fourth layer takes no rope, as llama.cpp fixes
    it; the Phi-3 file keeps Q|K|V and gate|up fused, and its LongRoPE factors as tensors;
    the OLMo 2 file's norms after attention and the MLP are `post_attention_norm` and
    `post_ffw_norm`, and an OLMo 3 file is llama.cpp's olmo2 with a window (three layers of
    four, unscaled rope there) and YaRN; the OLMoE file's experts are `feed_forward_length`
    wide (llama.cpp writes no `expert_feed_forward_length` for it) and its chosen experts'
    weights are not renormalised; the GLM-4 file's four norms a layer are Gemma 2's names
    with plain weights, its gate|up fused, and half a head rotates in neighbouring pairs
    (`rope.dimension_count`); the GLM-4.5 file holds a prediction layer after the last
    (`nextn_predict_layers`, counted in `block_count`), which is not loaded, its routing in
    `expert_gating_func`, `expert_weights_scale` and `exp_probs_b`, and its first layer
    dense (`leading_dense_block_count`); the dots.llm1 file is the same without the
    prediction layer and with Qwen3's attention; the DeepSeek files hold latent attention
    as llama.cpp's MLA rework writes it (`kv_b_proj` apart in `attn_k_b` and `attn_v_b`,
    the widths of a query head and a value in `*_length_mla`, YaRN's `mscale_all_dim` as a
    log multiplier), experts by softmax (V2) or sigmoid (V3, `exp_probs_b`) scores in
    groups; the Qwen3.5 file holds its linear attention under llama.cpp's SSM names and
    keys, `A_log` as -exp(A_log), its zero-centred norms as 1 + w, and its value heads in
    llama.cpp's order in every tensor that lists them (Qwen3-Next's in its checkpoint's
    order, its queries, keys and values split from `in_proj_qkvz` into `attn_qkv` and its
    gates into `attn_gate`, its betas and decays grouped by key head in `ssm_ba`)."""
    folder = make_tiny_model(family, tmp_path / family, overrides=OVERRIDES.get(family))
    model = write_hf_as_gguf(folder, tmp_path / f"{family}.gguf")
    hf = hf_model(folder)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(model), page_size=4) as llm:
        assert_logits_match(llm, hf)
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy_tokens(hf, prompt, 10)


def test_llama3_rope_factors_take_effect(tmp_path: Path) -> None:
    """Without `rope_freqs` the same weights miss transformers' logits: the factors are what
    made the file above match, not a scaling too weak to show (a 50-token prompt, whose slow
    rotary pairs turn far enough for it)."""
    folder = make_tiny_model("llama", tmp_path / "llama")
    prompt, continuation = list(range(3, 300, 6)), [7, 123, 45]
    with torch.inference_mode():
        theirs = hf_model(folder)(torch.tensor([prompt + continuation])).logits[0, 49:]
    for factors in (True, False):
        model = write_hf_as_gguf(folder, tmp_path / f"{factors}.gguf", rope_factors=factors)
        with LLM(str(model), page_size=4) as llm:
            ours = our_logits(llm, prompt, continuation)
        if factors:
            torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
        else:
            assert (ours - theirs).abs().max() > 2e-3
    config = ModelConfig.from_hf(*load_hf_config(resolve_model(str(tmp_path / "True.gguf"))))
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "freq_factors"
    assert len(config.rope_scaling["factors"]) == config.head_dim // 2


def test_rope_factors_of_the_wrong_size_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 64)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_head_count(4)
    writer.add_context_length(64)
    writer.add_tensor("rope_freqs.weight", np.ones(5, np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match="rope_freqs.weight should be 8 F32 values"):
        resolve_model(str(path))


def test_yarn_matches_transformers(tmp_path: Path) -> None:
    """Qwen's long-context setting, from a config.json and from a GGUF's metadata."""
    folder = make_tiny_model("qwen3", tmp_path / "qwen3", overrides={"rope_scaling": YARN})
    hf = hf_model(folder)
    model = write_hf_as_gguf(folder, tmp_path / "yarn.gguf")
    for source in (folder, model):
        with LLM(str(source), page_size=4) as llm:
            scaling = llm.runtime.engine.model_config.rope_scaling
            assert scaling is not None and scaling["rope_type"] == "yarn"
            assert_logits_match(llm, hf)


def test_yarn_scales_cos_and_sin_by_its_attention_factor() -> None:
    plain = RotaryEmbedding(16, 8, 10000.0, None)
    yarn = RotaryEmbedding(16, 8, 10000.0, {**YARN, "attention_factor": 1.5})
    # The fastest pair is kept by YaRN: only the attention factor changes it.
    torch.testing.assert_close(yarn.cos_sin[:, 0], 1.5 * plain.cos_sin[:, 0])
    stated = RotaryEmbedding(16, 8, 10000.0, YARN)
    assert stated.cos_sin[0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)) + 1)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "dynamic"}, "rope scaling 'dynamic' is not supported; aserve runs"),
        ({"rope_type": "yarn", "factor": 4.0}, "yarn rope scaling needs original_max_position"),
    ],
)
def test_unsupported_rope_scaling_is_one_line(
    scaling: dict[str, object], message: str, tmp_path: Path
) -> None:
    config, generation = load_hf_config(make_tiny_model("qwen3", tmp_path / "qwen3"))
    config.pop("rope_parameters", None)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**config, "rope_scaling": scaling}, generation)


@needs_kernels
def test_quantized_moe_gguf_keeps_its_experts_in_blocks(tmp_path: Path) -> None:
    """A Q8_0 Qwen3-MoE file runs its experts quantized (about a byte a weight, not float32's
    four; outside CUDA graphs; a step's chosen experts in one call of the CPU kernels for
    gate|up and one for down), with the logits of its de-quantized
    float32 twin (`--quantization none`) up to the order of float sums and, on CPUs where the
    kernels round activations to 16 bits, that rounding (~2e-4 here; both with a float32 KV
    cache: a quantized model's is float16 on CPU by default)."""
    folder = make_tiny_model("qwen3_moe", tmp_path / "moe", overrides=MOE_LAYERS)
    model = write_hf_as_gguf(folder, tmp_path / "moe.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    logits = []
    for quantization in ("auto", "none"):
        options = {"quantization": quantization, "kv_cache_dtype": "float32"}
        with LLM(str(model), page_size=4, **options) as llm:
            experts = llm.runtime.engine.model.model.layers[0].mlp.experts
            assert isinstance(experts, QuantizedExperts) == (quantization == "auto")
            if isinstance(experts, QuantizedExperts):
                weights = 8 * 3 * 32 * 64  # 8 experts' gate, up and down, 32 x 64 each
                assert weights < experts.nbytes < 1.5 * weights
                # a decode step's chosen experts go to the kernels in one call
                assert experts.gate_up.native is not None and experts.down.native is not None
                assert not llm.runtime.engine.model.graph_capturable
            logits.append(torch.cat([our_logits(llm, p, [7, 123, 45]) for p in PROMPTS]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-3, rtol=1e-3)
