"""Prompt logprobs (`SamplingParams.prompt_logprobs`, OpenAI completions' `echo` with
`logprobs`): every prompt token's log-probability against transformers' on the same random
weights, through chunked prefill, a cut scoring budget and a prefix-cache hit, beside
requests that do not ask for them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.sampling_params import SamplingError
from aserve.scheduler import plan
from tests.test_models import hf_model
from tests.tiny_models import make_tiny_model

PROMPT = [(11 * i + 5) % 300 + 3 for i in range(41)]
SCORED = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@torch.inference_mode()
def expected_logprobs(folder: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities `[len(prompt) - 1, vocab]` of tokens 1 to n-1."""
    logits = hf_model(folder)(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_scores(scores: list, prompt: list[int], expected: torch.Tensor) -> None:
    """Each entry is the next prompt token with transformers' logprob, and its two
    alternatives are transformers' two most likely tokens."""
    assert [lp.token_id for lp in scores] == prompt[1:]
    ours = torch.tensor([lp.logprob for lp in scores])
    theirs = expected.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    for lp, row in zip(scores, expected):
        assert len(lp.top) == 2
        top = row.topk(2)
        torch.testing.assert_close(
            torch.tensor([v for _, v in lp.top]), top.values, atol=2e-4, rtol=1e-4
        )
        assert lp.top[0][0] == int(top.indices[0])


@pytest.fixture(params=[(4096, 1024), (8, 1024), (4096, 5)], ids=["whole", "chunked", "cut"])
def budgeted_llm(
    request: pytest.FixtureRequest,
    tiny: Path,
    make_llm: Callable[..., LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> LLM:
    """A prompt prefilled whole, chunked by the prefill budget, or cut by the scoring
    budget."""
    prefill, scored_rows = request.param
    monkeypatch.setattr(plan, "SCORED_ROWS_PER_STEP", scored_rows)
    return make_llm(tiny, page_size=4, max_prefill_length=prefill)


def test_prompt_logprobs_match_transformers(tiny: Path, budgeted_llm: LLM) -> None:
    """Under every budget the same values, and the generated tokens are those of a
    request that did not ask."""
    llm = budgeted_llm
    out = llm.generate([PROMPT], SCORED)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT) - 1
    assert_scores(out.prompt_logprobs, PROMPT, expected_logprobs(tiny, PROMPT))
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert plain[0].prompt_logprobs is None
    assert plain[0].token_ids == out.token_ids


def test_prompt_logprobs_ignore_the_prefix_cache_and_share_a_batch(
    tiny: Path, make_llm: Callable[..., LLM]
) -> None:
    """A prompt whose prefix is cached is still scored whole; in one batch with requests
    that do not ask, each gets what it would alone (a one-token prompt scores nothing)."""
    llm = make_llm(tiny, page_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    others = [PROMPT[:9], [7, 8, 9, 10, 11, 12], PROMPT[5:30]]
    alone = [o.token_ids for o in llm.generate(others, greedy)]
    llm.generate([PROMPT], greedy)  # PROMPT's pages are now cached
    outputs = llm.generate(
        [others[0], PROMPT, others[1], [42], others[2]], [greedy, SCORED, greedy, SCORED, greedy]
    )
    assert llm.scheduler.planner.prompt_tokens_cached > 0  # the others did hit the cache
    assert_scores(outputs[1].prompt_logprobs, PROMPT, expected_logprobs(tiny, PROMPT))
    assert outputs[3].prompt_logprobs == []
    assert [outputs[i].token_ids for i in (0, 2, 4)] == alone
    assert all(outputs[i].prompt_logprobs is None for i in (0, 2, 4))
    llm.scheduler.check_integrity()


def test_prompt_logprobs_from_a_token_take_the_prefix_before_it_from_the_cache(
    tiny: Path, budgeted_llm: LLM
) -> None:
    """`prompt_logprobs_from` (SGLang's logprob_start_len): the tokens from there on get the
    values the whole prompt's scoring gives them; the prompt before the first scored
    position comes from the prefix cache when it is there, the scored positions never do."""
    llm = budgeted_llm
    expected = expected_logprobs(tiny, PROMPT)
    planner = llm.scheduler.planner
    for start in (23, len(PROMPT) - 1):
        tail = dataclasses.replace(SCORED, prompt_logprobs_from=start)
        for _ in range(2):  # cold, then with PROMPT's pages cached by the run before
            cached_before = planner.prompt_tokens_cached
            out = llm.generate([PROMPT], tail)[0]
            assert out.prompt_logprobs is not None
            assert_scores(out.prompt_logprobs, PROMPT[start - 1 :], expected[start - 1 :])
        assert planner.prompt_tokens_cached - cached_before == (start - 1) // 4 * 4
    llm.scheduler.check_integrity()
    whole = llm.generate([PROMPT], SCORED)[0]  # a whole scoring after all that: nothing cached
    assert_scores(whole.prompt_logprobs, PROMPT, expected)
    past = llm.generate([PROMPT], dataclasses.replace(SCORED, prompt_logprobs_from=len(PROMPT)))
    assert past[0].error is not None and "prompt logprobs from token 41" in past[0].error
    with pytest.raises(SamplingError, match="prompt_logprobs_from"):
        SamplingParams(prompt_logprobs=1, prompt_logprobs_from=0)


def test_prompt_logprobs_out_of_range_are_refused() -> None:
    for bad in (-1, 21):
        with pytest.raises(SamplingError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
