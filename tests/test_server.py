"""The HTTP server end to end: a real `aserve` process on a loopback port, real clients
(aiohttp and the openai SDK), the embedded SmolLM2 model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server_utils import ServerProcess, serving

MODEL = "smol"
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(
        ServerProcess(
            ["--model", str(smollm2_dir), "--served-model-name", MODEL, "--num-pages", "8193"]
        )
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with session.post(url, data=data, headers=headers) as response:
            return response.status, orjson.loads(await response.read())


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers) as response:
            return response.status, await response.read()


async def stream(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """All SSE payloads of a streamed request, and the raw frames."""
    frames: list[bytes] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={**body, "stream": True}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            buffer = b""
            async for piece in response.content.iter_any():
                buffer += piece
                while b"\n\n" in buffer:
                    frame, buffer = buffer.split(b"\n\n", 1)
                    frames.append(frame)
    assert frames[-1] == b"data: [DONE]", frames[-1]
    for frame in frames:
        assert frame.startswith(b"data: ")
        frame.decode("utf-8")
    return [orjson.loads(f[6:]) for f in frames[:-1]], frames


async def typed_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed /v1/responses request: `event: TYPE` then `data: JSON`
    each, and no [DONE]."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={**body, "stream": True}) as response:
            assert response.status == 200
            raw = await response.read()
    events = []
    for frame in raw.decode().split("\n\n")[:-1]:
        kind, data = frame.split("\n")
        event = orjson.loads(data.removeprefix("data: "))
        assert kind == "event: " + event["type"]
        events.append(event)
    return events


def chat_text(chunks: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content", "")
        for c in chunks
        if c["choices"] and c["choices"][0]["index"] == index
    )


def metric_value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_health_models_and_metrics(server: ServerProcess) -> None:
    assert server.health() == 200
    status, body = run(get(server.base_url + "/v1/models"))
    models = orjson.loads(body)
    assert status == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 8192
    status, body = run(get(server.base_url + "/metrics"))
    assert status == 200
    for name in (
        "aserve:num_requests_running",
        "aserve:kv_cache_usage_perc",
        "aserve:time_to_first_token_seconds",
        "aserve:prompt_tokens_total",
    ):
        assert name in body.decode()


def test_chat_completion_shape(server: ServerProcess) -> None:
    status, body = run(
        post(
            server.base_url + "/v1/chat/completions",
            {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 20},
        )
    )
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_streamed_chat_equals_non_streamed(server: ServerProcess) -> None:
    request = {
        "model": MODEL,
        "messages": HELLO,
        "temperature": 0,
        "max_tokens": 30,
        "stream_options": {"include_usage": True},
    }
    _, full = run(post(server.base_url + "/v1/chat/completions", request))
    chunks, _ = run(stream(server.base_url + "/v1/chat/completions", request))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chat_text(chunks) == full["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert (
        finishes[-1] == full["choices"][0]["finish_reason"]
        and finishes.count(None) == len(finishes) - 1
    )
    assert chunks[-1]["choices"] == []
    usage, details = chunks[-1]["usage"], chunks[-1]["usage"].pop("prompt_tokens_details")
    full["usage"].pop("prompt_tokens_details")
    assert usage == full["usage"]
    # the same prompt a second time: OpenAI's cached_tokens counts what the prefix cache gave
    assert 0 < details["cached_tokens"] < usage["prompt_tokens"]


def test_completion_prompt_forms_echo_and_n(server: ServerProcess) -> None:
    url = server.base_url + "/v1/completions"
    base = {"model": MODEL, "temperature": 0, "max_tokens": 8}
    _, one = run(post(url, {**base, "prompt": "The capital of France is"}))
    assert one["object"] == "text_completion" and one["id"].startswith("cmpl-")
    _, tokens = run(post(server.base_url + "/tokenize", {"prompt": "The capital of France is"}))
    _, by_ids = run(post(url, {**base, "prompt": tokens["tokens"]}))
    assert by_ids["choices"][0]["text"] == one["choices"][0]["text"]
    _, many = run(post(url, {**base, "prompt": ["The capital of France is", "One, two,"]}))
    assert [c["index"] for c in many["choices"]] == [0, 1]
    assert many["choices"][0]["text"] == one["choices"][0]["text"]
    _, nested = run(post(url, {**base, "prompt": [tokens["tokens"], tokens["tokens"]]}))
    assert len(nested["choices"]) == 2
    _, echoed = run(post(url, {**base, "prompt": "The capital of France is", "echo": True}))
    assert echoed["choices"][0]["text"] == "The capital of France is" + one["choices"][0]["text"]
    _, n2 = run(post(url, {"model": MODEL, "prompt": "Once", "n": 2, "seed": 1, "max_tokens": 12}))
    assert len(n2["choices"]) == 2 and n2["usage"]["completion_tokens"] == 24
    _, again = run(
        post(url, {"model": MODEL, "prompt": "Once", "n": 2, "seed": 1, "max_tokens": 12})
    )
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in n2["choices"]]


def test_streamed_completion_equals_non_streamed(server: ServerProcess) -> None:
    request = {"model": MODEL, "prompt": "def fibonacci(n):", "temperature": 0, "max_tokens": 40}
    _, full = run(post(server.base_url + "/v1/completions", request))
    chunks, _ = run(stream(server.base_url + "/v1/completions", request))
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_choices_equal_non_streamed(server: ServerProcess) -> None:
    """Several choices share one stream (n=2, and two prompts): each index's chunks add up to
    that choice's non-streamed text, and the usage counts them all."""
    url = server.base_url + "/v1/completions"
    base = {"model": MODEL, "max_tokens": 10, "seed": 3, "stream_options": {"include_usage": True}}
    for request in (
        {**base, "prompt": "Once", "n": 2},
        {**base, "prompt": ["The capital of France is", "One, two,"], "temperature": 0},
    ):
        _, full = run(post(url, request))
        chunks, _ = run(stream(url, request))
        texts = ["", ""]
        for chunk in chunks:
            for choice in chunk["choices"]:
                texts[choice["index"]] += choice["text"]
        assert texts == [c["text"] for c in full["choices"]]
        assert chunks[-1]["usage"]["completion_tokens"] == 20


