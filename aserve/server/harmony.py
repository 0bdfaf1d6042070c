"""OpenAI's harmony format (gpt-oss's replies), split into reasoning, content and tool calls.

A reply is a run of messages, each `[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT]
[<|constrain|>FORMAT]<|message|>BODY` ended by `<|end|>`, `<|return|>` (the reply's last) or
`<|call|>` (a tool call); the prompt opens the first one (`<|start|>assistant`). The
`analysis` channel holds the model's reasoning (`reasoning_content`), `final` its answer
(`content`), and `commentary` addressed `to=functions.NAME` a call of tool NAME whose body is
the arguments' JSON; commentary to no one (a preamble for the user) is content too. The
markers are special tokens: a harmony model's chat replies are decoded with them
(`skip_special_tokens` false) and this parser takes them out, as vLLM and SGLang give gpt-oss
replies. A reply that never opens a channel is all content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aserve.server.reasoning import Split
from aserve.server.tool_syntax import ParsedCall, offered_functions
from aserve.textstream import partial_marker_length

CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
ENDINGS = ("<|end|>", "<|return|>", "<|call|>")
MARKER_TEXTS = tuple(
    f"<|{name}|>" for name in ("start", "channel", "message", "end", "return", "call", "constrain")
)
MARKERS = re.compile("|".join(re.escape(marker) for marker in MARKER_TEXTS))
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([\w.-]+)")
RECIPIENT = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's)."""
    template = chat_template or ""
    return CHANNEL in template and MESSAGE in template


class HarmonyStream:
    """A reply's text, as it arrives, split into (reasoning, content), the tool calls at the
    end (`finish`). Text that may still turn into a marker is held back, and so is a
    message's header until its `<|message|>`. Any cut of the same text into pieces gives
    the same strings in the end, and the same as `split_harmony`."""

    def __init__(self) -> None:
        self._pending = ""
        self._kind: str | None = None  # in a body: "reasoning", "content" or "call"
        self._name = ""  # the function a call's body is for
        self._arguments = ""
        self._opened = False  # a header seen: the reply speaks harmony
        self.calls: list[ParsedCall] = []

    @property
    def reasoning(self) -> bool:
        """Inside an `analysis` body."""
        return self._kind == "reasoning"

    def push(self, text: str) -> Split:
        self._pending += text
        reasoning, content = "", ""
        while True:
            if self._kind is None:  # a header, up to <|message|>
                at = self._pending.find(MESSAGE)
                if at < 0:
                    if not self._opened and not MARKERS.search(self._pending):
                        # no harmony yet: content, but for what may begin a marker
                        keep = max(partial_marker_length(self._pending, m) for m in MARKER_TEXTS)
                        content += self._pending[: len(self._pending) - keep]
                        self._pending = self._pending[len(self._pending) - keep :]
                    return Split(reasoning, content)
                self._open(self._pending[:at])
                self._pending = self._pending[at + len(MESSAGE) :]
                continue
            ends = [(at, e) for e in ENDINGS if (at := self._pending.find(e)) >= 0]
            if ends:
                at, ending = min(ends)
                body, self._pending = self._pending[:at], self._pending[at + len(ending) :]
            else:
                keep = max(partial_marker_length(self._pending, e) for e in ENDINGS)
                body = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
            if self._kind == "reasoning":
                reasoning += body
            elif self._kind == "content":
                content += body
            else:
                self._arguments += body
            if not ends:
                return Split(reasoning, content)
            self._close()

    def finish(self) -> Split:
        """The held-back rest once the reply has ended (by its stop token, which the text
        may leave out, or cut short): a body's rest goes where the body went, a call with
        whole JSON arguments is kept (a cut one is dropped), and text that never became a
        header is content."""
        rest, self._pending = self._pending, ""
        if self._kind is None:
            return Split("", "" if self._opened else MARKERS.sub("", rest))
        kind = self._kind
        if kind == "call":
            self._arguments += rest
            self._close()
            return Split("", "")
        self._kind = None
        return Split(rest, "") if kind == "reasoning" else Split("", rest)

    def _open(self, header: str) -> None:
        self._opened = True
        channel = CHANNEL_NAME.search(header)
        recipient = RECIPIENT.search(MARKERS.sub(" ", header))
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            self._kind, self._name = "call", recipient.group(1).removeprefix(FUNCTIONS)
            self._arguments = ""
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _close(self) -> None:
        if self._kind == "call":
            try:
                arguments = json.loads(self._arguments)
            except (ValueError, RecursionError):
                pass  # cut short, or not JSON: not a call to make
            else:  # as OpenAI sends arguments, whatever spacing the model wrote
                self.calls.append(ParsedCall(self._name, json.dumps(arguments, ensure_ascii=False)))
        self._kind = None


def forcing_tag(tools: list[dict[str, Any]], tool_choice: Any) -> str:
    """The structural tag (JSON text) that makes a harmony reply a call of one of `tools`
    (of the named function where `tool_choice` names one), after as many analysis messages
    as the model writes, none included. The call ends with no marker: its `<|call|>` is a
    stop token, which the grammar allows once the arguments' JSON is whole (a stop token
    never matches text in a grammar). One call a reply: the model stops at its first. Its
    header takes the spellings xgrammar's harmony tag lists and the one OpenAI's renderer
    writes (a space before `<|constrain|>`); xgrammar's own tag for "required" also takes a
    reply of analysis alone."""
    from xgrammar.structural_tag import (
        AnyTextFormat,
        ConstStringFormat,
        JSONSchemaFormat,
        OrFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    calls = []
    for name, schema in offered_functions(tools, tool_choice):
        arguments = JSONSchemaFormat(json_schema=schema)
        to = f"to={FUNCTIONS}{name}"
        for header in (
            f"<|channel|>commentary {to} <|constrain|>json<|message|>",
            f"<|channel|>commentary {to}<|constrain|>json<|message|>",
            f" {to}<|channel|>commentary <|constrain|>json<|message|>",
            f" {to}<|channel|>commentary json<|message|>",
        ):
            calls.append(TagFormat(begin=header, content=arguments, end=""))
    call = TagsWithSeparatorFormat(
        tags=calls, separator="", at_least_one=True, stop_after_first=True
    )
    analysis = TagFormat(
        begin="<|channel|>analysis<|message|>", content=AnyTextFormat(), end="<|end|>"
    )
    thinking = TagsWithSeparatorFormat(
        tags=[analysis], separator="<|start|>assistant", at_least_one=True
    )
    start = ConstStringFormat(value="<|start|>assistant")
    then_call = SequenceFormat(elements=[thinking, start, call])
    return StructuralTag(format=OrFormat(elements=[call, then_call])).model_dump_json()


def split_harmony(text: str) -> tuple[str | None, str, list[ParsedCall]]:
    """A whole reply as (reasoning or None when it had none, content, tool calls)."""
    stream = HarmonyStream()
    first, last = stream.push(text), stream.finish()
    reasoning = first.reasoning + last.reasoning
    return reasoning or None, first.content + last.content, stream.calls
