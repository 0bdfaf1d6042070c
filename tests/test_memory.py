"""KV sizing: the working memory kept out of the pool, and the start-up capacity line."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM
from aserve.config import EngineConfig, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.engine.memory import (
    MIN_PREFILL_LENGTH,
    GiB,
    fit_step_to_memory,
    kv_bytes_per_token,
    plan_num_pages,
    step_bytes,
    working_memory_bytes,
)
from aserve.kvcache.pages import PageTable
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


def test_step_counts_one_page_id_buffer_for_all_decode_graphs() -> None:
    """The captured sizes share one int32 buffer of the largest batch's pages at full
    context; with graphs off (or fewer graph rows) the step needs less."""
    tiny, bf16 = model(), torch.bfloat16
    base = EngineConfig(max_running_requests=300, page_size=4, cuda_graph_max_bs=0)
    without = step_bytes(base, tiny, TPGroup(), bf16, 512)
    graphs_up_to = {
        limit: step_bytes(
            EngineConfig(max_running_requests=300, page_size=4, cuda_graph_max_bs=limit),
            tiny,
            TPGroup(),
            bf16,
            512,
        )
        for limit in (None, 64)
    }
    pages_per_row = -(-513 // 4)
    assert graphs_up_to[None] - without == 256 * pages_per_row * 4
    assert graphs_up_to[64] - without == 64 * pages_per_row * 4


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
    # the log's line as this one, up to the free memory, read at another moment
    before_memory = line.rsplit("=", 1)[0]
    assert re.search(re.escape(before_memory) + r"=\d+\.\d\d GB", caplog.text), caplog.text


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


def test_triton_hash_thread_leaves_the_key_for_the_launches() -> None:
    """The thread computes the key that Triton's first launch would (it is cached)."""
    cache = pytest.importorskip("triton.runtime.cache", reason="Triton is not installed")
    from aserve.engine.gpu import start_triton_hash

    cache.triton_key.cache_clear()
    start_triton_hash().join()
    assert cache.triton_key.cache_info().currsize == 1
    hits = cache.triton_key.cache_info().hits
    cache.triton_key()
    assert cache.triton_key.cache_info().hits == hits + 1


def llama_8b() -> ModelConfig:
    """The Llama-3.1-8B shape: a step's working memory is about 1.6 GiB at the defaults."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
    )


def pretend_gpu(monkeypatch: pytest.MonkeyPatch, free_gib: float, total_gib: float = 80) -> None:
    info = (int(free_gib * GiB), int(total_gib * GiB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: info)


def fit(config: EngineConfig, max_seq_len: int = 8192) -> EngineConfig:
    return fit_step_to_memory(
        config,
        llama_8b(),
        TPGroup(),
        torch.bfloat16,
        torch.device("cuda"),
        max_seq_len,
        torch.bfloat16,
    )


def test_enough_memory_keeps_the_batch_limits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pretend_gpu(monkeypatch, free_gib=60)
    config = EngineConfig(memory_ratio=0.9, page_size=16)
    with caplog.at_level("WARNING", logger="aserve.engine.memory"):
        assert fit(config) == config
    assert not caplog.records


@pytest.mark.parametrize("left_gib", [2.0, 1.5])
def test_little_memory_shrinks_batches_until_a_full_context_fits(
    left_gib: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`left_gib` of the device within --memory-ratio is all that KV and a step may use."""
    pretend_gpu(monkeypatch, free_gib=8 + left_gib, total_gib=80)
    config = EngineConfig(memory_ratio=0.9, page_size=16)  # 8 GiB (10%) stays unused
    with caplog.at_level("WARNING", logger="aserve.engine.memory"):
        fitted = fit(config)
    assert fitted.max_running_requests < config.max_running_requests
    assert fitted.max_prefill_length <= config.max_prefill_length
    assert fitted.max_prefill_length >= MIN_PREFILL_LENGTH
    rows = fitted.max_running_requests + 1
    working = working_memory_bytes(fitted, llama_8b(), TPGroup(), torch.bfloat16)
    working += rows * PageTable.bytes_per_row(8192, 16)
    full_context = 8192 * kv_bytes_per_token(llama_8b(), TPGroup(), torch.bfloat16)
    assert working + full_context <= left_gib * GiB
    # the largest limits that fit: doubling the running cap back would not
    undone = EngineConfig(
        memory_ratio=0.9,
        page_size=16,
        max_running_requests=fitted.max_running_requests * 2,
        max_prefill_length=fitted.max_prefill_length,
    )
    undone_working = working_memory_bytes(undone, llama_8b(), TPGroup(), torch.bfloat16)
    assert undone_working + full_context > left_gib * GiB
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"capped at {fitted.max_running_requests} instead of 256" in line
    pages = plan_num_pages(
        fitted, llama_8b(), TPGroup(), torch.bfloat16, torch.device("cuda"), 8192, torch.bfloat16
    )
    assert (pages - 1) * 16 >= 8192  # the pool holds a full context


