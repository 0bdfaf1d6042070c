"""gpt-oss: attention sinks and sliding windows through chunked prefill, prefix hits and
batches, against transformers; its configs in both transformers' spellings; GGUF files as
llama.cpp writes them, float and with MXFP4 experts on aserve's CPU kernels.

tests/test_models.py holds the logits of the tiny gpt-oss against transformers (prefill and
decode); tests/test_cpu_ops.py the sinks in the CPU kernels' attention; tests/test_tp.py
its tensor-parallel run. Here the prompts run well past the window of 4."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ExpertStyle, ModelConfig
from aserve.layers.moe import QuantizedExperts, activate
from aserve.quant.native import native_kernels
from tests.gguf_files import write_hf_as_gguf
from tests.test_gemma import LONG_PROMPTS
from tests.test_models import hf_model, our_logits
from tests.tiny_models import hf_greedy_tokens, make_tiny_model

LLAMA_CPP_CLAMP = {"swiglu_limit": 7.0}
"""llama.cpp's gpt-oss graph clamps at 7 whatever the checkpoint says (its files do not
carry the limit): the tiny model's GGUF twins take that limit."""
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def conversions_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


def test_sinks_and_windows_hold_through_chunks_prefix_hits_and_batches(gpt_oss: Path) -> None:
    """Prompts prefilled in chunks of 8 tokens, decoded together, then again with their
    prefixes cached and one at a time: transformers' greedy tokens every time."""
    hf = hf_model(gpt_oss)
    expected = [hf_greedy_tokens(hf, prompt, 16) for prompt in LONG_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(gpt_oss), page_size=4, max_prefill_length=8) as llm:
        engine = llm.runtime.engine
        assert engine.attn.windows == (4, 0)
        attention = engine.model.model.layers[0].self_attn
        assert attention.sinks is not None and attention.o_proj.bias is not None
        assert [o.token_ids for o in llm.generate(LONG_PROMPTS, greedy)] == expected
        planner = llm.scheduler.planner
        cached_before = planner.prompt_tokens_cached
        assert [o.token_ids for o in llm.generate(LONG_PROMPTS, greedy)] == expected
        assert planner.prompt_tokens_cached - cached_before >= 48  # 12 pages of 4
        alone = [llm.generate([prompt], greedy)[0].token_ids for prompt in LONG_PROMPTS]
        assert alone == expected
        llm.scheduler.check_integrity()


def test_transformers_4_config_reads_as_5(gpt_oss: Path) -> None:
    """The published config.json (transformers 4.55): `rope_scaling` beside `rope_theta`,
    no `layer_types` (every other layer windowed, from the first), experts as
    `num_local_experts`, no `swiglu_alpha`."""
    new = json.loads((gpt_oss / "config.json").read_text())
    rope = dict(new["rope_parameters"])
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    old.pop("swiglu_alpha", None)
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    config = ModelConfig.from_hf(new)
    assert config.layer_windows == (4, 0) and config.attention_sinks and config.o_bias
    assert config.num_experts == 8 and config.num_experts_per_tok == 2
    assert config.moe_intermediate_size == 32 and config.norm_topk_prob
    assert config.expert_style == ExpertStyle(biases=True, swiglu_alpha=1.702, swiglu_limit=1.5)
    assert config.rope_scaling is not None and config.rope_scaling["truncate"] is False
    assert config.norms_in_float32 and config.qkv_bias


def test_clamped_swiglu_is_transformers_gate() -> None:
    """`activate` with gpt-oss's style against transformers' own experts' gate (which reads
    gate and up interleaved), values on both sides of the clamp."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(swiglu_limit=1.5, intermediate_size=16))
    gate_up = torch.randn(5, 32) * 3
    interleaved = torch.stack(gate_up.chunk(2, -1), -1).flatten(-2)
    style = ExpertStyle(biases=True, swiglu_alpha=1.702, swiglu_limit=1.5)
    assert torch.equal(activate(gate_up, style), experts._apply_gate(interleaved))


def test_float_gguf_matches_transformers(tmp_path: Path) -> None:
    """A float GGUF as llama.cpp's converter writes gpt-oss (experts split into gate, up and
    down with their biases, the router as `ffn_gate_inp`, sinks, YaRN's betas): transformers'
    logits; its config says what llama.cpp's code fixes (windows, the clamp, no truncation)."""
    folder = make_tiny_model("gpt_oss", tmp_path / "hf", overrides=LLAMA_CPP_CLAMP)
    path = write_hf_as_gguf(folder, tmp_path / "f32.gguf")
    hf = hf_model(folder)
    with LLM(str(path), page_size=4) as llm:
        config = llm.runtime.engine.model_config
        assert config == ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        for prompt in LONG_PROMPTS[1:]:
            continuation = [7, 123, 45, 2, 99]
            ours = our_logits(llm, prompt, continuation)
            with torch.inference_mode():
                theirs = hf(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 :]
            torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.skipif(not native_kernels(), reason="the CPU kernels do not build here")
def test_mxfp4_experts_run_on_the_kernels(tmp_path: Path) -> None:
    """A file of MXFP4 experts (as gpt-oss's are published) and Q8_0 matrices keeps both in
    their blocks on the kernels, attends from the pool in C++ with its sinks, and generates
    the tokens of the same file de-quantized to float32, logprobs within Q8_0's rounding of
    the activations."""
    folder = make_tiny_model("gpt_oss", tmp_path / "hf", overrides=LLAMA_CPP_CLAMP)
    path = write_hf_as_gguf(
        folder, tmp_path / "mxfp4.gguf", qtype=Q.Q8_0, qtype_of={"_exps": Q.MXFP4}
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)
    with LLM(str(path), page_size=4, max_prefill_length=8) as quantized:
        engine = quantized.runtime.engine
        experts = engine.model.model.layers[0].mlp.experts
        assert isinstance(experts, QuantizedExperts) and experts.biases is not None
        native = experts.gate_up.native
        assert native is not None and all(w.levels is not None for w in native)
        assert engine.attn.native_decode and engine.model.model.decode_stack is None
        ours = quantized.generate(LONG_PROMPTS, params)
    with LLM(str(path), page_size=4, quantization="none") as float32:
        reference = float32.generate(LONG_PROMPTS, params)
    for got, want in zip(ours, reference):
        assert got.token_ids == want.token_ids
        for mine, theirs in zip(got.logprobs, want.logprobs):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=0.02)
