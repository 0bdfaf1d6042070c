"""Tool-call syntaxes without a model: each parser on its own syntax (text around calls,
look-alikes that stay text, calls cut by max_tokens), the syntax a template teaches, the
streaming hold-back, each forcing grammar against its own parser, and the markers that a
vocabulary holds as special tokens kept in the text."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from aserve.server.tool_syntax import (
    GLM45,
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_NAMED_ARGS,
    PHI4_MINI_JSON,
    PYTHONIC,
    QWEN3_CODER,
    ToolSyntax,
)
from aserve.server.tools import (
    ToolTextStream,
    parse_tool_calls,
    special_marker_ids,
    tool_syntax,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
TIME = '{"name": "get_time", "arguments": {}}'
CODER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "hour": {"type": "integer"},
                    "loud": {"type": "boolean"},
                    "days": {"type": "array"},
                    "unit": {"type": "string", "enum": ["celsius", "kelvin"]},
                },
            },
        },
    }
]


def names(calls: list[Any]) -> list[str]:
    return [c.name for c in calls]


def merged_deltas(deltas: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Chat `tool_calls` deltas merged by index as a client does: id and name from each
    call's first, its arguments' pieces joined."""
    merged: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        if delta["index"] not in merged:
            assert delta["type"] == "function" and delta["id"]
            merged[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"]}
            merged[delta["index"]]["arguments"] = ""
        else:
            assert "id" not in delta and "name" not in delta["function"]
        merged[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return merged


def test_hermes_blocks_with_text_around() -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me check."
    assert names(calls) == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    assert calls[1].arguments == "{}" and calls[0].id.startswith("call_")


def test_hermes_call_cut_after_whole_ones_is_dropped() -> None:
    """A forced reply that max_tokens cut inside its second call, or inside the marker that
    opens it: the first call, and no content (neither is a call nor text to show)."""
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + '{"n'
    content, calls = parse_tool_calls(text, HERMES)
    assert content is None and names(calls) == ["get_weather"]
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
    content, calls = parse_tool_calls(f"  {one}  ", LLAMA3_JSON)
    assert content is None and names(calls) == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    _, two = parse_tool_calls(f'{one}; {{"name": "get_time", "parameters": {{}}}}', LLAMA3_JSON)
    assert names(two) == ["get_weather", "get_time"]
    for text in ['{"city": "Oslo"}', f"{one} and then some words", "Hello"]:
        assert parse_tool_calls(text, LLAMA3_JSON) == (text, [])


def test_qwen3_coder_values_are_read_by_their_schema_type() -> None:
    """Each parameter's text is its value: a string stays a string however it looks, other
    types are read as JSON (or Python literals), whitespace around them dropped (as around
    an enum's string); an unknown function's values as JSON where they parse. Text before
    the block is content."""
    text = (
        "Setting it.\n<tool_call>\n<function=set_alarm>\n<parameter=label>\n007\n</parameter>\n"
        "<parameter=hour>\n 7\n\n</parameter><parameter=unit>\n\nkelvin\n</parameter>\n"
        "<parameter=loud>\ntrue\n</parameter>\n"
        "<parameter=days>\n['mon', 'tue']\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=other>\n<parameter=x>\n2.5\n</parameter>\n<parameter=y>\n"
        "two lines\nof text\n</parameter>\n</function>\n</tool_call>"
    )
    content, calls = parse_tool_calls(text, QWEN3_CODER, CODER_TOOLS)
    assert content == "Setting it." and names(calls) == ["set_alarm", "other"]
    assert json.loads(calls[0].arguments) == {
        "label": "007",
        "hour": 7,
        "loud": True,
        "days": ["mon", "tue"],
        "unit": "kelvin",
    }
    assert json.loads(calls[1].arguments) == {"x": 2.5, "y": "two lines\nof text"}
    cut = text[: text.index("<function=other>") + 12]
    assert parse_tool_calls(cut, QWEN3_CODER, CODER_TOOLS)[1] == calls[:1]
    closing_cut = text[: text.index("</tool_call>") + 5]  # "...</function>\n</tool"
    assert parse_tool_calls(closing_cut, QWEN3_CODER, CODER_TOOLS) == ("Setting it.", calls[:1])
    look_alike = "Use <tool_call> blocks, like <tool_call>\n{}\n</tool_call>."
    assert parse_tool_calls(look_alike, QWEN3_CODER, CODER_TOOLS) == (look_alike, [])


def test_glm45_values_are_read_by_their_schema_type() -> None:
    """GLM-4.5's calls, key and value pairs a line apart (GLM-4.7's back to back): each
    value read as qwen3_coder's are (a string stays a string, other types as JSON or Python
    literals); an unknown function's values as JSON where they parse. A call that
    max_tokens cuts after whole ones is dropped; a name that is no function's name, or a
    block that never closes with nothing before it, stays text."""
    text = (
        "Setting it.\n<tool_call>set_alarm\n<arg_key>label</arg_key>\n<arg_value>007"
        "</arg_value>\n<arg_key>hour</arg_key>\n<arg_value>7</arg_value>\n"
        "<arg_key>loud</arg_key>\n<arg_value>true</arg_value>\n<arg_key>days</arg_key>\n"
        '<arg_value>["mon", "tue"]</arg_value>\n</tool_call>'
        "<tool_call>other<arg_key>x</arg_key><arg_value>2.5</arg_value><arg_key>y</arg_key>"
        "<arg_value>two lines\nof text</arg_value></tool_call>"
    )
    content, calls = parse_tool_calls(text, GLM45, CODER_TOOLS)
    assert content == "Setting it." and names(calls) == ["set_alarm", "other"]
    assert json.loads(calls[0].arguments) == {
        "label": "007",
        "hour": 7,
        "loud": True,
        "days": ["mon", "tue"],
    }
    assert json.loads(calls[1].arguments) == {"x": 2.5, "y": "two lines\nof text"}
    cut = text[: text.index("<tool_call>other") + 16]
    assert parse_tool_calls(cut, GLM45, CODER_TOOLS) == ("Setting it.", calls[:1])
    for look_alike in ("Use <tool_call>two words</tool_call>.", "<tool_call>set_alarm\n<arg"):
        assert parse_tool_calls(look_alike, GLM45, CODER_TOOLS) == (look_alike, [])


def test_mistral_both_forms_and_nine_character_ids() -> None:
    """The JSON list after `[TOOL_CALLS]` (a space before it, as Mistral 7B v0.3 writes
    it) and the newer `NAME[ARGS]{...}` a call (with or without a `[CALL_ID]`); either
    syntax object reads both. Ids are nine letters and digits, as Mistral's templates ask
    of the ids that come back."""
    listed = f"[TOOL_CALLS] [{WEATHER}, {TIME}]"
    named = (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
        "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}"
    )
    for syntax in (MISTRAL, MISTRAL_NAMED_ARGS):
        for text in (listed, named, "Sure. " + named):
            content, calls = parse_tool_calls(text, syntax)
            assert content == ("Sure." if text.startswith("Sure") else None)
            assert names(calls) == ["get_weather", "get_time"]
            assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
            assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)
    assert parse_tool_calls(f"[TOOL_CALLS][{WEATHER}, {{", MISTRAL)[1][0].name == "get_weather"
    cut_named = '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"ci'
    content, calls = parse_tool_calls(cut_named, MISTRAL)
    assert content is None and names(calls) == ["get_time"]
    for text in ["[TOOL_CALLS] not json", "[TOOL_CALLS]two words[ARGS]{}", "plain"]:
        assert parse_tool_calls(text, MISTRAL) == (text, [])


@pytest.mark.parametrize(
    ("syntax", "marker"), [(GRANITE, "<|tool_call|>"), (PHI4_MINI_JSON, "functools")]
)
def test_json_list_after_a_marker(syntax: ToolSyntax, marker: str) -> None:
    """Granite's `<|tool_call|>[...]` and Phi-4-mini's `functools[...]`: the calls of the
    list, text before them as content; a list that is not calls stays text."""
    content, calls = parse_tool_calls(f"Checking.\n{marker}[{WEATHER}, {TIME}]", syntax)
    assert content == "Checking." and names(calls) == ["get_weather", "get_time"]
    assert calls[0].id.startswith("call_")
    arguments_as_text = f'{marker}[{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}]'
    assert json.loads(parse_tool_calls(arguments_as_text, syntax)[1][0].arguments) == {"a": 1}
    for text in [f"{marker}[1, 2]", f"{marker} is a word", f'{marker}[{{"name": 3}}]']:
        assert parse_tool_calls(text, syntax) == (text, [])


def test_pythonic_calls() -> None:
    """A Python list of keyword calls, JSON's true/false/null read as well, inside Llama 4's
    python tags or not; a forced reply's JSON calls read too. Anything else is text."""
    text = '[get_weather(city="Paris", days=2, metric=true), get_time(), '
    text += 'f(x=[1, {"a": None}], y=-1.5)]'
    content, calls = parse_tool_calls(text, PYTHONIC)
    assert content is None and names(calls) == ["get_weather", "get_time", "f"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2, "metric": True}
    assert json.loads(calls[2].arguments) == {"x": [1, {"a": None}], "y": -1.5}
    tagged = "<|python_start|>[get_time(zone='UTC')]<|python_end|>"
    assert json.loads(parse_tool_calls(tagged, PYTHONIC)[1][0].arguments) == {"zone": "UTC"}
    forced = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert names(parse_tool_calls(forced, PYTHONIC)[1]) == ["get_time"]
    for look_alike in [
        "[1, 2, 3]",
        "[get_time('UTC')]",  # positional arguments
        "[os.system(cmd='x')]",
        "[f(x=open('y'))]",  # not a literal
        "[get_time(zone=",
        "Hello [get_time()]",
        "[]",
    ]:
        assert parse_tool_calls(look_alike, PYTHONIC) == (look_alike, [])


@pytest.mark.parametrize(
    ("template", "parser", "expected"),
    [
        ("{% if tools %}<tool_call>{% endif %}", "auto", HERMES),
        ("<tool_call>\n<function=NAME>\n<parameter=KEY>", "auto", QWEN3_CODER),
        ("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>", "auto", GLM45),
        (None, "glm47", GLM45),
        ("<|start_header_id|>ipython<|end_header_id|>", "auto", LLAMA3_JSON),
        ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "auto", MISTRAL),
        ("{{ '[TOOL_CALLS]' + name + '[ARGS]' + args }}", "auto", MISTRAL_NAMED_ARGS),
        ("{{ '<|tool_call|>' + calls }}", "auto", GRANITE),
        ("<|tool|>{{ tools }}<|/tool|>", "auto", PHI4_MINI_JSON),
        ("[func_name1(params_name1=params_value1)]", "auto", PYTHONIC),
        (None, "auto", HERMES),
        (None, "mistral", MISTRAL),
        ("[TOOL_CALLS]x[ARGS]", "mistral", MISTRAL_NAMED_ARGS),
        ("<tool_call>", "pythonic", PYTHONIC),
        (None, "qwen25", HERMES),
        (None, "llama3", LLAMA3_JSON),
    ],
)
def test_syntax_follows_the_option_and_the_template(
    template: str | None, parser: str, expected: ToolSyntax
) -> None:
    assert tool_syntax(parser, template) is expected