def test_the_line_names_only_the_limits_that_shrank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """3 GiB for an 8B with 16k-token chunks (the H200 run of device-run.sh small-gpu): only
    the chunk shrinks, and the line says nothing about the running cap."""
    pretend_gpu(monkeypatch, free_gib=8 + 3, total_gib=80)
    config = EngineConfig(memory_ratio=0.9, page_size=16, max_prefill_length=16384)
    with caplog.at_level("WARNING", logger="aserve.engine.memory"):
        fitted = fit(config)
    assert (fitted.max_running_requests, fitted.max_prefill_length) == (256, 8192)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith("so prefill chunks at 8192 tokens instead of 16384")


def test_no_memory_at_all_stops_at_the_smallest_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpu(monkeypatch, free_gib=8.01, total_gib=80)  # 10 MiB: not even one step
    fitted = fit(EngineConfig(memory_ratio=0.9, page_size=16))
    assert (fitted.max_running_requests, fitted.max_prefill_length) == (1, MIN_PREFILL_LENGTH)
    with pytest.raises(MemoryError, match="no room for a KV cache"):
        plan_num_pages(
            fitted,
            llama_8b(),
            TPGroup(),
            torch.bfloat16,
            torch.device("cuda"),
            8192,
            torch.bfloat16,
        )


def test_cpu_and_fixed_pages_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpu(monkeypatch, free_gib=8.1, total_gib=80)
    fixed = EngineConfig(num_pages=100)
    assert fit(fixed) == fixed
    config = EngineConfig()
    assert (
        fit_step_to_memory(
            config,
            llama_8b(),
            TPGroup(),
            torch.bfloat16,
            torch.device("cpu"),
            8192,
            torch.bfloat16,
        )
        == config
    )


def test_sliding_window_layers_count_their_share_and_their_pool_its_least() -> None:
    """Six layers, five with a window of 64 (Gemma 3's pattern): a token of the pool counts
    the whole-context layer and 0.5 of each windowed one; the windowed pool gets half the
    other's pages, or what one request needs at once (its window and a prefill chunk) where
    that is more, its extra bytes then taken from the other pool when memory sized it."""
    import dataclasses

    from aserve.engine.memory import plan_window_pages, sliding_window_pool

    gemma = dataclasses.replace(model(), num_layers=6, layer_windows=(64,) * 5 + (0,))
    per_layer = kv_bytes_per_token(model(), TPGroup(), torch.bfloat16) // 2
    share = kv_bytes_per_token(gemma, TPGroup(), torch.bfloat16, 0.5)
    assert share == per_layer * (1 + 0.5 * 5)
    assert kv_bytes_per_token(gemma, TPGroup(), torch.bfloat16) == per_layer * 6
    assert sliding_window_pool(gemma, 4096) == 64 and sliding_window_pool(gemma, 64) == 0
    config = EngineConfig(swa_full_tokens_ratio=0.5, max_prefill_length=256, page_size=16)
    assert plan_window_pages(1001, gemma, config, 64, 4096) == (1001, 501)
    # one request: 64 + 256 + 16 positions, 21 pages, and the dummy one; the ratio gives 21,
    # so 5 layers' page comes out of the one whole-context layer's pool
    assert plan_window_pages(41, gemma, config, 64, 4096) == (36, 22)
    asked = dataclasses.replace(config, num_pages=41)  # --num-pages: as asked
    assert plan_window_pages(41, gemma, asked, 64, 4096) == (41, 22)
    assert plan_window_pages(41, gemma, config, 64, 100) == (41, 21)  # the context is less
