"""Overlap scheduling (step N+1 planned and launched before step N's results are read) must
not change any output. On CPU a step is synchronous, but the bookkeeping is the same code
the GPU runs, so these tests switch overlap on explicitly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from aserve import LLM, SamplingParams
from aserve.scheduler.request import FinishReason
from tests.scenarios import abort_one_of_two
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 42, 9, 100, 3], [300, 4, 4, 61, 7, 7, 7, 8, 250], [11, 12], list(range(20, 60))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def both(make_llm: Callable[..., LLM], tiny: Path, **options: object) -> tuple[LLM, LLM]:
    plain = make_llm(tiny, **options)
    overlapped = make_llm(tiny, **options)
    overlapped.scheduler.overlap = True
    return plain, overlapped


def results(llm: LLM, params: list[SamplingParams]) -> list[tuple[list[int], str]]:
    return [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)]


def test_overlap_keeps_greedy_sampled_and_stopped_outputs(
    make_llm: Callable[..., LLM], tiny: Path
) -> None:
    plain, overlapped = both(make_llm, tiny)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free = plain.generate(PROMPTS, greedy)
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[1].token_ids[5]]),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]
    expected = results(plain, params)
    assert expected[1][1] == "stop" and expected[0][1] == "length"
    assert results(overlapped, params) == expected
    assert results(overlapped, [greedy] * 4) == [(o.token_ids, "length") for o in free]


def test_overlap_keeps_outputs_under_retraction(make_llm: Callable[..., LLM], tiny: Path) -> None:
    plain, overlapped = both(make_llm, tiny, num_pages=90, page_size=1)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    expected = results(plain, params)
    assert results(overlapped, params) == expected
    assert overlapped.scheduler.planner.num_retractions > 0


def test_overlap_keeps_penalised_outputs(make_llm: Callable[..., LLM], tiny: Path) -> None:
    plain, overlapped = both(make_llm, tiny)
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=1, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=1.0),
    ]
    assert results(overlapped, params) == results(plain, params)


@pytest.mark.parametrize("penalty", [0.0, 1.5], ids=["free", "penalised"])
def test_overlap_abort_spares_the_others(
    make_llm: Callable[..., LLM], tiny: Path, penalty: float
) -> None:
    """An abort that lands while the loop waits on the step in flight: with penalties the
    next step's sampling is launched right after (it counts the tokens so far), and the
    aborted request's token of the step in flight must be among them, not a placeholder."""
    plain, overlapped = both(make_llm, tiny)
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=penalty
    )
    expected = plain.generate([PROMPTS[1]], params)[0].token_ids
    overlapped.generate([[1, 2]], SamplingParams(max_tokens=1))
    reason, produced = abort_one_of_two(overlapped, PROMPTS[0], PROMPTS[1], params, 3)
    assert reason is FinishReason.ABORT and produced == expected
    overlapped.scheduler.check_integrity()


def test_overlap_keeps_constrained_and_penalised_outputs(
    make_llm: Callable[..., LLM], smollm2_dir: Path
) -> None:
    """Grammars and penalties need the step in flight's tokens: such a step launches its
    forward, reads the step in flight, then launches its sampling. Outputs equal the
    non-overlapped ones, with free requests in the same batches."""
    from aserve.scheduler.scheduler import Scheduler

    plain = make_llm(smollm2_dir)
    overlapped = make_llm(smollm2_dir)
    overlapped.scheduler.overlap = True
    deferred: list[bool] = []

    def spy(planned: object) -> bool:
        deferred.append(Scheduler._needs_last_tokens(planned))  # type: ignore[arg-type]
        return deferred[-1]

    overlapped.scheduler._needs_last_tokens = spy  # type: ignore[method-assign]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    prompts = ["A person as JSON:", "Phone number:", "Tell me a story.", "Pick:", "Count:"]
    params = [
        SamplingParams(temperature=0, max_tokens=40, json_schema=schema),
        SamplingParams(temperature=0.8, seed=5, max_tokens=12, regex=r" \d{3}-\d{4}"),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, choice=("left", "right")),
        SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
    ]
    expected = [(o.token_ids, o.finish_reason) for o in plain.generate(prompts, params)]
    ours = [(o.token_ids, o.finish_reason) for o in overlapped.generate(prompts, params)]
    assert ours == expected
    assert any(deferred) and not all(deferred)  # the free tail ran overlapped as before