def test_stream_holds_back_a_call_and_a_split_marker() -> None:
    """Text before a call goes out as it comes; a piece that might begin the marker waits;
    the call itself never goes out as content, and goes out as a call with the piece that
    closes it."""
    stream = ToolTextStream(HERMES)
    pieces = ["Sure, ", "checking <", "tool", "_call>\n", WEATHER, "\n</tool_call>"]
    sent = [stream.push(p) for p in pieces]
    assert "".join(text for text, _ in sent) == "Sure, checking "
    assert sent[1] == ("checking ", [])  # "<" held until the next piece says what it is
    assert [names(calls) for _, calls in sent] == [[], [], [], [], [], ["get_weather"]]
    assert stream.finish() == ("", [])

    plain = ToolTextStream(HERMES)
    sent = [plain.push(p) for p in ["a < b", " and <tool", "s> too"]]
    rest, calls = plain.finish()
    assert "".join(text for text, _ in sent) + rest == "a < b and <tools> too" and calls == []


def test_parallel_calls_go_out_one_by_one_and_text_between_at_the_end() -> None:
    """Each call goes out with the piece that closes it, in order; text between calls waits
    for the end (the content after the first marker); a call left open when the reply ends
    (max_tokens) never goes out."""
    stream = ToolTextStream(HERMES)
    pieces = [f"<tool_call>\n{WEATHER}\n</tool", "_call>", " then ", f"<tool_call>\n{TIME}"]
    pieces += ["\n</tool_call>", '<tool_call>\n{"na']
    sent = [stream.push(p) for p in pieces]
    assert [text for text, _ in sent] == [""] * len(pieces)
    assert [names(calls) for _, calls in sent] == [[], ["get_weather"], [], [], ["get_time"], []]
    assert stream.finish() == ("then", [])

    listed = ToolTextStream(MISTRAL)
    sent = [listed.push(p) for p in ["[TOOL_CALLS][", WEATHER, ", ", TIME[:-1], "}", "]"]]
    assert [names(calls) for _, calls in sent] == [[], ["get_weather"], [], [], ["get_time"], []]
    assert listed.finish() == ("", [])


