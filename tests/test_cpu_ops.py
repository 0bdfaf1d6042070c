"""aserve's CPU kernels for the decoder's small steps (layers/cpu_ops.py) against the layers'
plain PyTorch formulas, which the float path runs and Hugging Face matches op for op."""

from __future__ import annotations

import pytest
import torch

from aserve.layers.cpu_ops import CpuKernels
from aserve.layers.norm import RMSNorm
from aserve.layers.rotary import RotaryEmbedding
from aserve.quant.native import native_kernels

pytestmark = pytest.mark.skipif(
    not native_kernels(), reason="aserve's CPU kernels did not build (no C++ compiler here)"
)
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def test_norms_match_the_plain_formula() -> None:
    generator = torch.Generator().manual_seed(0)
    plain, fused = RMSNorm(96, 1e-6), RMSNorm(96, 1e-6, CpuKernels())
    weight = torch.rand(96, generator=generator) + 0.5
    plain.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    wide = torch.randn(5, 160, generator=generator)
    x = wide[:, 32:128]  # a strided view, as Q and K are in the fused QKV output
    torch.testing.assert_close(fused(x), plain(x), **CLOSE)
    residual = torch.randn(5, 96, generator=generator)
    expected_out, expected_residual = plain.add_and_norm(x.clone(), residual.clone())
    out, new_residual = fused.add_and_norm(x.contiguous(), residual.clone())
    torch.testing.assert_close(new_residual, expected_residual, **CLOSE)
    torch.testing.assert_close(out, expected_out, **CLOSE)
    heads = torch.randn(5, 4 * 32, generator=generator)
    small_plain, small_fused = RMSNorm(32, 1e-6), RMSNorm(32, 1e-6, CpuKernels())
    expected = heads.clone()
    small_plain.norm_heads(expected, 32)
    small_fused.norm_heads(heads, 32)
    torch.testing.assert_close(heads, expected, **CLOSE)


def test_rope_matches_the_plain_formula() -> None:
    generator = torch.Generator().manual_seed(1)
    plain = RotaryEmbedding(32, 128, 10000.0, None)
    fused = RotaryEmbedding(32, 128, 10000.0, None, CpuKernels())
    positions = torch.tensor([0, 5, 17, 127, 3])
    qkv = torch.randn(5, (4 + 2 + 2) * 32, generator=generator)
    expected = qkv.clone()
    plain(positions, expected[:, : 6 * 32], 4 * 32)
    fused(positions, qkv[:, : 6 * 32], 4 * 32)
    torch.testing.assert_close(qkv, expected, **CLOSE)