@pytest.mark.parametrize(
    "pool", [{}, {"num_pages": 60, "page_size": 1}], ids=["roomy", "retracting"]
)
def test_random_aborts_spare_every_other_request(
    make_llm: Callable[..., LLM], tiny: Path, pool: dict[str, int]
) -> None:
    """Rounds of requests with penalties, logprobs, biases, min_tokens and stop tokens under
    overlap, some aborted after a random number of outputs (in a pool small enough to retract,
    too): each survivor gets the tokens it gets alone, no request ends in error, and every
    page comes back."""
    import random

    plain, overlapped = both(make_llm, tiny, **pool)
    kinds = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.7),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=True),
        SamplingParams(temperature=0, max_tokens=22, logit_bias={7: 5.0}, min_tokens=6),
        SamplingParams(temperature=0.9, seed=11, max_tokens=18, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=26, ignore_eos=True, stop_token_ids=[40]),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)][: 4 + i] for i in range(len(kinds))]
    alone = [plain.generate([p], k)[0].token_ids for p, k in zip(prompts, kinds)]
    overlapped.generate([[1, 2]], SamplingParams(max_tokens=1))
    scheduler = overlapped.scheduler
    rng = random.Random(0)

    async def round_of_aborts() -> list[tuple[bool, FinishReason | None, list[int]]]:
        reqs = [scheduler.make_request(p, k) for p, k in zip(prompts, kinds)]
        doomed = {i: rng.randint(1, 6) for i in rng.sample(range(len(reqs)), 3)}
        for req in reqs:
            scheduler.submit(req)

        async def follow(i: int) -> tuple[bool, FinishReason | None, list[int]]:
            tokens: list[int] = []
            seen = 0
            while True:
                out = await reqs[i].channel.get()
                tokens += out.token_ids
                seen += 1
                if i in doomed and seen == doomed[i]:
                    scheduler.abort(reqs[i])
                if out.finish_reason is not None:
                    return i in doomed, out.finish_reason, tokens

        return list(await asyncio.gather(*(follow(i) for i in range(len(reqs)))))

    for _ in range(4):
        results = overlapped._loop.run_until_complete(round_of_aborts())
        for (aborted, reason, tokens), expected in zip(results, alone):
            assert reason is not FinishReason.ERROR
            if not aborted:
                assert tokens == expected
            else:
                assert tokens == expected[: len(tokens)]
    scheduler.check_integrity()
    assert (scheduler.planner.num_retractions > 0) == bool(pool)


def test_overlap_with_speculative_decoding(make_llm: Callable[..., LLM], tiny: Path) -> None:
    """Steps where no request may draft (its drafts kept missing) overlap; a step after a
    verify step, or where a request may draft, waits for the one before."""
    plain, overlapped = both(make_llm, tiny)
    drafting = make_llm(tiny, speculative_algorithm="ngram")
    drafting.scheduler.overlap = True
    overlapped_steps: list[bool] = []
    pending_then = drafting.scheduler._overlaps

    def noted(pending: object) -> bool:
        answer = pending_then(pending)  # type: ignore[arg-type]
        overlapped_steps.append(answer)
        return answer

    drafting.scheduler._overlaps = noted  # type: ignore[method-assign]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=12),
    ]
    expected = results(plain, params)
    assert results(overlapped, params) == expected
    assert results(drafting, params) == expected
    planner = drafting.scheduler.planner
    assert planner.draft_tokens > planner.accepted_draft_tokens > 0
    assert not all(overlapped_steps)
    # one request alone, whose drafts miss more often than not: paused, it overlaps
    overlapped_steps.clear()
    alone = [SamplingParams(temperature=0.9, seed=1, max_tokens=60, ignore_eos=True)]
    want = [o.token_ids for o in plain.generate(PROMPTS[3:], alone)]
    assert [o.token_ids for o in drafting.generate(PROMPTS[3:], alone)] == want
    assert any(overlapped_steps) and not all(overlapped_steps)
