"""OpenAI's Responses API (/v1/responses) through the openai SDK on the embedded model: the
reply is the chat route's for the same conversation, in output items; function calls out and
their results back in; the typed event stream; JSON output; what is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from aserve.server import protocol
from tests.server_utils import ServerProcess, serving
from tests.test_server import post, run

MODEL = "smol"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(["--model", str(smollm2_dir), "--served-model-name", MODEL]))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none")


def chat_text(client: OpenAI, messages: list[dict[str, Any]], **options: Any) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        **options,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


def test_a_reply_is_the_chat_routes_in_output_items(server: ServerProcess, client: OpenAI) -> None:
    body = {
        "model": MODEL,
        "instructions": "Answer in one short sentence.",
        "input": "What is the capital of France?",
        "temperature": 0,
        "max_output_tokens": 40,
    }
    response = client.responses.create(**body)
    status, raw = run(post(server.base_url + "/v1/responses", body))
    assert status == 200 and raw["output"][0]["content"][0]["text"] == response.output_text
    protocol.ResponseObject.model_validate(raw)
    messages = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert response.output_text == chat_text(client, messages, max_tokens=40)
    assert response.status == "completed" and response.output[0].type == "message"
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    cut = client.responses.create(
        model=MODEL, input="Tell me a long story.", temperature=0, max_output_tokens=5
    )
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 5


def test_function_calls_out_and_their_outputs_back_in(client: OpenAI) -> None:
    """A forced call comes back as a function_call item whose arguments follow the schema;
    the call and its output sent back make the same prompt as chat's tool messages."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.responses.create(
        model=MODEL,
        input=[question],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    call = calls[0]
    answered = client.responses.create(
        model=MODEL,
        input=[
            question,
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        temperature=0,
        max_output_tokens=30,
    )
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    messages = [
        question,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    expected = chat_text(client, messages, tools=[chat_tool], max_tokens=30)
    assert answered.output_text == expected and expected


def test_the_event_stream_builds_the_whole_reply(client: OpenAI) -> None:
    whole = client.responses.create(
        model=MODEL, input="Say hello.", temperature=0, max_output_tokens=24
    )
    with client.responses.stream(
        model=MODEL, input="Say hello.", temperature=0, max_output_tokens=24
    ) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response  # completed, or incomplete at the token limit
    assert final.status == whole.status and final.output_text == whole.output_text
    called = client.responses.create(
        model=MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        stream=True,
    )
    streamed = list(called)
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["function_call"]
    arguments = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert arguments[0].arguments == done[0].arguments  # type: ignore[union-attr]
    # the arguments stream as the model writes them (Hermes blocks): in pieces that join up
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 2 and "".join(pieces) == done[0].arguments  # type: ignore[union-attr]
    assert "city" in json.loads(done[0].arguments)  # type: ignore[union-attr]
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert streamed[-1].type == "response.completed"


def test_json_schema_output(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["colors"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="Name three colors.",
        text={"format": {"type": "json_schema", "name": "colors", "schema": schema}},
        temperature=0,
        max_output_tokens=80,
    )
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text)["colors"], list)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning"}]}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ],
)
def test_refusals_name_the_field(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    status, reply = run(post(server.base_url + "/v1/responses", body))
    assert status == 400 and reply["error"]["param"] == param, reply


def test_the_sdk_raises_on_a_refusal(client: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="stores no responses"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")