def test_arguments_stream_as_they_are_written() -> None:
    """Hermes, piece by piece: the call's index, id and name go out once its arguments
    begin, then each piece of them as it comes (the model's own text, up to the object's
    end; braces inside strings and escaped quotes do not end it); the parser's call, closed
    by `</tool_call>`, keeps the streamed id and goes out no second time. The next call
    takes the next index; arguments that are not an object go out whole at the close."""
    stream = ToolTextStream(HERMES)
    pieces = ["Sure. <tool_call>\n", '{"name": "get_', 'weather", "arguments": ', '{"city": "P',
              'a}r\\"is", ', '"days": 2}', "}\n</tool_call>", '<tool_call>{"name": "f", ',
              '"arguments": "{}"}</tool_call>']  # fmt: skip
    sent = []
    for piece in pieces:
        content, calls = stream.push(piece)
        sent.append((content, names(calls), stream.take_deltas()))
    assert [content for content, _, _ in sent] == ["Sure. "] + [""] * 8
    assert [closed for _, closed, _ in sent] == [[]] * 6 + [["get_weather"], [], ["f"]]
    opening = sent[3][2][0]
    assert opening["index"] == 0 and opening["function"] == {"name": "get_weather", "arguments": ""}
    arguments = [d["function"]["arguments"] for _, _, deltas in sent[3:6] for d in deltas[-1:]]
    assert arguments == ['{"city": "P', 'a}r\\"is", ', '"days": 2}']
    assert sent[6][2] == []  # closed: nothing more to send for it
    whole = sent[8][2]
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in whole] == [
        (1, "f", "{}")
    ]
    merged = merged_deltas([d for _, _, deltas in sent for d in deltas])
    assert json.loads(merged[0]["arguments"]) == {"city": 'Pa}r"is', "days": 2}
    _, closed = stream.finish()
    assert closed == [] and merged[0]["id"] == opening["id"]


