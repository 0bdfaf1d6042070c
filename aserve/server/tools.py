"""OpenAI tool calls: which syntax the model writes them in, the grammar that forces one
(`tool_choice` "required" or a named function), and the parse of its text into `tool_calls`.

Two syntaxes cover the common open models, chosen from the chat template:
- Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a
  call, text around them allowed (Qwen2.5, Qwen3, Hermes, and the default);
- Llama 3: the reply is the call itself, `{"name": ..., "parameters": {...}}`, calls back to
  back (templates that mention `<|python_tag|>` or the `ipython` role).
The forcing grammars are xgrammar's structural tags for those syntaxes (`qwen_3`, `llama`):
every call names a listed function and its arguments follow that function's schema.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from aserve.textstream import partial_marker_length

HERMES = "qwen_3"
LLAMA = "llama"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_START = "<tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def tool_format(chat_template: str | None) -> str:
    """The syntax this model's template teaches it (Hermes unless it is Llama 3's)."""
    template = chat_template or ""
    if HERMES_START not in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA
    return HERMES


def forcing_tag(syntax: str, tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> str:
    """The structural tag (JSON text) that makes the output a call of the named function, or
    ("required") calls of `tools` and nothing else: one, or several a line apart when
    `parallel`. xgrammar's own "required" tag lets free text run between calls."""
    import xgrammar
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

    tag = xgrammar.get_model_structural_tag(
        syntax, tools=tools, tool_choice=tool_choice, reasoning=False, parallel_tool_calls=parallel
    )
    if tool_choice == "required":
        calls = TagsWithSeparatorFormat(
            tags=tag.format.tags, separator="\n", at_least_one=True, stop_after_first=not parallel
        )
        tag = StructuralTag(format=calls)
    return tag.model_dump_json()


def _call(body: dict[str, Any], argument_key: str) -> ParsedCall | None:
    name = body.get("name")
    arguments = body.get(argument_key, body.get("arguments", {}))
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, syntax: str) -> tuple[str | None, list[ParsedCall]]:
    """The reply's text outside tool calls (None if nothing is left) and its calls. Text that
    only looks like a call (bad JSON, no name) stays text; so does a lone call cut short, but
    after whole calls one left open at the end, or its marker begun, is a call that max_tokens
    cut (a forced "required" reply keeps adding calls), not text for the client to show."""
    if syntax == HERMES:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        last = 0
        for match in HERMES_BLOCK.finditer(text):
            try:
                call = _call(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last : match.start()])
            last = match.end()
        tail = text[last:]
        if calls:  # a call left open, or cut inside its marker
            opened = tail.find(HERMES_START)
            tail = (
                tail[:opened]
                if opened >= 0
                else tail[: len(tail) - partial_marker_length(tail, HERMES_START)]
            )
        kept.append(tail)
        rest = "".join(kept).strip()
        return (rest or None) if calls else (text or None), calls
    decoder = json.JSONDecoder()
    stripped, calls, at = text.strip(), [], 0
    while at < len(stripped):
        try:
            body, end = decoder.raw_decode(stripped, at)
        except json.JSONDecodeError:
            break
        call = _call(body, "parameters") if isinstance(body, dict) else None
        if call is None:
            break
        calls.append(call)
        at = end
        while at < len(stripped) and stripped[at] in " \n;":
            at += 1
    if not calls or at < len(stripped):
        return text or None, []
    return None, calls


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def openai_calls(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """`tool_calls` of an OpenAI message; streamed deltas add each one's `index`."""
    return [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


class ToolTextStream:
    """Streams a reply's text until a tool call may be starting, then holds the rest back for
    `finish` to parse: a client never sees a call's syntax as content."""

    def __init__(self, syntax: str) -> None:
        self.syntax = syntax
        self.text = ""
        self.sent = 0
        self.held = False

    def push(self, delta: str) -> str:
        """What of `delta` may go out as content now."""
        self.text += delta
        if self.held:
            return ""
        if self.syntax == LLAMA:
            start = self.text.lstrip()
            if start.startswith("{") or (not start and self.sent == 0):
                self.held = bool(start)
                return ""
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        found = self.text.find(HERMES_START, self.sent)
        if found >= 0:
            self.held = True
            out, self.sent = self.text[self.sent : found], found
            return out
        safe = len(self.text) - partial_marker_length(self.text, HERMES_START)
        out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The content still to send and the calls, once the reply is complete."""
        rest, calls = parse_tool_calls(self.text[self.sent :], self.syntax)
        return rest or "", calls
