"""Greedy generation of the embedded SmolLM2: equal to transformers, and unchanged by every
scheduling feature (radix hits, chunked prefill, page sizes, naive cache, retraction).

These run the GGUF's weights de-quantized to float32 (`quantization="none"`, multiplied by
aserve's float32 kernels), the same weights transformers computes with, so tokens must match
exactly; the quantized products have their own tests (tests/test_quant.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colours:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: I like apples.",
    "The quick brown fox",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[list[int]]:
    from aserve.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_tokens(smollm2_hf: torch.nn.Module, prompt_ids: list[list[int]]) -> list[list[int]]:
    outputs = []
    for ids in prompt_ids:
        with torch.inference_mode():
            generated = smollm2_hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(generated[0, len(ids) :].tolist())
    return outputs


def greedy_tokens(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_ids, GREEDY)
    assert all(o.finish_reason == "length" for o in outputs)
    return [o.token_ids for o in outputs]


def test_batched_greedy_equals_transformers(
    make_llm: Callable[..., LLM], smollm2_dir: Path, prompt_ids, hf_tokens
) -> None:
    llm = make_llm(smollm2_dir, quantization="none")
    assert greedy_tokens(llm, prompt_ids) == hf_tokens
    text = llm.generate(TEXTS[0], GREEDY)[0].text
    assert "Paris" in text


def test_radix_hits_do_not_change_outputs(
    make_llm: Callable[..., LLM], smollm2_dir: Path, prompt_ids, hf_tokens
) -> None:
    llm = make_llm(smollm2_dir, quantization="none", page_size=4)
    planner = llm.scheduler.planner
    assert greedy_tokens(llm, prompt_ids) == hf_tokens
    cached_before = planner.prompt_tokens_cached
    assert greedy_tokens(llm, prompt_ids) == hf_tokens
    assert planner.prompt_tokens_cached - cached_before > sum(len(p) for p in prompt_ids) // 2
    extended = [p + h[:5] for p, h in zip(prompt_ids, hf_tokens)]
    outputs = llm.generate(extended, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [h[5:13] for h in hf_tokens]


def test_quantized_model_on_cpu_keeps_its_bits_across_cache_hits_and_chunks(
    make_llm: Callable[..., LLM], smollm2_dir: Path, prompt_ids: list[list[int]]
) -> None:
    """The embedded Q4_1 file on aserve's CPU kernels (16-bit activations where the CPU has
    AVX-512 VNNI or AVX-VNNI): every token's logprob the same float, not merely close, whether
    its prompt was prefilled whole, again after a radix-cache hit, in chunks of 7 tokens, or
    with its first 5 generated tokens appended (their K/V from the cache, the rest computed
    anew). The prefill attention computes each token as its decode would."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)

    def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        outputs = llm.generate(prompts, params)
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]

    llm = make_llm(smollm2_dir, page_size=4)
    whole = run(llm, prompt_ids)
    assert run(llm, prompt_ids) == whole  # the prompts now cached
    chunked = make_llm(smollm2_dir, page_size=4, max_prefill_length=7)
    assert run(chunked, prompt_ids) == whole
    extended = run(llm, [p + t[:5] for p, (t, _) in zip(prompt_ids, whole)])
    for (tokens, logprobs), (ours, our_logprobs) in zip(whole, extended):
        assert ours[:7] == tokens[5:] and our_logprobs[:7] == logprobs[5:]


@pytest.mark.parametrize(
    "options",
    [
        {"max_prefill_length": 7},
        {"page_size": 1},
        {"page_size": 16},
        {"cache_type": "naive"},
        {"max_running_requests": 3},
        {"overlap": True, "max_prefill_length": 7, "page_size": 4},
    ],
    ids=["chunked-prefill", "page-1", "page-16", "naive-cache", "three-running", "overlap"],
)
def test_scheduling_options_do_not_change_outputs(
    make_llm: Callable[..., LLM], smollm2_dir: Path, prompt_ids, hf_tokens, options: dict
) -> None:
    options = dict(options)
    overlap = options.pop("overlap", False)
    llm = make_llm(smollm2_dir, quantization="none", **options)
    llm.scheduler.overlap = overlap
    assert greedy_tokens(llm, prompt_ids) == hf_tokens


def test_retraction_under_a_tiny_pool_keeps_outputs(
    make_llm: Callable[..., LLM], smollm2_dir: Path, prompt_ids, hf_tokens
) -> None:
    longest = max(len(p) for p in prompt_ids) + NEW_TOKENS
    llm = make_llm(smollm2_dir, quantization="none", num_pages=longest + 40, page_size=1)
    assert greedy_tokens(llm, prompt_ids) == hf_tokens
    assert llm.scheduler.planner.num_retractions > 0


def test_decode_stage_follows_rows_that_change_hands(
    make_llm: Callable[..., LLM],
    smollm2_dir: Path,
    prompt_ids: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU decode stage keeps a batch's K/V across steps; it must start afresh whenever
    a row gets a new request. First one request at a time on one row, each prompt 3 tokens
    longer than the one before and 4 tokens generated, so each request's first decode length
    is its predecessor's last plus one: only the row's generation tells them apart. Then
    requests of mixed lengths on 3 rows, rows changing hands while others keep decoding.
    Both give the tokens of the path that gathers K/V from the pool every step. The stage
    serves torch's float path (MoE and dummy weights, or where aserve's CPU kernels do not
    build; float weights otherwise run on the kernels and their decode stack), taken here."""
    from aserve.attention import torch_native
    from aserve.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "float_weights_on_kernels", lambda *args: None)

    flat = [t for ids in prompt_ids for t in ids]
    chained = [flat[i : i + 10 + 3 * i] for i in range(5)]
    four = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in (3, 9, 24, 5, 17, 2, 11, 24)
    ]

    def run(
        running: int, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        llm = make_llm(smollm2_dir, quantization="none", max_running_requests=running)
        return [o.token_ids for o in llm.generate(prompts, params)]

    stages_built = 0
    original_init = torch_native._DecodeStage.__init__

    def counting_init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        nonlocal stages_built
        stages_built += 1
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(torch_native._DecodeStage, "__init__", counting_init)
    staged_chained = run(1, chained, four)
    assert stages_built == len(chained)  # one per request: its other two decode steps append
    staged_mixed = run(3, prompt_ids, mixed)
    assert [len(t) for t in staged_mixed] == [p.max_tokens for p in mixed]

    monkeypatch.setattr(torch_native.TorchNativeBackend, "STAGE_MAX_BYTES", 0)
    built_before = stages_built
    assert run(1, chained, four) == staged_chained
    assert run(3, prompt_ids, mixed) == staged_mixed
    assert stages_built == built_before  # the reference runs never staged
