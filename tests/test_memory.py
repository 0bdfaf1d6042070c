"""KV sizing: the working memory kept out of the pool, and the start-up capacity line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM
from aserve.config import EngineConfig, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.engine.memory import working_memory_bytes
from tests.tiny_models import make_tiny_model


def model() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
    )


def test_working_memory_counts_prefill_graphs_and_sampler() -> None:
    config = EngineConfig(max_prefill_length=100, max_running_requests=8)
    # width per token: 3 * 64 residual/norm + (2 * 4 + 2 * 2) * 16 attention + 3 * 128 MLP
    width = 3 * 64 + 12 * 16 + 3 * 128
    expected = 100 * width * 2 + 8 * (width * 2 + 1000 * 2) + 4 * 8 * 1000 * 4
    assert working_memory_bytes(config, model(), TPGroup(), torch.bfloat16) == expected
    longer = EngineConfig(max_prefill_length=200, max_running_requests=8)
    assert working_memory_bytes(longer, model(), TPGroup(), torch.bfloat16) > expected


def test_capacity_line_uses_sglang_names(
    make_llm: Callable[..., LLM], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_tiny_model("llama", tmp_path)
    with caplog.at_level("INFO", logger="aserve.runtime"):
        llm = make_llm(
            folder, page_size=16, num_pages=9, max_prefill_length=32, max_running_requests=4
        )
    line = llm.runtime.capacity_line()
    assert line.startswith(
        "max_total_num_tokens=128, chunked_prefill_size=32, max_running_requests=4, "
        "context_len=128, available_host_mem="
    )
    assert line in caplog.text


def test_pretended_capability_parses_or_says_how() -> None:
    from aserve.config import ConfigError
    from aserve.engine.gpu import parse_capability, shared_memory_limit

    assert parse_capability("8.6") == (8, 6)
    assert parse_capability("9.0") == (9, 0)
    for bad in ("8", "8.x", "sm86", "8.6.1"):
        with pytest.raises(ConfigError, match="MAJOR.MINOR"):
            parse_capability(bad)
    assert shared_memory_limit((8, 6)) == shared_memory_limit((8, 9)) == 99 * 1024
    assert shared_memory_limit((8, 0)) < shared_memory_limit((9, 0))
