"""The FP8 kernels that feed and compute a layer's products (quant/fp8_cuda.py): compiled on
a GPU, and on CPU under Triton's interpreter as tests/test_triton_kernels.py runs its own.
The fused norm and the fused gated activation must write the bytes and scales that the float
kernels followed by the quantization kernel write; the token-scaled product must equal the float64
product of the FP8 values it reads."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
from aserve.layers.cuda_ops import CudaKernels  # noqa: E402
from aserve.layers.tickets import split_tickets  # noqa: E402
from aserve.quant.fp8 import quantize_rows  # noqa: E402
from aserve.quant.fp8_activations import Fp8Activations  # noqa: E402
from aserve.quant.fp8_cuda import (  # noqa: E402
    norm_fp8,
    quantize_tokens,
    silu_fp8,
    token_scaled,
    token_scaled_config,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float16: the interpreter truncates to bfloat16 where the GPU rounds (test_triton_kernels.py)
DTYPE = torch.float16 if DEVICE.type == "cpu" else torch.bfloat16
ops = CudaKernels()


def rows_of_many_magnitudes(rows: int, cols: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-2, 2, rows)[:, None]
    return (torch.randn(rows, cols, generator=generator) * magnitudes).to(DEVICE, DTYPE)


def assert_same_fp8(got: Fp8Activations, values: torch.Tensor, scales: torch.Tensor) -> None:
    assert got.dtype == DTYPE and got.scales.shape == scales.shape
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_fp8_writes_what_the_norm_then_the_quantization_write(with_residual: bool) -> None:
    """Rows of magnitudes 0.01 to 100 and a length no power of two: the same FP8 bytes and
    scales as `fused_add_rmsnorm` (or `rmsnorm`) followed by `quantize_tokens`, and the same
    updated residual."""
    x = rows_of_many_magnitudes(5, 200, 0)
    residual = rows_of_many_magnitudes(5, 200, 1)
    weight = rows_of_many_magnitudes(1, 200, 2)[0]
    if with_residual:
        x_ref, residual_ref = x.clone(), residual.clone()
        ops.fused_add_rmsnorm(x_ref, residual_ref, weight, 1e-6)
        got = norm_fp8(x, residual, weight, 1e-6)
        assert torch.equal(residual, residual_ref)
    else:
        x_ref = ops.rmsnorm(x, weight, 1e-6)
        got = norm_fp8(x, None, weight, 1e-6)
    assert_same_fp8(got, *quantize_tokens(x_ref))


def test_silu_fp8_writes_what_the_activation_then_the_quantization_write() -> None:
    """Gate|up rows of magnitudes 0.01 to 100, halves no power of two wide: the same FP8
    bytes and scales as SiLU-and-mul followed by `quantize_tokens`."""
    gate_up = rows_of_many_magnitudes(6, 2 * 300, 3)
    assert_same_fp8(silu_fp8(gate_up), *quantize_tokens(ops.silu_and_mul(gate_up)))


@pytest.mark.parametrize(
    "config",
    [
        (32, 64, 128, 1, 4, 4, False),
        (16, 64, 128, 1, 4, 4, True),
        (32, 64, 128, 2, 4, 4, False),
        (16, 64, 128, 4, 4, 4, True),
    ],
)
@pytest.mark.parametrize("tokens", [3, 37])
def test_token_scaled_equals_the_float64_product(
    config: tuple[int, int, int, int, int, int, bool], tokens: int
) -> None:
    """FP8 activations and weight, a scale per token and per output row, with a bias: equal
    to the float64 product of the de-quantized operands within 1e-3 of a row's largest
    output (float32 accumulation gives 1e-7; Hopper's FP8 tensor cores add up in fewer bits,
    2e-4 here with the weight as the first operand: a twentieth of bf16's rounding), with
    tokens and outputs that the tiles do not divide, whole or split over K (the splits
    added up in the kernel, the same sum launch after launch), the weight or the
    activations as the tensor cores' first operand."""
    generator = torch.Generator().manual_seed(4)
    weight = quantize_rows(torch.randn(200, 512, generator=generator) * 0.03)
    values, scales = quantize_tokens(rows_of_many_magnitudes(tokens, 512, 5))
    bias = torch.randn(200, generator=generator).to(DEVICE, DTYPE)
    operands = (values, scales, weight.values.to(DEVICE), weight.scales.to(DEVICE), bias)
    out = token_scaled(*operands, torch.float32, config)
    # the last program of each tile added the splits up and left the tickets at zero: a
    # second launch adds them up alike
    assert not split_tickets(DEVICE).any()
    assert torch.equal(token_scaled(*operands, torch.float32, config), out)
    exact = (values.double() * scales.double()) @ weight.dequantize(torch.float64).to(DEVICE).T
    exact += bias.double()
    assert out.shape == (tokens, 200)
    error = (out.double() - exact).abs() / exact.abs().amax(dim=1, keepdim=True)
    assert error.max() <= 1e-3


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_token_scaled_settings_fit_their_products(n: int, k: int) -> None:
    """Llama-3.1-8B's products: the chosen settings divide K as the kernel requires, small
    batches always take the kernel and prefill-sized ones always cuBLAS; on a GPU with 99 KB
    of shared memory a block the same products take the kernel with tiles that fit."""
    for m in [2, 16, 32, 64, 128, 192, 256, 512, 16384]:
        config = token_scaled_config(m, n, k)
        if config is not None:
            assert k % (config[2] * config[3]) == 0
        assert (config is not None) if m <= 64 else True
        assert config is None if m > 256 else True
    assert token_scaled_config(16, 512, 1000) is None  # K no multiple of 128
    # Ada's and consumer Ampere's 99 KB a block: fewer stages, every setting fits
    for m in [2, 64, 160, 256]:
        config = token_scaled_config(m, n, k, shared_memory=99 * 1024)
        assert (config is None) == (token_scaled_config(m, n, k) is None)
        if config is not None:
            assert config[5] * (config[0] + config[1]) * config[2] <= 99 * 1024


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("tokens", [2, 13])
def test_token_scaled_silu_writes_what_the_activation_kernel_writes(
    swap: bool, tokens: int
) -> None:
    """A fused gate|up product (100 gate rows, then 100 up rows: tiles of pairs that do not
    divide them) that ends with SiLU(gate) * up: the same bits as the product followed by
    `silu_and_mul`."""
    generator = torch.Generator().manual_seed(6)
    weight = quantize_rows(torch.randn(200, 512, generator=generator) * 0.03)
    values, scales = quantize_tokens(rows_of_many_magnitudes(tokens, 512, 7))
    operands = (values, scales, weight.values.to(DEVICE), weight.scales.to(DEVICE), None, DTYPE)
    config = (16, 64, 128, 1, 4, 4, swap)
    activation = token_scaled(*operands, config, silu=True)
    assert activation.shape == (tokens, 100)
    assert torch.equal(activation, ops.silu_and_mul(token_scaled(*operands, config)))
