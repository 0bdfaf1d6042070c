"""One choice of a chat or completion request: submit it, stream its text, end it cleanly.

A `Choice` turns the scheduler's token ids into text through the incremental detokenizer and
the stop-string matcher, so streamed and non-streamed responses are built from the same
deltas. Whatever way the request ends — finished, stop string, client gone, server fault —
`run` leaves no request behind in the scheduler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aserve.sampling_params import SamplingParams, TokenLogprob
from aserve.scheduler.request import FinishReason, Req, ReqOutput
from aserve.scheduler.scheduler import Scheduler
from aserve.textstream import TextStream
from aserve.tokenizer import Tokenizer


@dataclass
class Delta:
    """New text of one choice, the tokens behind it, and the finish reason on the last one."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Choice:
    scheduler: Scheduler
    tokenizer: Tokenizer | None
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    skip_special_tokens: bool = True
    include_stop: bool = False  # the text keeps the stop string or token that ended it
    prompt_only: bool = False  # max_tokens 0: the one token drawn is dropped
    grammar_after: int | None = None  # Req.grammar_after: a reasoning model's </think>
    shown_special_ids: frozenset[int] = frozenset()  # special tokens whose text is kept
    images: list[Any] = field(default_factory=list)  # pixels, one image token of the prompt each
    adapter: int = 0  # the LoRA adapter's key (0: the model itself)
    req: Req | None = None
    grammar: Any = None
    completion_tokens: int = 0
    first_token_seen: bool = False
    last_token_at: float = 0.0
    started: bool = False
    done: bool = False
    matched: str | int | None = None  # what stopped it: a stop string, or the token's id
    _stream: TextStream | None = field(default=None, repr=False)

    def prepare(self) -> str | None:
        """Create the request; returns why it can never run (the caller answers 400). With
        images, `prompt_ids` become the model's prompt, each image token its positions (as
        the vocabulary writes them: they count in the usage, as vLLM counts them)."""
        try:
            self.req = self.scheduler.make_request(
                self.prompt_ids, self.params, self.images, self.adapter
            )
        except ValueError as error:  # images and image tokens that do not pair up
            return str(error)
        if self.images:
            self.prompt_ids = self.req.vocabulary_prompt_ids
        self.req.grammar = self.grammar
        self.req.grammar_after = self.grammar_after
        return self.scheduler.check_request(self.req)

    def start(self) -> None:
        """Hand the request to the scheduler (once); `run` reads what it produces. A caller
        that starts a choice and may never run it must `cancel` it."""
        assert self.req is not None
        if self.started:
            return
        if self.tokenizer is not None:
            self._stream = TextStream(
                self.tokenizer,
                self.prompt_ids,
                self.stop,
                self.skip_special_tokens,
                self.params.min_tokens,
                self.include_stop,
                self.shown_special_ids,
            )
        self.scheduler.submit(self.req)
        self.started = True

    def cancel(self) -> None:
        """End the request unless it has ended; one not yet handed to the scheduler ends as
        soon as it is."""
        if self.req is not None and self.req.finish_reason is None:
            self.scheduler.abort(self.req)

    async def run(self) -> AsyncIterator[Delta]:
        """The choice's deltas as the scheduler hands out its tokens, to its end."""
        assert self.req is not None
        req = self.req
        self.start()
        try:
            while not self.done:
                delta = self.take(await req.channel.get())
                if delta is not None:
                    yield delta
        finally:
            if req.finish_reason is None:
                self.scheduler.abort(req)

    def take(self, out: ReqOutput) -> Delta | None:
        """The delta of one output of the scheduler, None where it brings nothing to send;
        the last one sets `done`. Plain code, so that a stream can run it where the
        scheduler hands the output over (server/streaming.py). Raises on an error finish."""
        assert self.req is not None
        if self.prompt_only and out.finish_reason is not FinishReason.ERROR:
            out = out._replace(token_ids=(), logprobs=(), finish_reason=FinishReason.LENGTH)
        self.completion_tokens += len(out.token_ids)
        ids = list(out.token_ids)
        prompt = list(out.prompt_logprobs)
        stopped_by_token = out.finish_reason is FinishReason.STOP and not self.include_stop
        text_ids = ids[:-1] if stopped_by_token else ids
        text, stopped = self._text(text_ids)
        if out.finish_reason is FinishReason.ERROR:
            self.done = True
            raise RuntimeError(out.error or "generation failed")
        if stopped:
            self.done = True
            self.matched = self._stream.matched if self._stream is not None else None
            self.scheduler.abort(self.req)
            return Delta(text, ids, list(out.logprobs), "stop", prompt)
        if out.finish_reason is not None:
            self.done = True
            reason = out.finish_reason.value
            if reason == "stop" and ids:
                self.matched = ids[-1]
            if self._stream is not None:
                text += self._stream.finish()
                if self._stream.stopped:
                    reason, self.matched = "stop", self._stream.matched
            return Delta(text, ids, list(out.logprobs), reason, prompt)
        if text or ids:
            return Delta(text, ids, list(out.logprobs), None, prompt)
        return None

    def _text(self, token_ids: list[int]) -> tuple[str, bool]:
        if self._stream is None:
            return "", False
        delta = self._stream.push(token_ids)
        return delta.text, delta.stopped
