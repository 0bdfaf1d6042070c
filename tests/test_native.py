"""SGLang's native /generate and /abort_request end to end on the embedded model: batches,
`n`, SGLang's streaming (each event the output so far), its meta_info (finish reason with what
stopped it, cached tokens) and logprobs as [logprob, token id, text] from logprob_start_len,
checked against what the OpenAI routes return for the same work."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from aserve.server import protocol
from tests.server_utils import ServerProcess, serving
from tests.test_server import post, run, stream

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(["--model", str(smollm2_dir)]))


def generate(server: ServerProcess, body: dict[str, Any]) -> Any:
    status, reply = run(post(server.base_url + "/generate", body))
    assert status == 200, reply
    protocol.GenerateReply.model_validate(reply)
    return reply


def completion(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = run(post(server.base_url + "/v1/completions", body))
    assert status == 200, reply
    return reply["choices"][0]


def test_one_prompt_as_the_completions_route_gives_it(server: ServerProcess) -> None:
    reply = generate(server, {"text": PROMPT, "sampling_params": GREEDY, "rid": "r-1"})
    choice = completion(
        server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    )
    assert reply["text"] == choice["text"] and reply["output_ids"] == choice["token_ids"]
    meta = reply["meta_info"]
    assert meta["id"] == "r-1" and meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8 and meta["prompt_tokens"] == 5
    assert meta["e2e_latency"] > 0 and "output_token_logprobs" not in meta
    again = generate(server, {"text": PROMPT, "sampling_params": GREEDY})
    assert again["meta_info"]["cached_tokens"] > 0  # the prompt's pages stayed cached
    assert again["meta_info"]["id"] != "r-1" and again["output_ids"] == reply["output_ids"]


def test_logprobs_from_logprob_start_len(server: ServerProcess) -> None:
    """Output logprobs are the completions route's; prompt logprobs those of scoring the
    prompt there (echo, max_tokens 0), from logprob_start_len on (the first token has none,
    -1 gives the last token's alone); each entry's text is its token's."""
    body = {
        "text": PROMPT,
        "sampling_params": GREEDY,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    whole = generate(server, {**body, "logprob_start_len": 0})["meta_info"]
    scored = completion(server, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2})[
        "logprobs"
    ]
    inputs = whole["input_token_logprobs"]
    assert len(inputs) == whole["prompt_tokens"] == 5
    assert inputs[0][0] is None and whole["input_top_logprobs"][0] is None
    assert [e[2] for e in inputs] == scored["tokens"]
    assert [e[0] for e in inputs[1:]] == pytest.approx(scored["token_logprobs"][1:], abs=1e-4)
    for tops, expected in zip(whole["input_top_logprobs"][1:], scored["top_logprobs"][1:]):
        assert {text: lp for lp, _, text in tops} == pytest.approx(expected, abs=1e-4)
    sampled = completion(
        server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    )["logprobs"]
    outputs = whole["output_token_logprobs"]
    assert [e[2] for e in outputs] == sampled["tokens"]
    # The second request prefills the prompt's last token again beside the cached rest: its
    # K/V may differ in float32's last bit, which can round to the next float16 of the cache.
    assert [e[0] for e in outputs] == pytest.approx(sampled["token_logprobs"], abs=2e-3)
    assert all(len(tops) == 2 for tops in whole["output_top_logprobs"])
    for start, count in ((-1, 1), (2, 3), (4, 1)):
        meta = generate(server, {**body, "logprob_start_len": start})["meta_info"]
        got, want = meta["input_token_logprobs"], inputs[5 - count :]
        assert [e[1:] for e in got] == [e[1:] for e in want]
        assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-4)
    plain = generate(server, {**body, "return_text_in_logprobs": False})["meta_info"]
    assert all(text is None for _, _, text in plain["output_token_logprobs"])


def test_scoring_a_prompt_with_no_new_tokens(server: ServerProcess) -> None:
    reply = generate(
        server,
        {
            "input_ids": [504, 3575, 282, 4649, 314],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 1,
        },
    )
    meta = reply["meta_info"]
    assert reply["text"] == "" and reply["output_ids"] == [] and meta["completion_tokens"] == 0
    assert [e[1] for e in meta["input_token_logprobs"]] == [3575, 282, 4649, 314]
    assert meta["output_token_logprobs"] == [] and meta["finish_reason"]["type"] == "length"