def test_stop_strings_never_appear(server: ServerProcess) -> None:
    url = server.base_url + "/v1/completions"
    base = {
        "model": MODEL,
        "prompt": "List the numbers from 1 to 20:",
        "temperature": 0,
        "max_tokens": 60,
        "ignore_eos": True,
    }
    _, free = run(post(url, base))
    text = free["choices"][0]["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    assert len(stop.strip()) >= 2, text
    expected = text[: text.index(stop)]
    _, stopped = run(post(url, {**base, "stop": [stop, "never-appears"]}))
    assert stopped["choices"][0]["text"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    chunks, _ = run(stream(url, {**base, "stop": stop}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    shown = {**base, "stop": stop, "include_stop_str_in_output": True}
    _, kept = run(post(url, shown))
    assert kept["choices"][0]["text"] == expected + stop
    chunks, _ = run(stream(url, shown))
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected + stop
    sampling = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True, "stop": stop}
    body = {"text": base["prompt"], "sampling_params": {**sampling, "no_stop_trim": True}}
    _, generated = run(post(server.base_url + "/generate", body))
    assert generated["text"] == expected + stop


def test_special_tokens_shown_on_request(server: ServerProcess) -> None:
    """skip_special_tokens false with include_stop_str_in_output (vLLM's): the end-of-turn
    token that ended the reply is in its text; by default neither is."""
    url = server.base_url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": HELLO, "temperature": 0, "guided_regex": "Paris"}
    _, plain = run(post(url, base))
    assert plain["choices"][0]["message"]["content"] == "Paris"
    raw = {**base, "skip_special_tokens": False, "include_stop_str_in_output": True}
    _, shown = run(post(url, raw))
    content = shown["choices"][0]["message"]["content"]
    assert content in ("Paris<|im_end|>", "Paris<|endoftext|>"), content


def test_logprobs(server: ServerProcess) -> None:
    _, chat = run(
        post(
            server.base_url + "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": HELLO,
                "temperature": 0,
                "max_tokens": 5,
                "logprobs": True,
                "top_logprobs": 3,
            },
        )
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
    _, completion = run(
        post(
            server.base_url + "/v1/completions",
            {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "logprobs": 2},
        )
    )
    lp = completion["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0


def test_echo_with_logprobs_scores_the_prompt(server: ServerProcess) -> None:
    """OpenAI's echo with logprobs (what lm-eval-harness sends for log-likelihoods): the
    prompt's tokens lead, the first with null logprobs, and the text offsets run through
    the echoed text; streamed, the same lists arrive over the chunks."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    request = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 2}
    request |= {"logprobs": 1, "echo": True}
    _, tokens = run(post(server.base_url + "/tokenize", {"prompt": prompt}))
    count = len(tokens["tokens"])
    _, full = run(post(server.base_url + "/v1/completions", request))
    choice = full["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == count + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"] and choice["text"].startswith(prompt)
    assert lp["text_offset"][count] == len(prompt)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # the last " is", which the first sentence's pattern predicts, beats " capital" after "The"
    assert lp["token_logprobs"][count - 1] > lp["token_logprobs"][1]
    chunks, _ = run(stream(server.base_url + "/v1/completions", request))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in lp:
        assert [v for part in streamed for v in part[key]] == lp[key]
    # max_tokens 0, OpenAI's legacy way to score a text: the prompt alone, nothing generated
    scoring = {**request, "max_tokens": 0}
    _, scored = run(post(server.base_url + "/v1/completions", scoring))
    choice = scored["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["tokens"] == lp["tokens"][:count]
    scored_values = choice["logprobs"]["token_logprobs"]
    assert scored_values[0] is None
    assert scored_values[1:] == pytest.approx(lp["token_logprobs"][1:count], abs=1e-4)
    chunks, _ = run(stream(server.base_url + "/v1/completions", scoring))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [v for part in streamed for v in part["tokens"]] == lp["tokens"][:count]
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    _, bare = run(post(server.base_url + "/v1/completions", {"prompt": prompt, "max_tokens": 0}))
    assert bare["choices"][0]["text"] == "" and bare["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/chat/completions", b"{not json", None, "JSON"),
        ("/v1/chat/completions", {"model": MODEL}, "messages", "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages", "messages"),
        (
            "/v1/chat/completions",
            {"messages": HELLO, "temperature": -1},
            "temperature",
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": HELLO, "top_p": 2}, "top_p", "top_p"),
        (
            "/v1/chat/completions",
            {"messages": HELLO, "max_tokens": "ten"},
            "max_tokens",
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": HELLO, "n": 0}, "n", "'n'"),
        ("/v1/chat/completions", {"messages": HELLO, "model": "gpt-4"}, "model", "gpt-4"),
        ("/v1/completions", {"prompt": 5}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": [1, -2]}, "prompt", "token ids"),
        ("/v1/completions", {"prompt": [10**7]}, "prompt", "vocabulary"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", "stop"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 9000}, "max_tokens", "9000"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages", "content"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}, "messages", "tool_calls"),
        (
            "/v1/chat/completions",
            {"messages": HELLO, "logit_bias": {"abc": 1}},
            "logit_bias",
            "token ids",
        ),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "100"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", "vocab"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "3"),
        (
            "/v1/chat/completions",
            {"messages": HELLO, "min_tokens": 2, "response_format": {"type": "json_object"}},
            "min_tokens",
            "cannot be combined",
        ),
        (
            "/v1/chat/completions",
            {"messages": HELLO, "continue_final_message": True},
            "continue_final_message",
            "assistant message last",
        ),
        (
            "/v1/chat/completions",
            {"messages": HELLO, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "cannot both be true",
        ),
        ("/tokenize", {"prompt": "a", "messages": HELLO}, None, "exactly one of"),
        ("/detokenize", {"tokens": [10**7]}, "tokens", "vocabulary"),
    ],
)
def test_bad_requests_get_openai_errors(
    server: ServerProcess, path: str, body: Any, param: str | None, fragment: str
) -> None:
    status, reply = run(post(server.base_url + path, body))
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"]


def test_context_error_names_both_numbers(server: ServerProcess) -> None:
    _, reply = run(
        post(server.base_url + "/v1/completions", {"prompt": "Hello there", "max_tokens": 8191})
    )
    message = reply["error"]["message"]
    assert (
        "8192" in message
        and "8191" in message
        and reply["error"]["code"] == "context_length_exceeded"
    )


def test_big_inputs_are_refused_before_any_work(server: ServerProcess) -> None:
    """A body over the limit that the context implies is a 413 named in bytes; a prompt too
    long for the context is a 400 named in characters, told without tokenizing it."""
    url = server.base_url + "/v1/completions"
    huge = {"prompt": "a" * 20_000_000, "max_tokens": 1}
    status, reply = run(post(url, huge))
    assert status == 413 and reply["error"]["code"] == "request_too_large"
    assert f"has {len(orjson.dumps(huge))} bytes" in reply["error"]["message"]
    status, reply = run(post(url, {"prompt": "Paris " * 200_000, "max_tokens": 1}))
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert "1200000 characters" in reply["error"]["message"]
    status, reply = run(post(server.base_url + "/tokenize", {"prompt": "x" * 1_000_000}))
    assert status == 400 and "characters" in reply["error"]["message"]
    _, metrics = run(get(server.base_url + "/metrics"))
    assert metric_value(metrics.decode(), "aserve:requests_rejected_total") >= 3


def test_replies_match_the_description(server: ServerProcess) -> None:
    """The bodies the handlers build as plain dicts validate against the models that
    /openapi.json describes."""
    from aserve.server import protocol

    status, body = run(get(server.base_url + "/openapi.json"))
    spec = orjson.loads(body)
    assert status == 200 and "/v1/chat/completions" in spec["paths"]
    base = {"max_tokens": 4, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    _, reply = run(post(server.base_url + "/v1/chat/completions", {**base, "messages": HELLO}))
    protocol.ChatCompletion.model_validate(reply)
    chunks, _ = run(
        stream(
            server.base_url + "/v1/chat/completions",
            {**base, "messages": HELLO, "stream_options": {"include_usage": True}},
        )
    )
    for chunk in chunks:
        protocol.ChatCompletionChunk.model_validate(chunk)
    completion = {"prompt": ["Hi", "Yo"], "max_tokens": 3, "logprobs": 2, "echo": True}
    _, reply = run(post(server.base_url + "/v1/completions", completion))
    protocol.Completion.model_validate(reply)
    chunks, _ = run(stream(server.base_url + "/v1/completions", completion))
    for chunk in chunks:
        protocol.Completion.model_validate(chunk)
    _, body = run(get(server.base_url + "/v1/models"))
    protocol.ModelList.model_validate_json(body)
    _, reply = run(post(server.base_url + "/tokenize", {"messages": HELLO}))
    protocol.TokenizeResponse.model_validate(reply)
    _, reply = run(post(server.base_url + "/detokenize", {"tokens": reply["tokens"]}))
    protocol.DetokenizeResponse.model_validate(reply)
    _, reply = run(post(server.base_url + "/generate", {"text": "Hi"}))
    protocol.GenerateResponse.model_validate(reply)
    status, reply = run(post(server.base_url + "/v1/completions", {"prompt": 1}))
    assert status == 400
    protocol.ErrorResponse.model_validate(reply)


def test_logit_bias_and_min_tokens(server: ServerProcess) -> None:
    """OpenAI's logit_bias steers the tokens (keys are token ids as strings); vLLM's
    min_tokens (SGLang's min_new_tokens on /generate) keeps a stop token from ending the
    output early, even one the bias pushes to the top."""
    _, tokens = run(post(server.base_url + "/tokenize", {"prompt": " Paris"}))
    (paris,) = tokens["tokens"]
    url = server.base_url + "/v1/completions"
    base = {"model": MODEL, "prompt": "Hello", "temperature": 0, "max_tokens": 4}
    _, forced = run(post(url, {**base, "logit_bias": {str(paris): 100}}))
    assert forced["choices"][0]["text"] == " Paris" * 4
    _, free = run(post(url, base))
    _, pushed_away = run(post(url, {**base, "logit_bias": {str(paris): -100}}))
    assert pushed_away["choices"][0]["text"] == free["choices"][0]["text"] != " Paris" * 4
    ending = {**base, "max_tokens": 8, "logit_bias": {str(paris): 100}, "stop_token_ids": [paris]}
    _, at_once = run(post(url, {**ending, "return_token_ids": True}))
    choice = at_once["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [paris]
    _, held = run(post(url, {**ending, "min_tokens": 3, "return_token_ids": True}))
    choice = held["choices"][0]
    assert choice["finish_reason"] == "stop" and len(choice["token_ids"]) == 4
    assert choice["token_ids"][-1] == paris and paris not in choice["token_ids"][:3]
    sampling = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [paris]}
    sampling |= {"logit_bias": {str(paris): 100}, "min_new_tokens": 3}
    _, generated = run(
        post(server.base_url + "/generate", {"text": "Hello", "sampling_params": sampling})
    )
    assert generated["output_ids"] == choice["token_ids"]


def test_continue_final_message(server: ServerProcess) -> None:
    """vLLM's continue_final_message: the reply carries on the last assistant message (the
    template leaves its turn open and adds no new one); add_generation_prompt false alone
    leaves the new turn out."""
    url = server.base_url + "/v1/chat/completions"
    started = [*HELLO, {"role": "assistant", "content": "The capital of France is"}]
    base = {"model": MODEL, "temperature": 0, "max_tokens": 3}
    _, continued = run(post(url, {**base, "messages": started, "continue_final_message": True}))
    assert "Paris" in continued["choices"][0]["message"]["content"]
    _, fresh = run(post(url, {**base, "messages": started}))
    _, closing = run(
        post(server.base_url + "/tokenize", {"prompt": "<|im_end|>\n<|im_start|>assistant\n"})
    )
    assert fresh["usage"]["prompt_tokens"] - continued["usage"]["prompt_tokens"] == closing["count"]
    _, bare = run(post(url, {**base, "messages": HELLO, "add_generation_prompt": False}))
    _, opened = run(post(url, {**base, "messages": HELLO}))
    _, turn = run(post(server.base_url + "/tokenize", {"prompt": "<|im_start|>assistant\n"}))
    assert opened["usage"]["prompt_tokens"] - bare["usage"]["prompt_tokens"] == turn["count"]


def test_unknown_fields_are_tolerated(server: ServerProcess) -> None:
    status, _ = run(
        post(
            server.base_url + "/v1/chat/completions",
            {"messages": HELLO, "max_tokens": 2, "user": "x", "frobnicate": {"a": 1}},
        )
    )
    assert status == 200


def test_tokenize_detokenize_and_generate(server: ServerProcess) -> None:
    _, tokens = run(post(server.base_url + "/tokenize", {"prompt": "Hello world"}))
    assert tokens["count"] == len(tokens["tokens"]) > 0
    _, text = run(post(server.base_url + "/detokenize", {"tokens": tokens["tokens"]}))
    assert text["prompt"] == "Hello world"
    _, chat_tokens = run(post(server.base_url + "/tokenize", {"messages": HELLO}))
    assert chat_tokens["count"] > tokens["count"]
    status, generated = run(
        post(
            server.base_url + "/generate",
            {
                "input_ids": tokens["tokens"],
                "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            },
        )
    )
    assert status == 200 and len(generated["output_ids"]) == 6
    assert generated["meta_info"]["finish_reason"]["type"] == "length"
    _, by_text = run(
        post(
            server.base_url + "/generate",
            {"text": "Hello world", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        )
    )
    assert by_text["output_ids"] == generated["output_ids"] and by_text["text"]


def test_router_facing_routes(server: ServerProcess) -> None:
    """What SGLang's router reads when it adds a worker, in its shapes (old names too), each
    as /openapi.json describes it."""
    from aserve.server import protocol

    for path in ("/server_info", "/get_server_info"):
        status, body = run(get(server.base_url + path))
        info = protocol.ServerInfo.model_validate_json(body).model_dump()
        assert status == 200 and info["served_model_name"] == MODEL
        assert info["dp_size"] == 1 and info["max_running_requests"] == 256
        assert info["max_total_num_tokens"] == 8192 and info["context_length"] == 8192
    for path in ("/model_info", "/get_model_info"):
        status, body = run(get(server.base_url + path))
        model = protocol.ModelInfo.model_validate_json(body).model_dump()
        assert status == 200 and model["is_generation"] is True
        assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
    status, body = run(get(server.base_url + "/get_load"))
    assert status == 200
    assert protocol.Load.model_validate_json(body).model_dump() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    status, body = run(get(server.base_url + "/health_generate"))
    assert status == 200 and protocol.Health.model_validate_json(body).status == "ok"
    # The router's placeholder for a request that names no model is served, not refused.
    status, _ = run(
        post(
            server.base_url + "/v1/chat/completions",
            {"model": "unknown", "messages": HELLO, "max_tokens": 1},
        )
    )
    assert status == 200


def test_flush_cache_empties_the_prefix_cache_only_when_idle(server: ServerProcess) -> None:
    url = server.base_url + "/v1/completions"
    body = {"prompt": "Flushing is done by the scheduler " * 8, "max_tokens": 1}
    run(post(url, body))

    def cached_tokens() -> float:
        _, metrics = run(get(server.base_url + "/metrics"))
        return metric_value(metrics.decode(), "aserve:prefix_cache_hits_total")

    before = cached_tokens()
    run(post(url, body))
    assert cached_tokens() > before  # the second time the prompt came from the cache
    status, flushed = run(post(server.base_url + "/flush_cache", b""))
    assert status == 200 and flushed == {"status": "flushed"}
    before = cached_tokens()
    run(post(url, body))
    assert cached_tokens() == before  # gone: computed again

    async def flush_while_busy() -> tuple[int, Any]:
        # still running at the flush: 1,000 tokens take ~4 s at ~4 ms a token
        long = {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True}
        running = asyncio.create_task(post(url, long))
        await asyncio.sleep(0.5)
        refused = await post(server.base_url + "/flush_cache", b"")
        await running
        return refused

    status, refused = run(flush_while_busy())
    assert status == 400 and refused["error"]["code"] == "server_busy"


def test_images_are_refused_by_a_text_model(server: ServerProcess) -> None:
    """An image part is a 400 where the model takes no images (tests/test_images.py runs
    them); the image is not fetched first."""
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never-fetched.png"}},
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    for route in ("/v1/chat/completions", "/tokenize"):
        status, reply = run(post(server.base_url + route, body))
        assert status == 400 and "takes no images" in reply["error"]["message"], route


def test_embeddings_are_refused_by_a_generating_server(server: ServerProcess) -> None:
    """/v1/embeddings needs --is-embedding (tests/test_embeddings.py serves it)."""
    status, reply = run(post(server.base_url + "/v1/embeddings", {"input": "hi"}))
    assert status == 400 and "--is-embedding" in reply["error"]["message"]
    assert reply["error"]["code"] == "embeddings_not_served"


def test_openai_sdk(server: ServerProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=20
    )
    assert "Paris" in reply.choices[0].message.content
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in streamed:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        else:
            usage = chunk.usage
    assert "".join(pieces) == reply.choices[0].message.content
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens
    completion = client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=5, temperature=0
    )
    assert completion.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=5000)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_concurrent_streams(server: ServerProcess) -> None:
    request = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 16}
    _, single = run(post(server.base_url + "/v1/chat/completions", request))

    async def many() -> list[list[dict[str, Any]]]:
        results = await asyncio.gather(
            *(stream(server.base_url + "/v1/chat/completions", request) for _ in range(32))
        )
        return [chunks for chunks, _ in results]

    for chunks in run(many()):
        assert chat_text(chunks) == single["choices"][0]["message"]["content"]


def idle_metrics(server: ServerProcess, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        _, body = run(get(server.base_url + "/metrics"))
        text = body.decode()
        idle = (
            metric_value(text, "aserve:num_requests_running") == 0
            and metric_value(text, "aserve:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_client_disconnect_frees_pages(server: ServerProcess) -> None:
    request = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 4000, "ignore_eos": True}

    async def streaming_then_hang_up() -> float:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                server.base_url + "/v1/completions", json={**request, "stream": True}
            ) as response:
                await response.content.readline()
                await response.content.readline()
                _, body = await get(server.base_url + "/metrics")
                return metric_value(body.decode(), "aserve:kv_cache_usage_perc")

    async def non_streaming_then_hang_up() -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(server.base_url + "/v1/completions", json=request):
                    pass

    busy = run(streaming_then_hang_up())
    assert busy > 0
    text = idle_metrics(server)
    assert metric_value(text, "aserve:kv_cache_usage_perc") == 0
    assert metric_value(text, "aserve:num_requests_running") == 0
    run(non_streaming_then_hang_up())
    text = idle_metrics(server)
    assert metric_value(text, "aserve:kv_cache_usage_perc") == 0
    assert metric_value(text, "aserve:num_requests_running") == 0


def test_return_token_ids(server: ServerProcess) -> None:
    """vLLM's `return_token_ids`: every chunk with tokens carries them, text or not."""
    request = {
        "model": MODEL,
        "prompt": "Hello",
        "temperature": 0,
        "max_tokens": 12,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    _, full = run(post(server.base_url + "/v1/completions", request))
    ids = full["choices"][0]["token_ids"]
    assert len(ids) == full["usage"]["completion_tokens"] == 12
    chunks, _ = run(stream(server.base_url + "/v1/completions", request))
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert streamed == ids
    _, tokens = run(post(server.base_url + "/tokenize", {"prompt": "Hello"}))
    _, generated = run(
        post(
            server.base_url + "/generate",
            {
                "input_ids": tokens["tokens"],
                "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            },
        )
    )
    assert generated["output_ids"] == ids


def test_truncate_prompt_tokens(server: ServerProcess) -> None:
    """vLLM's `truncate_prompt_tokens`: a completion's text or token ids and a chat keep
    their last N tokens (the usage counts them; greedy text as for those ids sent alone);
    0 and more than the context are 400s that name the field."""
    text = "The quick brown fox jumps over the lazy dog near the river bank"
    _, tokens = run(post(server.base_url + "/tokenize", {"prompt": text}))

    def complete(path: str = "/v1/completions", **body: Any) -> tuple[int, Any]:
        greedy = {"model": MODEL, "temperature": 0, "max_tokens": 6}
        return run(post(server.base_url + path, {**greedy, **body}))

    _, alone = complete(prompt=tokens["tokens"][-5:])
    for prompt in (text, tokens["tokens"]):
        _, cut = complete(prompt=prompt, truncate_prompt_tokens=5)
        assert cut["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] == 5
        assert cut["choices"][0]["text"] == alone["choices"][0]["text"]
    _, chat = complete("/v1/chat/completions", messages=HELLO, truncate_prompt_tokens=7)
    assert chat["usage"]["prompt_tokens"] == 7
    for wrong, fragment in ((0, "keep no token"), (9000, "context is 8192")):
        status, reply = complete(prompt=text, truncate_prompt_tokens=wrong)
        assert status == 400 and reply["error"]["param"] == "truncate_prompt_tokens", reply
        assert fragment in reply["error"]["message"]
