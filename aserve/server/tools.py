"""OpenAI tool calls on the server's side: which syntax a model writes them in
(`--tool-call-parser`, or read from its chat template), their OpenAI shape, and the
streaming hold-back that keeps a call's syntax out of the content. The syntaxes themselves,
their parsers and forcing grammars, are tool_syntax.py's.
"""

from __future__ import annotations

import json
from typing import Any

from aserve.server.tool_syntax import (
    GLM45,
    GLM_MARKERS,
    GRANITE,
    GRANITE_CALLS,
    HERMES,
    HERMES_START,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    MISTRAL_CALLS,
    MISTRAL_NAMED_ARGS,
    PHI4_MINI_JSON,
    PYTHONIC,
    QWEN3_CODER,
    ParsedCall,
    Tools,
    ToolSyntax,
)
from aserve.textstream import partial_marker_length
from aserve.tokenizer import Tokenizer

_BY_NAME = {
    "hermes": HERMES,
    "qwen25": HERMES,
    "qwen3_coder": QWEN3_CODER,
    "llama3_json": LLAMA3_JSON,
    "llama3": LLAMA3_JSON,
    "granite": GRANITE,
    "phi4_mini_json": PHI4_MINI_JSON,
    "pythonic": PYTHONIC,
    "glm45": GLM45,
    "glm47": GLM45,
}


def _from_template(template: str) -> ToolSyntax:
    """The syntax a chat template teaches, by the markers it writes (Hermes if none)."""
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if GLM_MARKERS[0] in template:
        return GLM45
    if MISTRAL_CALLS in template:
        return MISTRAL_NAMED_ARGS if MISTRAL_ARGS in template else MISTRAL
    if "<|/tool|>" in template or "functools[" in template:
        return PHI4_MINI_JSON
    if GRANITE_CALLS in template:
        return GRANITE
    if HERMES_START in template:
        return HERMES
    if "[func_name1(" in template:
        return PYTHONIC
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return HERMES


def tool_syntax(parser: str, chat_template: str | None) -> ToolSyntax:
    """`--tool-call-parser`'s syntax; "auto" reads it from the template. Mistral's two forms
    are told apart by the template either way (the newer one knows `[ARGS]`)."""
    template = chat_template or ""
    if parser == "auto":
        return _from_template(template)
    if parser == "mistral":
        return MISTRAL_NAMED_ARGS if MISTRAL_ARGS in template else MISTRAL
    return _BY_NAME[parser]


def special_marker_ids(syntax: ToolSyntax, tokenizer: Tokenizer) -> frozenset[int]:
    """The syntax's markers that this vocabulary holds as special tokens: a reply's text
    must show them (skip_special_tokens would drop Mistral's `[TOOL_CALLS]`)."""
    ids = (tokenizer.single_token(marker) for marker in syntax.kept_tokens)
    return frozenset(i for i in ids if i is not None) & tokenizer.special_ids


def parse_tool_calls(
    text: str, syntax: ToolSyntax, tools: Tools = ()
) -> tuple[str | None, list[ParsedCall]]:
    """The reply's text outside tool calls (None if nothing is left) and its calls."""
    return syntax.parse(text, tools)


