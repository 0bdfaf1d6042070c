"""Phi-3 (Phi-3.5-mini, Phi-4-mini): fused checkpoint projections, a partly rotating head and
LongRoPE's two sets of factors, against transformers.

tests/test_models.py holds the tiny Phi-3 at its original context (short factors) with the
other families; here the context runs past it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, ModelConfig
from aserve.engine import engine as engine_module
from aserve.layers import rotary as rotary_module
from aserve.layers.rotary import RotaryEmbedding, partial_rotary_order
from aserve.quant.native import native_kernels
from tests.gguf_files import write_hf_as_gguf
from tests.test_models import hf_model, our_logits
from tests.tiny_models import hf_greedy_tokens, make_tiny_model

LONG_CONTEXT = {"original_max_position_embeddings": 64}
"""The tiny Phi-3 trained on 64 positions, served on 512: LongRoPE's long factors, cos and
sin grown by sqrt(1 + ln 8 / ln 64)."""
PROMPT = list(range(3, 300, 4))  # 75 tokens: transformers takes the long factors past 64


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("phi3", tmp_path_factory.mktemp("phi3"), overrides=LONG_CONTEXT)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_long_factors_past_the_original_context(
    phi3: Path, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served on 512 positions, the model rotates by the long factors, as transformers does
    for a sequence past the original 64: logits within 2e-4 over a chunked prefill and five
    decode steps, and greedy tokens alike."""
    if not kernels:
        monkeypatch.setattr(engine_module, "float_weights_on_kernels", lambda *args: None)
    elif not native_kernels():
        pytest.skip("the CPU kernels do not build here")
    hf = hf_model(phi3)
    continuation = [7, 123, 45, 2, 99]
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT + continuation])).logits[0, len(PROMPT) - 1 :]
    with LLM(str(phi3), page_size=4, max_prefill_length=32) as llm:
        torch.testing.assert_close(
            our_logits(llm, PROMPT, continuation), theirs, atol=2e-4, rtol=1e-4
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        assert llm.generate([PROMPT], greedy)[0].token_ids == hf_greedy_tokens(hf, PROMPT, 12)


def test_gguf_holds_the_long_factors(phi3: Path, tmp_path: Path) -> None:
    """A Phi-3 file as llama.cpp writes it (fused projections, the factors as tensors, the
    original context and attention factor in its metadata, the rotating part as the rope's
    dimension count) runs as its checkpoint: transformers' logits past the original
    context."""
    model = write_hf_as_gguf(phi3, tmp_path / "phi3.gguf")
    hf = hf_model(phi3)
    continuation = [7, 123, 45]
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT + continuation])).logits[0, len(PROMPT) - 1 :]
    with LLM(str(model), page_size=4) as llm:
        config = llm.runtime.engine.model_config
        assert config.rotary_dim == 12 and config.rope_scaling is not None
        assert config.rope_scaling["rope_type"] == "longrope"
        torch.testing.assert_close(
            our_logits(llm, PROMPT, continuation), theirs, atol=2e-4, rtol=1e-4
        )


def test_short_factors_within_the_original_context(phi3: Path) -> None:
    """Served on at most the original 64 positions, the short factors (and still the
    attention factor of the 512 the model states): transformers' logits on a short prompt;
    the long factors miss them."""
    hf = hf_model(phi3)
    prompt, continuation = [5, 17, 42, 9, 100, 3, 77, 12, 250, 31, 8], [7, 123, 45]
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 :]
    with LLM(str(phi3), page_size=4, max_seq_len_override=64) as llm:
        torch.testing.assert_close(
            our_logits(llm, prompt, continuation), theirs, atol=2e-4, rtol=1e-4
        )
    with LLM(str(phi3), page_size=4) as llm:
        assert (our_logits(llm, prompt, continuation) - theirs).abs().max() > 1e-3


def test_rows_reordered_for_the_partial_rotation(
    phi3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the query and key rows in `partial_rotary_order` the same tables rotate the
    wrong pairs: the logits part from transformers'."""
    hf = hf_model(phi3)
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT])).logits[0, -1:]
    identity = lambda head_dim, rotary_dim, interleaved: torch.arange(head_dim)  # noqa: E731
    monkeypatch.setattr("aserve.models.decoder.partial_rotary_order", identity)
    with LLM(str(phi3), page_size=4) as llm:
        assert (our_logits(llm, PROMPT, []) - theirs).abs().max() > 2e-3  # 10x the tolerance


def test_whole_head_rotation_of_reordered_rows_is_the_partial_rotation() -> None:
    """Hugging Face's partial rotate-half (the first 12 of 16 dimensions) equals the whole
    head's rotation by aserve's table of the reordered dimensions, reordered back."""
    head_dim, rotary_dim, position = 16, 12, 37
    x = torch.randn(head_dim, generator=torch.Generator().manual_seed(0))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = position * inv_freq
    cos, sin = torch.cat((angles.cos(),) * 2), torch.cat((angles.sin(),) * 2)
    part, rest = x[:rotary_dim], x[rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat((-part[half:], part[:half]))
    expected = torch.cat((part * cos + turned * sin, rest))
    table = RotaryEmbedding(head_dim, 64, 10000.0, None, rotary_dim=rotary_dim)
    order = partial_rotary_order(head_dim, rotary_dim)
    rotated = x[order].clone()[None]
    table(torch.tensor([position]), rotated, head_dim)
    torch.testing.assert_close(rotated[0][torch.argsort(order)], expected)


def test_configs_read_their_rope(phi3: Path) -> None:
    """transformers 4's Phi-3 configs keep `partial_rotary_factor` and the original context
    at the top, 5's also in `rope_parameters`; a sliding window caps the context (Phi-3-mini-
    4k's 2,047), as Mistral's does."""
    config = json.loads((phi3 / "config.json").read_text())
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    old["rope_scaling"] = {
        "type": "longrope",
        "short_factor": config["rope_parameters"]["short_factor"],
        "long_factor": config["rope_parameters"]["long_factor"],
    }
    for spelling in (config, old):
        model = ModelConfig.from_hf(spelling)
        assert model.rotary_dim == 12 and model.head_dim == 16
        assert model.rope_scaling is not None
        assert model.rope_scaling["original_max_position_embeddings"] == 64
        assert model.rope_scaling["factor"] == 8.0
    assert ModelConfig.from_hf({**old, "sliding_window": 32}).max_position_embeddings == 32
    short = {**old["rope_scaling"], "short_factor": [1.0] * 5}
    with pytest.raises(ConfigError, match="short_factor holds 5 values; the 12 rotating"):
        ModelConfig.from_hf({**old, "rope_scaling": short})
    _, attention = rotary_module.rope_frequencies(12, 10000.0, model.rope_scaling, 512)
    assert attention == pytest.approx(
        (1 + torch.log(torch.tensor(8.0)) / torch.log(torch.tensor(64.0))) ** 0.5
    )
