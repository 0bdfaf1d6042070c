"""Vision-language checkpoints served for text: the language model of each against
transformers' whole model on text-only input (logits of a prefill and five decode steps,
greedy tokens), in both ways publishers name its tensors; the published Gemma 3 4B config,
whose text settings are mostly transformers' defaults; refusals. (An image part in a request
is a 400: tests/test_protocol.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve import LLM, SamplingParams
from aserve.config import (
    VISION_LANGUAGE_ARCHITECTURES,
    ConfigError,
    ModelConfig,
    language_model_config,
)
from aserve.engine import engine as engine_module
from aserve.layers.cpu_gemm import can_pack
from aserve.models.multimodal import (
    checkpoint_names,
    language_model_name,
    language_model_weights,
)
from tests.gguf_files import write_hf_as_gguf
from tests.test_models import PROMPTS, assert_logits_match
from tests.tiny_models import hf_greedy_tokens, make_tiny_vision_language

GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
"""google/gemma-3-4b-it's config.json as published (its text settings name six values)."""


@pytest.mark.parametrize("architecture", VISION_LANGUAGE_ARCHITECTURES)
def test_language_model_matches_transformers(architecture: str, tmp_path: Path) -> None:
    """The checkpoint as transformers saves it (the names its publishers use): the logits
    and greedy tokens of transformers' whole model given text alone."""
    hf = make_tiny_vision_language(architecture, tmp_path)
    expected = [hf_greedy_tokens(hf, prompt, 12) for prompt in PROMPTS]
    with LLM(str(tmp_path), page_size=4) as llm:
        model_config = llm.runtime.engine.model_config
        assert model_config.language_model_of == architecture
        assert model_config.architecture.endswith("ForCausalLM")
        assert_logits_match(llm, hf)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        assert [out.token_ids for out in llm.generate(PROMPTS, greedy)] == expected


def transformers_5_names(name: str) -> str:
    """A tensor's name where transformers 5 files it (`model.language_model.`, the vision
    parts under `model.`, the head at the top)."""
    first, _, rest = name.partition(".")
    if first == "language_model":
        inner, _, leaf = rest.partition(".")
        return f"model.language_model.{leaf}" if inner == "model" else rest
    return f"model.{name}"


def test_transformers_5_names_on_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 with its tensors renamed as transformers 5 files them, on torch's CPU path,
    whose tied head serves its lookups from the checkpoint's own table (memory-mapped under
    its vision-language name): transformers' logits still."""
    hf = make_tiny_vision_language("Gemma3ForConditionalGeneration", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    assert "language_model.model.embed_tokens.weight" in tensors
    save_file({transformers_5_names(n): t for n, t in tensors.items()}, str(file))
    monkeypatch.setattr(engine_module, "float_weights_on_kernels", lambda *args: None)
    with LLM(str(tmp_path), page_size=4) as llm:
        head = llm.runtime.engine.model.lm_head
        assert head is llm.runtime.engine.model.model.embed_tokens
        if can_pack(torch.empty(1)):  # where torch packs weights (MKL)
            assert head.packed is not None and head.lookup_table is not None
        assert_logits_match(llm, hf)


def test_language_model_names() -> None:
    """Each published filing maps to a text model's names; the vision side to nothing."""
    assert language_model_name("language_model.model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert language_model_name("language_model.lm_head.weight") == "lm_head.weight"
    assert language_model_name("model.language_model.norm.weight") == "model.norm.weight"
    assert language_model_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert language_model_name("lm_head.weight") == "lm_head.weight"
    for vision in (
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "multi_modal_projector.mm_input_projection_weight",
        "visual.blocks.0.attn.qkv.weight",
        "model.visual.merger.linear_fc1.weight",
        "model.vision_tower.patch_conv.weight",
    ):
        assert language_model_name(vision) is None, vision
    assert checkpoint_names("model.embed_tokens.weight", False) == ["model.embed_tokens.weight"]
    assert checkpoint_names("model.embed_tokens.weight", True) == [
        "model.embed_tokens.weight",
        "language_model.model.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
    ]


def test_published_gemma3_4b_config_takes_transformers_defaults() -> None:
    """Heads, head size, vocabulary and windows come from transformers' Gemma 3 text
    defaults; the end-of-turn id (106) and the dtype from the top level."""
    config = ModelConfig.from_hf(GEMMA3_4B, {"eos_token_id": [1, 106]})
    assert config.language_model_of == "Gemma3ForConditionalGeneration"
    assert config.architecture == "Gemma3ForCausalLM" and config.model_type == "gemma3"
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (2560, 10240, 34)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 256)
    assert config.vocab_size == 262208 and config.tie_word_embeddings
    assert set(config.eos_token_ids) == {1, 106}
    assert config.torch_dtype == "bfloat16"
    assert config.layer_windows == tuple(0 if i % 6 == 5 else 1024 for i in range(34))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.local_rope_theta == 10000.0 and config.rope_theta == 1000000.0
    assert config.attention_scale == 256**-0.5


QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 2048},
}
"""Qwen/Qwen2.5-VL-3B-Instruct's config.json as published (abridged): the text settings at
the top, no `text_config`."""


