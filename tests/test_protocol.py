"""The edge of the server without a model: request parsing and its messages, sampling
defaults, input limits, admission places and the OpenAPI description."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from aserve.config import build_config
from aserve.sampling_params import BOUNDS, SamplingParams
from aserve.server import openai
from aserve.server.admission import Admission
from aserve.server.app import Server
from aserve.server.limits import MIN_BODY_BYTES, InputLimits
from aserve.server.openai import APIError
from aserve.server.openapi import OPERATIONS, openapi_spec

USER = [{"role": "user", "content": "hi"}]


def chat(
    body: dict[str, Any], defaults: dict[str, float] | None = None
) -> openai.GenerationRequest:
    return openai.parse_chat(orjson.dumps(body), defaults or {})


def refusal(parse: Any, body: dict[str, Any] | bytes) -> APIError:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(APIError) as caught:
        parse(raw, {})
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (b"{not json", None, "request body is not valid JSON"),
        (b"[1, 2]", None, "request body must be a JSON object"),
        ({}, "messages", "'messages' is required"),
        ({"messages": []}, "messages", "'messages': List should have at least 1 item"),
        ({"messages": [{"role": "user"}]}, "messages", "'messages[0].content' is required"),
        ({"messages": [{"role": "system"}]}, "messages", "'messages[0].content' is required"),
        (
            {"messages": [{"role": "tool", "content": "42"}]},
            "messages",
            "'messages[0].tool_call_id' is required",
        ),
        (
            {"messages": [{"role": "assistant"}]},
            "messages",
            "an assistant message needs 'content' or 'tool_calls'",
        ),
        (
            {"messages": [{"role": "assistant", "content": None}]},
            "messages",
            "an assistant message needs 'content' or 'tool_calls'",
        ),
        ({"messages": [{"content": "x"}]}, "messages", "'messages[0].role' must be one of"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "'messages[0].role'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
            "image parts ({'type': 'image_url', 'image_url': {'url': ...}}; the Responses API's",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages",
            "audio and files are not supported",
        ),
        (
            {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
            "in a user message of chat image parts",
        ),
        ({"messages": USER, "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"messages": USER, "temperature": "1"}, "temperature", "valid number"),
        ({"messages": USER, "top_p": 0}, "top_p", "greater than 0"),
        ({"messages": USER, "max_tokens": 2.5}, "max_tokens", "valid integer"),
        ({"messages": USER, "max_tokens": True}, "max_tokens", "valid integer"),
        ({"messages": USER, "n": 17}, "n", "'n': Input should be less than or equal to 16"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616}',
            "seed",
            "less than or equal to 9223372036854775807",
        ),
        ({"messages": USER, "stop": ""}, "stop", "'stop' must be a non-empty string"),
        ({"messages": USER, "stop": ["a"] * 17}, "stop", "at most 16"),
        ({"messages": USER, "stream": "yes"}, "stream", "valid boolean"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ],
)
def test_chat_refusals_name_the_field(
    body: dict[str, Any] | bytes, param: str | None, message: str
) -> None:
    error = refusal(openai.parse_chat, body)
    assert error.param == param and message in error.message, error.message


@pytest.mark.parametrize(
    ("parse", "body", "param", "message"),
    [
        (openai.parse_completion, {"prompt": 5}, "prompt", "a list of token ids"),
        (openai.parse_completion, {"prompt": []}, "prompt", "'prompt' must be"),
        (openai.parse_completion, {"prompt": [1, -2]}, "prompt", "'prompt' must be"),
        (openai.parse_completion, {"prompt": [1, 2.0]}, "prompt", "'prompt' must be"),
        (openai.parse_completion, {"prompt": ["a", 1]}, "prompt", "'prompt' must be"),
        (openai.parse_completion, {"prompt": "x", "logprobs": 21}, "logprobs", "20"),
        (openai.parse_completion, {"prompt": "x", "suffix": "y"}, "suffix", "fill-in-the-middle"),
        (openai.parse_generate, {}, None, "exactly one of 'text' and 'input_ids'"),
        (openai.parse_generate, {"text": "a", "input_ids": [1]}, None, "exactly one of"),
        (
            openai.parse_generate,
            {"text": "a", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params",
            "'sampling_params.max_new_tokens'",
        ),
    ],
)
def test_other_refusals(parse: Any, body: dict[str, Any], param: str | None, message: str) -> None:
    error = refusal(parse, body)
    assert message in error.message, error.message
    if param is not None:
        assert error.param == param


def test_valid_shapes_parse() -> None:
    history = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[1"}},
                {
                    "id": "c3",
                    "type": "function",
                    "function": {"name": "h", "arguments": '{"a": 1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    parsed = chat({"messages": history, "n": 2.0, "max_tokens": 7.0, "stop": "x", "extra": 1})
    assert parsed.n == 2 and parsed.max_tokens == 7 and parsed.stop == ["x"]
    assert parsed.messages is not None
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "tool"]
    assert parsed.messages[1]["content"] == "ab" and parsed.messages[2]["content"] == ""
    calls = parsed.messages[2]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["f", "g", "h"]
    # as templates take them (GLM-4.5's walks their items): objects, text that is none as is
    assert [call["function"]["arguments"] for call in calls] == [{}, "[1", {"a": 1}]
    assert calls[0]["id"] == "c1" and calls[0]["type"] == "function"
    assert parsed.messages[3]["tool_call_id"] == "c1"
    for prompt, texts, ids in [
        ("a", ["a"], []),
        (["a", "b"], ["a", "b"], []),
        ([1, 2], [], [[1, 2]]),
        ([[1], [2, 3]], [], [[1], [2, 3]]),
    ]:
        parsed = openai.parse_completion(orjson.dumps({"prompt": prompt}), {})
        assert (parsed.texts, parsed.token_ids, parsed.max_tokens) == (texts, ids, 16)


def test_defaults_fill_only_what_a_request_leaves_unset() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 100}
    unset = chat({"messages": USER, "temperature": None}, defaults)
    assert unset.params.temperature == 0.2 and unset.params.top_p == 0.9
    assert unset.params.top_k == 40 and unset.max_tokens == 100
    assert unset.params.min_p == SamplingParams().min_p
    own = chat({"messages": USER, "temperature": 0, "top_k": -1, "max_tokens": 5}, defaults)
    assert own.params.temperature == 0 and own.params.top_k == -1 and own.max_tokens == 5
    assert own.params.top_p == 0.9
    assert chat({"messages": USER}).params == SamplingParams(max_tokens=1)
    completion = openai.parse_completion(b'{"prompt": "x"}', defaults)
    assert completion.max_tokens == 100 and completion.params.temperature == 0.2
    generate = openai.parse_generate(b'{"text": "x"}', {"temperature": 0.5}).prompts[0]
    assert generate.max_tokens == 128 and generate.params.temperature == 0.5


def test_request_schema_states_the_sampling_bounds() -> None:
    """The description and the offline API's checks read one table; a bound at its edge
    passes both, one step over fails both."""
    schema = openapi_spec(False)["components"]["schemas"]["ChatCompletionRequest"]
    keywords = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum"}
    for name, bound in BOUNDS.items():
        field = schema["properties"][name]["anyOf"][0]
        for side, keyword in keywords.items():
            assert field.get(keyword) == getattr(bound, side), (name, side)
    assert SamplingParams(temperature=100).temperature == 100
    refusal(openai.parse_chat, {"messages": USER, "temperature": 100.001})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=100.001)


def test_every_route_is_described() -> None:
    server = Server(build_config())
    app = server.make_app()
    routes = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    spec = openapi_spec(False)
    described = {(method, path) for path, item in spec["paths"].items() for method in item}
    assert routes == described == {(op.method, op.path) for op in OPERATIONS}
    assert spec["openapi"].startswith("3.1")
    refs = orjson.dumps(spec).decode().count('"$ref"')
    assert refs > 20 and all(
        name in spec["components"]["schemas"] for name in ("ChatCompletionChunk", "ErrorResponse")
    )


def test_api_key_is_in_the_description() -> None:
    spec = openapi_spec(True)
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert spec["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/health"]["get"]
    assert "securitySchemes" not in openapi_spec(False)["components"]


def test_admission_holds_its_capacity() -> None:
    admission = Admission(capacity=3)
    first = admission.reserve()
    first.resize(2)
    with pytest.raises(APIError) as full:
        admission.reserve(2)
    assert full.value.status == 503 and full.value.code == "queue_full"
    with admission.reserve() as second:
        assert admission.in_use == 3
        with pytest.raises(APIError):
            second.resize(2)
        assert second.count == 1
    assert admission.in_use == 2
    first.resize(1)
    with pytest.raises(RuntimeError), admission.reserve(2):
        raise RuntimeError("a failing handler")
    assert admission.in_use == 1
    first.release()
    assert admission.in_use == 0
    unbounded = Admission(None)
    unbounded.reserve(10_000)
    assert unbounded.in_use == 10_000


def test_input_limits_follow_the_context() -> None:
    limits = InputLimits.for_model(context=100, chars_per_token=10)
    assert limits.max_body_bytes == MIN_BODY_BYTES
    assert InputLimits.for_model(8192, 81).max_body_bytes == 12 * 8192 * 81
    assert InputLimits.for_model(10**6, 200).max_body_bytes == 64 << 20
    limits.check_text(99 * 10, None, "prompt")
    with pytest.raises(APIError) as long:
        limits.check_text(99 * 10 + 1, None, "prompt")
    assert long.value.code == "context_length_exceeded" and "at least 100" in long.value.message
    limits.check_text(90 * 10, 10, "prompt")
    with pytest.raises(APIError, match="max_tokens is 11"):
        limits.check_text(90 * 10, 11, "prompt")
    with pytest.raises(APIError) as no_room:
        limits.check_text(0, 100, "prompt")
    assert no_room.value.param == "max_tokens"
    unknown = InputLimits.for_model(100, None)
    unknown.check_text(10**9, None, "prompt")
    assert unknown.max_body_bytes == 64 << 20


def test_an_empty_suffix_is_no_suffix() -> None:
    """Clients that always send `suffix` send it empty when there is nothing after the cursor."""
    parsed = openai.parse_completion(b'{"prompt": "x", "suffix": ""}', {})
    assert parsed.texts == ["x"]
