"""Speculative decoding on the GPU: verify steps as decode rows through FlashInfer's and the
Triton decode kernels, in CUDA graphs, over bf16 and FP8 caches; the embedded model's
float32 tokens as the CPU's without drafts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from tests.test_gpu import KERNEL_SHAPES, KV_CACHE_DTYPES, small_gpu_engine
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NGRAM = {"speculative_algorithm": "ngram"}
PASSAGE = "A heron stood in the reeds at dawn. It waited, still as a post, for the fish below."
RECORD = '{"name": "heron", "legs": 2, "wading": true}'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "legs": {"type": "integer"},
        "wading": {"type": "boolean"},
    },
    "required": ["name", "legs", "wading"],
}
CHATS = [f"Repeat this text exactly:\n{PASSAGE}", f"{PASSAGE}\nWhat did the heron wait for?"]
REPEATING = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [9, 10, 11, 9, 10, 11, 9],
    list(range(20, 60)) + list(range(20, 30)),
    [40, 41],
]


@pytest.mark.parametrize("constrained", [False, True], ids=["text", "with-json-schema"])
def test_embedded_model_float32_tokens_as_the_cpu_s_without_drafts(
    make_llm: Callable[..., LLM], smollm2_dir: Path, constrained: bool
) -> None:
    """With a JSON schema's reply too, whose verify rows take masks applied on the GPU."""
    chats, params = list(CHATS), [SamplingParams(temperature=0, max_tokens=64)] * len(CHATS)
    if constrained:
        pytest.importorskip("xgrammar", reason="constrained output needs xgrammar")
        chats.append(f"Write this JSON again, exactly as it is:\n{RECORD}")
        params.append(SamplingParams(temperature=0, max_tokens=60, json_schema=SCHEMA))
    cpu = make_llm(smollm2_dir, device="cpu", quantization="none")
    tokenizer = cpu.tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    want = [o.token_ids for o in cpu.generate(prompts, params)]
    gpu = make_llm(smollm2_dir, device="cuda", dtype="float32", quantization="none", **NGRAM)
    assert [o.token_ids for o in gpu.generate(prompts, params)] == want
    assert gpu.scheduler.planner.accepted_draft_tokens > 10


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("backend", ["fi", "auto"])
def test_verify_rows_in_graphs_as_decoding_one_token_a_step(
    make_llm: Callable[..., LLM], tmp_path: Path, backend: str, kv_cache_dtype: str
) -> None:
    """bf16 with graphs (verify steps of 1-20 rows replay graphs of 1-32) against the same
    engine's decoding without drafts, penalties counted on the device; `auto` decodes on the
    Triton kernels."""
    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    options = small_gpu_engine(
        kv_cache_dtype=kv_cache_dtype, attention_backend=backend, cuda_graph_max_bs=32
    )
    greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "logprobs": True}
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, repetition_penalty=1.2),  # rows count the drafts before them
        SamplingParams(**greedy, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(**greedy),
    ]
    plain = make_llm(folder, **options)
    drafting = make_llm(folder, **options, **NGRAM)
    assert drafting.runtime.engine.graphs is not None
    want, got = plain.generate(REPEATING, params), drafting.generate(REPEATING, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for ours, theirs in zip(got, want):
        assert ours.logprobs is not None and theirs.logprobs is not None
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=0.02)
    assert drafting.scheduler.planner.accepted_draft_tokens > 0