def test_a_batch_with_its_own_sampling_params_and_n(server: ServerProcess) -> None:
    """A list of prompts (or n > 1) gives a list, item by item in order, each what the
    prompt gives alone; rids name the items, with n's copies numbered."""
    prompts = [PROMPT, "One, two, three,"]
    sampling = [GREEDY, {"temperature": 0, "max_new_tokens": 4, "n": 2}]
    reply = generate(server, {"text": prompts, "sampling_params": sampling, "rid": ["a", "b"]})
    assert [item["meta_info"]["id"] for item in reply] == ["a", "b-0", "b-1"]
    alone = [
        generate(server, {"text": p, "sampling_params": {**s, "n": 1}})
        for p, s in zip(prompts, sampling)
    ]
    assert [item["output_ids"] for item in reply] == [
        alone[0]["output_ids"],
        alone[1]["output_ids"],
        alone[1]["output_ids"],
    ]
    ids = [[504, 3575, 282], [504, 3575]]
    by_ids = generate(server, {"input_ids": ids, "sampling_params": GREEDY})
    assert isinstance(by_ids, list) and len(by_ids) == 2
    assert [item["meta_info"]["prompt_tokens"] for item in by_ids] == [3, 2]
    single_n = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "n": 2}})
    assert isinstance(single_n, list) and len(single_n) == 2


def test_stop_reasons_name_what_matched(server: ServerProcess) -> None:
    free = generate(server, {"text": PROMPT, "sampling_params": GREEDY})
    text, ids = free["text"], free["output_ids"]
    by_string = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": text[3:6]}})
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": text[3:6]}
    assert by_string["text"] == text[:3]
    by_token = generate(
        server, {"text": PROMPT, "sampling_params": {**GREEDY, "stop_token_ids": [ids[2]]}}
    )
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert by_token["output_ids"] == ids[:3]


def test_streamed_events_carry_the_output_so_far(server: ServerProcess) -> None:
    whole = generate(server, {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    events, _ = run(
        stream(
            server.base_url + "/generate",
            {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True},
        )
    )
    for event in events:
        protocol.GenerateResponse.model_validate(event)
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert len(last["meta_info"]["output_token_logprobs"]) == 8
    batch, _ = run(
        stream(
            server.base_url + "/generate",
            {"text": [PROMPT, "Hi"], "sampling_params": GREEDY},
        )
    )
    finals = {e["index"]: e for e in batch if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1] and finals[0]["output_ids"] == whole["output_ids"]


async def _abort_while_running(base_url: str) -> tuple[list[dict[str, Any]], Any, Any]:
    """Stream a long request, abort it by rid once it produced, while another runs."""
    long = {
        "text": "Count:",
        "rid": "long",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    other = asyncio.create_task(
        post(base_url + "/generate", {"text": PROMPT, "sampling_params": GREEDY})
    )
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + "/generate", json=long) as response:
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                events.append(orjson.loads(line[6:]))
                if len(events) == 3:
                    twin = await post(base_url + "/generate", {"text": "x", "rid": "long"})
                    aborted = await post(base_url + "/abort_request", {"rid": "long"})
    return events, (twin, aborted), await other


def test_abort_request_ends_one_request_and_spares_the_others(server: ServerProcess) -> None:
    events, (twin, aborted), other = run(_abort_while_running(server.base_url))
    assert twin[0] == 400 and twin[1]["error"]["param"] == "rid"  # "long" was running
    assert aborted == (200, {"aborted": 1})
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 2000
    expected = generate(server, {"text": PROMPT, "sampling_params": GREEDY})
    assert other[0] == 200 and other[1]["output_ids"] == expected["output_ids"]
    assert run(post(server.base_url + "/abort_request", {"rid": "gone"})) == (200, {"aborted": 0})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "Hi", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"text": ["a"], "sampling_params": [{}, {}]}, "sampling_params"),
        ({"input_ids": [[1], [10**7]]}, "input_ids"),
        ({"text": "a", "input_ids": [1]}, None),
        ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params"),
    ],
)
def test_bad_requests_are_refused_by_field(
    server: ServerProcess, body: dict[str, Any], param: str | None
) -> None:
    status, reply = run(post(server.base_url + "/generate", body))
    assert status == 400 and reply["error"]["param"] == param, reply


def test_abort_request_needs_a_rid_or_abort_all(server: ServerProcess) -> None:
    status, reply = run(post(server.base_url + "/abort_request", {}))
    assert status == 400 and reply["error"]["param"] == "rid"
