"""Reasoning models' thinking, split from their answer (`--reasoning-parser`).

Qwen3, QwQ and DeepSeek-R1 think between `<think>` and `</think>`, then answer. With a
parser the chat reply carries the thinking as `reasoning_content` (SGLang's and DeepSeek's
field) and only the answer as `content`, in which tool calls are then looked for.

Where the thinking starts is read from the prompt: DeepSeek-R1's and the Qwen3 thinking
models' templates end the prompt with `<think>`, so the reply starts inside it; Qwen3's
hybrid models write `<think>` themselves, or (with `chat_template_kwargs`
`{"enable_thinking": false}`) get an empty block in the prompt and answer at once. A reply
that stops before `</think>` is all thinking; one that never opens a block is all answer.
A constrained reply (a JSON schema, forced tool calls) thinks freely and its grammar starts
after `</think>`, as in vLLM and SGLang (aserve/server/completions.py); where the tag is no
single token of the vocabulary, the grammar writes the reply from its first token.
"""

from __future__ import annotations

from typing import NamedTuple

from aserve.textstream import partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt that ends with this text leaves the reply inside a thinking block."""
    return prompt_tail.rstrip().endswith(THINK_START)


def closes_thinking(prompt_tail: str) -> bool:
    """Whether it ends with a block closed already (Qwen3 with thinking switched off)."""
    return prompt_tail.rstrip().endswith(THINK_END)


class Split(NamedTuple):
    reasoning: str
    content: str


class ReasoningStream:
    """Splits a reply's text as it arrives. Text that may still turn into a tag is held
    back; the answer's leading whitespace (the blank line after `</think>`) is dropped. Any
    cut of the same text into pieces gives the same two strings in the end, and the same as
    `split_reasoning`."""

    def __init__(self, opened: bool) -> None:
        self._state = "thinking" if opened else "start"
        self._pending = ""
        self.thought = opened  # whether the reply has a thinking block (reasoning_content)

    def push(self, text: str) -> Split:
        """What of the text so far can go out now, as (reasoning, content)."""
        self._pending += text
        reasoning, content = "", ""
        while True:
            pending = self._pending
            if self._state == "start":  # before anything but whitespace
                stripped = pending.lstrip()
                if stripped.startswith(THINK_START):
                    self._state, self._pending = "thinking", stripped[len(THINK_START) :]
                    self.thought = True
                    continue
                if stripped and not THINK_START.startswith(stripped):
                    self._state = "answer"
                    continue
                return Split(reasoning, content)  # only whitespace or part of the tag yet
            if self._state == "thinking":
                end = pending.find(THINK_END)
                if end >= 0:
                    reasoning += pending[:end]
                    self._state, self._pending = "after", pending[end + len(THINK_END) :]
                    continue
                keep = partial_marker_length(pending, THINK_END)
                reasoning += pending[: len(pending) - keep]
                self._pending = pending[len(pending) - keep :]
                return Split(reasoning, content)
            if self._state == "after":  # the answer starts at its first visible character
                stripped = pending.lstrip()
                if not stripped:
                    self._pending = ""
                    return Split(reasoning, content)
                self._state, self._pending = "answer", stripped
                continue
            content += pending
            self._pending = ""
            return Split(reasoning, content)

    @property
    def thinking(self) -> bool:
        """Inside the <think> block (its end not yet seen)."""
        return self._state == "thinking"

    @property
    def undecided(self) -> bool:
        """Nothing but whitespace or the beginning of <think> so far."""
        return self._state == "start"

    def finish(self) -> Split:
        """The held-back rest once the reply has ended: a tag's unfinished beginning is
        text after all."""
        rest, self._pending = self._pending, ""
        if self._state == "thinking":
            return Split(rest, "")
        return Split("", "" if self._state == "after" else rest)


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """A whole reply as (reasoning or None when it never thought, content)."""
    stream = ReasoningStream(opened)
    first, last = stream.push(text), stream.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if stream.thought else None), first.content + last.content
