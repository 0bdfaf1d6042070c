"""aserve's Triton kernels (layers/cuda_ops.py, layers/gemv.py, engine/race_triton.py,
attention/triton_decode.py) against the torch formulas they replace: compiled on a GPU, and
on CPU under Triton's interpreter (the same kernel code run by NumPy; tests/conftest.py turns
it on when there is no GPU). float16, because the interpreter truncates to bfloat16 where
the GPU rounds."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aserve.engine.sampler import (
    Sampler,
    SamplingBatch,
    _seed_keys,
    filter_top_k_top_p_min_p,
    row_argmax,
    seeded_exponential_noise,
    step_keys,
)
from aserve.layers.rotary import RotaryEmbedding
from aserve.quant.codes import Codes
from aserve.sampling_params import SamplingParams

pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
from aserve.engine import race_triton  # noqa: E402
from aserve.engine.race_triton import race  # noqa: E402
from aserve.layers.cuda_ops import CudaKernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float16
FP8 = torch.float8_e4m3fn
F32 = torch.float32
ops = CudaKernels()


def hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * x32.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()).to(x.dtype)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rmsnorm_rows_and_strided_heads() -> None:
    x = torch.randn(7, 96, generator=gen(0)).half().to(DEVICE)
    weight = torch.randn(96, generator=gen(1)).half().to(DEVICE)
    torch.testing.assert_close(ops.rmsnorm(x, weight, 1e-6), hf_rmsnorm(x, weight, 1e-6))
    # Qwen3's Q norm: the heads of a strided slice of a wider row, normalised in place
    qkv = torch.randn(5, 3 * 64 + 32, generator=gen(2)).half().to(DEVICE)
    heads = qkv[:, : 3 * 64].unflatten(-1, (3, 64))
    want = hf_rmsnorm(heads, weight[:64], 1e-5)
    untouched = qkv[:, 3 * 64 :].clone()
    ops.rmsnorm(heads, weight[:64], 1e-5, out=heads)
    torch.testing.assert_close(heads, want)
    assert torch.equal(qkv[:, 3 * 64 :], untouched)


def test_fused_add_rmsnorm_rounds_the_sum_first() -> None:
    x = torch.randn(6, 200, generator=gen(3)).half().to(DEVICE)
    residual = torch.randn(6, 200, generator=gen(4)).half().to(DEVICE)
    weight = torch.randn(200, generator=gen(5)).half().to(DEVICE)
    total = x + residual
    ops.fused_add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(residual, total)
    torch.testing.assert_close(x, hf_rmsnorm(total, weight, 1e-6))


def test_gemma_norms_weigh_the_float32_row() -> None:
    """A float32 weight (Gemma's 1 + w) multiplies the normalised row before it is rounded,
    as transformers' Gemma3RMSNorm does: the kernels against `GemmaRMSNorm`'s torch path."""
    from aserve.layers.norm import GemmaRMSNorm

    plain, fused = GemmaRMSNorm(200, 1e-6), GemmaRMSNorm(200, 1e-6, ops)
    w = torch.randn(200, generator=gen(20)).half()
    for norm in (plain, fused):
        norm.load_weight("weight", w)
        norm.to(DEVICE)
    x = torch.randn(6, 200, generator=gen(21)).half().to(DEVICE)
    residual = torch.randn(6, 200, generator=gen(22)).half().to(DEVICE)
    want = plain(x)
    llama_order = hf_rmsnorm(x, plain.weight.half(), 1e-6)
    assert (fused(x) != want).sum() < (llama_order != want).sum() // 4
    want_normed, want_sum = plain.add_and_norm(x.clone(), residual.clone())
    got_normed, got_sum = fused.add_and_norm(x.clone(), residual.clone())
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_normed, want_normed)


def test_silu_and_mul() -> None:
    gate_up = torch.randn(4, 2 * 1500, generator=gen(6)).half().to(DEVICE)  # two column blocks
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=2e-3, atol=2e-3
    )


def test_gelu_tanh_and_mul() -> None:
    """Gemma's gate: transformers' `gelu_pytorch_tanh`, then the product."""
    gate_up = torch.randn(4, 2 * 1500, generator=gen(23)).half().to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate.float(), approximate="tanh").half() * up
    torch.testing.assert_close(ops.gelu_tanh_and_mul(gate_up), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_rope_matches_the_torch_rotation(head_dim: int) -> None:
    plain = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)
    fused = RotaryEmbedding(head_dim, 64, 10000.0, None, ops).to(DEVICE)
    heads, kv_heads = 4, 2
    qkv = torch.randn(9, (heads + 2 * kv_heads) * head_dim, generator=gen(7)).half().to(DEVICE)
    positions = torch.tensor([0, 1, 2, 5, 9, 17, 33, 62, 63], device=DEVICE)
    want, got = qkv.clone(), qkv.clone()
    q_size, qk_size = heads * head_dim, (heads + kv_heads) * head_dim
    plain(positions, want[:, :qk_size], q_size)
    fused(positions, got[:, :qk_size], q_size)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert torch.equal(got[:, qk_size:], qkv[:, qk_size:])  # V untouched


def torch_race(probs: torch.Tensor, seeds: list[int], steps: list[int]) -> torch.Tensor:
    keys = step_keys(_seed_keys(seeds).to(DEVICE), torch.tensor(steps, device=DEVICE))
    return row_argmax(probs / seeded_exponential_noise(keys, probs.shape[-1]))


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_race_picks_the_torch_race_winner(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over probabilities (filtered) the same bits as the torch path; over logits at a
    temperature the same winner (rounding differs only at ties). On a GPU of 8 SMs, 1 and 5
    rows split their 5,000 tokens over several programs; 8 rows take one program a row."""
    monkeypatch.setattr(race_triton, "_sm_count", lambda device: 8)
    vocab = 5000
    logits = (torch.randn(rows, vocab, generator=gen(8)) * 3).to(DEVICE)
    temperature = torch.linspace(0.5, 2.0, rows, device=DEVICE)
    seeds, steps = [11 + 7 * i for i in range(rows)], [i * 3 for i in range(rows)]
    seed_keys, step_t = _seed_keys(seeds).to(DEVICE), torch.tensor(steps, device=DEVICE)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    want = torch_race(probs, seeds, steps)
    assert torch.equal(race(probs, seed_keys, step_t, None), want)
    assert torch.equal(race(logits, seed_keys, step_t, temperature), want)
    top_k = probs.masked_fill(probs < probs.topk(20, dim=-1).values[:, -1:], 0.0)
    assert torch.equal(race(top_k, seed_keys, step_t, None), torch_race(top_k, seeds, steps))


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_race_without_noise_is_torch_argmax(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows: the first maximum, over several programs a row (8 SMs: 1 and 3 rows
    split their 9,000 tokens) or one (70 rows), with ties across programs, a NaN (the largest,
    as in torch) and a row of -inf (index 0, as in torch)."""
    monkeypatch.setattr(race_triton, "_sm_count", lambda device: 8)
    scores = torch.randn(rows, 9000, generator=gen(10)).half().to(DEVICE)
    top = scores[0].max()
    scores[0, 8500] = top + 1  # the maximum twice, in different programs' parts
    scores[0, 4100] = top + 1
    if rows > 1:
        scores[1, 6000] = float("nan")
        scores[2] = -float("inf")
    want = scores.argmax(dim=-1)
    assert want[0] == 4100
    assert torch.equal(race(scores, None, None, None), want)


def test_sampler_takes_greedy_rows_from_the_kernel() -> None:
    """With the kernel, greedy rows (a whole greedy batch, or beside sampled rows) get what
    the torch sampler gives them, the first maximum of their logits."""
    logits = torch.randn(6, 5000, generator=gen(11)).half().to(DEVICE)
    logits[2, 4500] = logits[2, 300] = logits[2].max() + 1
    for temperatures in ([0.0] * 6, [0.0, 0.7, 0.0, 1.0, 0.0, 0.0]):
        params = [SamplingParams(temperature=t, seed=5) for t in temperatures]
        batch = SamplingBatch.build(params, [5] * 6, [0] * 6, [[]] * 6, [[]] * 6, 5000, DEVICE)
        want = Sampler().sample(logits, batch).next_ids
        got = Sampler(race).sample(logits, batch).next_ids
        assert torch.equal(got, want)
        greedy = torch.tensor([t == 0.0 for t in temperatures], device=DEVICE)
        assert torch.equal(got[greedy], logits.argmax(dim=-1)[greedy])
    assert got[2] == 300


def test_race_over_many_steps_follows_the_distribution() -> None:
    """A 4-token distribution drawn at 400 steps: frequencies within a chi-square bound."""
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]], device=DEVICE).repeat(400, 1)
    seed_keys = _seed_keys([1234] * 400).to(DEVICE)
    ids = race(probs, seed_keys, torch.arange(400, device=DEVICE), None)
    counts = torch.bincount(ids.cpu(), minlength=4).float()
    expected = probs[0].cpu() * 400
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts.tolist(), chi2)  # p = 0.001 at 3 degrees of freedom


def test_filters_then_race_keep_the_allowed_set() -> None:
    """top-p on the torch side, race on the kernel: never a token outside the nucleus."""
    logits = torch.randn(1, 300, generator=gen(9)).repeat(200, 1).to(DEVICE)
    batch = SamplingBatch.build(
        [SamplingParams(temperature=1.0, top_p=0.5)] * 200,
        list(range(200)),
        [0] * 200,
        [[] for _ in range(200)],
        [[] for _ in range(200)],
        300,
        DEVICE,
    )
    probs = filter_top_k_top_p_min_p(torch.softmax(logits, dim=-1), batch)
    assert batch.seed_keys is not None and batch.steps is not None
    ids = race(probs, batch.seed_keys, batch.steps, None)
    allowed = probs[0] > 0
    assert bool(allowed[ids].all())
    assert len(set(ids.tolist())) > 1


def test_fp8_gemv_widens_every_byte_with_bit_operations() -> None:
    """The wide-weight FP8 GEMV (`_fp8_words_kernel`: four e4m3 bytes a word, widened with
    shifts and masks) against float64, over every finite e4m3 byte (zeros, denormals,
    negatives, 448) and a bias. The output is bfloat16: rounded (GPU) or truncated
    (interpreter), so a tolerance of one bfloat16 step, where a misplaced byte or bit would
    be far off."""
    from aserve.layers.gemv import FP8_WORDS_MIN_ROWS, gemv

    n, k = FP8_WORDS_MIN_ROWS, 512
    codes = torch.randint(0, 256, (n, k), generator=gen(20), dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # the two NaN codes become 1.5
    codes[0, :256] = torch.arange(256, dtype=torch.int32)
    codes[0, 0x7F] = codes[0, 0xFF] = 0
    values = codes.to(torch.uint8).view(FP8)
    scales = torch.rand(n, generator=gen(21)) + 0.5
    x = torch.randn(1, k, generator=gen(22)).bfloat16()
    bias = torch.randn(n, generator=gen(23)).bfloat16()
    out = gemv(x.to(DEVICE), values.to(DEVICE), bias.to(DEVICE), scales=scales.to(DEVICE))
    exact = (x.double() @ (values.double() * scales.double()[:, None]).T) + bias.double()
    error = (out.cpu().double() - exact).abs()
    assert out.dtype == torch.bfloat16
    assert (error <= exact.abs() * 2**-7 + 1e-3).all(), error.max()


@pytest.mark.parametrize(
    "qtype",
    ["Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ1_M", "IQ2_S",
     "IQ3_XXS"],
)  # fmt: skip
def test_gguf_products_on_each_path_match_float64(qtype: str) -> None:
    """quant/cuda.py's three paths for a GGUF weight against float64 on its exact de-quantized
    values, float32 activations: one row (`gemv`: codes read as 32-bit words, widened by
    shifts and masks under the exponent of 1.0, each group's sum of x taken back out), a few
    rows (the tiled product, a tile of up to 16 rows) and past DEQUANTIZE_ROWS (de-quantized
    slices); and the lookup of rows. 4-, 8- and 3-bit codes, groups of 32 and 16, offsets
    and none, IQ4's levels and the codebook formats' entries, kept in 2 bytes a run of 8
    inputs (IQ2_XXS, IQ1_M) or 3 (IQ2_S, IQ3_XXS); the widening's cancellation costs a few
    float32 steps, well under the tolerance."""
    from gguf import GGMLQuantizationType

    from aserve.quant.cuda import DEQUANTIZE_ROWS, CudaWeight
    from aserve.quant.gguf import decode
    from tests.test_quant import random_blocks

    kind = GGMLQuantizationType[qtype]
    codes = decode(torch.from_numpy(random_blocks(kind, 100, 512, seed=4)), kind, 512)
    weight = CudaWeight(codes, DEVICE, torch.float32)
    if codes.runs is not None:
        assert weight.codes.nbytes == 100 * 512 // 8 * codes.runs.entry_bits // 8
    assert (weight.offsets is None) == (not codes.offsets.any())
    exact_weight = codes.dequantize().double()
    for rows in (1, 5, 16, DEQUANTIZE_ROWS + 2):
        x = torch.randn(rows, 512, generator=gen(40 + rows))
        exact = x.double() @ exact_weight.T
        out = weight.linear(x.to(DEVICE), None).cpu()
        assert out.shape == (rows, 100)
        tolerance = 1e-5 * float(exact.abs().max())
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=tolerance)
    ids = torch.tensor([7, 0, 99])
    looked_up = weight.rows(ids.to(DEVICE)).cpu().double()
    torch.testing.assert_close(looked_up, exact_weight[ids], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("qtype", "rows"),
    [("Q4_0", 1), ("Q4_1", 1), ("Q4_K", 1), ("Q3_K", 1), ("Q5_K", 1), ("Q6_K", 1),
     ("Q8_0", 1), ("Q4_1", 2), ("Q4_K", 2), ("Q3_K", 2), ("Q6_K", 2), ("Q8_0", 2)],
)  # fmt: skip
def test_integer_dot_products_match_float64(qtype: str, rows: int) -> None:
    """float16 rows times codes without levels through `int_gemv` (one row) and `int_rows`
    (two): each group of inputs rounded to 16-bit integers on a step of its own, integer
    dot products, a group's sum scaled once. Within float16's rounding of the output of the
    float64 product on the exact de-quantized weight, 100 outputs (not a multiple of a
    program's), codes of 3 and 4 bits (nibbles) and of 5, 6 and 8 (bytes), groups of 32
    and 16 (the K-quants' Q3_K and Q6_K), with and without offsets. On a GPU the PTX
    (`dp2a`, byte permutes) and the shifts-and-masks forms give the same bits."""
    from gguf import GGMLQuantizationType

    from aserve.quant.cuda import CudaWeight, int_gemv, int_rows
    from aserve.quant.gguf import decode
    from tests.test_quant import random_blocks

    kind = GGMLQuantizationType[qtype]
    codes = decode(torch.from_numpy(random_blocks(kind, 100, 512, seed=5)), kind, 512)
    weight = CudaWeight(codes, DEVICE, torch.float16)
    x = torch.randn(rows, 512, generator=gen(41)).half().to(DEVICE)
    assert weight.takes_integer_dots(x) and not weight.takes_integer_dots(x.float())
    exact = x.cpu().double() @ codes.dequantize().double().T
    out = weight.linear(x, None).cpu()
    assert out.dtype == torch.float16 and out.shape == (rows, 100)
    tolerance = 2e-3 * float(exact.abs().max())
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=tolerance)
    if DEVICE.type == "cuda":
        outputs = []
        for ptx in (True, False):
            y = torch.empty(2, rows, 100, dtype=torch.float32, device=DEVICE)  # 2 splits of K
            shared = {
                "PTX": ptx, "OFFSETS": weight.offsets is not None, "FOUR_BIT": weight.four_bit,
                "GROUP": weight.group, "BLOCK_W": 32, "SPLIT_K": 2, "PDL": False,
                "num_warps": 1,
            }  # fmt: skip
            words = weight.codes.view(torch.int32)
            if rows == 1:
                int_gemv[(1, 2)](x, words, weight.scales, weight.offsets, y, 100, 512, **shared)
            else:
                block = 1 << (rows - 1).bit_length()
                int_rows[(1, 2)](
                    x, words, weight.scales, weight.offsets, y, rows, 100, 512, ROWS=block,
                    **shared,
                )  # fmt: skip
            outputs.append(y)
        assert torch.equal(*outputs)


@pytest.mark.parametrize(
    ("qtype", "cols"),
    [("Q4_0", 512), ("Q4_1", 352), ("Q4_K", 512), ("Q3_K", 512), ("Q5_K", 512), ("Q6_K", 512),
     ("Q8_0", 352)],
)  # fmt: skip
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "older"])
def test_dequantizing_tiles_match_float64(
    qtype: str, cols: int, hopper: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16-bit rows past INT_ROWS times codes without levels through `dequantizing_gemm`
    (codes widened in 128.0's or 256.0's mantissa, scaled in float32, rounded to the rows'
    dtype, the weight tile the dot's first operand): within float16's rounding of the float64
    product on the exact de-quantized weight, for each setting of `dequantizing_tiles`,
    Hopper's and older GPUs' (the wide one where the weight counts as wide: 128 rows a
    program, or two programs of 64), 4- and 8-bit codes, groups of 32 and 16, offsets and
    none, 100 outputs (not a multiple of a tile) and 352 inputs (11 groups: the step of
    inputs halved to 32)."""
    from gguf import GGMLQuantizationType

    from aserve.quant import cuda
    from aserve.quant.gguf import decode
    from tests.test_quant import random_blocks

    kind = GGMLQuantizationType[qtype]
    codes = decode(torch.from_numpy(random_blocks(kind, 100, cols, seed=7)), kind, cols)
    monkeypatch.setattr(cuda, "gpu_capability", lambda device: (9, 0) if hopper else (8, 9))
    weight = cuda.CudaWeight(codes, DEVICE, torch.float16)
    assert weight.hopper == hopper
    monkeypatch.setattr(cuda, "WIDE_TILE_CODES", 100 * cols)
    exact_weight = codes.dequantize().double()
    for rows in (3, 12, 40, 100):
        x = torch.randn(rows, cols, generator=gen(50 + rows)).half().to(DEVICE)
        assert weight.takes_dequantizing_tiles(x) and not weight.takes_integer_dots(x)
        exact = x.cpu().double() @ exact_weight.T
        out = weight.linear(x, None).cpu()
        assert out.dtype == torch.float16 and out.shape == (rows, 100)
        tolerance = 2e-3 * float(exact.abs().max())
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=tolerance)


def test_few_rows_take_integer_dots_then_dequantizing_tiles() -> None:
    """Which rows take which kernel: 16-bit rows beside codes without levels take the
    integer dot products up to INT_ROWS, then `dequantizing_gemm` up to TILE_ROWS
    (WIDE_TILE_ROWS for a weight of at least WIDE_TILE_CODES codes), then neither; float32
    rows, codes of levels and rows not in steps of 32 inputs never."""
    from gguf import GGMLQuantizationType

    from aserve.quant.codes import quantize
    from aserve.quant.cuda import (
        INT_ROWS,
        TILE_ROWS,
        WIDE_TILE_CODES,
        WIDE_TILE_ROWS,
        CudaWeight,
    )
    from aserve.quant.gguf import decode
    from tests.test_quant import random_blocks

    def weight(qtype: str, outputs: int = 64) -> CudaWeight:
        kind = GGMLQuantizationType[qtype]
        blocks = torch.from_numpy(random_blocks(kind, outputs, 256, seed=6))
        return CudaWeight(decode(blocks, kind, 256), DEVICE, torch.float16)

    def rows(count: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.zeros(count, 256, dtype=dtype)

    assert 1 < INT_ROWS < TILE_ROWS < WIDE_TILE_ROWS
    wide = weight("Q4_0", WIDE_TILE_CODES // 256)
    for codes in (weight("Q4_K"), weight("Q8_0"), wide):
        most = WIDE_TILE_ROWS if codes is wide else TILE_ROWS
        for count in range(1, most + 2):
            assert codes.takes_integer_dots(rows(count)) == (count <= INT_ROWS)
            assert codes.takes_dequantizing_tiles(rows(count)) == (count <= most), count
        assert not codes.takes_integer_dots(rows(2, torch.float32))
        assert not codes.takes_dequantizing_tiles(rows(8, torch.float32))
    levels = weight("IQ4_XS")
    assert not levels.takes_integer_dots(rows(1))
    assert not levels.takes_dequantizing_tiles(rows(8))
    # rows of 48 inputs in groups of 16 (no format makes them) keep the 16-row tiles
    odd = quantize(torch.randn(64, 48, generator=gen(8)), 4, group=16)
    uneven = CudaWeight(odd, DEVICE, torch.float16)
    x = torch.randn(8, 48, generator=gen(9)).half()
    assert not uneven.takes_dequantizing_tiles(x)
    exact = x.double() @ odd.dequantize().double().T
    out = uneven.linear(x.to(DEVICE), None).cpu().double()
    torch.testing.assert_close(out, exact, rtol=0, atol=2e-3 * float(exact.abs().max()))


def test_book_entries_past_their_book_are_refused_at_load() -> None:
    """The CUDA kernels read the book unchecked, so an entry past it is refused at load."""
    from gguf import GGMLQuantizationType

    from aserve.quant.cuda import CudaWeight
    from aserve.quant.gguf import decode
    from tests.test_quant import random_blocks

    kind = GGMLQuantizationType.IQ2_XXS
    codes = decode(torch.from_numpy(random_blocks(kind, 8, 256, seed=4)), kind, 256)
    assert codes.runs is not None
    entries = codes.runs.entries.clone()
    entries[3, 1] = codes.runs.entry_limit
    with pytest.raises(ValueError, match="past the end of their book"):
        CudaWeight(codes._replace(runs=codes.runs._replace(entries=entries)), DEVICE, F32)


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 128, 8), (5, 60, 6), (64, 8, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_kernel_routing_is_torchs(
    tokens: int, experts: int, top_k: int, renormalize: bool, dtype: torch.dtype
) -> None:
    """layers/moe_route_triton.py against `moe.route`'s torch ops: experts of the same
    probabilities in the same (descending) order, so the same experts where no two tie
    (float32 logits); of tied float16 logits it takes the lower expert, where torch's choice
    is its own. Weights to a float32 step (the exponentials' rounding) before the cast."""
    from aserve.layers.moe import route
    from aserve.layers.moe_route_triton import route_kernel

    logits = (torch.randn(tokens, experts, generator=gen(70 + tokens)) * 3).to(dtype)
    weights, ids = route_kernel(logits.to(DEVICE), top_k, renormalize)
    expected_weights, expected_ids = route(logits, top_k, renormalize)
    assert weights.dtype == dtype and ids.dtype == torch.int64
    probs = torch.softmax(logits.float(), -1)
    assert torch.equal(probs.gather(1, ids.cpu()), probs.gather(1, expected_ids))
    if dtype == torch.float32:
        assert torch.equal(ids.cpu(), expected_ids)
    step = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=step, atol=step)


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 128, 8), (7, 160, 8), (64, 8, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_kernel_sigmoid_routing_is_torchs(
    tokens: int, experts: int, top_k: int, renormalize: bool, dtype: torch.dtype
) -> None:
    """The kernel's sigmoid routing (GLM-4.5's, one group) against `moe.route_deepseek`'s
    torch ops: the same experts in descending order of score plus bias (float32 logits, as
    the router makes them; no ties), weighed by the scores alone, times the scaling, in the
    rows' dtype."""
    from aserve.config import RouterStyle
    from aserve.layers.moe import route_deepseek
    from aserve.layers.moe_route_triton import route_kernel

    logits = torch.randn(tokens, experts, generator=gen(90 + tokens)) * 2
    correction = torch.randn(experts, generator=gen(91)) * 0.5
    style = RouterStyle(sigmoid=True, scaling=2.5)
    weights, ids = route_kernel(
        logits.to(DEVICE), top_k, renormalize, correction.to(DEVICE), 2.5, dtype
    )
    expected_weights, expected_ids = route_deepseek(
        logits, correction, top_k, renormalize, style, dtype
    )
    assert weights.dtype == dtype and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), expected_ids)
    step = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=step, atol=step)


@pytest.mark.parametrize("renormalize", [True, False])
def test_one_kernel_softmax_routing_with_scaling_is_torchs(renormalize: bool) -> None:
    """DeepSeek-V2's router in one group (V2-Lite's): softmax scores of float32 logits, the
    k largest, times `routed_scaling_factor`, in the rows' dtype: the kernel against
    `moe.route_deepseek`'s torch ops."""
    from aserve.config import RouterStyle
    from aserve.layers.moe import route_deepseek
    from aserve.layers.moe_route_triton import route_kernel

    logits = torch.randn(5, 64, generator=gen(95)) * 2
    style = RouterStyle(group_best=1, scaling=1.5, in_float32=True)
    weights, ids = route_kernel(logits.to(DEVICE), 6, renormalize, None, 1.5, torch.float16)
    expected_weights, expected_ids = route_deepseek(
        logits, None, 6, renormalize, style, torch.float16
    )
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block", "used"),
    [(1, 128, 8, 16, None), (3, 8, 2, 16, 3), (64, 128, 8, 32, None), (37, 60, 4, 16, 20)],
)
def test_one_program_block_layout_is_the_torch_layout(
    tokens: int, experts: int, top_k: int, block: int, used: int | None
) -> None:
    """layers/moe_align_triton.py's one-program layout against `align_blocks`' torch ops,
    equal slot for slot: one token, experts that get nothing, a count of experts that is no
    power of two, and the largest batch it takes (512 pairs)."""
    from aserve.layers.moe_align_triton import MAX_PAIRS, device_layout
    from aserve.layers.moe_layout import align_blocks

    scores = torch.randn(tokens, used or experts, generator=gen(60 + tokens))
    ids = torch.topk(scores, top_k, dim=-1).indices
    assert ids.numel() <= MAX_PAIRS
    expected = align_blocks(ids, experts, block)
    actual = device_layout(ids.to(DEVICE), experts, block)
    assert torch.equal(actual.sorted_pairs.cpu(), expected.sorted_pairs)
    assert torch.equal(actual.block_expert.cpu(), expected.block_expert)


@pytest.mark.parametrize(
    ("qtype", "inter"),
    [
        ("Q4_0", 64),
        ("Q8_0", 96),
        ("Q3_K", 256),
        ("Q6_K", 256),
        ("IQ4_XS", 256),
        ("IQ2_XS", 256),
        ("IQ3_XXS", 256),
    ],
)
@pytest.mark.parametrize("tokens", [1, 7, 40])
# random blocks make gate values of up to ~1e7: the interpreter's float32 exp overflows to
# inf in SiLU's sigmoid, which then is exactly 0 as on the GPU
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_fused_gguf_experts_match_float64(qtype: str, inter: int, tokens: int) -> None:
    """layers/moe_codes_triton.py's two launches over experts stacked in codes against the
    float64 definition on their exact de-quantized values: 4-bit groups of 32, 8-bit codes,
    3-bit groups of 16, Q6_K's 6-bit bytes, IQ4's levels, and IQ2_XS's and IQ3_XXS's book
    entries (16 and 24 bits); one token (decode),
    several whose experts repeat, and enough for tiles of 32 rows; experts that get no
    token."""
    check_fused_gguf_experts(qtype, inter, tokens)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_fused_experts_with_biases_and_clamped_swiglu(tokens: int, fp8: bool) -> None:
    """gpt-oss's experts in the fused kernels (layers/moe_triton.py): each expert's gate|up
    bias before the clamped SwiGLU, its down bias before the routing weight, float32 or FP8
    weights (scaled rows), gate and up values on both sides of the clamp; against the torch
    backend on the same weights. Without a down bias (tensor-parallel ranks after the
    first) the kernels leave it out as the torch backend does."""
    from aserve.config import ExpertStyle
    from aserve.layers.moe import torch_experts
    from aserve.layers.moe_triton import fused_experts
    from aserve.quant.fp8 import quantize_rows
    from tests.test_moe import random_experts

    x, w13, w2, weights, ids = random_experts(tokens, 8, 2, hidden=64, inter=48)
    w13, w2 = w13 * 4, w2 * 2  # gate and up values of a few units, past the clamp of 1.5
    b13 = torch.randn(8, 96, generator=gen(50))
    b2 = torch.randn(8, 64, generator=gen(51))
    style = ExpertStyle(biases=True, swiglu_alpha=1.702, swiglu_limit=1.5)
    s13 = s2 = None
    if fp8:
        q13, q2 = quantize_rows(w13.flatten(0, 1)), quantize_rows(w2.flatten(0, 1))
        w13, s13 = q13.values.view(w13.shape), q13.scales.view(w13.shape[:2])
        w2, s2 = q2.values.view(w2.shape), q2.scales.view(w2.shape[:2])
    on = [t if t is None else t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2, b13, b2)]
    for down_bias in (on[8], None):
        args = (*on[:8], down_bias, style)
        expected = torch_experts(*args)
        actual = fused_experts(*args)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    if not fp8:  # the clamp is reached
        assert (x @ w13[0].T).abs().max() > 3 * style.swiglu_limit


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "inter"), [(1, 8, 2, 48), (3, 16, 4, 100), (4, 8, 8, 64)]
)
def test_gemv_experts_match_the_torch_backend(
    tokens: int, experts: int, top_k: int, inter: int, fp8: bool
) -> None:
    """A few tokens' experts as matrix-vector products (layers/moe_gemv_triton.py), as
    `fused_experts` runs FP8 ones in decode: against the torch backend on the same weights
    (float32, or FP8 rows with their scales), an expert width that no tile divides, tokens
    that share experts, every expert a token's."""
    from aserve.layers.moe import torch_experts
    from aserve.layers.moe_gemv_triton import GEMV_TOKENS, gemv_experts
    from aserve.layers.moe_triton import fused_experts
    from aserve.quant.fp8 import quantize_rows
    from tests.test_moe import random_experts

    assert tokens <= GEMV_TOKENS
    x, w13, w2, weights, ids = random_experts(tokens, experts, top_k, hidden=96, inter=inter)
    s13 = s2 = None
    if fp8:
        q13, q2 = quantize_rows(w13.flatten(0, 1)), quantize_rows(w2.flatten(0, 1))
        w13, s13 = q13.values.view(w13.shape), q13.scales.view(w13.shape[:2])
        w2, s2 = q2.values.view(w2.shape), q2.scales.view(w2.shape[:2])
    args = [t if t is None else t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2)]
    expected = torch_experts(*args)
    actual = gemv_experts(*args)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    if fp8:  # the path the backend takes for them
        assert torch.equal(fused_experts(*args), actual)


