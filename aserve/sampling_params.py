"""SamplingParams and TokenLogprob: what a request asks of the sampler and what it gets back.

They sit low in the house because the engine's sampler, the scheduler and the API layers
all read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple


class SamplingError(ValueError):
    """A sampling parameter outside its range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Field names and meanings follow OpenAI's API.

    temperature 0 means greedy. top_k <= 0 means no top-k cut. A request with a seed gets
    the same tokens whatever other requests share its batch; one without may be drawn by
    faster batch-wide kernels (see aserve/engine/sampler.py).
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

    @cached_property
    def sampler_row(self) -> tuple[float, ...]:
        """This request's row of the sampler's per-batch table (columns in SAMPLER_COLUMNS),
        computed once: the sampler packs it every step."""
        return (
            1.0 if self.greedy else self.temperature,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
            max(self.top_k, 0),
            self.greedy,
            self.has_penalties,
            self.seed is not None,
            self.logprobs or self.top_logprobs > 0,
            self.top_logprobs,
        )


SAMPLER_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "top_k",
    "greedy",
    "penalties",
    "seeded",
    "logprobs",
    "top_logprobs",
)


class TokenLogprob(NamedTuple):
    """The chosen token's log-probability and the top alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
