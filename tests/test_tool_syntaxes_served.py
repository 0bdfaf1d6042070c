"""Each tool-call syntax over HTTP on the embedded model (its own template's Hermes blocks,
`--tool-call-parser`, or a chat template that names the syntax): forced calls, written by
the syntax's grammar, come back as valid `tool_calls`, streamed the same, with the ids the
syntax asks for. The 135M model was never taught these syntaxes (its template does not
render tools either), so only forced replies are checked."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server_utils import ServerProcess, serving
from tests.test_structured import MODEL, TOOLS, WEATHER_QUESTION, client

# The embedded model's own template, with a comment that shows Mistral's newer call form:
# `auto` then reads that syntax from the template.
MISTRAL_ARGS_NOTE = "{#- calls are written [TOOL_CALLS]NAME[ARGS]{...} -#}\n"
OPTIONS = {
    "hermes (the default)": [],
    "mistral": ["--tool-call-parser", "mistral"],
    "mistral-args-template": ["--chat-template", MISTRAL_ARGS_NOTE],
    "granite": ["--tool-call-parser", "granite"],
    "phi4_mini_json": ["--tool-call-parser", "phi4_mini_json"],
    "qwen3_coder": ["--tool-call-parser", "qwen3_coder"],
    "pythonic": ["--tool-call-parser", "pythonic"],
    "glm45": ["--tool-call-parser", "glm45"],
}


@pytest.fixture(scope="module", params=list(OPTIONS))
def server(request: pytest.FixtureRequest, smollm2_dir: Path) -> Iterator[ServerProcess]:
    options = OPTIONS[request.param]
    if options[:1] == ["--chat-template"]:
        template = (smollm2_dir / "chat_template.jinja").read_text()
        options = ["--chat-template", options[1] + template]
    args = ["--model", str(smollm2_dir), "--served-model-name", MODEL, *options]
    process = ServerProcess(args)
    process.syntax = request.param  # type: ignore[attr-defined]
    yield from serving(process)


def assert_valid_calls(server: ServerProcess, calls: Any, names: set[str]) -> None:
    """Each call names an offered function, its arguments follow that function's schema,
    and its id is OpenAI's shape, or Mistral's nine letters and digits. qwen3_coder's and
    glm45's free strings are any text up to `</parameter>` (`</arg_value>`) in xgrammar's
    grammar, which bounds no length: their maxLength is left out of the check."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    syntax = server.syntax  # type: ignore[attr-defined]
    if syntax in ("qwen3_coder", "glm45"):
        schemas = json.loads(json.dumps(schemas).replace('"maxLength"', '"unbounded"'))
    mistral = syntax.startswith("mistral")
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        assert re.fullmatch(r"[A-Za-z0-9]{9}" if mistral else r"call_[0-9a-f]{24}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_come_back_as_tool_calls(server: ServerProcess, parallel: bool) -> None:
    """`required`: calls only, finish_reason tool_calls; without parallel_tool_calls exactly
    one. With them the 135M model may go on calling until max_tokens: the complete calls
    are still valid, and one cut short is dropped. A named function: a call of it. Sampled
    as well as greedy."""
    sdk = client(server)
    for options in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        reply = sdk.chat.completions.create(
            model=MODEL,
            messages=WEATHER_QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=200,
            **options,
        )
        choice = reply.choices[0]
        assert_valid_calls(server, choice.message.tool_calls, {"get_weather", "get_time"})
        assert choice.message.content is None
        if parallel:
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert choice.finish_reason == "tool_calls"
            assert len(choice.message.tool_calls) == 1
    named = sdk.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=100,
        temperature=0,
    )
    assert named.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(server, named.choices[0].message.tool_calls, {"get_time"})


def test_streamed_calls_equal_the_reply(server: ServerProcess) -> None:
    """Streamed, the calls arrive as tool_calls deltas, none of their syntax as content: in
    the JSON syntaxes each call's index, id and name first, then its arguments in pieces as
    they are written (merged by index, as OpenAI's SDK does, the reply's calls: the same
    names and ids' shapes, the same arguments read as JSON, and where max_tokens cut the
    last one, that one as far as it went); qwen3_coder's, glm45's and pythonic calls a delta
    each. glm45's free strings run on in the 135M model's hands (any text but
    `</arg_value>`): its first call closes only after 120 tokens, so it gets 300."""
    sdk = client(server)
    request = {
        "model": MODEL,
        "messages": WEATHER_QUESTION,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": True,
        "max_tokens": 300 if server.syntax == "glm45" else 120,  # type: ignore[attr-defined]
        "temperature": 0,
    }
    reply = sdk.chat.completions.create(**request).choices[0]
    content, reasons = "", []
    merged: dict[int, dict[str, Any]] = {}
    pieces: dict[int, int] = {}
    for chunk in sdk.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            pieces[call.index] = pieces.get(call.index, 0) + 1
            if call.index not in merged:
                assert call.id and call.type == "function" and call.function.name
                merged[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
            merged[call.index]["arguments"] += call.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (content or None) == reply.message.content and reasons[-1] == reply.finish_reason
    expected = reply.message.tool_calls
    assert_valid_calls(server, expected, {"get_weather", "get_time"})
    # a call that max_tokens cut went out as far as it was written; the reply drops it
    cut = len(merged) - len(expected)
    assert list(merged) == list(range(len(merged)))
    assert cut == 0 or (cut == 1 and reply.finish_reason == "length"), (cut, reply)
    for call, sent in zip(expected, merged.values()):
        assert sent["name"] == call.function.name
        assert json.loads(sent["arguments"]) == json.loads(call.function.arguments)
        assert (len(sent["id"]) == 9) == (len(call.id) == 9)
    whole = ("qwen3_coder", "pythonic", "glm45")
    written = server.syntax not in whole  # type: ignore[attr-defined]
    assert (max(pieces.values()) > 2) == written, pieces