def test_published_qwen2_5_vl_config_with_text_settings_at_the_top() -> None:
    """Qwen2.5-VL's text settings at the top of its config: Qwen2's layers (Q/K/V biases),
    M-RoPE's sections read as the plain rope they are for text."""
    config = ModelConfig.from_hf(QWEN2_5_VL_3B)
    assert config.language_model_of == "Qwen2_5_VLForConditionalGeneration"
    assert (config.architecture, config.model_type) == ("Qwen2ForCausalLM", "qwen2")
    assert (config.hidden_size, config.num_layers, config.num_heads) == (2048, 36, 16)
    assert (config.num_kv_heads, config.head_dim, config.vocab_size) == (2, 128, 151936)
    assert config.qkv_bias and not config.o_bias and config.tie_word_embeddings
    assert config.rope_theta == 1000000.0 and config.rope_scaling is None
    assert config.eos_token_ids == (151645,)


def test_unsupported_language_models_are_refused() -> None:
    """A vision-language model over a language model aserve does not run: one line that
    names it."""
    llava_gpt2 = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": {"model_type": "gpt2", "n_layer": 2},
    }
    with pytest.raises(ConfigError, match="'gpt2' language model is not supported"):
        ModelConfig.from_hf(llava_gpt2)
    with pytest.raises(ConfigError, match="unsupported architecture"):
        ModelConfig.from_hf({"architectures": ["Idefics3ForConditionalGeneration"]})


def test_quantized_at_load_as_its_text_twin(tmp_path: Path) -> None:
    """`--quantization int8` on a vision-language checkpoint generates exactly what it does
    on a text checkpoint of the same language model (its config and renamed tensors)."""
    folder = tmp_path / "vision_language"
    make_tiny_vision_language("Qwen3VLForConditionalGeneration", folder)
    twin = text_twin(folder, tmp_path / "text")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for path in (folder, twin):
        with LLM(str(path), quantization="int8") as llm:
            assert llm.runtime.engine.model_config.quantization == "int8"
            outputs.append([out.token_ids for out in llm.generate(PROMPTS, greedy)])
    assert outputs[0] == outputs[1]


def text_twin(folder: Path, twin: Path) -> Path:
    """A text checkpoint of `folder`'s language model: its config as config.py reads it and
    its tensors renamed."""
    config = json.loads((folder / "config.json").read_text())
    twin.mkdir()
    text = language_model_config(config, config["architectures"][0])
    (twin / "config.json").write_text(json.dumps(text))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(dict(language_model_weights(tensors.items())), str(twin / "model.safetensors"))
    return twin


@pytest.mark.parametrize(
    "architecture", ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"]
)
def test_qwen_vl_gguf_files(architecture: str, tmp_path: Path) -> None:
    """llama.cpp's files of Qwen-VL language models (`qwen2vl`, `qwen3vl`: M-RoPE sections
    in the metadata, Qwen3-VL's deepstack count) run as Qwen2 and Qwen3: transformers'
    logits of the whole model, from the file's float32 tensors."""
    hf = make_tiny_vision_language(architecture, tmp_path / "checkpoint")
    twin = text_twin(tmp_path / "checkpoint", tmp_path / "text")
    file = write_hf_as_gguf(twin, tmp_path / "model.gguf")
    arch = "qwen3vl" if "Qwen3" in architecture else "qwen2vl"
    assert gguf.GGUFReader(file).fields["general.architecture"].contents() == arch
    with LLM(str(file), page_size=4) as llm:
        assert llm.runtime.engine.model_config.architecture == (
            "Qwen3ForCausalLM" if arch == "qwen3vl" else "Qwen2ForCausalLM"
        )
        assert_logits_match(llm, hf)
