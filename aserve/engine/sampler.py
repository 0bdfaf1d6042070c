"""Turn one batch of logits into next tokens: penalties, greedy or seeded sampling, logprobs.

Sampling never syncs with the host: every per-row choice (greedy or not, top-k, top-p, min-p,
penalties) is a tensor built once per batch, and the only Python branches test flags that
`SamplingBatch.build` computed from the parameters, never tensor values. (On CPU, where there
is no device to wait for, top-p reads whether a prefix of the sorted row suffices.)

Every draw is an exponential race, an exact sample of the filtered distribution: an integer
hash of (request seed, step, token id) gives each candidate token a uniform number u, and the
token with the largest p / -log(u) wins. It needs no generator state and gives a request the
same tokens whatever else shares its batch; requests that name no seed get a random one when
they arrive. On CPU the race is a few torch passes over [B, V] int64 tensors; on CUDA one
Triton kernel (engine/race_triton.py) hashes and races in a single pass, over the logits
themselves when no top-k / top-p / min-p asks for the probabilities.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from aserve.constrained.masks import StepMasks, apply_token_masks
from aserve.sampling_params import SAMPLER_COLUMNS, SamplingParams, TokenLogprob

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_TOKEN_SALT = 0x85EBCA6B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 avalanche mixer, in place on a fresh int64 tensor holding [0, 2**32).

    Values stay non-negative, so every >> is logical. A product can pass 2**63 and wrap;
    wrapping keeps the low 32 bits exact on CPU and CUDA alike, and the mask keeps only those.
    In place because at [B, V] each temporary costs B * V * 8 bytes.
    """
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def _seed_keys(seeds: list[int]) -> torch.Tensor:
    """One 32-bit key per seed (its low 64 bits take part); a row's key at a step is
    `_mix32(seed_key ^ step)`."""
    lo = torch.tensor([s & _MASK32 for s in seeds], dtype=torch.int64)
    hi = torch.tensor([(s >> 32) & _MASK32 for s in seeds], dtype=torch.int64)
    return _mix32(_mix32(hi ^ _SEED_SALT) ^ lo)


