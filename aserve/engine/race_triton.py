"""The sampler's exponential race in one Triton kernel (CUDA; also runs under Triton's CPU
interpreter, which the tests use).

`Sampler` draws a token as the argmax of p / E over the vocabulary, with E ~ Exp(1) made
from a hash of (request seed, step, token id) (engine/sampler.py). In plain torch that is
several passes over [B, V] int64 tensors; here one pass reads the row once, hashes each
token's noise in registers and keeps the running maximum. Without top-k / top-p / min-p the
row needs no softmax either: argmax p / E = argmax (s / T - log E) for scores s and
temperature T, so the kernel reads the logits themselves.

Rows split the vocabulary over several programs (each finds its part's winner; the first
maximum of the parts wins, as in one pass) until the launch has `PROGRAMS_PER_SM` programs an
SM: the race is bound by its arithmetic (two hashes and two logarithms a token), which wants
many warps. On H200s, 128,256-token rows in a CUDA graph, us at 1 / 8 / 32 / 96 / 160 /
256 rows: 6.9 / 10.8 / 28.4 / 72.9 / 173.4 / 182.2 with blocks of 1,024 and splits up to 2
programs an SM (one program a row from a row an SM); 7.6 / 9.8 / 20.3 / 48.1 / 79.9 / 119.5
with these settings on the next machine (the winner's argmax and gather kernels included),
the same tokens; the single 8B stream 2.617 -> 2.616 ms/token in one command.

Greedy rows run the same kernel without the noise (their argmax). 128,256-token bf16 rows on
an H200, us at 1 / 8 / 64 / 256 rows: torch's argmax 26.4 / 26.6 / 27.1 / 45.7, this kernel
and its winner's 3.3 / 4.1 / 10.6 / 35.3; a single 8B FP8 stream 2.544 / 2.547 -> 2.518 /
2.519 ms/token (alternating in one command).

Replaced FlashInfer's sampling kernels, whose module took 80-100 s to compile on a fresh
machine; this one compiles in about a second.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 2048
PROGRAMS_PER_SM = 8


@triton.jit
def _mix32(x):
    """lowbias32 on uint32, the mixer of engine/sampler.py's `_mix32` (same bits)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _keep_first_max(value, offset, best_value, best_id):
    """The running (maximum, its index) after the block `value` of columns from `offset`:
    a later block wins only with a larger value, so ties keep the first."""
    block_best = tl.max(value, axis=0)
    better = block_best > best_value
    best_id = tl.where(better, offset + tl.argmax(value, axis=0), best_id)
    return tl.where(better, block_best, best_value), best_id


# The row count sets `splits` and the alignment of the sampling batch's packed columns
# (`temperature`, `seed_keys`, `steps` are slices of one tensor): specialized on them, the
# kernel compiled again for new batches inside a server's first requests (twice in the
# first offline run on a fresh H200; with layers/rope_store.py's one, 0.7 s of a 9.8 s run).
@triton.jit(
    do_not_specialize=["splits"],
    do_not_specialize_on_alignment=["temperature", "seed_keys", "steps"],
)
def _race_kernel(
    scores,
    row_stride,
    vocab,
    chunk,
    temperature,
    seed_keys,
    steps,
    best_values,
    best_ids,
    splits,
    NOISE: tl.constexpr,
    LOG_SPACE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    if NOISE:
        seed_key = tl.load(seed_keys + row).to(tl.uint32)
        step = tl.load(steps + row).to(tl.uint32)
        key = _mix32(seed_key ^ step)
    if LOG_SPACE:
        t = tl.load(temperature + row)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    best_value = -float("inf")
    best_id = start
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        inside = cols < end
        s = tl.load(scores + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        if NOISE:
            token = _mix32(cols.to(tl.uint32) ^ 0x85EBCA6B)
            odd = (_mix32(key ^ token) >> 8) | 1
            noise = -tl.log(odd.to(tl.float32) * (1.0 / 16777216.0))
            value = s / t - tl.log(noise) if LOG_SPACE else s / noise
        else:  # greedy: the first maximum, a NaN taken as the largest (torch's argmax)
            value = tl.where(s != s, float("inf"), s)
        value = tl.where(inside, value, -float("inf"))
        best_value, best_id = _keep_first_max(value, offset, best_value, best_id)
    tl.store(best_values + row * splits + split, best_value)
    tl.store(best_ids + row * splits + split, best_id)


@triton.jit(do_not_specialize=["splits"])
def _winner_kernel(values, ids, out, splits, BLOCK: tl.constexpr):
    """Each row's winner among its splits' (the first maximum; a NaN counts as the largest,
    as in torch's argmax), in one kernel where torch's argmax and gather took two (4 and 2
    us at one row on an H200)."""
    row = tl.program_id(0)
    best_value = -float("inf")
    best_split = 0
    for start in range(0, splits, BLOCK):
        at = start + tl.arange(0, BLOCK)
        value = tl.load(values + row * splits + at, mask=at < splits, other=-float("inf"))
        value = tl.where(value != value, float("inf"), value)
        best_value, best_split = _keep_first_max(value, start, best_value, best_split)
    tl.store(out + row, tl.load(ids + row * splits + best_split))


def race(
    scores: torch.Tensor,
    seed_keys: torch.Tensor | None,
    steps: torch.Tensor | None,
    temperature: torch.Tensor | None,
) -> torch.Tensor:
    """Next token ids [B] int64. `scores` [B, V]: logits with `temperature` [B], or
    probabilities (filtered, not necessarily normalised) with `temperature` None. Without
    `seed_keys` there is no noise: each row's first maximum (greedy rows)."""
    rows, vocab = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    blocks = triton.cdiv(vocab, BLOCK)
    sms = _sm_count(scores.device)
    programs = PROGRAMS_PER_SM * sms
    splits = 1 if rows >= programs else max(1, min(blocks, triton.cdiv(programs, rows)))
    chunk = triton.cdiv(blocks, splits) * BLOCK
    splits = triton.cdiv(vocab, chunk)
    values = torch.empty(rows, splits, dtype=torch.float32, device=scores.device)
    ids = torch.empty(rows, splits, dtype=torch.int64, device=scores.device)
    noise = seed_keys is not None
    log_space = noise and temperature is not None
    _race_kernel[(rows, splits)](
        scores,
        scores.stride(0),
        vocab,
        chunk,
        temperature if log_space else values,  # unread without LOG_SPACE
        seed_keys if noise else ids,  # unread without NOISE
        steps if noise else ids,
        values,
        ids,
        splits,
        NOISE=noise,
        LOG_SPACE=log_space,
        BLOCK=BLOCK,
    )
    if splits == 1:
        return ids.view(rows)
    winners = torch.empty(rows, dtype=torch.int64, device=scores.device)
    _winner_kernel[(rows,)](values, ids, winners, splits, BLOCK=128)
    return winners


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
