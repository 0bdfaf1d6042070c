"""Embeddings on CUDA in bf16 (FlashInfer prefill, in chunks and from prefix hits) against
transformers' base model and the float32 CPU engine (run on the GPU machine; skipped without
CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM
from tests.embedding_refs import PROMPTS, embedded, reference
from tests.test_gpu import KERNEL_SHAPES
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bf16_embeddings_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    """Cosine similarity past 0.999 with transformers' float32 pooled base model; the same
    vectors (to bf16 rounding) in chunks of 4 tokens and from prefix hits."""
    folder = make_tiny_model(family, tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    expected = reference(folder, PROMPTS)
    llm = make_llm(folder, device="cuda", dtype="bfloat16", is_embedding=True)
    assert type(llm.runtime.engine.attn).__name__ == "FlashInferBackend"
    assert llm.runtime.engine.graphs is None
    got = embedded(llm, PROMPTS)
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.dot(ours, theirs).item() > 0.999
    again = embedded(llm, PROMPTS)
    chunked = make_llm(
        folder, device="cuda", dtype="bfloat16", is_embedding=True, max_prefill_length=4
    )
    for first, hit, piece in zip(got, again, embedded(chunked, PROMPTS), strict=True):
        assert torch.dot(first, hit).item() > 0.9999
        assert torch.dot(first, piece).item() > 0.999