@pytest.mark.parametrize(
    ("syntax", "text"),
    [
        (MISTRAL_NAMED_ARGS,
         '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
        (MISTRAL, f"[TOOL_CALLS][{TIME}, {WEATHER}]"),
        (GRANITE, f"<|tool_call|>[{TIME}, {WEATHER}]"),
        (PHI4_MINI_JSON, f"functools[{TIME}, {WEATHER}]"),
    ],
)  # fmt: skip
def test_each_json_syntax_streams_its_calls_in_order(syntax: ToolSyntax, text: str) -> None:
    """Mistral's two forms, Granite's and Phi-4-mini's lists, a character at a time: both
    calls stream, in order, with the syntax's ids, and merge into the parser's calls."""
    stream = ToolTextStream(syntax)
    closed = [call for char in text for call in stream.push(char)[1]]
    rest, last = stream.finish()
    merged = merged_deltas(stream.take_deltas())
    _, parsed = parse_tool_calls(text, syntax)
    assert rest == "" and [c.name for c in closed + last] == names(parsed)
    assert [call["name"] for call in merged.values()] == names(parsed)
    assert names(parsed) == ["get_time", "get_weather"]
    for call, expected in zip(merged.values(), parsed):
        assert json.loads(call["arguments"]) == json.loads(expected.arguments)
    assert [c.id for c in closed + last] == [call["id"] for call in merged.values()]
    assert all(len(call["id"]) == 9 for call in merged.values()) == (syntax.name == "mistral")


def test_arguments_cut_by_max_tokens_stay_as_sent() -> None:
    """A call whose arguments were going out when the reply ended stays as sent (a client
    sees finish_reason "length"); its syntax does not come back as content."""
    stream = ToolTextStream(HERMES)
    for piece in ["OK <tool_call>", '{"name": "get_weather", ', '"arguments": {"ci']:
        stream.push(piece)
    assert stream.finish() == ("", [])
    merged = merged_deltas(stream.take_deltas())
    assert merged[0]["name"] == "get_weather" and merged[0]["arguments"] == '{"ci'
    assert stream.indices == 1


@pytest.mark.parametrize(
    ("syntax", "pieces"),
    [
        (MISTRAL, ["Sure ", "[TOOL", "_CALLS]", "get_time[ARGS]", "{}"]),
        (GRANITE, ["Sure ", "<|tool", "_call|>", f"[{TIME}]"]),
        (PHI4_MINI_JSON, ["Sure ", "func", "tools[", f"{TIME}]"]),
        (QWEN3_CODER, ["Sure ", "<tool_", "call>\n<function=get_time>\n</function>\n</tool_call>"]),
        (GLM45, ["Sure ", "<tool", "_call>get_time", "\n</tool_call>"]),
    ],
)
def test_each_marker_is_held_back_when_split(syntax: ToolSyntax, pieces: list[str]) -> None:
    stream = ToolTextStream(syntax)
    sent = [stream.push(p) for p in pieces]
    assert [text for text, _ in sent] == ["Sure ", *[""] * (len(pieces) - 1)]
    assert names(sent[-1][1]) == ["get_time"] and stream.finish() == ("", [])


@pytest.mark.parametrize("syntax", [LLAMA3_JSON, PYTHONIC])
def test_a_whole_reply_syntax_holds_a_reply_that_opens_like_a_call(syntax: ToolSyntax) -> None:
    opening = "[get_time(" if syntax is PYTHONIC else '{"name": "get_time", '
    closing = ")]" if syntax is PYTHONIC else '"parameters": {}}'
    stream = ToolTextStream(syntax)
    assert [stream.push(p) for p in (" ", opening, closing)] == [("", [])] * 3
    assert names(stream.finish()[1]) == ["get_time"]  # text after it would make it text
    words = ToolTextStream(syntax)
    assert words.push("Hello") == ("Hello", []) and words.push(" [x] {y}") == (" [x] {y}", [])
    assert words.finish() == ("", [])
    if syntax is PYTHONIC:  # Llama 4's tag may be split; text that only began like it goes
        tagged = ToolTextStream(syntax)
        assert tagged.push("<|python") == ("", []) and tagged.push("_start|>[f()]") == ("", [])
        assert names(tagged.finish()[1]) == ["f"]
        angle = ToolTextStream(syntax)
        assert angle.push("<") == ("", []) and angle.push("3 you") == ("<3 you", [])


# ---- the forcing grammars, compiled over a vocabulary of single characters -----------------

ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer"}, "label": {"type": "string"}},
            "required": ["hour", "label"],
            "additionalProperties": False,
        },
    },
}
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
# One call of set_alarm in each syntax, as its forcing grammar writes it.
FORCED_ALARM = {
    "hermes": '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7, "label": "up"}}'
    "\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n"
    "<parameter=label>\nup\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "set_alarm", "parameters": {"hour": 7, "label": "up"}}',
    "pythonic": '{"name": "set_alarm", "parameters": {"hour": 7, "label": "up"}}',
    "mistral": '[TOOL_CALLS][{"name": "set_alarm", "arguments": {"hour": 7, "label": "up"}}]',
    "mistral_args": '[TOOL_CALLS]set_alarm[ARGS]{"hour": 7, "label": "up"}',
    "granite": '<|tool_call|>[{"name": "set_alarm", "arguments": {"hour": 7, "label": "up"}}]',
    "phi4_mini_json": 'functools[{"name": "set_alarm", "arguments": {"hour": 7, "label": "up"}}]',
    "glm45": "<tool_call>set_alarm<arg_key>hour</arg_key><arg_value>7</arg_value>"
    "<arg_key>label</arg_key><arg_value>up</arg_value></tool_call>",
}
SYNTAXES = {
    "hermes": HERMES,
    "qwen3_coder": QWEN3_CODER,
    "llama3_json": LLAMA3_JSON,
    "pythonic": PYTHONIC,
    "mistral": MISTRAL,
    "mistral_args": MISTRAL_NAMED_ARGS,
    "granite": GRANITE,
    "phi4_mini_json": PHI4_MINI_JSON,
    "glm45": GLM45,
}
TWO_CALLS_APART = {  # what stands between two calls of a parallel forced reply
    "hermes": "\n",
    "qwen3_coder": "\n",
    "llama3_json": "\n",
    "pythonic": "\n",
    "mistral": None,  # inside one list: ", "
    "mistral_args": "",
    "granite": None,
    "phi4_mini_json": None,
    "glm45": "\n",
}


