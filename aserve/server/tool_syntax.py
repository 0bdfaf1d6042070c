"""The ways open models write tool calls: each one's parser (reply text -> calls) and the
grammar that forces calls in it (`tool_choice` "required" or a named function).

Names are vLLM's `--tool-call-parser` names:
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, a block a call, text
  around them (Qwen2.5, Qwen3, Hermes, SmolLM3);
- qwen3_coder: the same blocks holding `<function=NAME>` and `<parameter=KEY>` elements, each
  value as plain text, read by its schema type (Qwen3-Coder);
- llama3_json: the reply is the calls, `{"name": ..., "parameters": {...}}` objects back to back
  (Llama 3.1-3.3);
- mistral: `[TOOL_CALLS]` and a JSON list of calls (Mistral 7B v0.3, Nemo, Small 3.1,
  Mixtral), or `[TOOL_CALLS]NAME[ARGS]{...}` a call (Mistral Small 3.2, Magistral, Devstral:
  templates that know `[ARGS]`); its call ids are nine letters and digits, as its templates
  require of the ids that come back in the history;
- granite: `<|tool_call|>` and a JSON list (Granite 3);
- phi4_mini_json: `functools` and a JSON list (Phi-4-mini);
- pythonic: the reply is a Python list of calls, `[get_weather(city="Paris"), ...]` (Llama
  3.2's and Llama 4's pythonic templates);
- glm45 (glm47): `<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`
  pairs and `</tool_call>`, newlines between them or not, values read by their schema types
  as qwen3_coder's are (GLM-4.5, 4.6, 4.7).
A reply whose call syntax does not parse stays text; after whole calls, one cut short by
max_tokens is dropped (a forced "required" reply keeps adding calls until stopped).

The forcing grammars are xgrammar structural tags: each call names an offered function and
its arguments follow that function's schema. xgrammar has the tags of hermes, qwen3_coder,
llama3_json and glm45 (GLM-4.7's, which writes no newlines); the JSON-list ones are built
here. Python's call syntax has no schema grammar in xgrammar, so a forced pythonic reply is
written as llama3_json calls (vLLM forces every parser's calls as JSON), which the pythonic
parser also reads.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aserve.textstream import partial_marker_length

Tools = Sequence[dict[str, Any]]
Parsed = tuple[str | None, list["ParsedCall"]]
# Calls read at a position just after a marker: those found and where they end (None where
# the text ends first: a call cut short, or no call at all).
CallReader = Callable[[str, int], tuple[list["ParsedCall"], int | None]]

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GRANITE_CALLS = "<|tool_call|>"
PHI4_CALLS = "functools"
LLAMA4_PYTHON = ("<|python_start|>", "<|python_end|>")
CODER_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
GLM_MARKERS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
FUNCTION_NAME = re.compile(r"[\w.\-]+")
# A JSON call object up to its arguments: `{"name": "...", "arguments": ` (Llama's key is
# "parameters"); `[TOOL_CALLS]NAME[ARGS]` (Mistral's newer form)
JSON_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
MISTRAL_ARGS_HEAD = re.compile(r"\[TOOL_CALLS\](?P<name>[\w.\-]+)(?:\[CALL_ID\][\w]*)?\[ARGS\]\s*")
ID_CHARACTERS = string.ascii_letters + string.digits
# What a model's text can raise when read as JSON or as a Python literal: deep nesting
# overflows the readers' recursion too, and such text is text, not a failed request.
NOT_JSON = (ValueError, RecursionError)
NOT_PYTHON = (ValueError, TypeError, SyntaxError, RecursionError, MemoryError)


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def mistral_call_id() -> str:
    return "".join(secrets.choice(ID_CHARACTERS) for _ in range(9))


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=openai_call_id, compare=False)


def _arguments(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except NOT_JSON:
            return None
    return value if isinstance(value, dict) else None


def _json_call(body: Any, key: str) -> ParsedCall | None:
    """A call object, `{"name": ..., key: {...}}` ("arguments" is read too)."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = _arguments(body.get(key, body.get("arguments", {})))
    if arguments is None:
        return None
    return ParsedCall(body["name"], json.dumps(arguments, ensure_ascii=False))


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _json_list(text: str, at: int, key: str = "arguments") -> tuple[list[ParsedCall], int | None]:
    """The calls of a JSON list starting at `at`: the whole ones before a cut or a bad element,
    and where the list ends (None if it does not)."""
    decoder, calls = json.JSONDecoder(), []
    at = _skip_space(text, at)
    if not text.startswith("[", at):
        return [], None
    at += 1
    while True:
        at = _skip_space(text, at)
        if text.startswith("]", at):
            return calls, at + 1
        try:
            body, at = decoder.raw_decode(text, at)
        except NOT_JSON:
            return calls, None
        call = _json_call(body, key)
        if call is None:
            return calls, None
        calls.append(call)
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at += 1


