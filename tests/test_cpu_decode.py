"""The decode step's layers in C++ (models/cpu_decode.py) against the modules they replace:
the same bits, for each family the stack takes, in batches, and not taken where a layer is
not the kernels' whole."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.models.cpu_decode import DecodeStack
from aserve.quant import native as native_module
from tests.gguf_files import write_hf_as_gguf
from tests.test_gguf_models import (
    DOTS1_AS_LLAMA_CPP,
    GEMMA2_AS_LLAMA_CPP,
    GEMMA3_AS_LLAMA_CPP,
    MOE_LAYERS,
    SMOLLM3_AS_LLAMA_CPP,
)
from tests.test_quant import needs_kernels
from tests.tiny_models import make_tiny_model

pytestmark = needs_kernels

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0

PROMPTS = [[5, 17, 33, 9], list(range(3, 40, 2)), [250, 4, 4, 4, 61, 7, 300], [11]]
"""Four requests of different lengths, decoded together: rows of different contexts."""

NO_PREFIX_CACHE = {"page_size": 4, "cache_type": "naive"}
"""The second pass would find its prompts cached, and a cached prefix's attention differs
from an uncached one in last bits (prefill's SDPA): both passes prefill alike instead."""


@pytest.fixture(autouse=True)
def conversions_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))


def decode_both_ways(llm: LLM) -> tuple[list, list, int]:
    """Greedy tokens and logprobs of PROMPTS with the stack, then with the modules; and how
    many steps the stack ran."""
    decoder = llm.runtime.engine.model.model
    stack = decoder.decode_stack
    assert isinstance(stack, DecodeStack)
    runs = 0
    run = stack.run

    def counted(*args: object) -> object:
        nonlocal runs
        runs += 1
        return run(*args)

    stack.run = counted  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
    results = []
    for use_stack in (True, False):
        decoder.decode_stack = stack if use_stack else None
        outputs = llm.generate(PROMPTS, params)
        results.append([(o.token_ids, [t.logprob for t in o.logprobs]) for o in outputs])
    decoder.decode_stack = stack
    return results[0], results[1], runs


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen2_moe",
        "gemma2",
        "gemma3",
        "gpt_oss",
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
    ],
)
def test_stack_gives_the_modules_bits(family: str, tmp_path: Path) -> None:
    """Llama's Q4_0 value projection beside its Q8_0 queries and keys makes Q|K|V two
        products joined; Qwen2 adds their bias, Qwen3 its Q/K norms, Qwen3-MoE its experts,
        Gemma 3 its norms after attention and the MLP, GELU, two ropes and windows of 4 over
        prompts of up to 19 tokens, Gemma 2 its soft-capped scores, gpt-oss its sinks, biases
        on every projection, the router and the MXFP4 experts, and its clamped SwiGLU, SmolLM3
        a layer without rope, Phi-3 its fused Q|K|V and gate|up and a partly rotating head,
        OLMo 2 its norms after attention and the MLP alone and Q/K norms across heads, Qwen2-MoE
        a shared expert beside the routed ones, weighed by its sigmoid gate, GLM-4.5 an ungated one
    beside experts chosen by sigmoid scores plus a bias, and Q/K norms on a partly rotating
    head. The
        float32 cache keeps a float16 rounding out of what is compared (both ways would share
        it)."""
    overrides = {
        "qwen3_moe": MOE_LAYERS,
        "qwen2_moe": MOE_LAYERS,
        "gemma2": GEMMA2_AS_LLAMA_CPP,
        "gemma3": GEMMA3_AS_LLAMA_CPP,
        "smollm3": SMOLLM3_AS_LLAMA_CPP,
        "dots1": DOTS1_AS_LLAMA_CPP,
    }.get(family)
    folder = make_tiny_model(family, tmp_path / family, overrides=overrides)
    mixed = {"attn_v": Q4_0} if family == "llama" else None
    if family == "gpt_oss":
        mixed = {"_exps": gguf.GGMLQuantizationType.MXFP4}
    model = write_hf_as_gguf(folder, tmp_path / f"{family}.gguf", qtype=Q8_0, qtype_of=mixed)
    with LLM(str(model), kv_cache_dtype="float32", **NO_PREFIX_CACHE) as llm:
        if family == "llama":
            qkv = llm.runtime.engine.model.model.layers[0].self_attn.qkv_proj.quantized
            assert len(qkv.products) == 2
        stacked, modules, runs = decode_both_ways(llm)
    assert runs == 11  # every decode step after the prefill
    assert stacked == modules


def test_stack_over_a_float16_cache(tmp_path: Path) -> None:
    """A quantized model's default cache on CPU: float16 K/V written and read by the stack's
    ops as by the modules'."""
    folder = make_tiny_model("qwen3", tmp_path / "qwen3")
    model = write_hf_as_gguf(folder, tmp_path / "qwen3.gguf", qtype=Q4_0)
    with LLM(str(model), **NO_PREFIX_CACHE) as llm:
        stacked, modules, runs = decode_both_ways(llm)
    assert runs == 11
    assert stacked == modules


def test_load_time_quantization_takes_the_stack(tmp_path: Path) -> None:
    """`--quantization int4` of a float checkpoint packs the same kernel weights."""
    folder = make_tiny_model("llama", tmp_path / "llama")
    with LLM(str(folder), quantization="int4", **NO_PREFIX_CACHE) as llm:
        stacked, modules, runs = decode_both_ways(llm)
    assert runs == 11
    assert stacked == modules


def test_a_format_sent_to_blas_sooner_keeps_larger_batches_off_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stack runs only batches that every one of its weights multiplies on the kernels:
    with Q4_0's products going to BLAS from 3 rows (`blas_rows`, by code format) and Q8_0's
    never, steps of four requests run the modules and steps of two the stack."""
    monkeypatch.setattr(
        native_module, "blas_rows", lambda weight: 3 if weight.code_bits == 4 else 10**6
    )
    folder = make_tiny_model("llama", tmp_path / "llama")
    model = write_hf_as_gguf(folder, tmp_path / "m.gguf", qtype=Q8_0, qtype_of={"attn_v": Q4_0})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(model), **NO_PREFIX_CACHE) as llm:
        stack = llm.runtime.engine.model.model.decode_stack
        assert isinstance(stack, DecodeStack)
        runs: list[int] = []
        run = stack.run

        def counted(hidden: torch.Tensor, *args: object) -> object:
            runs.append(hidden.shape[0])
            return run(hidden, *args)

        stack.run = counted  # type: ignore[method-assign]
        llm.generate(PROMPTS, params)
        assert runs == []
        llm.generate(PROMPTS[:2], params)
        assert runs == [2] * 11


def test_no_stack_where_a_layer_is_not_the_kernels(tmp_path: Path) -> None:
    """Float weights run on the kernels too, so a float32 checkpoint and an F32 file decode
    through the stack as a quantized file does; dummy weights stay on torch's float path and
    run their modules."""
    folder = make_tiny_model("llama", tmp_path / "llama")
    quantized = write_hf_as_gguf(folder, tmp_path / "q8.gguf", qtype=Q8_0, qtype_of={})
    float32 = write_hf_as_gguf(folder, tmp_path / "f32.gguf")
    for model in (folder, quantized, float32):
        with LLM(str(model), page_size=4) as llm:
            assert llm.runtime.engine.model.model.decode_stack is not None, model.name
    with LLM(str(folder), page_size=4, dummy_weight=True) as llm:
        assert llm.runtime.engine.model.model.decode_stack is None
