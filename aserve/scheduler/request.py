"""A request as the scheduler sees it: sampling parameters, token ids and KV bookkeeping."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from aserve.sampling_params import SamplingParams, TokenLogprob


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


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
