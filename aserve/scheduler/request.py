"""A request as the scheduler sees it: sampling parameters, token ids and KV bookkeeping."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class SamplingError(ValueError):
    """A sampling parameter outside its range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Field names and meanings follow OpenAI's API.

    temperature 0 means greedy. top_k <= 0 means no top-k cut. A request without a seed
    gets a random one at submission, so every request samples from its own seeded stream
    and its output never depends on which other requests share its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k must be -1 (off) or >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (self.seed is None or self.seed >= 0, "seed must be non-negative"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class TokenLogprob(NamedTuple):
    """The chosen token's log-probability and the top alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class ReqOutput(NamedTuple):
    """What the scheduler pushes to a request's channel after each step that produced tokens.

    `finish_reason` is set on the last message only; `error` explains an "error" finish.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason | None = None
    error: str | None = None


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
    the other pages are the request's own. `decoding` turns true once the whole sequence has
    been prefilled: from then on each step feeds the last sampled token.
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    channel: asyncio.Queue[ReqOutput] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    prefix_len: int = 0
    decoding: bool = False
    cache_handle: object | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    aborted: bool = False
    max_total_len: int = 0

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
