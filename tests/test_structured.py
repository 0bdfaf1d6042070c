"""Structured outputs through xgrammar: JSON schemas (OpenAI's `response_format`, as the openai
SDK's `chat.completions.parse` sends it), JSON objects, regular expressions, choices and
grammars (vLLM's and SGLang's fields), offline and over HTTP on the embedded model, beside
unconstrained requests in the same batches."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, Field

from aserve import LLM, SamplingParams
from aserve.constrained.masks import apply_token_masks
from tests.server_utils import ServerProcess, serving
from tests.step_masks import masks_of
from tests.test_server import post, run

MODEL = "smol"


class Colour(str, Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=40_000_000)
    capital: bool


class Country(BaseModel):
    """Nested objects, an array, an enum and a bounded number."""

    name: str = Field(max_length=16)
    cities: list[City] = Field(min_length=1, max_length=2)
    flag_colour: Colour
    area_km2: float = Field(ge=1, le=20_000_000)


class Answer(BaseModel):
    answer: str = Field(max_length=24)
    confident: bool


SCHEMAS = [Country, City, Answer]
PROMPTS = {
    Country: "Describe France as JSON: its name, two cities, its flag's main colour, its area.",
    City: "Give Paris as JSON with its name, population and whether it is a capital.",
    Answer: "What is the capital of France? Answer as JSON.",
}


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(["--model", str(smollm2_dir), "--served-model-name", MODEL]))


def client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def ask(schema: type[BaseModel]) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[schema]}]


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_sdk_parse_returns_objects_of_the_schema(server: ServerProcess, schema: type) -> None:
    """`chat.completions.parse` sends the model's strict JSON schema and parses the reply;
    greedy and sampled, both finish by the grammar (not by length) with a valid object."""
    sdk = client(server)
    for options in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
        reply = sdk.chat.completions.parse(
            model=MODEL,
            messages=ask(schema),
            response_format=schema,
            max_tokens=300,
            **options,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, schema)
        schema.model_validate_json(choice.message.content)


def test_sdk_stream_with_a_schema(server: ServerProcess) -> None:
    """Streamed, the chunks add up to an object of the schema."""
    sdk = client(server)
    with sdk.chat.completions.stream(
        model=MODEL, messages=ask(City), response_format=City, max_tokens=200, temperature=0
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)


def test_json_object_regex_choice_and_grammar(server: ServerProcess) -> None:
    """OpenAI's json_object, and vLLM's guided_regex / guided_choice / guided_grammar and
    SGLang's regex / ebnf (chat, completions and /generate)."""
    sdk = client(server)
    chat = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:  # a 135M model may talk until the limit; what it wrote is still an object's start
        assert chat.choices[0].message.content.lstrip().startswith("{")
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    completion = sdk.completions.create(
        model=MODEL,
        prompt="The city and year: ",
        max_tokens=30,
        temperature=0.7,
        seed=1,
        extra_body={"guided_regex": pattern},
    )
    assert re.fullmatch(pattern, completion.choices[0].text)
    choices = ["Paris", "London", "Berlin"]
    picked = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Which is the capital of France?"}],
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": choices},
    )
    assert picked.choices[0].message.content in choices
    scored = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Which is the capital of France?"}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=12,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    # the grammar allows a few tokens first ("y", "ye", "yes", "n", "no"): only those are
    # listed, none at -inf
    first = scored.choices[0].logprobs.content[0]
    assert 1 <= len(first.top_logprobs) < 12
    assert all(t.logprob > float("-inf") for t in first.top_logprobs)
    grammar = 'root ::= "yes" | "no"'
    for fields in ({"guided_grammar": grammar}, {"ebnf": grammar}):
        reply = sdk.completions.create(
            model=MODEL, prompt="Is water wet?", max_tokens=5, temperature=0, extra_body=fields
        )
        assert reply.choices[0].text in ("yes", "no")
    tag_format = {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "json_schema", "json_schema": {"type": "integer", "minimum": 0}},
        "end": "</answer>",
    }
    tagged = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "How many legs has a cat?"}],
        max_tokens=20,
        temperature=0,
        response_format={"type": "structural_tag", "format": tag_format},
    )
    assert re.fullmatch(r"<answer>[0-9]+</answer>", tagged.choices[0].message.content)
    status, generated = run(
        post(
            server.base_url + "/generate",
            {"text": "Year:", "sampling_params": {"max_new_tokens": 8, "regex": " [0-9]{4}"}},
        )
    )
    assert status == 200 and re.fullmatch(" [0-9]{4}", generated["text"])


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
            "Unsupported type",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", ""),
        ({"guided_regex": "[a-"}, "guided_regex", "Unclosed"),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar", "not defined"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "cannot be combined"),
        ({"guided_choice": []}, None, "choice"),
        ({"response_format": {"type": "xml"}}, "response_format", ""),
    ],
)
def test_bad_constraints_are_400s(
    server: ServerProcess, fields: dict[str, Any], param: str | None, fragment: str
) -> None:
    """A constraint that cannot compile is an OpenAI-style 400 naming its field; the server
    goes on serving."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, reply = run(post(server.base_url + "/v1/chat/completions", {**body, **fields}))
    assert status == 400, reply
    error = reply["error"]
    assert fragment in error["message"]
    if param is not None:
        assert error["param"] == param
    status, _ = run(post(server.base_url + "/v1/chat/completions", body))
    assert status == 200


def test_constrained_and_free_requests_share_batches(server: ServerProcess) -> None:
    """Three schemas and three unconstrained greedy requests at once: each constrained one
    is an object of its schema, each free one the text it gets alone."""
    url = server.base_url + "/v1/chat/completions"
    free = [
        {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 24}
        | {"temperature": 0}
        for q in ("Name a fruit.", "Count to five.", "Say hello in French.")
    ]
    alone = [run(post(url, body))[1]["choices"][0]["message"]["content"] for body in free]
    constrained = [
        {"model": MODEL, "messages": ask(schema), "max_tokens": 300, "temperature": 0}
        | {"response_format": strict_format(schema)}
        for schema in SCHEMAS
    ]

    async def together() -> list[tuple[int, Any]]:
        bodies = [x for pair in zip(constrained, free) for x in pair]
        return list(await asyncio.gather(*(post(url, body) for body in bodies)))

    replies = run(together())
    for schema, (status, reply) in zip(SCHEMAS, replies[0::2]):
        assert status == 200
        schema.model_validate_json(reply["choices"][0]["message"]["content"])
    assert [r["choices"][0]["message"]["content"] for _, r in replies[1::2]] == alone


def strict_format(schema: type[BaseModel]) -> dict[str, Any]:
    """`response_format` as the openai SDK builds it from a pydantic model."""
    from openai.lib._pydantic import to_strict_json_schema

    spec = {"name": schema.__name__, "schema": to_strict_json_schema(schema), "strict": True}
    return {"type": "json_schema", "json_schema": spec}


def test_offline_api_takes_the_same_constraints(
    smollm2_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """SamplingParams(json_schema=..., regex=..., choice=...) on the offline API; a bad one
    ends that request with an error, not the batch."""
    llm = make_llm(smollm2_dir)
    schema = City.model_json_schema()
    outputs = llm.chat(
        [ask(City), ask(Answer), [{"role": "user", "content": "Pick a colour."}]],
        [
            SamplingParams(temperature=0, max_tokens=200, json_schema=schema),
            SamplingParams(
                temperature=0, max_tokens=200, json_schema=json.dumps(Answer.model_json_schema())
            ),
            SamplingParams(temperature=0, max_tokens=8, choice=("red", "green", "blue")),
        ],
    )
    City.model_validate_json(outputs[0].text)
    Answer.model_validate_json(outputs[1].text)
    assert outputs[2].text in ("red", "green", "blue")
    bad, good = llm.generate(
        ["a", "b"],
        [SamplingParams(regex="(", max_tokens=3), SamplingParams(regex="[0-9]+", max_tokens=3)],
    )
    assert bad.finish_reason == "error" and "invalid regex" in (bad.error or "")
    assert good.text.isdigit()


def test_token_masks_equal_xgrammar_apply() -> None:
    """Our -inf masking of the constrained rows equals xgrammar's reference on every row
    (unconstrained rows untouched), for a vocabulary no multiple of 32."""
    import xgrammar

    vocab, batch = 1000, 5
    generator = torch.Generator().manual_seed(0)
    full = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), generator=generator)
    full = full.to(torch.int32)
    logits = torch.randn(batch, vocab, generator=generator)
    rows = [0, 3, 4]
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, full, indices=rows)
    ours = logits.clone()
    apply_token_masks(ours, masks_of(full, rows))
    assert torch.equal(ours, expected)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_conversation_with_tool_results(server: ServerProcess) -> None:
    """The assistant's call and the tool's result go back into the history; the model
    answers in text (tool_choice auto: a reply without calls stays content)."""
    sdk = client(server)
    history = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = sdk.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert choice.message.tool_calls is None


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "'x'"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_requests_are_400s(
    server: ServerProcess, fields: dict[str, Any], fragment: str
) -> None:
    body = {"model": MODEL, "messages": WEATHER_QUESTION, "max_tokens": 4, **fields}
    status, reply = run(post(server.base_url + "/v1/chat/completions", body))
    assert status == 400 and reply["error"]["param"] == "tool_choice"
    assert fragment in reply["error"]["message"]


def test_batch_filled_masks_equal_each_matcher_s_own(smollm2_dir: Path) -> None:
    """Several constrained rows are filled together: the same bits as one matcher at a time,
    for matchers at different points of different grammars."""
    import xgrammar

    from aserve.constrained.grammar import GrammarCompiler, new_matcher
    from aserve.constrained.masks import TokenMasks
    from aserve.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({2}))
    grammars = [
        compiler.compile(SamplingParams(json_schema=City.model_json_schema())),
        compiler.compile(SamplingParams(regex="[0-9]{2}-[a-z]+")),
        compiler.compile(SamplingParams(choice=("alpha", "beta"))),
    ]
    matchers = [new_matcher(g) for g in grammars]
    for matcher, text in zip(matchers, ['{"name": "Pa', "12-", ""]):
        for token in tokenizer.encode(text):
            assert matcher.accept_token(token)
    built = TokenMasks(49152).build([matchers[0], None, matchers[1], matchers[2]])
    assert built is not None and built.count == 3
    assert built.rows.tolist() == [0, 2, 3]
    for at, matcher in enumerate(matchers):
        alone = xgrammar.allocate_token_bitmask(1, 49152)
        matcher.fill_next_token_bitmask(alone, 0)
        assert torch.equal(built.bitmask[at], alone[0])
    tokenizer.close()
