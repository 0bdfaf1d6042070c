"""Gemma 2 and 3: sliding windows (and Gemma 2's soft caps) through chunked prefill, prefix
hits and batches, against transformers; Gemma 3's configs in both transformers' spellings;
GGUF files quantized; refusals.

tests/test_models.py and tests/test_gguf_models.py hold the logits of the tiny Gemmas
against transformers (prefill and decode, with and without aserve's CPU kernels, and from a
GGUF file); here the prompts run well past the window of 4."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, ModelConfig
from aserve.engine import engine as engine_module
from aserve.layers.norm import GemmaRMSNorm
from aserve.quant.native import NativeWeight, native_kernels
from tests.gguf_files import write_hf_as_gguf
from tests.test_gguf_models import GEMMA3_AS_LLAMA_CPP
from tests.test_models import hf_model
from tests.tiny_models import hf_greedy_tokens, make_tiny_model

LONG_PROMPTS = [list(range(7, 67, 2)), [300, 4, 4, 61, *range(100, 121)], [9, 250, 31]]
"""30, 25 and 3 tokens: the windowed layer (4 positions) reads a small part of the longer."""


@pytest.fixture(autouse=True)
def conversions_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma2", tmp_path_factory.mktemp("gemma2"))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_windows_hold_through_chunks_prefix_hits_and_batches(
    family: str, kernels: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts prefilled in chunks of 8 tokens, decoded together, then again with their
    prefixes cached and one at a time: transformers' greedy tokens every time. Gemma 2's
    scores are soft-capped at 0.5 and its logits at 2 (tests/tiny_models.py)."""
    folder: Path = request.getfixturevalue("gemma" if family == "gemma3" else family)
    if not kernels:
        monkeypatch.setattr(engine_module, "float_weights_on_kernels", lambda *args: None)
    elif not native_kernels():
        pytest.skip("the CPU kernels do not build here")
    with LLM(str(folder), page_size=4, max_prefill_length=8) as llm:
        engine = llm.runtime.engine
        assert engine.attn.windows == (4, 0)
        assert engine.attn.softcap == (0.5 if family == "gemma2" else 0.0)
        assert (engine.model_config.quantization == "float32") == kernels
        assert (engine.model.model.decode_stack is not None) == kernels  # the C++ layers
        assert_long_prompts_generate_as_transformers(llm, folder)


def assert_long_prompts_generate_as_transformers(llm: LLM, folder: Path) -> None:
    """LONG_PROMPTS decoded together (prefilled in chunks where `llm` cuts them), then again
    with their prefixes cached, then one at a time: transformers' greedy tokens every time."""
    hf = hf_model(folder)
    expected = [hf_greedy_tokens(hf, prompt, 16) for prompt in LONG_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(LONG_PROMPTS, greedy)] == expected
    planner = llm.scheduler.planner
    cached_before = planner.prompt_tokens_cached
    assert [o.token_ids for o in llm.generate(LONG_PROMPTS, greedy)] == expected
    assert planner.prompt_tokens_cached - cached_before >= 48  # 12 pages of 4
    alone = [llm.generate([prompt], greedy)[0].token_ids for prompt in LONG_PROMPTS]
    assert alone == expected
    llm.scheduler.check_integrity()


