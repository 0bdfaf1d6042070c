"""gpt-oss's harmony replies split into reasoning, content and tool calls: whole, and
streamed in every cut into two pieces and one character at a time; then over HTTP."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aserve.server.harmony import HarmonyStream, is_harmony, split_harmony
from tests.server_utils import ServerProcess, serving
from tests.test_server import post, run, stream

THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>The user asks for a capital.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 2}<|call|>'
)
WEATHER = [("get_weather", {"city": "Paris", "days": 2})]
CASES = [
    (THINK_THEN_ANSWER, "The user asks for a capital.", "Paris.", []),
    # the stop token left out of the text
    (THINK_THEN_ANSWER.removesuffix("<|return|>"), "The user asks for a capital.", "Paris.", []),
    (CALL, "Need the weather.", "", WEATHER),
    (CALL.removesuffix("<|call|>"), "Need the weather.", "", WEATHER),
    # the recipient before the channel, a preamble to the user, two calls
    (
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather"
        '<|message|>{"city": "Oslo"}<|call|>',
        None,
        "Checking both.",
        [("get_time", {}), ("get_weather", {"city": "Oslo"})],
    ),
    # cut by max_tokens inside a call's arguments: no call, and nothing shown of it
    (CALL[:-12], "Need the weather.", "", []),
    # cut inside a header
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assist", "Hmm.", "", []),
    # a reply that never speaks harmony is all content
    ("Just text, with a <| in it.", None, "Just text, with a <| in it.", []),
]


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), CASES)
def test_whole_replies_split(
    reply: str, reasoning: str | None, content: str, calls: list[tuple[str, dict]]
) -> None:
    got_reasoning, got_content, got_calls = split_harmony(reply)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), CASES)
def test_any_cut_streams_the_same(
    reply: str, reasoning: str | None, content: str, calls: list[tuple[str, dict]]
) -> None:
    """Cut anywhere in two, or a character at a time: the same strings and calls, and no
    marker ever goes out."""
    cuts = [[reply[:at], reply[at:]] for at in range(len(reply) + 1)]
    for pieces in [*cuts, list(reply)]:
        stream = HarmonyStream()
        out_reasoning, out_content = "", ""
        for piece in pieces:
            split = stream.push(piece)
            out_reasoning += split.reasoning
            out_content += split.content
            assert "<|channel|>" not in out_reasoning + out_content
        last = stream.finish()
        assert (out_reasoning + last.reasoning) == (reasoning or "")
        assert out_content + last.content == content
        assert [c.name for c in stream.calls] == [name for name, _ in calls]


def test_reasoning_is_known_while_inside_analysis() -> None:
    stream = HarmonyStream()
    stream.push("<|channel|>analysis<|message|>Thinking")
    assert stream.reasoning
    stream.push("<|end|><|start|>assistant<|channel|>final<|message|>Yes")
    assert not stream.reasoning


def test_harmony_templates_are_told_apart() -> None:
    assert is_harmony("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not is_harmony("<|im_start|>assistant\n")
    assert not is_harmony(None)


def test_the_forcing_tag_takes_analysis_then_one_call_of_a_listed_function() -> None:
    """harmony.forcing_tag compiled over a vocabulary of single characters (a stop token
    after them): analysis messages then a call of a listed function ends the reply; a reply
    of analysis alone cannot end, nor one that calls another function than the named one,
    nor arguments outside the schema; the header written the other way round is a call."""
    import xgrammar

    from aserve.server.harmony import forcing_tag

    tools = [WEATHER_TOOL, STRICT_TOOL]
    stop = 95
    info = xgrammar.TokenizerInfo(
        [chr(c) for c in range(32, 127)] + ["</s>"], stop_token_ids=[stop]
    )
    compiler = xgrammar.GrammarCompiler(info)

    def ends(choice: Any, reply: str) -> bool:
        matcher = xgrammar.GrammarMatcher(
            compiler.compile_structural_tag(forcing_tag(tools, choice))
        )
        return matcher.accept_string(reply) and matcher.accept_token(stop)

    think = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant"
    call_f = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"n": 3}'
    named_f = {"type": "function", "function": {"name": "f"}}
    assert ends("required", think + call_f)
    assert ends("required", call_f) and ends(named_f, call_f)
    assert ends(
        "required",
        " to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Paris"}',
    )
    assert not ends("required", "<|channel|>analysis<|message|>hm<|end|>")
    assert not ends(
        named_f,
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}',
    )
    assert not ends("required", call_f.replace("3", '"three"'))


# ---- over HTTP: the embedded model under a harmony template, its replies steered by a
# regular expression into harmony's shapes (its vocabulary spells the markers in pieces) ---

HARMONY_TEMPLATE = (
    "{%- for m in messages %}<|start|>{{ m.role }}"
    "{%- if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>"
    "{% endfor -%}<|start|>assistant"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THINK_THEN_ANSWER_PATTERN = (
    re.escape("<|channel|>analysis<|message|>")
    + "[a-z ]{3,24}"
    + re.escape("<|end|><|start|>assistant<|channel|>final<|message|>")
    + "(Paris|Rome)"
)
CALL_PATTERN = re.escape(
    "<|channel|>analysis<|message|>weather<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
STRICT_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "harmony.jinja"
    template.write_text(HARMONY_TEMPLATE)
    args = ["--model", str(smollm2_dir), "--served-model-name", "smol"]
    yield from serving(ServerProcess([*args, "--chat-template", str(template)]))


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": ASK, "temperature": 0, "max_tokens": 90, **fields}


def test_reply_channels_become_reasoning_and_content(server: ServerProcess) -> None:
    """No --reasoning-parser needed: a harmony template's replies are split whole and
    streamed alike, without a marker left in either part."""
    url = server.base_url + "/v1/chat/completions"
    status, reply = run(post(url, chat_body(guided_regex=THINK_THEN_ANSWER_PATTERN)))
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    assert message["content"] in ("Paris", "Rome")
    assert re.fullmatch("[a-z ]{3,24}", message["reasoning_content"])
    chunks, _ = run(stream(url, chat_body(guided_regex=THINK_THEN_ANSWER_PATTERN)))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_a_commentary_to_a_function_is_a_tool_call(server: ServerProcess) -> None:
    url = server.base_url + "/v1/chat/completions"
    body = chat_body(tools=[WEATHER_TOOL], guided_regex=CALL_PATTERN, max_tokens=250)
    status, reply = run(post(url, body))
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "weather"
    (made,) = choice["message"]["tool_calls"]
    assert made["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_call_follows_the_schema(server: ServerProcess, choice: Any) -> None:
    """tool_choice "required" or a named function: the grammar (harmony.forcing_tag) lets
    the model write analysis messages, then makes it call one of the tools, its arguments
    in the tool's schema; whole and streamed alike."""
    url = server.base_url + "/v1/chat/completions"
    tools = [WEATHER_TOOL, STRICT_TOOL]
    body = chat_body(tools=tools, tool_choice=choice, max_tokens=200)
    status, reply = run(post(url, body))
    assert status == 200, reply
    choice_out = reply["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls"
    (made,) = choice_out["message"]["tool_calls"]
    names = ["get_weather", "f"] if choice == "required" else ["f"]
    assert made["function"]["name"] in names
    arguments = json.loads(made["function"]["arguments"])
    if made["function"]["name"] == "f":
        assert set(arguments) == {"n"} and isinstance(arguments["n"], int)
    chunks, _ = run(stream(url, body))
    streamed = [
        call
        for c in chunks
        if c["choices"]
        for call in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert streamed[0]["function"]["name"] == made["function"]["name"]
    assert (
        "".join(c["function"].get("arguments", "") for c in streamed)
        == made["function"]["arguments"]
    )