@pytest.mark.parametrize(("qtype", "inter", "tokens"), [("Q4_0", 64, 40), ("Q6_K", 256, 7)])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_fused_gguf_experts_in_wide_tiles_match_float64(
    qtype: str, inter: int, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 128 x 128 tiles of long prefill batches of wide experts, taken here at any size
    (with float32 activations: two stages)."""
    from aserve.layers import moe_codes_triton, moe_triton
    from tests.test_moe import force_wide_tiles

    blocks = force_wide_tiles(monkeypatch, moe_codes_triton, block_m_at=8)
    check_fused_gguf_experts(qtype, inter, tokens)
    assert blocks == [moe_triton.WIDE_BLOCK_M] * 2


@pytest.mark.parametrize("tokens", [1, 40])
def test_fused_mxfp4_experts_with_biases_and_clamped_swiglu(tokens: int) -> None:
    """gpt-oss's experts as its files hold them (MXFP4 blocks) in the fused code kernels,
    with their biases and clamped SwiGLU, against the float64 definition on the exact
    de-quantized values, with and without the down biases (a rank after the first)."""
    check_fused_gguf_experts("MXFP4", 64, tokens, gpt_oss=True)


def check_fused_gguf_experts(qtype: str, inter: int, tokens: int, gpt_oss: bool = False) -> None:
    from gguf import GGMLQuantizationType

    from aserve.layers.moe import route, torch_experts
    from aserve.layers.moe_codes_triton import fused_code_experts, stack_experts
    from aserve.quant.gguf import decode
    from tests.test_quant import random_blocks

    kind = GGMLQuantizationType[qtype]
    num_experts, hidden = 6, 256

    def part(rows: int, cols: int, seed: int) -> Codes:
        """One part of every expert, decoded at once (`[E * rows, cols]`), as a file's."""
        raw = random_blocks(kind, num_experts * rows, cols, seed=seed)
        return decode(torch.from_numpy(raw), kind, cols)

    def exact(codes: Codes, rows: int) -> torch.Tensor:
        return codes.dequantize().double().view(num_experts, rows, -1)

    gate, up, down = part(inter, hidden, 1), part(inter, hidden, 2), part(hidden, inter, 3)
    stacked13 = stack_experts(gate.interleave_blocks(up, num_experts), num_experts, DEVICE, F32)
    stacked2 = stack_experts(down, num_experts, DEVICE, F32)
    assert stacked13 is not None and stacked2 is not None
    assert (stacked13.experts, stacked13.rows, stacked13.cols) == (num_experts, 2 * inter, hidden)
    exact13 = torch.cat([exact(gate, inter), exact(up, inter)], 1)

    x = torch.randn(tokens, hidden, generator=gen(51)) / 8
    # experts 4 and 5 get no token
    weights, ids = route(torch.randn(tokens, 4, generator=gen(52)), 2, renormalize=True)
    on = (x.to(DEVICE), stacked13, stacked2, weights.to(DEVICE), ids.to(DEVICE))
    if not gpt_oss:
        out = fused_code_experts(*on)
        expected = torch_experts(x.double(), exact13, exact(down, hidden), weights.double(), ids)
        assert out.shape == (tokens, hidden)
        tolerance = 1e-5 * float(expected.abs().max())
        torch.testing.assert_close(out.cpu().double(), expected, rtol=0, atol=tolerance)
        return
    from aserve.config import ExpertStyle

    x = x * 16  # gate and up values past the clamp of 1.5
    on = (x.to(DEVICE), *on[1:])
    style = ExpertStyle(biases=True, swiglu_alpha=1.702, swiglu_limit=1.5)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen(53))
    b2 = torch.randn(num_experts, hidden, generator=gen(54))
    for down_bias in (b2, None):
        on_device = None if down_bias is None else down_bias.to(DEVICE)
        out = fused_code_experts(*on, b13.to(DEVICE), on_device, style)
        expected = torch_experts(
            x.double(), exact13, exact(down, hidden), weights.double(), ids, None, None,
            b13.double(), None if down_bias is None else down_bias.double(), style,
        )  # fmt: skip
        tolerance = 1e-5 * float(expected.abs().max())
        torch.testing.assert_close(out.cpu().double(), expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize(
    ("n", "k", "gated", "fp8"),
    [
        (64, 4096, False, True),
        (32, 14336, False, True),
        (64, 4096, False, False),
        (16, 9216, True, False),
    ],
)
def test_gemv_tiles_loaded_before_the_wait_change_no_bit(
    monkeypatch: pytest.MonkeyPatch, n: int, k: int, gated: bool, fp8: bool
) -> None:
    """The one-row GEMV's first tiles, loaded before its PDL wait (one, or two over a long
    row), are added in the order the loop would add them: the same bits as with none,
    plain, FP8 and gated."""
    from aserve.layers import gemv as module

    weight = torch.randn(n, k, generator=gen(30)) / k**0.5
    scales = torch.rand(n, generator=gen(31)) + 0.5 if fp8 else None
    if fp8:
        weight = weight.to(FP8)
    x = torch.randn(1, 2 * k if gated else k, generator=gen(32)).bfloat16()

    def run() -> torch.Tensor:
        return module.gemv(
            x.to(DEVICE),
            weight.to(DEVICE, weight.dtype if fp8 else torch.bfloat16),
            None,
            gated=gated,
            scales=None if scales is None else scales.to(DEVICE),
        )

    block_k = 1024 if gated or fp8 else 2048
    assert module._preload_tiles(k, block_k, True) == (2 if k > 8192 else 1)
    preloaded = run()
    monkeypatch.setattr(module, "_preload_tiles", lambda k, block_k, even: 0)
    assert torch.equal(preloaded, run())


@pytest.mark.parametrize(
    ("scores", "head_dim"), [("plain", 64), ("sinks", 64), ("softcap", 64), ("plain", 96)]
)
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("kernel", ["split", "whole"])
@pytest.mark.parametrize(("page_size", "fp8"), [(16, False), (256, True)])
def test_triton_decode_kernels_equal_plain_attention(
    monkeypatch: pytest.MonkeyPatch,
    kernel: str,
    page_size: int,
    fp8: bool,
    window: int,
    scores: str,
    head_dim: int,
) -> None:
    """The Triton decode attention (attention/triton_decode.py) against softmax attention
    written out in float32 over the K and V the pool reads back, for contexts of 1 token to
    more than a page, on pages in scattered order, over a 16-bit and an FP8 cache (scaled);
    the split kernels with their merge (over more splits than it reads at a time, run twice:
    its tickets are back at 0 after each run), or (`kernel`) the whole-context one. With a
    `window` (Gemma 3's sliding layers) a query reads the last 100 positions, its scores
    scaled by 1 / sqrt(24) (`query_pre_attn_scalar`). With `sinks` (gpt-oss) each head's
    softmax also sums e^sink, sinks from far below to far above the scores; with `softcap`
    (Gemma 2) the scaled scores are capped at 1.5 (they spread over about +-4). Heads of 96
    (Phi-3-mini) are read as padded to 128. tests/test_gpu.py has more shapes on the GPU."""
    from aserve.attention import triton_decode
    from aserve.kvcache.pool import KVPool

    monkeypatch.setattr(triton_decode, "WHOLE_MIN_PROGRAMS", 1 if kernel == "whole" else 1 << 30)
    q_heads, kv_heads = 8, 2
    lengths = [1, 7, 300, 64, 129, 1100]
    pages_per_row = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_row) + 3
    pool = KVPool(1, num_pages, page_size, kv_heads, head_dim, DTYPE, DEVICE, FP8 if fp8 else None)
    if fp8:
        pool.set_scales(0, 0.5, 2.0)
    slots = torch.arange(num_pages * page_size, device=DEVICE)
    pool.store(
        0,
        slots,
        torch.randn(len(slots), 2, kv_heads, head_dim, generator=gen(40)).to(DEVICE, DTYPE),
    )
    page_ids = (torch.randperm(num_pages - 1, generator=gen(41)) + 1)[: sum(pages_per_row)].int()
    indptr = torch.tensor([0, *torch.tensor(pages_per_row).cumsum(0).tolist()], dtype=torch.int32)
    last = [n - (p - 1) * page_size for n, p in zip(lengths, pages_per_row, strict=True)]
    q = torch.randn(len(lengths), q_heads, head_dim, generator=gen(42)).to(DEVICE, DTYPE)
    sm_scale = 24**-0.5 if window else head_dim**-0.5
    sink_logits = torch.tensor([-20.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 20.0])
    softcap = 1.5
    expected = []
    for row, n in enumerate(lengths):
        pages = page_ids[indptr[row] : indptr[row + 1]].long().to(DEVICE)
        kv = pool.gather(0, (pages[:, None] * page_size + slots[:page_size]).flatten()[:n]).float()
        kv = kv[-window:] if window else kv
        k, v = (kv[:, i].repeat_interleave(q_heads // kv_heads, dim=1) for i in (0, 1))
        logits = torch.einsum("hd,nhd->hn", q[row].float(), k) * sm_scale
        if scores == "softcap":
            logits = softcap * torch.tanh(logits / softcap)
        if scores == "sinks":
            logits = torch.cat((logits, sink_logits.to(DEVICE)[:, None]), -1)
        weights = logits.softmax(-1)[:, : k.shape[0]]
        expected.append(torch.einsum("hn,nhd->hd", weights, v))
    wrapper = triton_decode.TritonDecodeWrapper(DEVICE)
    wrapper.plan(
        indptr,
        page_ids,
        torch.tensor(last, dtype=torch.int32),
        num_qo_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        q_data_type=DTYPE,
        kv_data_type=pool.storage_dtype,
    )
    assert (wrapper.num_splits == 1) == (kernel == "whole")
    shape = (-1, page_size, kv_heads, head_dim)
    for _ in range(2):
        cache = (pool.k[0].view(shape), pool.v[0].view(shape))
        scaled = {"window": window, "sm_scale": sm_scale} if window else {}
        if scores == "sinks":
            scaled["sinks"] = sink_logits.to(DEVICE)
        if scores == "softcap":
            scaled["softcap"] = softcap
        out = wrapper.run(q, cache, *pool.scale_pairs[0], **scaled)
        torch.testing.assert_close(out.float(), torch.stack(expected), atol=1e-2, rtol=1e-2)
        assert not wrapper.tickets.any()
    if kernel == "split" and not window:  # the longest context's merge reads in two goes
        block = triton_decode.FP8_SPLIT_SETTINGS[-1][1] if fp8 else triton_decode.SPLIT_BLOCK_TOKENS
        chunk = math.ceil(math.ceil(1100 / wrapper.num_splits) / block) * block
        assert math.ceil(1100 / chunk) > triton_decode.MERGE_SPLITS.value


def test_flashinfer_builds_the_decode_modules_its_batches_plan() -> None:
    """A start builds FlashInfer's decode modules that some batch will plan, and no other."""
    from aserve.attention.flashinfer import decode_modules

    # Llama-3.1-8B (4 query heads a KV head): tensor cores at every batch
    assert decode_modules(32, 8, 128, 256) == ["decode"]
    # Qwen3-0.6B (2): Triton from 40 requests, FlashInfer's 3-39 on tensor cores
    assert decode_modules(16, 8, 128, 256) == ["decode"]
    # SmolLM2-135M (3 KV heads): FlashInfer up to 106 requests, on CUDA cores above 64
    assert decode_modules(9, 3, 64, 256) == ["decode", "CUDA-core decode"]
    assert decode_modules(9, 3, 64, 64) == ["decode"]
    # heads of 96 (Phi-3-mini), which FlashInfer's kernels do not take: Triton at every batch
    assert decode_modules(8, 4, 96, 256) == []
    assert decode_modules(16, 8, 128, 2) == []  # Triton takes one and two requests


def test_pdl_only_for_few_rows_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch (layers/pdl.py) goes to launches over up to
    `PDL_MAX_ROWS` rows on a GPU of compute capability 9.0 or newer, never elsewhere."""
    from aserve.layers import pdl

    off = {"PDL": False, "launch_pdl": False}
    assert pdl.pdl_options(torch.device("cpu"), 1) == off
    hopper, older = torch.device("cuda", 0), torch.device("cuda", 1)
    capabilities = {hopper: (9, 0), older: (8, 9)}
    monkeypatch.setattr(pdl, "gpu_capability", lambda device: capabilities.get(device))
    assert pdl.pdl_options(hopper, 1) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_options(hopper, pdl.PDL_MAX_ROWS)["PDL"]
    assert pdl.pdl_options(hopper, pdl.PDL_MAX_ROWS + 1) == off
    assert pdl.pdl_options(older, 1) == off


HOPPER_COMPILE = """
import sys
from concurrent.futures import ThreadPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aserve.layers import moe_codes_triton
from aserve.quant import cuda
from aserve.quant.gguf import IQ4_LEVELS

POINTERS = {"levels_ptr": "*bf16", "book_ptr": "*i32", "scales_ptr": "*fp16",
            "offsets_ptr": "*fp16", "y_ptr": "*fp32"}
GEMV = {"x_ptr": "*bf16", "words_ptr": "*i32", **POINTERS, "N": "i32", "K": "i32"}
BOOK_GEMV = {"x_ptr": "*bf16", "entries_ptr": "*u8", **POINTERS, "N": "i32", "K": "i32"}
GEMM = {"x_ptr": "*bf16", "x_sums_ptr": "*fp32", "codes_ptr": "*u8", **POINTERS,
        "M": "i32", "N": "i32", "K": "i32"}
MOE = {"a_ptr": "*bf16", "codes_ptr": "*u8", "levels_ptr": "*bf16", "book_ptr": "*i32",
       "scales_ptr": "*fp16", "offsets_ptr": "*fp16", "c_ptr": "*bf16", "weight_ptr": "*fp32",
       "bias_ptr": "*bf16", "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32",
       "num_pairs": "i32", "num_experts": "i32", "n_size": "i32", "N": "i32", "K": "i32",
       "stride_am": "i32", "stride_cm": "i32", "stride_bias": "i32", "swiglu_alpha": "fp32",
       "swiglu_limit": "fp32"}
permutes = cuda.level_permutes(IQ4_LEVELS)
compiled = 0
jobs = []
# (four-bit, levels, book entries' low bits and signs): 4-bit codes of levels, plain 4- and
# 8-bit codes, and 16- and 24-bit book entries
for four_bit, levels, low_bits, signs_at in (
    (True, True, 0, 0), (True, False, 0, 0), (False, False, 0, 0), (True, True, 8, 0),
    (True, True, 8, 512),
):
    flags = {"FOUR_BIT": four_bit, "LEVELS": levels, "PERMUTE": True,
             "LEVEL_ASM": permutes if levels else "", "LOW_BITS": low_bits,
             "SIGNS_AT": signs_at, "OFFSETS": not levels}
    if not levels:
        flags["levels_ptr"] = None  # as the launches pass a weight without levels
    if not low_bits:
        flags["book_ptr"] = None
    if levels:
        flags["offsets_ptr"] = None
    gemv = (cuda.book_gemv, BOOK_GEMV, {"GROUP": 32, "BLOCK_N": 512, "SPLIT_K": 2, "PDL": True},
            {"num_warps": 4, "num_stages": 3}) if low_bits else (
            cuda.gemv, GEMV, {"GROUP": 32, "BLOCK_W": 32, "SPLIT_K": 2, "PDL": True},
            {"num_warps": 1, "num_stages": 3})
    for fn, signature, rest, options in (
        gemv,
        (cuda.quantized_gemm, GEMM, {"GROUP": 16 if levels else 32, "PRECISION": "tf32",
         "BLOCK_M": 16, "BLOCK_N": 64, "GROUPS_PER_STEP": 8 if low_bits else 2, "SPLIT_K": 1},
         {"num_warps": 4, "num_stages": 4}),
        # codes of levels with gpt-oss's biases and clamp (MXFP4's), the others without
        (moe_codes_triton._moe_codes_gemm, MOE, {"ROWS_PER_A": 1, "GATED": True,
         "BIAS": levels, "CLAMPED": levels, "GROUP": 32, "PRECISION": "tf32", "BLOCK_M": 16,
         "BLOCK_N": 64, "BLOCK_K": 128}, {"num_warps": 4, "num_stages": 3}),
    ):
        constants = {k: v for k, v in {**flags, **rest}.items() if k in fn.arg_names}
        # in the kernel's order of parameters, which the constexprs' indices follow
        names = {p: "constexpr" if p in constants else signature[p] for p in fn.arg_names}
        source = ASTSource(
            fn=fn,
            signature=names,
            constexprs={(list(names).index(k),): v for k, v in constants.items()},
        )
        jobs.append((source, options, (fn.__name__, four_bit, levels)))
# the one-row product of plain 4-bit codes by integer dot products, its nibbles spread by
# byte permutes
INT_GEMV = {"x_ptr": "*bf16", "words_ptr": "*i32", "scales_ptr": "*fp16",
            "offsets_ptr": "*fp16", "y_ptr": "*fp32", "N": "i32", "K": "i32", "PTX": "constexpr",
            "OFFSETS": "constexpr", "FOUR_BIT": "constexpr", "GROUP": "constexpr",
            "BLOCK_W": "constexpr", "SPLIT_K": "constexpr", "PDL": "constexpr"}
# and of a few rows
INT_ROWS = {**{k: v for k, v in INT_GEMV.items() if k != "K" and k != "N"}, "M": "i32",
            "N": "i32", "K": "i32", "ROWS": "constexpr"}
for four_bit, group in ((True, 32), (False, 16)):
    int_constants = {"PTX": True, "OFFSETS": True, "FOUR_BIT": four_bit, "GROUP": group,
                     "BLOCK_W": 64, "SPLIT_K": 2, "PDL": True}
    for fn, signature, extra in ((cuda.int_gemv, INT_GEMV, {}),
                                 (cuda.int_rows, INT_ROWS, {"ROWS": 4})):
        constants = {**int_constants, **extra}
        names = {p: signature[p] for p in fn.arg_names}
        source = ASTSource(
            fn=fn,
            signature=names,
            constexprs={(list(names).index(k),): v for k, v in constants.items()},
        )
        jobs.append((source, {"num_warps": 1}, (fn.__name__, four_bit, True)))
# the tiles de-quantized in registers, 4-bit codes with offsets and 8-bit ones without
DEQUANTIZING = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp16",
                "offsets_ptr": "*fp16", "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
for four_bit in (True, False):
    constants = {"FOUR_BIT": four_bit, "OFFSETS": four_bit, "GROUP": 32, "BLOCK_M": 16,
                 "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 2, "PDL": True}
    if not four_bit:
        constants["offsets_ptr"] = None
    fn = cuda.dequantizing_gemm
    names = {p: "constexpr" if p in constants else DEQUANTIZING[p] for p in fn.arg_names}
    source = ASTSource(
        fn=fn,
        signature=names,
        constexprs={(list(names).index(k),): v for k, v in constants.items()},
    )
    jobs.append((source, {"num_warps": 4, "num_stages": 1}, (fn.__name__, four_bit, False)))


def compile_for_hopper(job):
    return triton.compile(job[0], target=GPUTarget("cuda", 90, 32), options=job[1])


# Triton's compiler lets go of the GIL: two threads take half the time on two cores.
try:
    with ThreadPoolExecutor(2) as pool:
        kernels = list(pool.map(compile_for_hopper, jobs))
except FileNotFoundError as error:  # no ptxas in this Triton
    print("no ptxas:", error)
    sys.exit(0)
for kernel, (_, _, (name, four_bit, permutes)) in zip(kernels, jobs):
    if name == "dequantizing_gemm":  # Hopper's tensor cores, the weight tile from registers
        assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in kernel.asm["ptx"]
    else:
        assert ("prmt" in kernel.asm["ptx"]) == permutes, (name, four_bit, permutes)
    assert ("dp2a" in kernel.asm["ptx"]) == (name in ("int_gemv", "int_rows")), name
    compiled += 1
print("compiled", compiled)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests above compile them")
def test_quantized_products_compile_for_hopper_without_a_gpu(tmp_path: Path) -> None:
    """Triton's interpreter, which runs the kernels on CPU here, neither compiles them nor runs
    PTX, so a front-end error or bad inline PTX showed only on the GPU machine (two device
    runs lost, bench/NOTES.md). Here quant/cuda.py's one-row and tiled products are compiled
    for sm_90 to PTX and by ptxas, in a process without the interpreter, with the fused MoE
    kernel of layers/moe_codes_triton.py: codes of levels (their byte permutes in the PTX;
    with gpt-oss's biases and clamped SwiGLU), plain 4-bit and 8-bit codes, with the None
    table that launches pass for weights without levels, and the integer dot products of
    4-bit and 8-bit codes, one row's (`int_gemv`) and a few rows' (`int_rows`), and the tiles
    de-quantized in registers (`dequantizing_gemm`, on Hopper's wgmma)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", HOPPER_COMPILE],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    if result.stdout.startswith("no ptxas"):
        pytest.skip(f"this Triton has no ptxas to compile with: {result.stdout.strip()}")
    assert result.returncode == 0 and "compiled 21" in result.stdout, result.stderr[-3000:]
