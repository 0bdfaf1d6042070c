"""Quantized weights on CUDA (quant/cuda.py; run on the GPU machine, skipped without CUDA):
the Triton product against float64, tiny GGUF models of each format, integer checkpoints
(AWQ, GPTQ, compressed-tensors) and the embedded model against their de-quantized twins, in
bfloat16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from aserve import LLM, SamplingParams
from aserve.quant.codes import Codes
from tests.test_int_checkpoints import Layout, write_int_checkpoint
from tests.test_quant import (
    FORMATS,
    decode,
    first_tokens_agreeing,
    greedy_parting,
    random_blocks,
    write_tiny_llama,
)
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_cuda_products_match_float64(qtype: QType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the float64 product of the same activations and the exact de-quantized
    weight, in bfloat16 (float16 scales; in `dequantizing_gemm` and from DEQUANTIZE_ROWS
    the weight is rounded to bfloat16, as a bf16 model's is) and in float32: one row, two,
    a few (groups split over programs), a full tile of 16, past DEQUANTIZE_ROWS, and past
    TILE_ROWS, 100 outputs (not a multiple of the tile); then 300 outputs de-quantized in
    slices of 128."""
    from aserve.quant import cuda as cuda_module
    from aserve.quant.cuda import DEQUANTIZE_ROWS, TILE_ROWS, CudaWeight

    codes: Codes = decode(torch.from_numpy(random_blocks(qtype, 100, 512, seed=2)), qtype, 512)
    weight = codes.dequantize().double().cuda()
    generator = torch.Generator().manual_seed(0)
    # codes of levels take the one-row GEMV's `1 + (level + 128) / 256` widening: taking the
    # ones back out scales a group's float32 rounding by 256 (MXFP4 missed 1e-5 by 1.35x on
    # one draw of a row)
    float32 = 3e-5 if codes.table is not None else 1e-5
    for dtype, tolerance in ((torch.bfloat16, 1e-2), (torch.float32, float32)):
        cuda = CudaWeight(codes, torch.device("cuda"), dtype)
        assert cuda.scales.dtype == (torch.float16 if dtype == torch.bfloat16 else dtype)
        if dtype == torch.bfloat16:
            assert cuda.nbytes < 100 * 512 * 2, "smaller than the bfloat16 weight"
        for rows in (1, 2, 5, 16, DEQUANTIZE_ROWS + 3, TILE_ROWS + 1):
            x = torch.randn(rows, 512, generator=generator).to("cuda", dtype)
            exact = x.double() @ weight.T
            out = cuda.linear(x, None)
            assert out.dtype == dtype and out.shape == (rows, 100)
            torch.testing.assert_close(
                out.double(), exact, rtol=0, atol=tolerance * float(exact.abs().max())
            )
        ids = torch.tensor([5, 0, 99], device="cuda")
        assert cuda.rows(ids).is_contiguous()
        largest = float(weight.abs().max())
        torch.testing.assert_close(
            cuda.rows(ids).double(), weight[ids], rtol=0, atol=tolerance * largest
        )
    wide: Codes = decode(torch.from_numpy(random_blocks(qtype, 300, 512, seed=3)), qtype, 512)
    cuda = CudaWeight(wide, torch.device("cuda"), torch.bfloat16)
    x = torch.randn(DEQUANTIZE_ROWS + 3, 512, generator=generator).to("cuda", torch.bfloat16)
    exact = x.double() @ wide.dequantize().double().cuda().T
    monkeypatch.setattr(cuda_module, "DEQUANTIZE_SLICE_BYTES", 128 * 512 * 2)
    sliced = cuda.linear(x, None)
    assert sliced.shape == (DEQUANTIZE_ROWS + 3, 300)
    torch.testing.assert_close(sliced.double(), exact, rtol=0, atol=1e-2 * float(exact.abs().max()))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_tiny_gguf_runs_quantized_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_llm: Callable[..., LLM], qtype: QType
) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_llama(model, qtype)
    quantized = make_llm(model, num_pages=256)
    reference = make_llm(model, num_pages=256, quantization="none")
    engine, float_engine = quantized.runtime.engine, reference.runtime.engine
    assert engine.device.type == "cuda" and engine.weight_bytes < float_engine.weight_bytes
    agree, pairs = first_tokens_agreeing(quantized, reference)
    assert agree >= 4, pairs