def two_calls(key: str) -> str:
    one = FORCED_ALARM[key]
    if TWO_CALLS_APART[key] is not None:
        return one + TWO_CALLS_APART[key] + one
    body = one[one.index("[{") + 1 : -1]
    return one[: one.index("[{") + 1] + body + ", " + body + "]"


@pytest.mark.parametrize("key", list(SYNTAXES))
def test_forcing_grammar_writes_what_its_parser_reads(key: str) -> None:
    """The grammar ends a reply of one call of an offered function whose arguments follow
    its schema, and the parser reads that reply as the call; it refuses other functions
    than the named one and arguments outside the schema; two calls only when parallel."""
    import xgrammar

    syntax, stop = SYNTAXES[key], 96
    info = xgrammar.TokenizerInfo(
        [chr(c) for c in range(32, 127)] + ["\n", "</s>"], stop_token_ids=[stop]
    )
    compiler = xgrammar.GrammarCompiler(info)

    def ends(choice: Any, reply: str, parallel: bool = False) -> bool:
        tag = syntax.forcing_tag([ALARM, NOTE], choice, parallel)
        matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(tag))
        ids = [95 if c == "\n" else ord(c) - 32 for c in reply]
        return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(stop)

    alarm = FORCED_ALARM[key]
    named_alarm = {"type": "function", "function": {"name": "set_alarm"}}
    named_note = {"type": "function", "function": {"name": "note"}}
    assert ends("required", alarm) and ends(named_alarm, alarm)
    assert not ends(named_note, alarm)
    assert not ends("required", alarm.replace("7", '"seven"'))
    assert not ends("required", two_calls(key)) and ends("required", two_calls(key), True)
    content, calls = parse_tool_calls(two_calls(key), syntax, [ALARM, NOTE])
    assert content is None and names(calls) == ["set_alarm", "set_alarm"]
    assert json.loads(calls[0].arguments) == {"hour": 7, "label": "up"}


