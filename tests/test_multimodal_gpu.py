"""Vision-language checkpoints' language models on CUDA in bf16 (FlashInfer, decode graphs)
against transformers' whole model on text (run on the GPU machine; skipped without CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM
from tests.test_gpu import KERNEL_SHAPES, assert_greedy_logprobs_close
from tests.tiny_models import make_tiny_vision_language

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SECTIONS = {"rope_type": "default", "mrope_section": [8, 12, 12], "mrope_interleaved": True}
"""Qwen3-VL's M-RoPE sections over heads of 64 (32 frequencies)."""


@pytest.mark.parametrize(
    "architecture", ["Gemma3ForConditionalGeneration", "Qwen3VLForConditionalGeneration"]
)
def test_language_model_bf16_logprobs_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path, architecture: str
) -> None:
    shapes = {**KERNEL_SHAPES, "head_dim": 64}
    if architecture.startswith("Qwen3"):
        shapes["rope_scaling"] = SECTIONS
    hf = make_tiny_vision_language(architecture, tmp_path, overrides=shapes)
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16")
    assert llm.runtime.engine.model_config.language_model_of == architecture
    assert type(llm.runtime.engine.attn).__name__ == "FlashInferBackend"
    assert llm.runtime.engine.graphs is not None
    assert_greedy_logprobs_close(llm, hf)