def _after_markers(text: str, marker: str, read: CallReader) -> Parsed:
    """Text holding calls that each start with `marker`; the rest of the text is content.
    A marker whose calls do not read stays text, unless whole calls came before it (then it
    is the start of a call that max_tokens cut)."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    last = 0
    at = text.find(marker)
    while at >= 0:
        found, end = read(text, at + len(marker))
        if not found and not (calls and end is None):
            at = text.find(marker, at + 1)
            continue
        kept.append(text[last:at])
        calls += found
        last = len(text) if end is None else end
        if end is None:
            break
        at = text.find(marker, end)
    if not calls:
        return text or None, []
    tail = text[last:]
    kept.append(tail[: len(tail) - partial_marker_length(tail, marker)])
    return "".join(kept).strip() or None, calls


def _read_hermes(text: str, at: int) -> tuple[list[ParsedCall], int | None]:
    close = text.find(HERMES_END, at)
    if close < 0:
        return [], None
    try:
        call = _json_call(json.loads(text[at:close]), "arguments")
    except NOT_JSON:
        call = None
    return [call] if call else [], close + len(HERMES_END)


def _coder_value(raw: str, schema: dict[str, Any]) -> Any:
    """A qwen3_coder parameter's text as the value its schema's type asks for; text that is
    not that type stays a string. A free string is the text inside the newlines that the
    template writes around it; any other value may have whitespace around it (xgrammar's
    grammar lets an enum's or a number's value have some)."""
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        if "enum" in schema or "const" in schema:
            return raw.strip()
        return raw.removeprefix("\n").removesuffix("\n")
    value = raw.strip()
    try:
        return json.loads(value)
    except NOT_JSON:
        pass
    try:  # Python literals: True, None, single quotes
        return ast.literal_eval(value)
    except NOT_PYTHON:
        return value


def _typed_arguments(pairs: list[tuple[str, str]], properties: dict[str, Any]) -> str:
    """Key and text pairs (qwen3_coder's parameters, GLM's arguments) as a JSON arguments
    object, each value read by its schema (`_coder_value`)."""
    arguments = {
        key.strip(): _coder_value(raw, properties.get(key.strip(), {})) for key, raw in pairs
    }
    return json.dumps(arguments, ensure_ascii=False)


def _function_schemas(tools: Tools) -> dict[str, dict[str, Any]]:
    """Each offered function's argument properties, by name."""
    schemas = {}
    for tool in tools:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        schemas[function.get("name")] = properties if isinstance(properties, dict) else {}
    return schemas


def _coder_reader(tools: Tools) -> CallReader:
    schemas = _function_schemas(tools)

    def read(text: str, at: int) -> tuple[list[ParsedCall], int | None]:
        function = CODER_FUNCTION.match(text, at)
        if function is None:
            return [], None
        name = function.group(1).strip()
        pairs = CODER_PARAMETER.findall(function.group(2))
        arguments = _typed_arguments(pairs, schemas.get(name, {}))
        end = function.end()
        if text.startswith(HERMES_END, end):
            end = _skip_space(text, end + len(HERMES_END))
        elif HERMES_END.startswith(text[end:]):  # the closing tag cut short (max_tokens)
            end = len(text)
        return [ParsedCall(name, arguments)], end

    return read


def _glm_reader(tools: Tools) -> CallReader:
    schemas = _function_schemas(tools)

    def read(text: str, at: int) -> tuple[list[ParsedCall], int | None]:
        close = text.find(HERMES_END, at)
        if close < 0:
            return [], None
        body = text[at:close]
        first = body.find(GLM_MARKERS[0])
        name = body[: len(body) if first < 0 else first].strip()
        end = _skip_space(text, close + len(HERMES_END))
        if FUNCTION_NAME.fullmatch(name) is None:
            return [], end
        pairs = GLM_ARGUMENT.findall(body, max(first, 0))
        return [ParsedCall(name, _typed_arguments(pairs, schemas.get(name, {})))], end

    return read


def _read_mistral(text: str, at: int) -> tuple[list[ParsedCall], int | None]:
    """Either form after `[TOOL_CALLS]`: a JSON list, or `NAME[ARGS]{...}` (one call)."""
    if text.startswith("[", _skip_space(text, at)):
        found, end = _json_list(text, at)
        return [ParsedCall(c.name, c.arguments, mistral_call_id()) for c in found], end
    args = text.find(MISTRAL_ARGS, at)
    name = text[at:args].split(MISTRAL_CALL_ID)[0].strip()
    if args < 0 or not FUNCTION_NAME.fullmatch(name):
        return [], None
    try:
        body, end = json.JSONDecoder().raw_decode(text, _skip_space(text, args + len(MISTRAL_ARGS)))
    except NOT_JSON:
        return [], None
    arguments = _arguments(body)
    if arguments is None:
        return [], end
    return [ParsedCall(name, json.dumps(arguments, ensure_ascii=False), mistral_call_id())], end