def openai_calls(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """`tool_calls` of an OpenAI message; streamed deltas add each one's `index`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


HEAD_REACH = 512
"""How far before a piece a call's head may begin and still be found: each piece is searched
with this much before it, not the whole reply again (a longer head goes out whole)."""


class _ObjectEnd:
    """Where a JSON object that began at its first character ends, read piece by piece:
    braces counted outside strings, escapes skipped."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """How much of `text` the object takes: up to its end, or None if it goes on."""
        for at, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
        return None


class _StreamedCall:
    """A call whose arguments are going out as they come: its index, id, name and the
    arguments' text sent so far."""

    def __init__(self, index: int, call_id: str, name: str, start: int) -> None:
        self.index, self.id, self.name = index, call_id, name
        self.sent = start  # where the arguments' unsent text begins, in the reply's text
        self.arguments = ""
        self.end = _ObjectEnd()
        self.whole = False

    def same_as(self, call: ParsedCall) -> bool:
        """Whether the parser's call is this one (its arguments are the same JSON)."""
        try:
            return call.name == self.name and json.loads(self.arguments) == json.loads(
                call.arguments
            )
        except ValueError:
            return False


class ToolTextStream:
    """Streams a reply's text until a tool call may be starting, then holds the rest back: a
    client never sees a call's syntax as content. Where the syntax has a `call_head`, each
    call goes out as it is written, as OpenAI streams them: its index, id and name once the
    name is complete, then its arguments' text as it comes (`take_deltas`); the others go
    out whole once their syntax has closed (in a syntax of markers nothing later can undo
    it); calls that are the whole reply (llama3_json, pythonic) wait for its end, as does
    the text around calls. `push` and `finish` also return each call once it has closed, as
    the parser reads it (the Responses API's items)."""

    def __init__(self, syntax: ToolSyntax, tools: Tools = ()) -> None:
        self.syntax = syntax
        self.tools = tools
        self.text = ""
        self.sent = 0
        self.held = False
        self.called = 0  # calls the parser closed before the reply ended
        self.indices = 0  # calls given an index (streamed or sent whole)
        self._deltas: list[dict[str, Any]] = []
        self._streamed: list[_StreamedCall] = []  # not yet closed by the parser
        self._scan_from = 0  # where the next call's head may begin

    def push(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """What of `delta` may go out as content now, and the calls it closed."""
        content = self._content(delta)
        if not self.held or self.syntax.whole_reply:
            return content, []
        self._stream_arguments(len(delta))
        if not any(c in delta for c in "]}>"):
            return content, []  # nothing can have closed a call
        _, calls = self.syntax.parse(self.text[self.sent :], self.tools)
        closed, self.called = calls[self.called :], len(calls)
        return content, self._closing(closed)

    def take_deltas(self) -> list[dict[str, Any]]:
        """The `tool_calls` entries of a chat chunk since the last call: streamed calls'
        openings and arguments' text, and whole calls."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def _stream_arguments(self, new: int) -> None:
        """Send what has come of the open call's arguments; open the calls whose heads have
        come (ending in the `new` characters or HEAD_REACH before them), while their
        arguments are an object."""
        head = self.syntax.call_head
        while head is not None:
            call = self._streamed[-1] if self._streamed else None
            if call is not None and not call.whole:
                ended = call.end.feed(self.text[call.sent :])
                upto = len(self.text) if ended is None else call.sent + ended
                piece = self.text[call.sent : upto]
                if piece:
                    call.arguments += piece
                    self._deltas.append({"index": call.index, "function": {"arguments": piece}})
                call.sent = upto
                if ended is None:
                    return
                call.whole, self._scan_from = True, upto
            reach = len(self.text) - new - HEAD_REACH
            found = head.search(self.text, max(self._scan_from, self.sent, reach))
            if found is None or found.end() == len(self.text):
                return  # no head yet, or its arguments not begun
            self._scan_from = found.end()
            if self.text[found.end()] != "{":
                continue  # arguments of another shape: the call goes out whole
            name = found.group("name")
            if self.syntax.quoted_name:
                name = json.loads(name)
            opened = _StreamedCall(self.indices, self.syntax.new_call_id(), name, found.end())
            self.indices += 1
            self._streamed.append(opened)
            self._deltas.append(
                {
                    "index": opened.index,
                    "id": opened.id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )

    def _closing(self, closed: list[ParsedCall]) -> list[ParsedCall]:
        """The parser's newly closed calls: a streamed one keeps its id; the others go out
        whole."""
        calls = []
        for call in closed:
            streamed = next((s for s in self._streamed if s.whole and s.same_as(call)), None)
            if streamed is not None:
                self._streamed.remove(streamed)
                calls.append(ParsedCall(call.name, call.arguments, streamed.id))
                continue
            calls.append(call)
            entry = openai_calls([call])[0]
            self._deltas.append({"index": self.indices, **entry})
            self.indices += 1
        return calls

    def _content(self, delta: str) -> str:
        self.text += delta
        if self.held:
            return ""
        if self.syntax.whole_reply:  # calls are the reply: hold one that opens like them
            start = self.text.lstrip()
            if not start and self.sent == 0:
                return ""
            if self.sent == 0 and any(
                start.startswith(m) or m.startswith(start) for m in self.syntax.markers
            ):
                self.held = any(start.startswith(m) for m in self.syntax.markers)
                return ""
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        found = [at for m in self.syntax.markers if (at := self.text.find(m, self.sent)) >= 0]
        if found:
            self.held = True
            out, self.sent = self.text[self.sent : min(found)], min(found)
            return out
        waiting = max(partial_marker_length(self.text, m) for m in self.syntax.markers)
        safe = len(self.text) - waiting
        out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The content still to send and the calls not handed out yet, once the reply is
        complete. A call that went out as it was written stays out, whatever follows it
        (arguments cut by max_tokens, a syntax broken after them)."""
        rest, calls = parse_tool_calls(self.text[self.sent :], self.syntax, self.tools)
        if not calls and self.indices:  # calls went out as written: their text is no content
            rest = ""
        return rest or "", self._closing(calls[self.called :])
