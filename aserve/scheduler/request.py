"""A request as the scheduler sees it: sampling parameters, token ids and KV bookkeeping."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from aserve.sampling_params import SamplingParams, TokenLogprob


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ReqOutput(NamedTuple):
    """What the scheduler pushes to a request's channel after each step that produced tokens.

    `finish_reason` is set on the last message only; `error` explains an "error" finish.
    `prompt_logprobs` (prompt tokens 1 to n-1) come with the first token, when asked for.
    A pooling model's request ends with its one output, which holds what was `pooled`
    (float32, on the host): an embedding (unit length), or a classifier's logits.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    pooled: Any = None  # a torch.Tensor [hidden] or [labels]


# A LoRA adapter's prefix-cache keys are token ids plus its id times 2^40: past every
# vocabulary and the ids that stand for images' pixels (models/vision.py, under 2^31).
ADAPTER_KEY_SHIFT = 40
AUTO_MIN_STREAMS = 64
"""`--stream-interval auto` gathers tokens only in decode batches of at least this many
requests: below it a stream's events cost the loop little, and a step's own launch is what a
waiting GPU waits for (a single stream's steps of ~1 ms on an H200)."""

AUTO_RETRY_STEPS = 256
"""Decode steps in a row without the GPU waiting (`gpu_wait_share` under 5%) after which
`auto` tries one token an event again, for a server whose batch stays large: if the loop is
still the bound, a few steps bring the share back past a half."""


class StreamPace:
    """How many tokens a streamed event gathers (`--stream-interval`), shared by the streams.

    A number fixes it. `auto` (None) sends each token while the loop keeps up with the GPU and
    two an event from when the GPU waits on the loop under many streams (the scheduler's
    `gpu_wait_share` past a half, in a batch of `AUTO_MIN_STREAMS` or more) until that batch
    has halved, or until the GPU has not waited for `AUTO_RETRY_STEPS` steps. At 256 streams
    on a host core that ran Python at half speed the loop, not the GPU, set the pace:
    20.6-22.7k tok/s against offline's 26.9k; two tokens an event halve what it writes and
    detokenizes a step (23.1-25.2k, bench/NOTES.md, issue 21)."""

    def __init__(self, interval: int | None = 1) -> None:
        self.auto = interval is None
        self.gather = interval or 1
        self._switched_at = 0
        self._calm_steps = 0

    def on_decode_step(self, batch_size: int, gpu_wait_share: float) -> None:
        if not self.auto:
            return
        if self.gather == 1:
            if batch_size >= AUTO_MIN_STREAMS and gpu_wait_share > 0.5:
                self.gather, self._switched_at, self._calm_steps = 2, batch_size, 0
            return
        self._calm_steps = self._calm_steps + 1 if gpu_wait_share < 0.05 else 0
        if 2 * batch_size < self._switched_at or self._calm_steps >= AUTO_RETRY_STEPS:
            self.gather = 1


EVERY_TOKEN = StreamPace(1)