def test_forcing_a_function_that_is_not_offered_is_an_error() -> None:
    missing = {"type": "function", "function": {"name": "missing"}}
    for syntax in (MISTRAL, MISTRAL_NAMED_ARGS, GRANITE, PHI4_MINI_JSON):
        with pytest.raises(ValueError, match="'missing'"):
            syntax.forcing_tag([ALARM], missing, False)


# ---- markers that the vocabulary holds as special tokens ---------------------------------


def test_special_markers_stay_in_the_reply_text(smollm2_dir: Path, tmp_path: Path) -> None:
    """A vocabulary where `[TOOL_CALLS]` and `[ARGS]` are special tokens: skipping special
    tokens would drop them from the reply, and the call with them; the Mistral syntax's
    markers are shown, every other special token is still dropped. A chat request with
    tools under `--tool-call-parser mistral` carries those ids to its choices."""
    import asyncio

    import transformers

    from aserve.sampling_params import SamplingParams
    from aserve.server.completions import Completions
    from aserve.server.openai import GenerationRequest
    from aserve.textstream import TextStream
    from aserve.tokenizer import Tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]", "[INST]"]})
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    calls, args, inst = hf.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]", "[INST]"])
    assert special_marker_ids(MISTRAL, tokenizer) == {calls, args}
    assert special_marker_ids(HERMES, tokenizer) == frozenset()  # SmolLM2 spells it in pieces
    request = GenerationRequest(
        "chat", "m", SamplingParams(), None, tools=[ALARM], tool_choice="auto"
    )
    parsed = asyncio.run(Completions._with_tools(tokenizer, request, "mistral"))
    assert parsed.tool_syntax is MISTRAL and parsed.shown_special_ids == {calls, args}

    reply = [inst, calls, *hf.encode("get_time", add_special_tokens=False), args]
    reply += hf.encode('{"zone": "UTC"}', add_special_tokens=False)
    shown = TextStream(tokenizer, shown_special_ids=special_marker_ids(MISTRAL, tokenizer))
    text = "".join(shown.push([i]).text for i in reply) + shown.finish()
    assert text == '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
    assert names(parse_tool_calls(text, MISTRAL)[1]) == ["get_time"]
    skipped = TextStream(tokenizer)
    assert skipped.push(reply).text + skipped.finish() == 'get_time{"zone": "UTC"}'


