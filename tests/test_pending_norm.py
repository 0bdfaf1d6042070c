"""A one-row add and norm left to the product after it (layers/pending_norm.py): where no
kernel takes it over (every CPU path, shapes the GPU kernels' blocks do not fill) it is
computed as the norm computes it. The CUDA kernels that take it are test_fp8_gpu.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.layers.norm import RMSNorm
from aserve.layers.pending_norm import PendingNorm
from aserve.models.decoder import DecoderLayer
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resolve_has_the_norms_bits(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(1, 96, generator=generator).to(dtype) for _ in "xr")
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data.copy_(torch.rand(96, generator=generator) + 0.5)
    expected, expected_residual = norm.add_and_norm(x.clone(), residual.clone())
    pending = PendingNorm(x, residual, norm.weight, 1e-6, torch.empty_like(residual))
    assert torch.equal(pending.resolve(), expected)
    assert torch.equal(pending.new_residual, expected_residual)


def test_products_without_a_kernel_for_it_resolve_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Llama on CPU with every layer's norms left to the products after them (which
    on CPU compute them first: the QKV and gate|up products, through the MLP's gated path)
    gives the tokens and logprobs it gives with the norms' own kernels."""
    folder = make_tiny_model("llama", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    prompts = [[5, 17, 42, 9, 100, 3], [300, 4, 4, 61]]
    options = {"device": "cpu", "dtype": "float32", "num_pages": 256}
    with LLM(str(folder), **options) as llm:
        want = llm.generate(prompts, params)
        layers = [m for m in llm.runtime.engine.model.modules() if isinstance(m, DecoderLayer)]
        for layer in layers:
            layer.input_layernorm.fold_one_row = True
            layer.post_attention_layernorm.fold_one_row = True
        calls: list[int] = []
        original = PendingNorm.resolve

        def counted(self: PendingNorm) -> torch.Tensor:
            calls.append(1)
            return original(self)

        monkeypatch.setattr(PendingNorm, "resolve", counted)
        got = llm.generate([prompts[0]], params) + llm.generate([prompts[1]], params)
    assert calls, "one-row steps should have left their norms to the products"
    for ours, theirs in zip(got, want, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs is not None and theirs.logprobs is not None
        assert [lp.logprob for lp in ours.logprobs] == pytest.approx(
            [lp.logprob for lp in theirs.logprobs], abs=1e-5
        )