class OutputChannel:
    """A request's outputs on their way from the scheduler to its reader.

    `get` hands over everything that arrived since the last call as one output (token ids and
    logprobs joined, the finish reason of the last), so a reader that falls behind catches up
    in one wake-up instead of one per token: under load that is what keeps the event loop, and
    with it the GPU, from waiting on hundreds of stream handlers. It is lighter than an
    `asyncio.Queue`, which the loop would wake once per put.

    A listener (`listen`) takes each output as it is put, in the putter's call, instead of
    the reader (a streamed response writes its events there; server/streaming.py); outputs
    put after `unlisten` wait for `get` as before. It must not raise. With a pace that
    gathers n tokens (`--stream-interval`), it gets the first output at once, then outputs
    joined as `get` joins them each time the count of tokens put plus the listener's `phase`
    is a multiple of n, and the last one with what is held. Streams of different phases send
    in different steps: when all 256 of a burst switched to two tokens at once, every other
    step wrote all of them and the next none, and the GPU, one step ahead of the loop at
    most, waited through each heavy step.
    """

    def __init__(self) -> None:
        self._pending: list[ReqOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[ReqOutput], None] | None = None
        self._pace = EVERY_TOKEN
        self._held: list[ReqOutput] = []
        self._held_tokens = 0
        self._heard = False  # an output has gone to the listener or a reader
        self._tokens_put = 0
        self._phase = 0

    @property
    def listener(self) -> Callable[[ReqOutput], None] | None:
        return self._listener

    def listen(
        self, listener: Callable[[ReqOutput], None], pace: StreamPace = EVERY_TOKEN, phase: int = 0
    ) -> None:
        """Hand outputs to `listener` from now on (call `get_nowait` first: outputs already
        pending keep waiting for a reader), gathered as `pace` says at each put, in the
        steps that `phase` (any integer, e.g. the request's id) picks."""
        self._listener, self._pace, self._phase = listener, pace, phase

    def unlisten(self) -> None:
        """Stop calling the listener; outputs it was gathering wait for `get`, first."""
        self._listener = None
        if self._held:
            self._pending[:0] = self._held
            self._held, self._held_tokens = [], 0
            self._wake()

    def put_nowait(self, out: ReqOutput) -> None:
        self._tokens_put += len(out.token_ids)
        listener = self._listener
        if listener is not None and not self._pending:
            gather = self._pace.gather
            if (gather > 1 or self._held) and self._heard:
                self._held.append(out)
                self._held_tokens += len(out.token_ids)
                due = (self._tokens_put + self._phase) % gather == 0
                if not due and self._held_tokens < gather and out.finish_reason is None:
                    return
                out = _joined(self._held)
                self._held, self._held_tokens = [], 0
            self._heard = True
            listener(out)
            return
        self._pending.append(out)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> ReqOutput:
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self.get_nowait()
        assert out is not None
        return out

    def get_nowait(self) -> ReqOutput | None:
        """Everything pending as one output, as `get` gives it; None if nothing is."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        self._heard = True
        return _joined(pending)


def _joined(outputs: list[ReqOutput]) -> ReqOutput:
    """Consecutive outputs as one: token ids and logprobs joined, the last one's finish."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return ReqOutput(
        tuple(t for out in outputs for t in out.token_ids),
        tuple(lp for out in outputs for lp in out.logprobs),
        last.finish_reason,
        last.error,
        tuple(lp for out in outputs for lp in out.prompt_logprobs),
        last.pooled,
    )


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One generation request. The scheduler owns every field below `channel`.

    KV bookkeeping: positions [0, cached_len) of this request have KV in the pool. `pages`
    cover positions [0, len(pages) * page_size) and are mapped in page-table row `slot`; the
    first `prefix_len` positions came from the prefix cache (locked through `cache_handle`),
    the other pages are the request's own. With a sliding window, `window_pages[i]` is the
    windowed layers' page beside `pages[i]`, 0 once its own such page has been dropped (its
    positions are behind every later query's window). `decoding` turns true once the whole
    sequence has been prefilled: from then on each step feeds the last sampled token.

    With `params.prompt_logprobs`, `prompt_logprobs[p]` is prompt token p + 1's, filled as
    the steps computing position p come back, from position `score_from` on (the positions
    before it may come from the prefix cache, and need no logits);
    `scored_len` prompt positions have had their logits launched (a retracted request keeps
    both: results in flight still land, and it does not score its prompt again).

    A constrained request carries its compiled `grammar` (aserve/constrained/); the scheduler
    gives it a `matcher` at submission and feeds it every sampled token, or with
    `grammar_after` (a reasoning model's `</think>` id) every token after that one: until
    it is sampled the request thinks freely.

    A prompt with images holds, at each image's positions (`images`), an id past the
    vocabulary that stands for its pixels (models/vision.py); their features replace those
    positions' embeddings as they are prefilled.

    A request of a LoRA adapter (`adapter_key` > 0) computes KV of its own: its prefix-cache
    keys (`cache_key`) are its ids moved into the adapter's range, so it shares cached
    prefixes only with requests of the same adapter (an adapter loaded again at run time has
    a new key).
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    channel: OutputChannel = field(default_factory=OutputChannel)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    window_pages: list[int] = field(default_factory=list)
    window_kept_from: int = 0  # every own window page before this page index is dropped
    cached_len: int = 0
    prefix_len: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied before the first token
    decoding: bool = False
    cache_handle: object | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    aborted: bool = False
    max_total_len: int = 0
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    scored_len: int = 0
    grammar: Any = None
    matcher: Any = None
    grammar_after: int | None = None
    images: list[Any] = field(default_factory=list)  # models/vision.ImageSpan, by position
    mrope: Any = None  # models/mrope.MropePositions: Qwen-VL's positions where images move them
    ngram: Any = None  # speculative/ngram.NgramIndex of its tokens, made when it first drafts
    draft_misses: int = 0  # verify steps in a row that took none of its drafts
    draft_pause: int = 0  # decode steps it goes without drafts (Planner.accept)
    adapter: int = 0  # the slot of its LoRA adapter (aserve/lora/; 0: the base model)
    adapter_key: int = 0  # that adapter's key, never reused (0: the base model)
    # prefilled whole in one step, none of it from the prefix cache (an embedding model
    # whose attention runs both ways or whose pooling reads every position: Engine)
    whole_prompt: bool = False

    @property
    def score_from(self) -> int:
        """The first prompt position whose logits prompt logprobs need."""
        return self.params.prompt_logprobs_from - 1

    @property
    def scores_prompt(self) -> bool:
        """Prompt positions are still to be scored (prompt logprobs)."""
        last = len(self.prompt_ids) - 1  # the last position's logits sample, scoring none
        return (
            self.params.prompt_logprobs is not None and max(self.scored_len, self.score_from) < last
        )

    @property
    def reusable_len(self) -> int:
        """How much of the sequence the prefix cache may supply: all but the last token
        (whose logits sample), and none of the positions still to be scored; nothing of a
        prompt that runs whole."""
        if self.whole_prompt:
            return 0
        if self.scores_prompt:
            return min(self.total_len - 1, self.score_from)
        return self.total_len - 1

    @property
    def unscored_ahead(self) -> int:
        """Positions its next prefill chunk can take before the first one it must score."""
        if self.scores_prompt:
            return max(0, self.score_from - self.cached_len)
        return self.extend_len

    def scored_rows(self, n: int) -> int:
        """How many of the next chunk's `n` positions, counted back from its end, need their
        logits for prompt logprobs."""
        if not self.scores_prompt:
            return 0
        return max(0, n - self.unscored_ahead)

    @property
    def vocabulary_prompt_ids(self) -> list[int]:
        """The prompt as the vocabulary writes it, each image feature's position its image
        token: what transformers' repetition penalty counts there."""
        if not self.images:
            return self.prompt_ids
        ids = list(self.prompt_ids)
        for span in self.images:
            for position in span.feature_positions():
                ids[position] = span.token
        return ids

    def cache_key(self, ids: list[int]) -> list[int]:
        """`ids` (a prefix of `all_ids`) as the prefix cache keys them."""
        if not self.adapter_key:
            return ids
        shift = self.adapter_key << ADAPTER_KEY_SHIFT
        return [token + shift for token in ids]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.total_len - self.cached_len