def test_embedded_model_quantized_on_cuda(
    make_llm: Callable[..., LLM], smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded Q4_1 model on CUDA against its de-quantized twin. In float32 both hold
    the exact weights, so the greedy tokens of 8 prompts agree (at least 7 of 8 for all 24
    tokens); in bfloat16 the twin's weights are rounded to bfloat16 and near-ties part early
    (measured [5, 0, 24, 24, 24, 24, 24, 4]): at least 4 agree for 8 tokens, and the README
    answer holds. Where they part is printed."""
    from tests.test_generation import TEXTS

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def parted_from_twin(dtype: str) -> list[int]:
        quantized = make_llm(smollm2_dir, dtype=dtype)
        reference = make_llm(smollm2_dir, dtype=dtype, quantization="none")
        assert quantized.runtime.engine.weight_bytes < reference.runtime.engine.weight_bytes
        if dtype == "bfloat16":
            assert "Paris" in quantized.generate(TEXTS[0], greedy)[0].text
        return greedy_parting(quantized, reference, TEXTS, 24)

    exact, rounded = parted_from_twin("float32"), parted_from_twin("bfloat16")
    with capsys.disabled():
        print("\nembedded Q4_1 on CUDA, first differing token of 8 prompts against the")
        print(f"de-quantized model: float32 {exact}, bfloat16 {rounded}")
    assert sum(p == 24 for p in exact) >= 7
    assert sum(p >= 8 for p in rounded) >= 4


def compiled_variants(kernel: Any) -> int:
    """How many compiled variants a Triton kernel holds, over its devices."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def forget_variants(kernel: Any) -> None:
    """Drop a Triton kernel's variants held in memory (earlier tests compiled some of those
    counted here; a later launch loads them again from Triton's disk cache)."""
    for entry in kernel.device_caches.values():
        for cache in entry:
            if isinstance(cache, dict):  # the variants, and in newer Tritons a key index
                cache.clear()


def test_one_compile_serves_every_row_count() -> None:
    """The products' kernels are not specialized on their row count (Triton would compile
    one variant for 1 row, one for multiples of 16 and one for the rest): each captured
    batch size of a start-up would otherwise add compiles. For a GGUF product the one-row
    GEMV, two rows' integer dots, one variant of `dequantizing_gemm` a setting (3-16,
    17-32, 33-64 rows) and one de-quantizing kernel past them; one FP8 setting, split over K
    (which it adds up itself), over 3-16 tokens and one more over 17-48 where the GPU
    launches up to 16 rows with PDL (a compile-time switch of the kernels: layers/pdl.py)."""
    from aserve.layers.pdl import pdl
    from aserve.quant import cuda as cuda_module
    from aserve.quant import fp8_cuda
    from aserve.quant.cuda import CudaWeight
    from aserve.quant.fp8 import quantize_rows

    qtype = QType.Q4_1
    codes: Codes = decode(torch.from_numpy(random_blocks(qtype, 100, 512, seed=2)), qtype, 512)
    weight = CudaWeight(codes, torch.device("cuda"), torch.bfloat16)
    kernels = (cuda_module.int_gemv, cuda_module.int_rows, cuda_module.dequantizing_gemm)
    for kernel in (*kernels, cuda_module.dequantize_kernel):
        forget_variants(kernel)
    before = compiled_variants(cuda_module.quantized_gemm)

    def counts(*row_counts: int) -> list[int]:
        for rows in row_counts:
            weight.linear(torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16), None)
        return [compiled_variants(kernel) for kernel in kernels]

    assert counts(1) == [1, 0, 0], "one row takes the GEMV"
    assert counts(2) == [1, 1, 0]
    assert counts(3, 4, 9, 16) == [1, 1, 1]
    assert counts(17, 32) == [1, 1, 2]
    assert counts(33, 48, 64) == [1, 1, 3]
    forget_variants(cuda_module.dequantize_kernel)
    assert counts(65, 80) == [1, 1, 3]  # de-quantized slices
    assert compiled_variants(cuda_module.dequantize_kernel) == 1
    assert compiled_variants(cuda_module.quantized_gemm) == before

    fp8_weight = quantize_rows(torch.randn(200, 512) * 0.03)
    kernels = (fp8_cuda._token_scaled_kernel,)
    for kernel in kernels:
        forget_variants(kernel)
    before_fp8 = [compiled_variants(kernel) for kernel in kernels]
    for tokens in (3, 16, 17, 48):
        values, scales = fp8_cuda.quantize_tokens(
            torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        )
        fp8_cuda.token_scaled(
            values,
            scales,
            fp8_weight.values.cuda(),
            fp8_weight.scales.cuda(),
            None,
            torch.bfloat16,
            (32, 64, 128, 2, 4, 4, False),
        )
    expected = 2 if pdl(torch.device("cuda")) else 1
    assert [compiled_variants(k) - n for k, n in zip(kernels, before_fp8)] == [expected]


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("llama", Layout("awq", group=128)),
        ("llama", Layout("gptq", bits=8, symmetric=True, group=128)),
        ("llama", Layout("compressed-tensors", symmetric=True, scale_dtype=torch.bfloat16)),
        ("qwen3_moe", Layout("gptq", group=64)),
        ("llama", Layout("gptq", group=128, act_order=True)),
        ("llama", Layout("gptq", bits=3, group=128)),
    ],
    ids=["awq-g128", "gptq-8bit", "ct-w4a16", "moe-gptq", "gptq-act-order", "gptq-3bit"],
)
def test_int_checkpoints_run_quantized_on_cuda(
    tmp_path: Path, make_llm: Callable[..., LLM], family: str, layout: Layout
) -> None:
    """AWQ, GPTQ and compressed-tensors checkpoints (tests/test_int_checkpoints.py's
    writers) on CUDA in bfloat16: their codes on the CUDA products (MoE experts on the fused
    kernels, act-order inputs gathered inside the graphs), first greedy tokens as the
    de-quantized twin on most prompts, and CUDA graphs generating what eager steps
    generate."""
    overrides = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    if family == "qwen3_moe":
        overrides |= {"moe_intermediate_size": 128, "mlp_only_layers": []}
    float_folder = make_tiny_model(family, tmp_path / "float", overrides=overrides)
    folder, twin_folder = tmp_path / "int", tmp_path / "twin"
    write_int_checkpoint(float_folder, folder, twin_folder, layout)
    quantized = make_llm(folder, num_pages=256)
    twin = make_llm(twin_folder, num_pages=256)
    engine = quantized.runtime.engine
    assert engine.device.type == "cuda" and engine.weight_bytes < twin.runtime.engine.weight_bytes
    if family == "qwen3_moe":
        assert engine.model.model.layers[0].mlp.experts.stacked is not None
    agree, pairs = first_tokens_agreeing(quantized, twin, max_tokens=8)
    assert agree >= 4, pairs
    eager = make_llm(folder, num_pages=256, cuda_graph_max_bs=0)
    assert [a for a, _ in first_tokens_agreeing(eager, quantized, max_tokens=8)[1]] == [
        a for a, _ in pairs
    ]