def step_keys(seed_keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's key for its step: what the race hashes with each token id."""
    return _mix32(seed_keys ^ (steps & _MASK32))


@functools.cache
def _token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Each token id's own hash, the same at every step: kept, where recomputing it took 0.1
    ms of a CPU draw over 49,152 tokens."""
    return _mix32(torch.arange(vocab_size, device=device) ^ _TOKEN_SALT)


def seeded_exponential_noise(
    keys: torch.Tensor, vocab_size: int, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Exp(1) noise [B, V] from the row keys: u is an odd 24-bit integer over 2**24, exact in
    float32 and strictly inside (0, 1), so the noise is finite and positive. With `ids`
    [B, N], the same noise at those tokens of each row only."""
    tokens = _token_hashes(vocab_size, keys.device)
    tokens = tokens[None, :] if ids is None else tokens[ids]
    odd = (_mix32(keys[:, None] ^ tokens) >> 8) | 1
    return torch.log(odd.float() * 2.0**-24).neg_()


_ARGMAX_BLOCK = 1024


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(-1)` of a `[rows, vocab]` tensor, the same index (the first maximum; a
    NaN counts as the largest). On CPU argmax is not vectorised: 16 rows of 49,152 took
    0.69 ms against 0.04 for `amax`. So find the first block that holds the row's maximum
    with `amax`, then argmax only within that block."""
    rows, vocab = scores.shape
    if scores.device.type != "cpu" or vocab < 4 * _ARGMAX_BLOCK:
        return scores.argmax(dim=-1)
    scores = scores.contiguous()
    whole = vocab - vocab % _ARGMAX_BLOCK
    maxima = scores[:, :whole].view(rows, -1, _ARGMAX_BLOCK).amax(dim=-1)
    if whole < vocab:
        maxima = torch.cat((maxima, scores[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    start = maxima.argmax(dim=-1) * _ARGMAX_BLOCK
    # The last block may be short: its window repeats the final column, after the original.
    columns = (start[:, None] + torch.arange(_ARGMAX_BLOCK)).clamp_(max=vocab - 1)
    return start + scores.gather(1, columns).argmax(dim=-1)


def _flat_ids(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Row i's ids as indices into a flattened [B, V] table, on the device."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    return (row_of * vocab_size + torch.from_numpy(ids)).to(device, non_blocking=True)


def _count_into(counts: torch.Tensor, rows: list[list[int]]) -> None:
    """Add row i's ids to row i of the float32 counts [B, V], in place."""
    flat = _flat_ids(rows, counts.shape[1], counts.device)
    counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))


class TokenBias(NamedTuple):
    """Numbers added to a few (row, token) logits: requests' `logit_bias`, and -inf on the
    tokens that would end a request still short of its `min_tokens`. Sparse, because a dense
    [B, V] table would cost more to fill and copy than the whole draw."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        held: list[bool],
        eos_token_ids: frozenset[int],
        device: torch.device,
    ) -> TokenBias | None:
        """Each row's logit_bias (as arrays made once a request) and, where `held`, -inf on
        its ending tokens; None when no row has either."""
        if not any(held) and not any(p.logit_bias for p in params):
            return None
        ids: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for p, hold in zip(params, held, strict=True):
            row_ids, row_values = p.bias_columns
            if hold:
                banned = np.array(p.banned_tokens(eos_token_ids), dtype=np.int64)
                row_ids = np.concatenate((row_ids, banned))
                row_values = np.concatenate((row_values, np.full(len(banned), -np.inf, np.float32)))
            ids.append(row_ids)
            values.append(row_values)
        counts = [len(row) for row in ids]
        if not any(counts):
            return None
        rows = np.repeat(np.arange(len(params), dtype=np.int64), counts)
        packed = torch.from_numpy(np.stack((rows, np.concatenate(ids))))
        packed = packed.to(device, non_blocking=True)
        biases = torch.from_numpy(np.concatenate(values)).to(device, non_blocking=True)
        return cls(packed[0], packed[1], biases)

    def added_to(self, scores: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `scores` with the biases added (equal entries add up)."""
        return scores.float().index_put((self.rows, self.ids), self.values, accumulate=True)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors, plus host flags that keep cheap paths cheap.

    Greedy rows carry temperature 1 so that no row divides by zero; top_k 0 means no cut.
    `seen` exists only when some row has a repetition penalty, `output_counts` only when one
    has a frequency or presence penalty, `bias` only when some row has a logit bias or a
    `min_tokens` still to reach (`any_min_tokens`: it changes by step).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    seed_keys: torch.Tensor | None
    steps: torch.Tensor | None
    top_k: torch.Tensor
    greedy: torch.Tensor
    seen: torch.Tensor | None
    output_counts: torch.Tensor | None
    bias: TokenBias | None
    all_greedy: bool
    any_greedy: bool
    max_top_k: int
    any_top_p: bool
    top_p_within_top_k: bool
    sampled_within_top_k: bool
    any_min_p: bool
    any_penalties: bool
    any_min_tokens: bool
    want_logprobs: bool
    max_top_logprobs: int

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        steps: list[int],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SamplingBatch:
        """Pack the rows' parameters into tensors with two host-to-device copies (plus the
        token ids of rows with penalties, and the biases). The copies are asynchronous: a
        blocking copy would wait for the step in flight and undo overlap scheduling. Each
        parameter is one contiguous row, as the race kernel reads them. A greedy batch has
        no seed keys. `steps` are the rows' tokens so far, which `min_tokens` compares
        against; `eos_token_ids` are what it rules out besides stop_token_ids."""
        table = np.array([p.sampler_row for p in params], dtype=np.float64)
        table = table.reshape(-1, len(SAMPLER_COLUMNS))
        (temperature, top_p, min_p, rep, freq, pres, top_k, greedy, penalties,
         logprobs, top_logprobs) = table.T  # fmt: skip
        top_k = np.minimum(top_k, vocab_size)
        floats = torch.from_numpy(np.ascontiguousarray(table[:, :6].T, dtype=np.float32))
        floats = floats.to(device, non_blocking=True)
        needs_keys = not greedy.all()
        ints = [torch.from_numpy(top_k.astype(np.int64)), torch.from_numpy(greedy.astype(np.int64))]
        if needs_keys:
            ints += [_seed_keys(seeds), torch.tensor(steps, dtype=torch.int64)]
        packed = torch.stack(ints).to(device, non_blocking=True)
        any_penalties = bool(penalties.any())
        seen = output_counts = None
        if (rep != 1.0).any():
            seen = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
        if (freq != 0.0).any() or (pres != 0.0).any():
            output_counts = torch.zeros(len(params), vocab_size, device=device)
        short = [p.min_tokens > step for p, step in zip(params, steps, strict=True)]
        temperature_t, top_p_t, min_p_t, rep_t, freq_t, pres_t = floats.unbind(0)
        batch = cls(
            temperature=temperature_t,
            top_p=top_p_t,
            min_p=min_p_t,
            repetition_penalty=rep_t,
            frequency_penalty=freq_t,
            presence_penalty=pres_t,
            seed_keys=packed[2] if needs_keys else None,
            steps=packed[3] if needs_keys else None,
            top_k=packed[0],
            greedy=packed[1].bool(),
            seen=seen,
            output_counts=output_counts,
            bias=TokenBias.build(params, short, eos_token_ids, device),
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            max_top_k=int(top_k.max(initial=0)),
            any_top_p=bool((top_p < 1.0).any()),
            top_p_within_top_k=bool((top_k[top_p < 1.0] > 0).all()),
            sampled_within_top_k=bool((top_k[greedy == 0] > 0).all()),
            any_min_p=bool((min_p > 0.0).any()),
            any_penalties=any_penalties,
            any_min_tokens=any(short),
            want_logprobs=bool(logprobs.any()),
            max_top_logprobs=int(top_logprobs.max(initial=0)),
        )
        batch.count_tokens(params, prompt_ids, output_ids)
        return batch

    def count_tokens(
        self,
        params: list[SamplingParams],
        prompt_ids: Sequence[list[int]],
        output_ids: Sequence[list[int]],
    ) -> None:
        """Add each row's tokens to the count tables, in place: its prompt and outputs to
        `seen` where it has a repetition penalty, its outputs to `output_counts` where it has
        a frequency or presence penalty. `build` counts whole histories; a batch kept from
        step to step counts only the tokens sampled since (with empty prompts), where
        counting whole histories each step took 95 ms at 256 requests of 1,200 tokens and a
        151,936-token vocabulary (CPU tensors)."""
        rows = list(zip(params, prompt_ids, output_ids, strict=True))
        if self.seen is not None:
            repeated = [ids + out if p.repetition_penalty != 1.0 else [] for p, ids, out in rows]
            flat = _flat_ids(repeated, self.seen.shape[1], self.seen.device)
            # index_fill_ takes the value as a number: `seen[flat] = True` copied it to the
            # GPU as a tensor, a blocking copy that waited for the step in flight
            self.seen.view(-1).index_fill_(0, flat, True)
        if self.output_counts is not None:
            counted = [
                out if p.frequency_penalty or p.presence_penalty else [] for p, _, out in rows
            ]
            _count_into(self.output_counts, counted)

    def carry_counts(self, previous: SamplingBatch, rows: list[int | None]) -> None:
        """Row i of the count tables takes row `rows[i]` of `previous`'s (where not None),
        copied on the device: a request that stays in the batch keeps what was counted."""
        mine = [i for i, j in enumerate(rows) if j is not None]
        theirs = [j for j in rows if j is not None]
        device = self.temperature.device
        to = torch.tensor(mine).to(device, non_blocking=True)
        source = torch.tensor(theirs).to(device, non_blocking=True)
        for table, old in (
            (self.seen, previous.seen),
            (self.output_counts, previous.output_counts),
        ):
            if table is not None and old is not None:
                table.index_copy_(0, to, old.index_select(0, source))

    def at_steps(self, steps: list[int]) -> SamplingBatch:
        """The same rows at other steps: what a steady decode step needs, one small copy."""
        if self.seed_keys is None:
            return self
        on_device = torch.tensor(steps, dtype=torch.int64).to(
            self.seed_keys.device, non_blocking=True
        )
        return replace(self, steps=on_device)

    @property
    def keys(self) -> torch.Tensor:
        """Each row's hash key for its step (the torch race's input)."""
        assert self.seed_keys is not None and self.steps is not None, "a greedy batch has no keys"
        return step_keys(self.seed_keys, self.steps)


class SampleOutput(NamedTuple):
    """Next tokens [B] int64; logprobs of them [B] and the top-N alternatives [B, N], sorted
    descending, or None when no row asked (top-N also None when N is 0). The `prompt_` three
    are the same for every logits row of a step with prompt logprobs (`score_prompt`)."""

    next_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    prompt_logprobs: torch.Tensor | None = None
    prompt_top_ids: torch.Tensor | None = None
    prompt_top_logprobs: torch.Tensor | None = None
    pooled: torch.Tensor | None = None  # [B, hidden | labels] float32: a pooling model's

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SampleOutput:
        """Move every tensor, e.g. to pinned host memory before the scheduler reads it."""
        return SampleOutput(
            *(None if t is None else t.to(device, non_blocking=non_blocking) for t in self)
        )

    def to_token_logprobs(self, row: int, n: int) -> TokenLogprob:
        """Row `row` with its first `n` alternatives; reads values, so call it on host tensors."""
        if self.logprobs is None:
            raise ValueError("no row of this batch asked for logprobs")
        top: tuple[tuple[int, float], ...] = ()
        if self.top_ids is not None and self.top_logprobs is not None and n > 0:
            ids, values = self.top_ids[row, :n].tolist(), self.top_logprobs[row, :n].tolist()
            # a constrained row may allow fewer tokens than asked for: the rest are -inf
            top = tuple((i, v) for i, v in zip(ids, values, strict=True) if v != float("-inf"))
        return TokenLogprob(int(self.next_ids[row]), float(self.logprobs[row]), top)


class PromptScoring(NamedTuple):
    """A step's prompt logprobs: `targets[r]` is the token whose log-probability logits row r
    gives (0 for the rows that score no prompt token, read by nobody), with `top`
    alternatives a row."""

    targets: torch.Tensor
    top: int


def score_prompt(logits: torch.Tensor, scoring: PromptScoring) -> dict[str, torch.Tensor]:
    """The model's own log-probabilities (no temperature or penalties, as vLLM reports
    them) of the targets, and the top alternatives: SampleOutput's `prompt_` fields."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    scores = {"prompt_logprobs": logprobs.gather(1, scoring.targets[:, None]).squeeze(1)}
    if scoring.top > 0:
        top = logprobs.topk(scoring.top, dim=-1)
        scores.update(prompt_top_ids=top.indices, prompt_top_logprobs=top.values)
    return scores


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty as Hugging Face / vLLM (prompt and output tokens), then OpenAI's
    frequency and presence penalties (output tokens only); each only where some row asks for
    it (the others' terms leave a logit as it is). Returns a new tensor."""
    if batch.seen is not None:
        rep = batch.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(batch.seen, penalised, logits)
    counts = batch.output_counts
    if counts is None:
        return logits
    return (
        logits
        - batch.frequency_penalty[:, None] * counts
        - batch.presence_penalty[:, None] * (counts > 0)
    )


def filter_top_k_top_p_min_p(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero the probabilities that top-k, then top-p (on the top-k mass), then min-p drop.

    The result is not renormalised: the exponential race is invariant to scaling a row.
    """
    largest = None
    if batch.max_top_k > 0:
        largest = probs.topk(batch.max_top_k, dim=-1)
        index = (batch.top_k.clamp(min=1) - 1)[:, None]
        threshold = torch.where(batch.top_k[:, None] > 0, largest.values.gather(1, index), 0.0)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if batch.any_top_p and largest is not None and batch.top_p_within_top_k:
        probs = _top_p_within_top_k(probs, largest.values, largest.indices, batch)
    elif batch.any_top_p:
        cut = _top_p_among_largest(probs, batch.top_p) if probs.device.type == "cpu" else None
        if cut is None:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            limit = (batch.top_p * sorted_probs.sum(dim=-1))[:, None]
            keep_sorted = mass_before < limit
            keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
            cut = probs.masked_fill(~keep, 0.0)
        probs = cut
    if batch.any_min_p:
        floor = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _top_p_within_top_k(
    probs: torch.Tensor, values: torch.Tensor, order: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """Top-p where every row that asks for it has a top-k (`top_p_within_top_k`): its kept
    probabilities are its k largest, which `topk` gave sorted, so the cut needs no sort of
    the vocabulary (on an H100 a sort of 256 x 151,936 was most of a sampling step). The
    same cut as sorting the row, probabilities tied with the k-th past the batch's largest k
    aside. Rows without top-p keep what top-k kept."""
    ranks = torch.arange(values.shape[1], device=values.device)[None, :]
    values = values.masked_fill(ranks >= batch.top_k[:, None], 0.0)
    mass = values.cumsum(dim=-1)
    limit = (batch.top_p * mass[:, -1])[:, None]
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, mass - values < limit)
    return probs.masked_fill(~(kept | (batch.top_p >= 1.0)[:, None]), 0.0)


def _race_among_top_k(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The draw where every sampled row has a top-k (`sampled_within_top_k`, the usual model
    card): only a row's k largest scores can win, so the softmax, the filters and the race
    run on those k, as probabilities relative to the row's largest (the race does not mind
    the scale), with the same noise at their token ids. The same winner as racing the whole
    row, up to rounding; a softmax, a sort and the race's passes over the vocabulary fewer.
    Greedy rows are drawn with the largest k too (the caller keeps their argmax)."""
    assert batch.seed_keys is not None and batch.steps is not None
    largest, ids = scores.topk(batch.max_top_k, dim=-1)
    ranks = torch.arange(batch.max_top_k, device=scores.device)[None, :]
    k = torch.where(batch.top_k > 0, batch.top_k, batch.max_top_k)[:, None]
    logits = (largest.float() / batch.temperature[:, None]).masked_fill(ranks >= k, -torch.inf)
    probs = torch.exp(logits - logits[:, :1])
    if batch.any_top_p:
        mass = probs.cumsum(dim=-1)
        cut = mass - probs >= batch.top_p[:, None] * mass[:, -1:]
        probs = probs.masked_fill(cut & (batch.top_p < 1.0)[:, None], 0.0)
    if batch.any_min_p:
        probs = probs.masked_fill(probs < batch.min_p[:, None], 0.0)
    noise = seeded_exponential_noise(batch.keys, scores.shape[-1], ids)
    return ids.gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)


TOP_P_PREFIXES = (256, 4096)
"""How many of a row's largest probabilities top-p looks among on CPU before it sorts the
row: a sort of 49,152 took 3.0 ms on a 2-core Zen 5, 3 ms of every sampled token of the
embedded model, where the 256 largest took 0.07 (`topk`)."""


def _top_p_among_largest(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Top-p from each row's `TOP_P_PREFIXES` largest probabilities, in descending order as
    the sort would give them, once those hold every row's mass (`top_p` times the row's sum,
    summed in vocabulary order: the sort's sum up to rounding); None where a row needs more
    (a flat distribution): the caller sorts. Rows with top_p 1 keep every token (a batch's
    other rows asked for top-p). CPU only: checking the mass reads it on the host."""
    vocab = probs.shape[-1]
    limit = (top_p * probs.sum(dim=-1))[:, None]
    whole = (top_p >= 1.0)[:, None]
    for count in TOP_P_PREFIXES:
        if count >= vocab:
            return None
        largest, order = probs.topk(count, dim=-1)
        mass = largest.cumsum(dim=-1)
        if not bool(((mass[:, -1:] >= limit) | whole).all()):
            continue
        kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, mass - largest < limit)
        return probs.masked_fill(~(kept | whole), 0.0)
    return None


Race = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], torch.Tensor
]


def race_kernel(device: torch.device) -> Race | None:
    """The one-pass race of engine/race_triton.py on CUDA, or None (CPU, or no Triton)."""
    if device.type != "cuda":
        return None
    try:
        from aserve.engine.race_triton import race
    except ImportError:
        return None
    return race


class Sampler:
    """One instance serves every batch; `race` (CUDA) runs the draw as one kernel."""

    def __init__(self, race: Race | None = None) -> None:
        self.race = race

    def sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        token_masks: StepMasks | None = None,
    ) -> SampleOutput:
        """Pick one token per row of `logits` [B, V] as `batch` says, without host syncs.
        `token_masks` (the constrained rows' bitmasks) first rule out what constrained rows'
        grammars forbid: in place, so logprobs see it too. Penalties and biases then apply
        to a copy: logprobs are the model's own."""
        if token_masks is not None:
            apply_token_masks(logits, token_masks)
        scores = apply_penalties(logits.float(), batch) if batch.any_penalties else logits
        if batch.bias is not None:
            scores = batch.bias.added_to(scores)
        if batch.all_greedy:
            next_ids = self._argmax(scores)
        else:
            next_ids = self._draw(scores, batch)
            if batch.any_greedy:
                next_ids = torch.where(batch.greedy, self._argmax(scores), next_ids)
        if not batch.want_logprobs:
            return SampleOutput(next_ids, None, None, None)
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        chosen = logprobs.gather(1, next_ids[:, None]).squeeze(1)
        if batch.max_top_logprobs == 0:
            return SampleOutput(next_ids, chosen, None, None)
        top = logprobs.topk(batch.max_top_logprobs, dim=-1)
        return SampleOutput(next_ids, chosen, top.indices, top.values)

    def _argmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Greedy rows' tokens: the race without noise where there is the kernel."""
        if self.race is not None:
            return self.race(scores, None, None, None)
        return row_argmax(scores)

    def _draw(self, scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Top-k, then top-p on what top-k kept, then min-p, then the race. Without those
        filters the kernel races the logits at each row's temperature (the same winner as
        the probabilities, up to rounding), which spares the softmax's passes."""
        assert batch.seed_keys is not None and batch.steps is not None
        if batch.sampled_within_top_k:
            return _race_among_top_k(scores, batch)
        filtered = batch.max_top_k > 0 or batch.any_top_p or batch.any_min_p
        if self.race is not None and not filtered:
            return self.race(scores, batch.seed_keys, batch.steps, batch.temperature)
        probs = torch.softmax(scores / batch.temperature[:, None], dim=-1)
        probs = filter_top_k_top_p_min_p(probs, batch)
        if self.race is not None:
            return self.race(probs, batch.seed_keys, batch.steps, None)
        noise = seeded_exponential_noise(batch.keys, probs.shape[-1])
        return row_argmax(probs / noise)
