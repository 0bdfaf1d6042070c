"""SamplingParams and TokenLogprob: what a request asks of the sampler and what it gets back.

They sit low in the house because the engine's sampler, the scheduler and the API layers
all read them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np


class SamplingError(ValueError):
    """A sampling parameter outside its range; the message names the field."""


class Bound(NamedTuple):
    """An allowed range; None leaves that side open. The server's request schema states the
    same ranges (aserve/server/protocol.py reads this table), so the API description and
    the checks here cannot disagree."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def admits(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    def describe(self) -> str:
        low = f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt)}"
        if self.le is None:
            return f"{low[1:]} or more"
        return f"in {low}, {_number(self.le)}]"


def _number(value: float | None) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(ge=1),
    "temperature": Bound(ge=0, le=100),
    "top_p": Bound(gt=0, le=1),
    "top_k": Bound(ge=-1, le=MAX_TOKEN_ID),
    "min_p": Bound(ge=0, le=1),
    "presence_penalty": Bound(ge=-2, le=2),
    "frequency_penalty": Bound(ge=-2, le=2),
    "repetition_penalty": Bound(gt=0, le=10),
    "top_logprobs": Bound(ge=0, le=20),
    "seed": Bound(ge=0, le=MAX_SEED),
    "min_tokens": Bound(ge=0),
}
LOGIT_BIAS = Bound(ge=-100, le=100)
"""The range of one `logit_bias` value (OpenAI's)."""

GRAMMAR_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
"""SamplingParams' output constraints, of which a request takes at most one."""

# The fields a server-wide default may fill when a request leaves them unset (the model's
# generation_config.json, --default-sampling); aserve/generation_defaults.py resolves them.
DEFAULTABLE_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Field names and meanings follow OpenAI's API.

    temperature 0 means greedy. top_k <= 0 means no top-k cut. A request with a seed gets
    the same tokens whatever other requests share its batch; one without may be drawn by
    faster batch-wide kernels (see aserve/engine/sampler.py).

    `prompt_logprobs` (vLLM's field; OpenAI completions' `echo` with `logprobs`): the
    log-probability of every prompt token from `prompt_logprobs_from` on (by default every
    token after the first; SGLang's `logprob_start_len`) under the model, with that many
    alternatives. The positions that score them are computed, not taken from the prefix
    cache, whose tokens have no logits; the prompt before them may come from the cache.

    `logit_bias` (OpenAI's): token id -> a number in [-100, 100] added to that token's
    logit before sampling (a dict or (id, bias) pairs; kept as pairs sorted by id).
    `min_tokens` (vLLM's): until this many tokens are out, the tokens that would end the
    request (its stop_token_ids, and the model's end-of-sequence tokens unless ignore_eos)
    cannot be sampled and stop strings do not end it. Log-probabilities are the model's own,
    before penalties and biases, as vLLM reports them.

    At most one of `json_schema` (a JSON Schema, as a dict or its JSON text), `json_object`
    (any JSON object), `regex`, `choice` (one of these strings), `grammar` (EBNF, as
    xgrammar reads it) and `structural_tag` (xgrammar's, as JSON text: how forced tool calls
    are written) constrains the output: tokens that cannot continue a match are never
    sampled (aserve/constrained/).
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
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 1
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.json_schema, dict):  # as text, the compile cache's key (in its own
            # key order: properties come out in the order the schema lists them)
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingError("choice must be a non-empty list of non-empty strings")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise SamplingError(f"{given[0]} and {given[1]} cannot be combined: choose one")
        # prompt_logprobs is no request field of its own (echo with logprobs sets it)
        for name, bound in (*BOUNDS.items(), ("prompt_logprobs", BOUNDS["top_logprobs"])):
            value = getattr(self, name)
            if value is not None and not bound.admits(value):
                raise SamplingError(f"{name} must be {bound.describe()}, got {value}")
        if self.prompt_logprobs_from < 1:
            raise SamplingError(
                f"prompt_logprobs_from must be at least 1, got {self.prompt_logprobs_from}"
            )
        if self.min_tokens and given:  # the grammar decides where the output ends
            raise SamplingError(f"min_tokens and {given[0]} cannot be combined: choose one")
        if self.min_tokens > self.max_tokens:
            raise SamplingError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def banned_tokens(self, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
        """What `min_tokens` rules out while it holds: every token that would end the
        request."""
        ending = set(self.stop_token_ids)
        if not self.ignore_eos:
            ending |= eos_token_ids
        return tuple(sorted(ending))

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, or None: one of GRAMMAR_FIELDS and the
        schema, pattern or grammar (choices as a JSON list)."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is True:
                return name, ""
            if isinstance(value, tuple):
                return name, json.dumps(list(value))
            if value:
                return name, str(value)
        return None

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
    def bias_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as token ids (int64) and biases (float32), made once: the sampler
        packs the rows' biases every step."""
        ids = np.array([t for t, _ in self.logit_bias], dtype=np.int64)
        return ids, np.array([b for _, b in self.logit_bias], dtype=np.float32)

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
            self.logprobs or self.top_logprobs > 0,
            self.top_logprobs,
        )


def _bias_pairs(bias: Mapping[int, float] | Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs sorted by id, each checked."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    checked: dict[int, float] = {}
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise SamplingError(f"logit_bias keys must be token ids, got {token!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SamplingError(f"logit_bias values must be numbers, got {value!r} for {token}")
        if not math.isfinite(value) or not LOGIT_BIAS.admits(value):
            raise SamplingError(
                f"logit_bias values must be {LOGIT_BIAS.describe()}, got {value} for {token}"
            )
        checked[token] = float(value)
    return tuple(sorted(checked.items()))


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
    "logprobs",
    "top_logprobs",
)


class TokenLogprob(NamedTuple):
    """The chosen token's log-probability and the top alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