def test_transformers_4_config_reads_as_5(gemma: Path) -> None:
    """transformers 4 wrote `rope_local_base_freq`, `rope_theta`, `rope_scaling` and a window
    pattern where 5 writes `rope_parameters` by layer type and `layer_types`."""
    new = json.loads((gemma / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old |= {
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 2,
    }
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    config = ModelConfig.from_hf(new)
    assert config.layer_windows == (4, 0) and config.local_rope_theta == 10000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.attention_scale == pytest.approx(24**-0.5)
    assert config.embedding_scale == pytest.approx(8.0) and config.gemma_norms


def test_norms_hold_one_plus_the_checkpoint_weight(gemma: Path) -> None:
    """The float32 weight is 1 + w, which a norm after a bf16 input weighs in float32 before
    rounding (transformers' Gemma3RMSNorm), not after as Llama's does."""
    norm = GemmaRMSNorm(8, 1e-6)
    weight = torch.linspace(-0.5, 0.5, 8, dtype=torch.bfloat16)
    norm.load_weight("weight", weight)
    assert norm.weight.dtype == torch.float32
    assert torch.equal(norm.weight, weight.float() + 1)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    x32 = x.float()
    expected = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.float())
    assert torch.equal(norm(x), expected.to(torch.bfloat16))


@pytest.mark.skipif(not native_kernels(), reason="the CPU kernels do not build here")
def test_quantized_gguf_runs_on_the_kernels(tmp_path: Path) -> None:
    """A Q8_0 Gemma 3 file (llama.cpp's layout: norms as 1 + w, five windowed layers of six)
    runs its products on the kernels with a float16 cache, within Q8_0's rounding of the
    same file de-quantized to float32."""
    folder = make_tiny_model("gemma3", tmp_path / "gemma3", overrides=GEMMA3_AS_LLAMA_CPP)
    path = write_hf_as_gguf(folder, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)
    with LLM(str(path), page_size=4) as quantized:
        engine = quantized.runtime.engine
        products = engine.model.model.layers[0].self_attn.qkv_proj.quantized.products
        assert all(isinstance(p, NativeWeight) for p in products)
        assert engine.pool.storage_dtype == torch.float16
        assert engine.attn.windows == (4, 4, 4, 4, 4, 0)
        ours = quantized.generate(LONG_PROMPTS, params)
    with LLM(str(path), page_size=4, quantization="none") as float32:
        reference = float32.generate(LONG_PROMPTS, params)
    for got, want in zip(ours, reference):
        first = [t.logprob for t in got.logprobs][0]
        assert first == pytest.approx([t.logprob for t in want.logprobs][0], abs=0.05)
        assert got.token_ids[:4] == want.token_ids[:4]


def test_other_activations_are_refused(gemma: Path) -> None:
    """The GPU refusals (FA3 with windows or soft caps) are in tests/test_gpu.py."""
    config = json.loads((gemma / "config.json").read_text())
    with pytest.raises(ConfigError, match="activation 'relu'"):
        ModelConfig.from_hf({**config, "hidden_activation": "relu"})


def test_gemma2_config_reads_its_caps_and_windows(gemma2: Path) -> None:
    """Gemma 2 windows every other layer from the first (transformers 4's configs hold no
    `layer_types`), takes one rope for all layers, and reads both soft caps."""
    config = json.loads((gemma2 / "config.json").read_text())
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    for spelling in (config, {**old, "rope_theta": 10000.0, "num_hidden_layers": 4}):
        model = ModelConfig.from_hf(spelling)
        assert model.layer_windows == (4, 0) * (model.num_layers // 2)
        assert (model.attention_softcap, model.logit_softcap) == (0.5, 2.0)
        assert model.local_rope_theta is None and model.rope_theta == 10000.0
        assert model.attention_scale == 24**-0.5 and model.gemma_norms
        assert not model.qk_norm


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's turn markers, its generation prompt written by an expression (as its own template
does: Jinja drops a template's last newline)."""


def sentencepiece_vocabulary(writer: gguf.GGUFWriter) -> None:
    """A 320-token SentencePiece vocabulary as llama.cpp writes Gemma's: specials, the 256
    byte tokens, then pieces with scores; no merges (transformers rebuilds them)."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "he", "ll", "or", "ld", "wor"]
    pieces += ["\u2581w", "\u2581wor", "\u2581world"]  # the merges' path to "\u2581world"
    tokens = specials + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    tokens += [f"\u2581x{i}" for i in range(320 - len(tokens))]
    control, byte, normal = 3, 6, 1  # llama.cpp's token types
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([control] * 6 + [byte] * 256 + [normal] * (len(tokens) - 262))
    writer.add_add_bos_token(True)
    writer.add_chat_template(GEMMA_TEMPLATE)


def test_gguf_with_gemmas_vocabulary_chats(tmp_path: Path) -> None:
    """A Gemma 3 file's SentencePiece vocabulary and chat template become the server's
    tokenizer at conversion: the rendered turn, pieces, byte fallbacks (the newline) and
    specials as Gemma's tokenizer gives them."""
    folder = make_tiny_model("gemma3", tmp_path / "gemma3", overrides=GEMMA3_AS_LLAMA_CPP)
    path = write_hf_as_gguf(folder, tmp_path / "g.gguf", vocabulary=sentencepiece_vocabulary)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(path), page_size=4) as llm:
        out = llm.chat([{"role": "user", "content": "hello world"}], params)[0]
    newline, u, s, e, r, m, o, d, ell = 16, 283, 281, 267, 280, 275, 277, 266, 274
    he, ll, world = 289, 290, 296
    assert out.prompt_token_ids == [
        *(1, 4, u, s, e, r, newline),  # <bos><start_of_turn>user\n
        *(he, ll, o, world, 5, newline),  # hello world<end_of_turn>\n
        *(4, m, o, d, e, ell, newline),  # <start_of_turn>model\n
    ]
    assert len(out.token_ids) == 4


def test_flashinfer_takes_one_window_size() -> None:
    """FlashInfer fixes a plan's window: layers' windows of one size (0: none) plan one
    windowed wrapper; two sizes are refused in one line."""
    from aserve.attention.flashinfer import window_of

    assert window_of((4, 4, 0, 4)) == 4 and window_of((0, 0)) == 0 and window_of(()) == 0
    with pytest.raises(ConfigError, match=r"windows of \[4, 8\]"):
        window_of((4, 8, 0))
