"""SGLang's /generate replies: per prompt (and `n`) the text, the token ids and SGLang's
`meta_info` (finish reason with what stopped it, cached tokens, logprobs as [logprob, token
id, text] triples), built from the same choices' deltas as the OpenAI routes.

A streamed reply is SGLang's: each SSE event carries the item's output so far, not the part
that is new, with `index` saying which item of a batch it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aserve.sampling_params import TokenLogprob
from aserve.server.generation import Choice, Delta
from aserve.server.http import SSE_DONE, sse
from aserve.server.openai import APIError, NativeRequest
from aserve.tokenizer import Tokenizer

Entry = tuple[float | None, int, str | None]


@dataclass
class NativeItem:
    """One item's output so far."""

    rid: str
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.output_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.finish_reason = delta.finish_reason


class NativeShaper:
    """Builds the reply of one /generate request, whole or as SSE events (the interface of
    server/responses.ResponseShaper that the streaming code calls)."""

    def __init__(
        self,
        native: NativeRequest,
        tokenizer: Tokenizer | None,
        choices: list[Choice],
        rids: list[str],
        started: float,
    ) -> None:
        self.native = native
        self.tokenizer = tokenizer
        self.choices = choices
        self.items = [NativeItem(rid) for rid in rids]
        self.started = started
        self._texts: dict[int, str | None] = {}

    DONE = SSE_DONE

    def opening_events(self) -> bytes:
        return b""

    def closing_events(self) -> bytes:
        return b""

    def delta_events(self, index: int, delta: Delta) -> bytes:
        self.items[index].add(delta)
        body = self.item_body(index)
        if self.native.batched:
            body["index"] = index
        return sse(body)

    def full_body(self, results: list[list[Delta]]) -> Any:
        for item, deltas in zip(self.items, results):
            for delta in deltas:
                item.add(delta)
            if not deltas:
                item.finish_reason = "abort"
        bodies = [self.item_body(index) for index in range(len(self.items))]
        return bodies if self.native.batched else bodies[0]

    def item_body(self, index: int) -> dict[str, Any]:
        item, choice = self.items[index], self.choices[index]
        assert choice.req is not None
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": self._finish(item, choice),
            "prompt_tokens": len(choice.prompt_ids),
            "completion_tokens": choice.completion_tokens,
            "cached_tokens": choice.req.cached_tokens,
        }
        if item.finish_reason is not None:
            meta["e2e_latency"] = time.monotonic() - self.started
        if self.native.return_logprob:
            self._add_logprobs(meta, item, choice)
        return {"text": "".join(item.text), "output_ids": item.output_ids, "meta_info": meta}

    @staticmethod
    def _finish(item: NativeItem, choice: Choice) -> dict[str, Any] | None:
        """SGLang's finish reason: a stop names its stop token or string, a length the tokens
        it reached, an abort why."""
        reason = item.finish_reason
        if reason is None:
            return None
        if reason == "stop":
            return {"type": "stop", "matched": choice.matched}
        if reason == "length":
            return {"type": "length", "length": choice.completion_tokens}
        return {"type": reason, "message": "the request was aborted"}

    def _add_logprobs(self, meta: dict[str, Any], item: NativeItem, choice: Choice) -> None:
        """Output logprobs, and the prompt's from logprob_start_len (-1: the last token): a
        first prompt token has no logprob (nothing comes before it)."""
        first: list[Entry] = []
        start = self.native.logprob_start_len
        if start == 0:
            first = [(None, choice.prompt_ids[0], self._text(choice.prompt_ids[0]))]
        meta["input_token_logprobs"] = first + self._entries(item.prompt_logprobs)
        meta["output_token_logprobs"] = self._entries(item.logprobs)
        if choice.params.top_logprobs:
            meta["input_top_logprobs"] = [None] * len(first) + self._tops(item.prompt_logprobs)
            meta["output_top_logprobs"] = self._tops(item.logprobs)

    def _entries(self, logprobs: list[TokenLogprob]) -> list[Entry]:
        return [(lp.logprob, lp.token_id, self._text(lp.token_id)) for lp in logprobs]

    def _tops(self, logprobs: list[TokenLogprob]) -> list[list[Entry]]:
        return [[(value, i, self._text(i)) for i, value in lp.top] for lp in logprobs]

    def _text(self, token_id: int) -> str | None:
        """A token's text with return_text_in_logprobs, else None (SGLang's)."""
        if not self.native.return_text_in_logprobs or self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], False)
        return text


class RunningRids:
    """The /generate requests running under their rids, for SGLang's /abort_request."""

    def __init__(self) -> None:
        self.choices: dict[str, Choice] = {}

    @contextmanager
    def hold(self, rids: list[str], choices: list[Choice]) -> Iterator[None]:
        """These rids name these choices until the block ends; a rid already running is a
        400."""
        for rid in rids:
            if rid in self.choices:
                raise APIError(f"a request with rid '{rid}' is already running", param="rid")
        self.choices.update(zip(rids, choices))
        try:
            yield
        finally:
            for rid in rids:
                del self.choices[rid]

    def abort(self, rid: str | None) -> int:
        """End the request under `rid`, or every one where it is None; how many there were."""
        doomed = list(self.choices.values()) if rid is None else [self.choices.get(rid)]
        ended = [choice for choice in doomed if choice is not None]
        for choice in ended:
            choice.cancel()
        return len(ended)
