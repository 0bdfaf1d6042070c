"""Speculative decoding with n-gram drafts: a verify step's tokens are the ones decoding one
token a step gives, whatever the sampling, batch, cache and pool do; the planner drafts
within each request's limits; options, metrics and the stats line."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.cli import parse_config
from aserve.config import ConfigError, SchedulerConfig, build_config
from aserve.engine.step import StepSpec
from aserve.forward import ForwardMode
from aserve.kvcache.naive import NaiveCache
from aserve.kvcache.pages import PageAllocator, PageTable
from aserve.metrics import StatsLogger
from aserve.scheduler.batch import step_spec
from aserve.scheduler.plan import Planner
from aserve.scheduler.request import Req
from tests.server_utils import ServerProcess, serving
from tests.test_metrics import SNAPSHOT
from tests.test_server import get, metric_value, post, run, stream
from tests.tiny_models import make_tiny_model

NGRAM = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
TEXT = (
    "The lighthouse was built in 1872 from granite. Its lamp burned oil until 1901, then "
    "kerosene, and since 1956 it has run on electricity. The last keeper left in 1989."
)
CHATS = [
    f"Repeat this text exactly:\n{TEXT}",
    f"{TEXT}\nWhen did the last keeper leave? Quote the text.",
    "Write a short poem about the sea.",
]


def chat_ids(llm: LLM) -> list[list[int]]:
    tokenizer = llm.runtime.tokenizer
    assert tokenizer is not None
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def accepted(llm: LLM) -> int:
    return llm.scheduler.planner.accepted_draft_tokens


def test_greedy_tokens_and_logprobs_are_decoding_s(make_llm: Callable[..., LLM]) -> None:
    plain, drafting = make_llm(), make_llm(**NGRAM)
    prompts = chat_ids(plain)
    params = SamplingParams(temperature=0, max_tokens=80, logprobs=True, top_logprobs=2)
    want, got = plain.generate(prompts, params), drafting.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for ours, theirs in zip(got, want):
        assert ours.logprobs is not None and theirs.logprobs is not None
        assert len(ours.logprobs) == len(ours.token_ids)
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert a.token_id == b.token_id
            # the CPU's kernels give a row the same bits whatever rows are beside it
            assert (a.logprob, a.top) == (b.logprob, b.top)
    planner = drafting.scheduler.planner
    assert planner.draft_tokens > 0 and accepted(drafting) > 10  # the copy is drafted well
    assert plain.scheduler.planner.draft_tokens == 0


def test_one_at_a_time_and_seeded_sampling_as_decoding(make_llm: Callable[..., LLM]) -> None:
    plain, drafting = make_llm(), make_llm(**NGRAM)
    prompts = chat_ids(plain)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=60)
    for prompt in prompts:  # alone: every step of a stream may verify drafts
        assert (
            drafting.generate([prompt], seeded)[0].token_ids
            == plain.generate([prompt], seeded)[0].token_ids
        )
    mixed = [
        seeded,
        SamplingParams(temperature=0, max_tokens=50),
        SamplingParams(temperature=1.2, seed=3, max_tokens=40, min_tokens=30),
    ]
    want = [o.token_ids for o in plain.generate(prompts, mixed)]
    assert [o.token_ids for o in drafting.generate(prompts, mixed)] == want
    assert len(want[2]) >= 30
    assert accepted(drafting) > 0


def test_stop_tokens_and_lengths_cut_the_accepted_drafts(make_llm: Callable[..., LLM]) -> None:
    plain, drafting = make_llm(), make_llm(**NGRAM)
    prompt = chat_ids(plain)[0]
    full = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=60))[0].token_ids
    stop = full[25]  # a token the copy makes (drafted, most likely, with those around it)
    for params in (
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=23),
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    ):
        want = plain.generate([prompt], params)[0]
        got = drafting.generate([prompt], params)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert len(got.token_ids) <= params.max_tokens
    assert accepted(drafting) > 0


RECORD = '{"name": "lighthouse", "year": 1872, "keepers": 3, "automated": true}'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "year": {"type": "integer"},
        "keepers": {"type": "integer"},
        "automated": {"type": "boolean"},
    },
    "required": ["name", "year", "keepers", "automated"],
}


def test_grammars_and_penalties_with_drafts(make_llm: Callable[..., LLM]) -> None:
    """A constrained request drafts as far as its grammar allows and each verify row is
    masked as the grammar stands after the drafts before it; a penalised one's rows count
    the drafts before them as decoding would have counted those tokens."""
    plain, drafting = make_llm(), make_llm(**NGRAM)
    prompts = chat_ids(plain)
    tokenizer = plain.runtime.tokenizer
    assert tokenizer is not None
    copy = f"Write this JSON again, exactly as it is:\n{RECORD}"
    prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": copy}]))
    params = [
        SamplingParams(temperature=0, max_tokens=50, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=50),
        SamplingParams(temperature=0, max_tokens=40, regex="(yes|no), [a-z ]{5,30}"),
        SamplingParams(temperature=0, max_tokens=60, json_schema=SCHEMA),
    ]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in drafting.generate(prompts, params)] == want
    assert accepted(drafting) > 0
    # the JSON reply alone: its drafts come through its grammar's masks
    alone = make_llm(**NGRAM)
    reply = alone.generate(prompts[3:], params[3:])[0]
    assert reply.token_ids == want[3] and reply.finish_reason == "stop"
    assert accepted(alone) > 5
    assert reply.text.startswith("{") and '"year": 1872' in reply.text
    # penalties alone and together, on the copy that drafts well, then a batch of them
    copying = chat_ids(plain)[:2]
    for penalties in (
        {"repetition_penalty": 1.1},
        {"frequency_penalty": 0.3},
        {"presence_penalty": 0.4, "repetition_penalty": 1.05},
    ):
        penalised = SamplingParams(temperature=0, max_tokens=60, **penalties)
        # from an empty prefix cache, as `alone` starts: where BLAS takes long prefills (an
        # AVX2 CPU's, quant/native.py's `blas_rows`), the batch of four above left these
        # prompts' KV with other last bits than a prefill of the two computes
        assert plain.scheduler.flush_cache()
        want = [o.token_ids for o in plain.generate(copying, penalised)]
        alone = make_llm(**NGRAM)
        assert [o.token_ids for o in alone.generate(copying, penalised)] == want, penalties
        assert accepted(alone) > 0, penalties
        # one at a time too: each step's counts then carry on from the step before
        assert alone.generate(copying[:1], penalised)[0].token_ids == want[0]


def test_drafts_stop_where_a_grammar_stops_allowing_them() -> None:
    import xgrammar

    from aserve.constrained.grammar import new_matcher
    from aserve.scheduler.plan import grammar_allowed

    info = xgrammar.TokenizerInfo([f"t{i}" for i in range(8)] + ["a", "b", "c"], stop_token_ids=[7])
    grammar = xgrammar.GrammarCompiler(info).compile_regex("a+bc")
    req = Req(rid=1, prompt_ids=[1], params=SamplingParams(), seed=0)
    req.matcher = new_matcher(grammar)
    assert req.matcher.accept_token(8)  # "a" so far
    assert grammar_allowed(req, [8, 8, 9, 10, 8]) == [8, 8, 9, 10]  # "aabc", then nothing
    assert grammar_allowed(req, [9, 9]) == [9]
    assert grammar_allowed(req, [10]) == []
    assert grammar_allowed(req, [9, 10, 7, 8]) == [9, 10]  # a stop token: sampled, not drafted
    assert req.matcher.accept_token(9)  # the matcher stands where it stood: after "a"
    thinking = Req(rid=2, prompt_ids=[1], params=SamplingParams(), seed=0)
    thinking.matcher, thinking.grammar_after = new_matcher(grammar), 6
    assert grammar_allowed(thinking, [1, 2, 6, 8]) == [1, 2]


def test_prefix_hits_chunks_and_a_small_pool_change_nothing(
    make_llm: Callable[..., LLM],
) -> None:
    plain = make_llm()
    prompts = chat_ids(plain)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    chunked = make_llm(**NGRAM, max_prefill_length=16)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == want
    assert [o.token_ids for o in chunked.generate(prompts, params)] == want  # from the cache
    # a pool that holds one request's whole context and little more: drafts need pages,
    # requests are retracted and come back
    longest = max(len(p) for p in prompts) + 64
    small = make_llm(**NGRAM, num_pages=longest + 24)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.scheduler.planner.num_retractions > 0
    assert accepted(small) > 0


REPEATING = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [40, 41]]


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_float_model_through_the_modules(
    make_llm: Callable[..., LLM], tiny: Path, page_size: int
) -> None:
    """A float32 model runs its layers as modules (not the quantized C++ stack)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = make_llm(tiny, page_size=page_size)
    want = [o.token_ids for o in plain.generate(REPEATING, params)]
    drafting = make_llm(tiny, page_size=page_size, **NGRAM)
    assert [o.token_ids for o in drafting.generate(REPEATING, params)] == want
    assert drafting.scheduler.planner.draft_tokens > 0


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "deepseek_v2"])
def test_windowed_latent_and_expert_layers(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    """Gemma 3's windowed layers keep a pool of their own (a window of 4 here: verify rows
    past it read only the window); Qwen3-MoE routes each row's token on its own; DeepSeek's
    latent attention verifies its drafts over its one-part cache."""
    folder = make_tiny_model(family, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in make_llm(folder).generate(REPEATING, params)]
    drafting = make_llm(folder, **NGRAM)
    assert [o.token_ids for o in drafting.generate(REPEATING, params)] == want
    assert drafting.scheduler.planner.draft_tokens > 0


def make_planner(**options: int | str) -> Planner:
    config = SchedulerConfig(**{"speculative_algorithm": "ngram", **options})  # type: ignore[arg-type]
    allocator = PageAllocator(64, 1)
    table = PageTable(4, 32, 1, torch.device("cpu"))
    return Planner(config, allocator, NaiveCache(allocator), table)


def decoding_request(rid: int, prompt: list[int], params: SamplingParams) -> Req:
    req = Req(rid=rid, prompt_ids=prompt, params=params, seed=0)
    req.max_total_len = min(len(prompt) + params.max_tokens, 32)
    return req


def test_the_planner_drafts_within_each_request_s_limits() -> None:
    planner = make_planner(speculative_num_draft_tokens=3)
    repeating = [1, 2, 3, 4, 5, 6, 1, 2]
    reqs = [
        decoding_request(1, repeating, SamplingParams(max_tokens=20)),
        decoding_request(2, repeating, SamplingParams(max_tokens=3)),  # 2 tokens left after
        decoding_request(3, repeating, SamplingParams(max_tokens=20, presence_penalty=0.5)),
        decoding_request(4, [7, 8, 9], SamplingParams(max_tokens=20)),  # nothing matches
    ]
    reqs[2].draft_pause = 1  # its drafts missed last time: this step it drafts none
    for req in reqs:
        planner.add(req)
    first = planner.schedule()
    assert first is not None and first.mode is ForwardMode.PREFILL
    planner.complete(first, [3, 3, 3, 10])
    batch = planner.schedule()
    assert batch is not None and batch.mode is ForwardMode.DECODE
    # request 1 ends "... 1, 2, 3": drafts 4, 5, 6; request 2 may make 2 more tokens, so one
    # is drafted (the verify step's own sample is the second)
    assert batch.drafts == [[4, 5, 6], [4], [], []]
    assert batch.extend_lens == [4, 2, 1, 1]
    assert reqs[2].draft_pause == 0
    assert all(len(r.pages) >= r.total_len + len(d) - 1 for r, d in zip(reqs, batch.drafts))
    spec = step_spec(batch, planner.page_table)
    assert spec.mode is ForwardMode.DECODE
    assert spec.rows == [reqs[0].slot] * 4 + [reqs[1].slot] * 2 + [reqs[2].slot, reqs[3].slot]
    assert spec.prefix_lens == [8, 9, 10, 11, 8, 9, 8, 3]
    assert spec.input_ids == [3, 4, 5, 6, 3, 4, 3, 10]
    assert StepSpec.unpack(spec.pack()) == spec  # what tensor-parallel ranks receive
    # the model agrees with two of request 1's drafts, none of request 2's
    planner.launched(batch)
    assert [r.cached_len for r in reqs] == [9, 9, 9, 4]
    planner.accept(reqs[0], [5, 7])
    assert reqs[0].cached_len == 11 and reqs[0].output_ids == [3, -1, 5, 7]
    assert planner.draft_tokens == 4 and planner.accepted_draft_tokens == 2


def test_a_verify_step_takes_at_most_max_verify_rows() -> None:
    """On CUDA the largest decode graph: a bigger verify step would run eagerly."""
    planner = make_planner(speculative_num_draft_tokens=3)
    planner.max_verify_rows = 6
    reqs = [
        decoding_request(i, [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20)) for i in (1, 2, 3)
    ]
    for req in reqs:
        planner.add(req)
    first = planner.schedule()
    assert first is not None
    planner.complete(first, [3, 3, 3])
    batch = planner.schedule()
    assert batch is not None and batch.drafts == [[4, 1, 2], [], []]
    assert sum(batch.extend_lens) == 6


class RefusingMatcher:
    """A grammar that allows none of the drafts (the duck type `grammar_allowed` reads)."""

    def accept_token(self, token: int) -> bool:
        return False

    def is_terminated(self) -> bool:
        return False

    def rollback(self, count: int) -> None:
        raise AssertionError("nothing was accepted")


def test_drafts_a_grammar_refuses_are_neither_run_nor_counted() -> None:
    planner = make_planner()
    req = decoding_request(1, [1, 2, 3, 1, 2], SamplingParams(max_tokens=20))
    req.matcher = RefusingMatcher()
    planner.add(req)
    first = planner.schedule()
    assert first is not None
    planner.complete(first, [3])
    batch = planner.schedule()
    assert batch is not None and batch.drafts is None  # a plain decode step
    assert planner.draft_tokens == 0


def test_a_request_whose_drafts_miss_pauses_drafting() -> None:
    planner = make_planner(speculative_num_draft_tokens=2)
    req = decoding_request(1, [1, 2, 3, 1, 2], SamplingParams(max_tokens=30))
    planner.add(req)
    step = planner.schedule()
    assert step is not None
    planner.complete(step, [3])
    pauses = []
    for _ in range(4):  # every verify step takes none of its drafts
        assert planner.may_draft()
        step = planner.schedule()
        assert step is not None and step.drafts is not None and step.drafts[0]
        planner.launched(step)
        req.output_ids[-1] = 9
        planner.accept(req, [])
        pauses.append(req.draft_pause)
        while req.draft_pause:  # plain decode steps meanwhile
            assert not planner.may_draft()
            plain = planner.schedule()
            assert plain is not None and plain.drafts is None
            planner.complete(plain, [3])
        # the last token 3 again: it occurred before, with tokens after it
        req.output_ids[-1] = 3
    assert pauses == [1, 2, 4, 8]
    step = planner.schedule()
    assert step is not None and step.drafts
    planner.launched(step)
    planner.accept(req, [step.drafts[0][0]])  # a hit: drafting goes on at once
    assert req.draft_pause == 0 and req.draft_misses == 0


def test_no_drafts_anywhere_plans_a_plain_decode_step() -> None:
    planner = make_planner()
    req = decoding_request(1, [1, 2, 3], SamplingParams(max_tokens=20))
    planner.add(req)
    first = planner.schedule()
    assert first is not None
    planner.complete(first, [4])
    batch = planner.schedule()
    assert batch is not None and batch.drafts is None and batch.extend_lens == [1]


def test_options_take_effect_and_bad_ones_are_refused() -> None:
    config, _ = parse_config(
        [
            "--speculative-algorithm",
            "NGRAM",
            "--speculative-num-draft-tokens",
            "6",
            "--speculative-ngram-min-match-window-size",
            "2",
            "--speculative-ngram-max-match-window-size",
            "5",
        ]
    )
    sched = config.scheduler
    assert sched.speculative_algorithm == "ngram"
    assert sched.speculative_num_draft_tokens == 6
    assert (
        sched.speculative_ngram_min_match_window_size,
        sched.speculative_ngram_max_match_window_size,
    ) == (2, 5)
    assert build_config().scheduler.speculative_algorithm is None
    for options, message in (
        ({"speculative_algorithm": "eagle"}, "--speculative-algorithm must be one of ngram"),
        ({"speculative_num_draft_tokens": 0}, "--speculative-num-draft-tokens must be at least 1"),
        (
            {
                "speculative_ngram_min_match_window_size": 4,
                "speculative_ngram_max_match_window_size": 3,
            },
            "min-match-window-size must be at least 1 and at most",
        ),
        (
            {"speculative_algorithm": "ngram", "is_embedding": True},
            "an --is-embedding server generates none",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            build_config(**options)


def test_the_stats_line_gives_the_accept_length(caplog: pytest.LogCaptureFixture) -> None:
    clock = iter([0.0, 10.0, 20.0, 30.0])
    stats = StatsLogger(interval_s=5.0, clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="aserve.stats"):
        for tokens in (10, 4, 4, 4):  # a line every second step; the first window drafted
            stats.on_step("decode", SNAPSHOT, 0.5, tokens, requests=4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "accept len: 1.75" in lines[0] and "accept len" not in lines[1]


@pytest.fixture(scope="module")
def drafting_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(
        ServerProcess(["--model", str(smollm2_dir), "--speculative-algorithm", "ngram"])
    )


def test_a_server_streams_several_tokens_a_step(
    drafting_server: ServerProcess, make_llm: Callable[..., LLM]
) -> None:
    """A verify step hands a stream all its accepted tokens at once: the streamed text, the
    whole reply and the offline API's (decoding one token a step) are the same; /metrics
    counts the drafts."""
    url = drafting_server.base_url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": CHATS[0]}], "max_tokens": 60}
    body["temperature"] = 0
    status, whole = run(post(url, body))
    assert status == 200, whole
    chunks, _ = run(stream(url, body))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    text = whole["choices"][0]["message"]["content"]
    assert streamed == text
    plain = make_llm()
    offline = plain.chat(
        [[{"role": "user", "content": CHATS[0]}]], SamplingParams(temperature=0, max_tokens=60)
    )
    assert text == offline[0].text
    assert whole["usage"]["completion_tokens"] == len(offline[0].token_ids)
    _, metrics = run(get(drafting_server.base_url + "/metrics"))
    drafted = metric_value(metrics.decode(), "aserve:spec_decode_num_draft_tokens_total")
    taken = metric_value(metrics.decode(), "aserve:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < taken <= drafted
