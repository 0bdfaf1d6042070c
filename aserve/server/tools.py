"""OpenAI tool calls on the server's side: which syntax a model writes them in
(`--tool-call-parser`, or read from its chat template), their OpenAI shape, and the
streaming hold-back that keeps a call's syntax out of the content. The syntaxes themselves,
their parsers and forcing grammars, are tool_syntax.py's.
"""

from __future__ import annotations

from typing import Any

from aserve.server.tool_syntax import (
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
}


def _from_template(template: str) -> ToolSyntax:
    """The syntax a chat template teaches, by the markers it writes (Hermes if none)."""
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
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


class ToolTextStream:
    """Streams a reply's text until a tool call may be starting, then holds the rest back: a
    client never sees a call's syntax as content. Each call goes out once its syntax has
    closed (in a syntax of markers nothing later can undo it); calls that are the whole
    reply (llama3_json, pythonic) wait for its end, as does the text around calls."""

    def __init__(self, syntax: ToolSyntax, tools: Tools = ()) -> None:
        self.syntax = syntax
        self.tools = tools
        self.text = ""
        self.sent = 0
        self.held = False
        self.called = 0  # calls handed out before the reply ended

    def push(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """What of `delta` may go out as content now, and the calls it closed."""
        content = self._content(delta)
        if not self.held or self.syntax.whole_reply or not any(c in delta for c in "]}>"):
            return content, []  # nothing can have closed a call
        _, calls = self.syntax.parse(self.text[self.sent :], self.tools)
        closed, self.called = calls[self.called :], len(calls)
        return content, closed

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
        complete."""
        rest, calls = parse_tool_calls(self.text[self.sent :], self.syntax, self.tools)
        return rest or "", calls[self.called :]
