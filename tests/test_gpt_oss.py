"""gpt-oss: attention sinks and sliding windows through chunked prefill, prefix hits and
batches, against transformers; its configs in both transformers' spellings; GGUF files as
llama.cpp writes them, float and with MXFP4 experts on aserve's CPU kernels; checkpoints
with MXFP4 experts as OpenAI publishes them.

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
from aserve.config import ConfigError, ExpertStyle, ModelConfig
from aserve.layers.moe import QuantizedExperts, activate
from aserve.quant.gguf import QuantizedTensor
from aserve.quant.mxfp4 import ggml_blocks
from aserve.quant.native import native_kernels
from tests.gguf_files import write_hf_as_gguf
from tests.test_gemma import LONG_PROMPTS, assert_long_prompts_generate_as_transformers
from tests.test_models import hf_model, our_logits
from tests.tiny_models import make_tiny_model

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
    with LLM(str(gpt_oss), page_size=4, max_prefill_length=8) as llm:
        engine = llm.runtime.engine
        assert engine.attn.windows == (4, 0)
        attention = engine.model.model.layers[0].self_attn
        assert attention.sinks is not None and attention.o_proj.bias is not None
        assert_long_prompts_generate_as_transformers(llm, gpt_oss)


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
    their blocks on the kernels, decodes its layers in C++ (the decode stack: sinks, biases,
    experts in one call with their biases and clamped SwiGLU), and generates
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
        assert experts.takes_whole_layer(torch.zeros(1, 64))  # decode: the one-call layer
        assert engine.attn.native_decode and engine.model.model.decode_stack is not None
        ours = quantized.generate(LONG_PROMPTS, params)
    with LLM(str(path), page_size=4, quantization="none") as float32:
        reference = float32.generate(LONG_PROMPTS, params)
    for got, want in zip(ours, reference):
        assert got.token_ids == want.token_ids
        for mine, theirs in zip(got.logprobs, want.logprobs):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=0.02)


def test_mxfp4_blocks_read_as_transformers_reads_them() -> None:
    """Random code bytes and exponents in transformers' layout, as llama.cpp's MXFP4 blocks:
    the values transformers' own de-quantization gives, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=generator)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for expert in range(3):
        raw = ggml_blocks(blocks[expert], scales[expert])
        ours = QuantizedTensor(raw, Q.MXFP4, 128).decode().dequantize()
        assert torch.equal(ours, theirs[expert].T)


def write_mxfp4_checkpoint(folder: Path, out: Path) -> Path:
    """`folder`'s float gpt-oss with its experts in MXFP4 as the published checkpoints store
    them (gguf's quantizer rounds each row; its blocks turned into transformers' layout)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name).transpose(1, 2).contiguous()  # [E, out, in]
        experts, count, cols = rows.shape
        raw = gguf.quants.quantize(rows.reshape(-1, cols).numpy(), Q.MXFP4)
        ggml = torch.from_numpy(raw).view(experts, count, cols // 32, 17)
        codes = torch.cat((ggml[..., 1:] & 15, ggml[..., 1:] >> 4), -1)  # inputs in order
        tensors[f"{name}_blocks"] = (codes[..., 0::2] | codes[..., 1::2] << 4).contiguous()
        tensors[f"{name}_scales"] = ggml[..., 0].contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.skipif(not native_kernels(), reason="the CPU kernels do not build here")
def test_published_mxfp4_checkpoint_runs_its_experts_in_blocks(tmp_path: Path) -> None:
    """A checkpoint laid out as openai/gpt-oss-20b is (MXFP4 experts, float rest) keeps its
    experts in their blocks and gives the logits of the same weights written as a GGUF with
    MXFP4 experts (the same rounding of every row); `--quantization none` reads them as
    float32, within the 16-bit activations' rounding of the blocks."""
    folder = make_tiny_model("gpt_oss", tmp_path / "hf", overrides=LLAMA_CPP_CLAMP)
    checkpoint = write_mxfp4_checkpoint(folder, tmp_path / "mxfp4")
    twin = write_hf_as_gguf(folder, tmp_path / "twin.gguf", qtype_of={"_exps": Q.MXFP4})
    prompt, continuation = LONG_PROMPTS[1], [7, 123, 45, 2, 99]
    logits = {}
    for name, model, options in [
        ("blocks", checkpoint, {}),
        ("gguf", twin, {}),
        ("float", checkpoint, {"quantization": "none"}),
    ]:
        with LLM(str(model), page_size=4, **options) as llm:
            experts = llm.runtime.engine.model.model.layers[0].mlp.experts
            assert isinstance(experts, QuantizedExperts) == (name != "float")
            logits[name] = our_logits(llm, prompt, continuation)
    torch.testing.assert_close(logits["blocks"], logits["gguf"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["blocks"], logits["float"], atol=0.05, rtol=0.01)


def test_mxfp4_checkpoint_refuses_int8_in_one_line(tmp_path: Path) -> None:
    folder = make_tiny_model("gpt_oss", tmp_path / "hf", overrides=LLAMA_CPP_CLAMP)
    checkpoint = write_mxfp4_checkpoint(folder, tmp_path / "mxfp4")
    with pytest.raises(ConfigError, match=r"already quantized \(MXFP4\)"):
        LLM(str(checkpoint), quantization="int8")