# ---- any text at all --------------------------------------------------------------------

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=x>",
    "</parameter>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call|>", "functools",
    "<|python_start|>", "[", "]", "{", "}", '"name"', '"arguments"', '"parameters"', ":", ",",
    '"f"', "1", "true", "null", "f(", ")", "x=", " ", "\n", "text", '"', "\\", "(", "=",
]  # fmt: skip
DEEP = ["[" * 100_000, '{"a":' * 50_000, "[f(x=" + "[" * 5_000 + "1" + "]" * 5_000 + ")]"]


@pytest.mark.parametrize("syntax", list(SYNTAXES.values()), ids=list(SYNTAXES))
def test_any_text_parses_and_streams_without_raising(syntax: ToolSyntax) -> None:
    """Replies made of the syntaxes' pieces at random, and nesting deep enough to overflow
    the JSON and Python readers after each marker: the parser and the stream never raise
    (the reply's text then stays text), each call's arguments are a JSON object, and the
    stream hands out the calls the parser finds, with the same content."""
    import random

    rng = random.Random(7)
    texts = ["".join(rng.choices(FRAGMENTS, k=rng.randint(1, 30))) for _ in range(1500)]
    markers = ["", "<tool_call>", "[TOOL_CALLS]", "[TOOL_CALLS]f[ARGS]", "<|tool_call|>"]
    texts += [marker + deep for marker in markers + ["functools"] for deep in DEEP]
    for text in texts:
        content, calls = parse_tool_calls(text, syntax, CODER_TOOLS)
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
        stream = ToolTextStream(syntax, CODER_TOOLS)
        cut = rng.randint(0, len(text))
        first, second = stream.push(text[:cut]), stream.push(text[cut:])
        rest, last = stream.finish()
        streamed = first[1] + second[1] + last
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
        sent = merged_deltas(stream.take_deltas())
        if calls:
            assert (first[0] + second[0] + rest).strip() == (content or "")
            closed = {c.id: c for c in streamed}
            for call in sent.values():  # each closed call went out with its arguments
                if call["id"] in closed:
                    expected = json.loads(closed[call["id"]].arguments)
                    assert json.loads(call["arguments"]) == expected
            assert set(closed) <= {call["id"] for call in sent.values()}
        elif sent:  # calls went out as they were written: their text is no content
            assert first[0] + second[0] + rest == text[: stream.sent]
        else:
            assert first[0] + second[0] + rest == text