def _parse_llama(text: str) -> Parsed:
    """The whole reply as JSON call objects, back to back (`;` or spaces between)."""
    decoder = json.JSONDecoder()
    stripped, calls, at = text.strip(), [], 0
    while at < len(stripped):
        try:
            body, end = decoder.raw_decode(stripped, at)
        except NOT_JSON:
            break
        call = _json_call(body, "parameters")
        if call is None:
            break
        calls.append(call)
        at = end
        while at < len(stripped) and stripped[at] in " \n;":
            at += 1
    if not calls or at < len(stripped):
        return text or None, []
    return None, calls


def _literal(node: ast.expr) -> Any:
    """A Python literal's value, where JSON's true, false and null are read as well."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def _parse_pythonic(text: str) -> Parsed:
    """The whole reply as a Python list of keyword-argument calls (Llama 4 wraps it in its
    python tags), or JSON calls, as a forced reply writes them."""
    body = text.strip().removeprefix(LLAMA4_PYTHON[0]).removesuffix(LLAMA4_PYTHON[1]).strip()
    if body.startswith("{"):
        return _parse_llama(text)
    try:
        with warnings.catch_warnings():  # a model's "\d" in a string is no warning to log
            warnings.simplefilter("ignore")
            tree = ast.parse(body, mode="eval").body
    except NOT_PYTHON:
        return text or None, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text or None, []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return text or None, []
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        except NOT_PYTHON:
            return text or None, []
        calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return None, calls


# ---- forcing grammars ----


def offered_functions(tools: Tools, tool_choice: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, argument schema) of the functions a forced reply may call."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    offered = []
    for tool in tools:
        function = tool.get("function") or {}
        name = function.get("name")
        if name and (named is None or name == named):
            offered.append((name, function.get("parameters") or {"type": "object"}))
    if not offered:
        raise ValueError(f"tool_choice names no function of the tools: {named!r}")
    return offered


def _xgrammar_tag(model: str, tools: Tools, tool_choice: Any, parallel: bool) -> Any:
    """xgrammar's own tag for `model`; its "required" tag lets free text run between calls,
    so a required reply is rebuilt as calls alone (one, or several a line apart)."""
    import xgrammar
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

    tag = xgrammar.get_model_structural_tag(
        model,
        tools=list(tools),
        tool_choice=tool_choice,
        reasoning=False,
        parallel_tool_calls=parallel,
    )
    if tool_choice == "required":
        calls = TagsWithSeparatorFormat(
            tags=tag.format.tags, separator="\n", at_least_one=True, stop_after_first=not parallel
        )
        tag = StructuralTag(format=calls)
    return tag


def _calls(
    tools: Tools,
    tool_choice: Any,
    parallel: bool,
    begin: Callable[[str], str],
    end: str,
    separator: str,
) -> Any:
    """Calls of the offered functions, each `begin(name)`, arguments that follow its schema
    and `end`: one, or (`parallel`) several `separator` apart."""
    from xgrammar.structural_tag import JSONSchemaFormat, TagFormat, TagsWithSeparatorFormat

    tags = [
        TagFormat(begin=begin(name), content=JSONSchemaFormat(json_schema=schema), end=end)
        for name, schema in offered_functions(tools, tool_choice)
    ]
    return TagsWithSeparatorFormat(
        tags=tags, separator=separator, at_least_one=True, stop_after_first=not parallel
    )


def _json_list_tag(opening: str, tools: Tools, tool_choice: Any, parallel: bool) -> Any:
    """`opening` then a JSON list of calls `{"name": ..., "arguments": {...}}`."""
    from xgrammar.structural_tag import ConstStringFormat, SequenceFormat, StructuralTag

    def begin(name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "arguments": '

    listed = _calls(tools, tool_choice, parallel, begin, "}", ", ")
    elements = [ConstStringFormat(value=opening + "["), listed, ConstStringFormat(value="]")]
    return StructuralTag(format=SequenceFormat(elements=elements))


def _mistral_args_tag(tools: Tools, tool_choice: Any, parallel: bool) -> Any:
    """`[TOOL_CALLS]NAME[ARGS]{...}` a call, back to back."""
    from xgrammar.structural_tag import StructuralTag

    def begin(name: str) -> str:
        return f"{MISTRAL_CALLS}{name}{MISTRAL_ARGS}"

    return StructuralTag(format=_calls(tools, tool_choice, parallel, begin, "", ""))


# ---- the syntaxes ----


@dataclass(frozen=True)
class ToolSyntax:
    """One way of writing calls. A streamed reply's content stops where one of `markers`
    begins, or (`whole_reply`) is held back entirely when it opens with one of them.
    `kept_tokens` are markers that some vocabularies hold as special tokens, which a
    detokenizer would otherwise drop."""

    name: str
    markers: tuple[str, ...]
    parse: Callable[[str, Tools], Parsed]
    force: Callable[[Tools, Any, bool], Any]  # -> xgrammar StructuralTag
    whole_reply: bool = False
    kept_tokens: tuple[str, ...] = ()
    # Where a call's arguments object begins once its name is known (group "name", JSON
    # text where `quoted_name`): a streamed reply sends the arguments as they come. Syntaxes
    # without one send each call whole once its syntax closes.
    call_head: re.Pattern[str] | None = None
    quoted_name: bool = True
    new_call_id: Callable[[], str] = openai_call_id

    def forcing_tag(self, tools: Tools, tool_choice: Any, parallel: bool) -> str:
        """The structural tag (JSON text) that makes the reply a call of the named function,
        or ("required") calls of `tools` and nothing else: one, or several when `parallel`."""
        return self.force(tools, tool_choice, parallel).model_dump_json()


def _mistral(force: Callable[[Tools, Any, bool], Any], head: re.Pattern[str]) -> ToolSyntax:
    return ToolSyntax(
        "mistral",
        (MISTRAL_CALLS,),
        lambda text, tools: _after_markers(text, MISTRAL_CALLS, _read_mistral),
        force,
        kept_tokens=(MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID),
        call_head=head,
        quoted_name=head is JSON_CALL_HEAD,
        new_call_id=mistral_call_id,
    )


HERMES = ToolSyntax(
    "hermes",
    (HERMES_START,),
    lambda text, tools: _after_markers(text, HERMES_START, _read_hermes),
    lambda tools, choice, parallel: _xgrammar_tag("qwen_3", tools, choice, parallel),
    kept_tokens=(HERMES_START, HERMES_END),
    call_head=JSON_CALL_HEAD,
)
QWEN3_CODER = ToolSyntax(
    "qwen3_coder",
    (HERMES_START,),
    lambda text, tools: _after_markers(text, HERMES_START, _coder_reader(tools)),
    lambda tools, choice, parallel: _xgrammar_tag("qwen_3_coder", tools, choice, parallel),
    kept_tokens=(HERMES_START, HERMES_END),
)
GLM45 = ToolSyntax(
    "glm45",
    (HERMES_START,),
    lambda text, tools: _after_markers(text, HERMES_START, _glm_reader(tools)),
    lambda tools, choice, parallel: _xgrammar_tag("glm_4_7", tools, choice, parallel),
    kept_tokens=(HERMES_START, HERMES_END, *GLM_MARKERS),
)
LLAMA3_JSON = ToolSyntax(
    "llama3_json",
    ("{",),
    lambda text, tools: _parse_llama(text),
    lambda tools, choice, parallel: _xgrammar_tag("llama", tools, choice, parallel),
    whole_reply=True,
)
PYTHONIC = ToolSyntax(
    "pythonic",
    ("[", "{", LLAMA4_PYTHON[0]),
    lambda text, tools: _parse_pythonic(text),
    LLAMA3_JSON.force,
    whole_reply=True,
    kept_tokens=LLAMA4_PYTHON,
)
MISTRAL = _mistral(
    lambda tools, choice, parallel: _json_list_tag(MISTRAL_CALLS, tools, choice, parallel),
    JSON_CALL_HEAD,
)
MISTRAL_NAMED_ARGS = _mistral(_mistral_args_tag, MISTRAL_ARGS_HEAD)
GRANITE = ToolSyntax(
    "granite",
    (GRANITE_CALLS,),
    lambda text, tools: _after_markers(text, GRANITE_CALLS, _json_list),
    lambda tools, choice, parallel: _json_list_tag(GRANITE_CALLS, tools, choice, parallel),
    kept_tokens=(GRANITE_CALLS,),
    call_head=JSON_CALL_HEAD,
)
PHI4_MINI_JSON = ToolSyntax(
    "phi4_mini_json",
    (PHI4_CALLS,),
    lambda text, tools: _after_markers(text, PHI4_CALLS, _json_list),
    lambda tools, choice, parallel: _json_list_tag(PHI4_CALLS, tools, choice, parallel),
    call_head=JSON_CALL_HEAD,
)
