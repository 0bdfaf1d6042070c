"""Float weights on aserve's CPU kernels (aserve/quant/native.py, `FloatWeight`;
csrc/cpu_float.cpp), 16-bit ones kept in their two bytes: the products against float64,
exact widening, a row's outputs whatever its batch; bfloat16 / float16 checkpoints
(safetensors and GGUF) generating transformers' greedy tokens with every linear layer in 16
bits, and float32 checkpoints and `--quantization none` with them in float32."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.quant.native import FloatWeight, native_kernels
from tests.gguf_files import write_hf_as_gguf
from tests.tiny_models import hf_greedy_tokens, make_tiny_model

pytestmark = pytest.mark.skipif(not native_kernels(), reason="the CPU kernels do not build here")

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], [1, 2, 3], [300, 301, 5, 9, 12, 44]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(13, 64), (40, 96), (256, 200)])
def test_products_against_float64_and_alone_equal_batched(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=generator).to(dtype)
    half = FloatWeight(weight)
    size = weight.element_size()
    assert half.words.dtype == dtype and half.nbytes == half.padded * shape[1] * size
    x = torch.randn(7, shape[1], generator=generator)
    reference = x.double() @ weight.double().t()
    for rows in (1, 2, 3, 4, 5, 7):
        out = half.kernel_linear(x[:rows].contiguous())[:, : shape[0]]
        assert (out.double() - reference[:rows]).abs().max() < 1e-4 * shape[1] ** 0.5
        # each output is one chain of FMAs over the inputs in order, whatever its tile
        for m in range(rows):
            alone = half.kernel_linear(x[m : m + 1].contiguous())[:, : shape[0]]
            assert torch.equal(alone[0], out[m])
    through_blas = half._blas_linear(x)[:, : shape[0]]
    assert (through_blas.double() - reference).abs().max() < 1e-4 * shape[1] ** 0.5
    ids = torch.tensor([0, shape[0] - 1, 5])
    assert torch.equal(half.rows(ids), weight[ids].float())


def test_gated_product_is_the_product_then_silu_and_mul() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(2 * 24, 64, generator=generator).to(torch.bfloat16)
    half = FloatWeight(weight)
    x = torch.randn(3, 64, generator=generator)
    gated = half.silu(x)
    assert gated is not None
    y = half.kernel_linear(x)
    assert torch.equal(gated, torch.nn.functional.silu(y[:, :24]) * y[:, 24:48])


def half_checkpoint(folder: Path, family: str, dtype: torch.dtype, tied: bool) -> Path:
    """A tiny random model saved in `dtype` (config.json says so, as published ones do)."""
    import transformers

    make_tiny_model(family, folder / "float", overrides={"tie_word_embeddings": tied})
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "float")
    model.to(dtype).save_pretrained(folder / "half")
    config = json.loads((folder / "half" / "config.json").read_text())
    assert (config.get("dtype") or config.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    return folder / "half"


def linear_products(llm: LLM) -> list[object]:
    model = llm.runtime.engine.model
    return [
        product
        for module in model.modules()
        if getattr(module, "quantized", None) is not None and hasattr(module.quantized, "products")
        for product in module.quantized.products
    ]


@pytest.mark.parametrize(
    ("family", "dtype", "tied"),
    [("llama", torch.bfloat16, False), ("qwen3", torch.float16, True)],
)
def test_half_checkpoint_keeps_16_bits_and_generates_transformers_tokens(
    tmp_path: Path,
    make_llm: Callable[..., LLM],
    family: str,
    dtype: torch.dtype,
    tied: bool,
) -> None:
    import transformers

    folder = half_checkpoint(tmp_path, family, dtype, tied)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy_tokens(hf, prompt, 12) for prompt in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    llm = make_llm(folder, num_pages=256)
    products = linear_products(llm)
    assert products and all(isinstance(p, FloatWeight) for p in products)
    assert all(p.words.dtype == dtype for p in products)
    engine = llm.runtime.engine
    embed = engine.model.model.embed_tokens
    assert embed.table is not None and isinstance(embed.table.lookups, FloatWeight)
    batched = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    assert batched == expected
    # one at a time (other batches, the prefix cache warm) gives the same tokens
    assert [llm.generate([p], greedy)[0].token_ids for p in PROMPTS] == expected

    # --quantization none widens them to float32 at load, for the same kernels
    float32 = make_llm(folder, num_pages=256, quantization="none")
    products = linear_products(float32)
    assert products and all(p.words.dtype == torch.float32 for p in products)
    assert float32.runtime.engine.weight_bytes > 1.8 * engine.weight_bytes
    assert [o.token_ids for o in float32.generate(PROMPTS, greedy)] == expected


@pytest.mark.parametrize(
    ("qtype", "dtype"),
    [
        (gguf.GGMLQuantizationType.F16, torch.float16),
        (gguf.GGMLQuantizationType.BF16, torch.bfloat16),
    ],
)
def test_16_bit_gguf_keeps_16_bits(
    tmp_path: Path,
    make_llm: Callable[..., LLM],
    qtype: gguf.GGMLQuantizationType,
    dtype: torch.dtype,
) -> None:
    """A GGUF whose matrices are all F16 or BF16 (llama.cpp's `--outtype f16` / `bf16`) runs
    them in 16 bits on CPU, with the tokens of the same weights in float32."""
    folder = make_tiny_model("llama", tmp_path / "model")
    path = write_hf_as_gguf(folder, tmp_path / "half.gguf", qtype=qtype)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = make_llm(path, num_pages=256)
    products = linear_products(llm)
    assert products and all(isinstance(p, FloatWeight) and p.words.dtype == dtype for p in products)
    float32 = make_llm(path, num_pages=256, quantization="none")
    assert all(p.words.dtype == torch.float32 for p in linear_products(float32))
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == [
        o.token_ids for o in float32.generate(PROMPTS, greedy)
    ]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float32_checkpoint_runs_on_the_kernels_with_transformers_tokens(
    tmp_path: Path, make_llm: Callable[..., LLM], family: str
) -> None:
    """A float32 checkpoint: every linear layer, the embedding and the LM head in float32 on
    the kernels (not MKL, whose few-row products read a third as fast on AMD CPUs), giving
    transformers' greedy tokens batched and alone. Dummy weights keep torch's float path."""
    import transformers

    folder = make_tiny_model(family, tmp_path / "model", overrides={"tie_word_embeddings": False})
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy_tokens(hf, prompt, 12) for prompt in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    llm = make_llm(folder, num_pages=256)
    products = linear_products(llm)
    assert products and all(
        isinstance(p, FloatWeight) and p.words.dtype == torch.float32 for p in products
    )
    model = llm.runtime.engine.model
    for table in (model.model.embed_tokens.table, model.lm_head.table):
        assert table is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected
    assert [llm.generate([p], greedy)[0].token_ids for p in PROMPTS] == expected

    dummy = make_llm(folder, num_pages=256, dummy_weight=True)
    assert not linear_products(dummy)
