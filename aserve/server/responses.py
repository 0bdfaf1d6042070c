"""Shape choices' deltas into OpenAI bodies and SSE chunks, chat and completion alike.

Streamed and non-streamed responses are built from the same deltas, so their text, finish
reasons and usage agree by construction.
"""

from __future__ import annotations

from typing import Any

import orjson

from aserve.runtime import Runtime
from aserve.sampling_params import TokenLogprob
from aserve.server import openai
from aserve.server.generation import Choice, Delta
from aserve.server.harmony import HarmonyStream, split_harmony
from aserve.server.http import SSE_DONE, sse
from aserve.server.openai import GenerationRequest, ResponseHead
from aserve.server.reasoning import ReasoningStream, split_reasoning
from aserve.server.tool_syntax import ParsedCall
from aserve.server.tools import ToolTextStream, openai_calls, parse_tool_calls


class ResponseShaper:
    def __init__(
        self,
        parsed: GenerationRequest,
        head: ResponseHead,
        runtime: Runtime,
        choices: list[Choice],
    ) -> None:
        self.parsed = parsed
        self.head = head
        self.runtime = runtime
        self.choices = choices
        self.is_chat = parsed.kind == "chat"
        self._text_offsets = [0] * len(choices)
        self._scores_prompt = parsed.params.prompt_logprobs is not None
        self._prompt_sent = [False] * len(choices)
        self._splitters = [ReplySplitter(parsed) for _ in choices]
        plain = not (parsed.params.logprobs or parsed.return_token_ids or self._scores_prompt)
        syntax, opened, harmony = parsed.tool_syntax, parsed.thinking_opened, parsed.harmony
        self._text_templates = (
            [self._text_template(i) for i in range(len(choices))]
            if parsed.stream and plain and syntax is None and opened is None and not harmony
            else None
        )

    def _text_template(self, index: int) -> tuple[bytes, bytes]:
        """A text delta's SSE event around its JSON string: the chunk serialized once with a
        stand-in for the text, then cut there (a stand-in orjson writes as an escape; the
        text is the chunk's last string)."""
        stand_in = "\x00"
        if self.is_chat:
            chunk = openai.chat_chunk(self.head, index, {"content": stand_in})
        else:
            chunk = openai.completion_chunk(self.head, index, stand_in)
        before, after = sse(chunk).rsplit(orjson.dumps(stand_in), 1)
        return before, after

    def _echo_text(self, index: int) -> str:
        if not self.parsed.echo or self.runtime.tokenizer is None:
            return ""
        return self.runtime.tokenizer.decode(self.choices[index].prompt_ids)

    def _token_texts(
        self, logprobs: list[TokenLogprob]
    ) -> list[tuple[str, TokenLogprob, list[str]]]:
        tokenizer = self.runtime.tokenizer
        if tokenizer is None:
            return [(str(lp.token_id), lp, [str(i) for i, _ in lp.top]) for lp in logprobs]
        return [
            (
                tokenizer.decode([lp.token_id], False),
                lp,
                [tokenizer.decode([i], False) for i, _ in lp.top],
            )
            for lp in logprobs
        ]

    def _prompt_logprobs(self, index: int, scored: list[TokenLogprob]) -> dict[str, Any]:
        """An echoed prompt's logprobs (OpenAI's echo with logprobs): its first token has
        none, the others score the tokens before them; offsets count from the text's start."""
        first = self.choices[index].prompt_ids[0]
        tokenizer = self.runtime.tokenizer
        head = str(first) if tokenizer is None else tokenizer.decode([first], False)
        entries: list[tuple[str, TokenLogprob | None, list[str]]] = [(head, None, [])]
        entries += self._token_texts(scored)
        return openai.completion_logprobs(entries, 0)

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.parsed.params.logprobs:
            return None
        entries = self._token_texts(logprobs)
        if self.is_chat:
            return openai.chat_logprobs(entries)
        body = openai.completion_logprobs(entries, self._text_offsets[index])
        self._text_offsets[index] += sum(len(text) for text, _, _ in entries)
        return body

    DONE = SSE_DONE

    def opening_events(self) -> bytes:
        return b"".join(sse(chunk) for chunk in self.opening_chunks())

    def closing_events(self) -> bytes:
        """The usage chunk, when asked for."""
        chunk = self.usage_chunk()
        return b"" if chunk is None else sse(chunk)

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role; echo sends the prompt."""
        chunks = []
        for index in range(len(self.choices)):
            if self.is_chat:
                delta = {"role": "assistant", "content": ""}
                chunks.append(openai.chat_chunk(self.head, index, delta))
            elif self.parsed.echo:
                text = self._echo_text(index)
                self._text_offsets[index] = len(text)
                chunks.append(openai.completion_chunk(self.head, index, text))
        return chunks

    def delta_events(self, index: int, delta: Delta) -> bytes:
        """`delta_chunks` as SSE bytes. The usual delta, text alone, fills a template: it is
        written for every token of every stream, on the event loop."""
        if self._text_templates is not None and delta.finish_reason is None:
            if not delta.text:
                return b""
            before, after = self._text_templates[index]
            return before + orjson.dumps(delta.text) + after
        return b"".join(sse(chunk) for chunk in self.delta_chunks(index, delta))

    def delta_chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        """A choice's first delta brings its prompt's logprobs, when asked for: they go out
        in a chunk of their own, after the echoed prompt and before the first token."""
        # (max_tokens 0: the one delta has no token but ends the choice)
        first = delta.token_ids or (self.parsed.prompt_only and delta.finish_reason is not None)
        if not self._scores_prompt or self._prompt_sent[index] or not first:
            return self._delta_chunks(index, delta)
        self._prompt_sent[index] = True
        prompt = self._prompt_logprobs(index, delta.prompt_logprobs)
        opening = openai.completion_chunk(self.head, index, "", None, prompt)
        return [opening, *self._delta_chunks(index, delta)]

    def _delta_chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        logprobs = self._logprobs(index, delta.logprobs)
        token_ids = self.parsed.return_token_ids and bool(delta.token_ids)
        if self.is_chat:
            splitter = self._splitters[index]
            reasoning, text, _ = splitter.push(delta)
            chunks = []
            if reasoning or text or logprobs or token_ids:
                message = {"reasoning_content": reasoning} if reasoning else {}
                if text or not reasoning:
                    message["content"] = text
                chunks.append(openai.chat_chunk(self.head, index, message, None, logprobs))
            calls = splitter.take_call_deltas()
            if calls:
                chunks.append(openai.chat_chunk(self.head, index, {"tool_calls": calls}))
            if delta.finish_reason is not None:
                reason = _finish_with_calls(delta.finish_reason, splitter.called > 0)
                chunks.append(openai.chat_chunk(self.head, index, {}, reason))
        elif delta.text or logprobs is not None or token_ids or delta.finish_reason is not None:
            chunks = [
                openai.completion_chunk(self.head, index, delta.text, delta.finish_reason, logprobs)
            ]
        else:
            chunks = []
        if token_ids and chunks:
            chunks[0]["choices"][0]["token_ids"] = delta.token_ids
        return chunks

    def _usage(self) -> dict[str, Any]:
        """A prompt counts once however many choices (`n`) share it."""
        firsts = [c for i, c in enumerate(self.choices) if i % self.parsed.n == 0]
        return openai.usage(
            sum(len(c.prompt_ids) for c in firsts),
            sum(c.completion_tokens for c in self.choices),
            sum(c.req.cached_tokens for c in firsts if c.req is not None),
        )

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.parsed.include_usage:
            return None
        return openai.usage_chunk(self.head, self.parsed.kind, self._usage())

    def full_body(self, results: list[list[Delta]]) -> dict[str, Any]:
        choices = []
        for index, deltas in enumerate(results):
            text = "".join(d.text for d in deltas)
            token_ids = [t for d in deltas for t in d.token_ids]
            finish = deltas[-1].finish_reason if deltas else "abort"
            logprobs = self._logprobs(index, [lp for d in deltas for lp in d.logprobs])
            if self.is_chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.parsed.harmony:
                    reasoning, text, calls = split_harmony(text)
                    message.update(content=text, reasoning_content=reasoning)
                    if calls:
                        message.update(content=text or None, tool_calls=openai_calls(calls))
                        finish = _finish_with_calls(finish, True)
                if self.parsed.thinking_opened is not None:
                    reasoning, text = split_reasoning(text, self.parsed.thinking_opened)
                    message.update(content=text, reasoning_content=reasoning)
                if self.parsed.tool_syntax is not None:
                    content, calls = parse_tool_calls(
                        text, self.parsed.tool_syntax, self.parsed.tools or ()
                    )
                    if calls:
                        message.update(content=content, tool_calls=openai_calls(calls))
                        finish = _finish_with_calls(finish, True)
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                )
            else:
                echo = self._echo_text(index)
                if logprobs is not None and echo:
                    logprobs["text_offset"] = [o + len(echo) for o in logprobs["text_offset"]]
                if logprobs is not None and self._scores_prompt:
                    scored = [lp for d in deltas for lp in d.prompt_logprobs]
                    prompt = self._prompt_logprobs(index, scored)
                    logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
                choices.append(
                    {
                        "index": index,
                        "text": echo + text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                )
            if self.parsed.return_token_ids:
                choices[-1]["token_ids"] = token_ids
        return openai.full_body(self.head, self.parsed.kind, choices, self._usage())


class ReplySplitter:
    """A chat reply's deltas as the reasoning (with a reasoning parser), the content, and the
    tool calls (where they are parsed), each once whole: a call's syntax never goes out as
    content, nor the <think> block. A `harmony` reply (gpt-oss) is split by its channels."""

    def __init__(self, parsed: GenerationRequest) -> None:
        syntax, opened = parsed.tool_syntax, parsed.thinking_opened
        self._tools = None if syntax is None else ToolTextStream(syntax, parsed.tools or ())
        self._thinking = None if opened is None else ReasoningStream(opened)
        self._harmony = HarmonyStream() if parsed.harmony else None
        # The tokens of the deltas inside <think>, its tags included: exact where each delta
        # is one token (a stream), else a delta across the block's end counts whole.
        self.reasoning_tokens = 0
        self._undecided_tokens = 0  # before the reply shows whether it thinks
        self.called = 0  # tool calls handed out so far, whole or as they are written
        self._whole_calls: list[dict[str, Any]] = []  # harmony's, as chat deltas

    def push(self, delta: Delta) -> tuple[str, str, list[ParsedCall]]:
        """The delta's reasoning and content, and the tool calls it closed (before the
        reply ends where its syntax allows); `take_call_deltas` has the same calls as a
        chat stream sends them."""
        reasoning, text, calls = self._split(delta)
        if self._tools is not None:
            self.called = self._tools.indices
        elif calls:
            numbered = enumerate(openai_calls(calls), self.called)
            self._whole_calls += [{"index": i, **call} for i, call in numbered]
            self.called += len(calls)
        return reasoning, text, calls

    def take_call_deltas(self) -> list[dict[str, Any]]:
        """The `tool_calls` entries of a chat chunk since the last call: calls as they are
        written (their openings, then their arguments' text) where the syntax allows, else
        whole."""
        if self._tools is not None:
            return self._tools.take_deltas()
        deltas, self._whole_calls = self._whole_calls, []
        return deltas

    def _split(self, delta: Delta) -> tuple[str, str, list[ParsedCall]]:
        reasoning, text, calls = "", delta.text, []
        final = delta.finish_reason is not None
        if self._harmony is not None:
            return self._push_harmony(delta, self._harmony, final)
        if self._thinking is not None:
            reasoning, text = self._push_thinking(delta, self._thinking)
            if final:
                more_reasoning, more_text = self._thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if self._tools is not None:
            text, calls = self._tools.push(text)
            if final:
                rest, more = self._tools.finish()
                text, calls = text + rest, calls + more
        return reasoning, text, calls

    def _push_harmony(
        self, delta: Delta, harmony: HarmonyStream, final: bool
    ) -> tuple[str, str, list[ParsedCall]]:
        """A delta's tokens count as reasoning where they began or ended in `analysis`."""
        was_reasoning = harmony.reasoning
        reasoning, text = harmony.push(delta.text)
        if was_reasoning or harmony.reasoning:
            self.reasoning_tokens += len(delta.token_ids)
        if not final:
            return reasoning, text, []
        last = harmony.finish()
        return reasoning + last.reasoning, text + last.content, harmony.calls

    def _push_thinking(self, delta: Delta, thinking: ReasoningStream) -> tuple[str, str]:
        """Push the delta's text, counting its tokens as reasoning where they are inside
        the block (with those before it that began its opening tag)."""
        was_thinking, was_undecided = thinking.thinking, thinking.undecided
        split = thinking.push(delta.text)
        tokens = len(delta.token_ids)
        if thinking.undecided:
            self._undecided_tokens += tokens
            return split
        if was_thinking or thinking.thinking or (was_undecided and thinking.thought):
            self.reasoning_tokens += tokens + (self._undecided_tokens if was_undecided else 0)
        self._undecided_tokens = 0
        return split


def _finish_with_calls(reason: str, called: bool) -> str:
    """OpenAI's finish reason for a reply that ended by itself in tool calls."""
    return "tool_calls" if called and reason == "stop" else reason
