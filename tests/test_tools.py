"""Tool-call parsing and streaming hold-back (no model): the two syntaxes, text around calls,
look-alikes that stay text, a marker split across stream pieces."""

from __future__ import annotations

import json

import pytest

from aserve.server.tools import (
    HERMES,
    LLAMA,
    ToolTextStream,
    parse_tool_calls,
    tool_format,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


def test_hermes_blocks_with_text_around() -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + (
        '{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    assert calls[1].arguments == "{}"


def test_hermes_call_cut_after_whole_ones_is_dropped() -> None:
    """A forced reply that max_tokens cut inside its second call, or inside the marker that
    opens it: the first call, and no content (neither is a call nor text to show)."""
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + '{"n'
    content, calls = parse_tool_calls(text, HERMES)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    content, calls = parse_tool_calls(f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool", HERMES)
    assert content is None and len(calls) == 1
    content, calls = parse_tool_calls(
        f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call> ok <tool_call>", HERMES
    )
    assert content == "Sure.\n ok" and len(calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "Just text.",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        f"<tool_call>\n{WEATHER}",  # never closed (a reply cut by max_tokens)
    ],
)
def test_hermes_look_alikes_stay_text(text: str) -> None:
    assert parse_tool_calls(text, HERMES) == (text, [])


def test_llama_json_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, calls = parse_tool_calls(f"  {one}  ", LLAMA)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    _, two = parse_tool_calls(f'{one}; {{"name": "get_time", "parameters": {{}}}}', LLAMA)
    assert [c.name for c in two] == ["get_weather", "get_time"]
    for text in ['{"city": "Oslo"}', f"{one} and then some words", "Hello"]:
        assert parse_tool_calls(text, LLAMA) == (text, [])


def test_syntax_follows_the_template() -> None:
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert tool_format("<|start_header_id|>ipython<|end_header_id|>") == LLAMA
    assert tool_format(None) == HERMES


def test_stream_holds_back_a_call_and_a_split_marker() -> None:
    """Text before a call goes out as it comes; a piece that might begin the marker waits;
    the call itself never goes out as content."""
    stream = ToolTextStream(HERMES)
    pieces = ["Sure, ", "checking <", "tool", "_call>\n", WEATHER, "\n</tool_call>"]
    sent = [stream.push(p) for p in pieces]
    assert "".join(sent) == "Sure, checking "
    assert sent[1] == "checking "  # "<" held until the next piece says what it is
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]

    plain = ToolTextStream(HERMES)
    sent = [plain.push(p) for p in ["a < b", " and <tool", "s> too"]]
    rest, calls = plain.finish()
    assert "".join(sent) + rest == "a < b and <tools> too" and calls == []


def test_llama_stream_holds_a_reply_that_opens_with_a_brace() -> None:
    stream = ToolTextStream(LLAMA)
    assert stream.push(" ") == "" and stream.push('{"name": "f", ') == ""
    assert stream.push('"parameters": {}}') == ""
    assert stream.finish()[1][0].name == "f"
    words = ToolTextStream(LLAMA)
    assert words.push("Hello") == "Hello" and words.push(" {x}") == " {x}"
    assert words.finish() == ("", [])
