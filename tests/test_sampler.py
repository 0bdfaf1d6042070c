from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from aserve.engine.sampler import (
    TOP_P_PREFIXES,
    SampleOutput,
    Sampler,
    SamplingBatch,
    _top_p_among_largest,
    apply_penalties,
    filter_top_k_top_p_min_p,
    row_argmax,
    seeded_exponential_noise,
)
from aserve.sampling_params import SamplingError, SamplingParams, TokenLogprob

CPU = torch.device("cpu")
CHI2_3DOF_P999 = 16.27


def make_batch(
    params: list[SamplingParams],
    vocab_size: int,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    device: torch.device = CPU,
    eos_token_ids: frozenset[int] = frozenset(),
) -> SamplingBatch:
    """A batch whose seeds default to the params' seeds and whose histories default to empty."""
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else [p.seed or 0 for p in params],
        steps if steps is not None else [0] * n,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        vocab_size,
        device,
        eos_token_ids,
    )


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SampleOutput:
    batch = make_batch(params, logits.shape[-1], seeds, steps, prompts, outputs, logits.device)
    return Sampler().sample(logits, batch)


def run_request(
    logits: torch.Tensor, params: SamplingParams, seed: int, steps: int, row: int, width: int
) -> list[int]:
    """One request's tokens over `steps` steps, sampled at `row` of a batch of `width` rows
    whose other rows use different parameters, seeds and logits."""
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=3, presence_penalty=1.0),
        SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1),
    ]
    tokens = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        batch_logits = torch.randn(width, logits.shape[-1], generator=generator)
        batch_logits[row] = logits
        params_list = [others[i % len(others)] for i in range(width)]
        params_list[row] = params
        seeds = [1000 + 17 * i + step for i in range(width)]
        seeds[row] = seed
        outputs = [[i, step] for i in range(width)]
        out = sample(batch_logits, params_list, seeds=seeds, steps=[step] * width, outputs=outputs)
        tokens.append(int(out.next_ids[row]))
    return tokens


def frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Counts per token over `draws` distinct (seed, step) pairs of the same distribution."""
    seeds = [i // 8 for i in range(draws)]
    steps = [i % 8 for i in range(draws)]
    out = sample(logits.expand(draws, -1), [params] * draws, seeds=seeds, steps=steps)
    return torch.bincount(out.next_ids, minlength=logits.shape[-1])


def test_greedy_is_argmax_for_any_dtype() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sample(logits.to(dtype), [SamplingParams(temperature=0.0)] * 6)
        assert out.next_ids.dtype == torch.int64
        assert torch.equal(out.next_ids, logits.to(dtype).float().argmax(dim=-1))
        assert out.logprobs is None and out.top_ids is None


def test_top_k_one_is_greedy_at_temperature_one() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_k=1)] * 8
    for step in range(5):
        out = sample(logits, params, seeds=list(range(8)), steps=[step] * 8)
        assert torch.equal(out.next_ids, logits.argmax(dim=-1))


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = torch.zeros(40)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    alone = run_request(logits, params, seed=123, steps=30, row=0, width=1)
    assert len(set(alone)) > 10
    assert run_request(logits, params, seed=123, steps=30, row=2, width=5) == alone
    assert run_request(logits, params, seed=123, steps=30, row=0, width=3) == alone
    assert run_request(logits, params, seed=124, steps=30, row=0, width=1) != alone


def test_row_order_does_not_change_tokens() -> None:
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, seed=9)]
    forward = sample(logits, params, steps=[3, 3]).next_ids
    backward = sample(logits.flip(0), params[::-1], steps=[3, 3]).next_ids
    assert torch.equal(forward, backward.flip(0))


def test_different_seeds_give_different_streams() -> None:
    logits = torch.zeros(2, 100)
    params = [SamplingParams(temperature=1.0)] * 2
    same = 0
    for step in range(200):
        ids = sample(logits, params, seeds=[1, 2], steps=[step, step]).next_ids
        same += int(ids[0] == ids[1])
    assert same < 10


def test_large_seeds_use_their_high_bits() -> None:
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(temperature=1.0)] * 2
    ids = sample(logits, params, seeds=[7, 7 + 2**40]).next_ids
    assert ids[0] != ids[1]


FREQUENCY_CASES = [
    (SamplingParams(), [0.5, 0.25, 0.15, 0.10]),
    (SamplingParams(temperature=0.5), [25 / 34.5, 6.25 / 34.5, 2.25 / 34.5, 1 / 34.5]),
    (SamplingParams(top_k=3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0]),
    (SamplingParams(top_p=0.7), [2 / 3, 1 / 3, 0.0, 0.0]),
    (SamplingParams(min_p=0.35), [2 / 3, 1 / 3, 0.0, 0.0]),
    (SamplingParams(top_k=2, top_p=0.5), [1.0, 0.0, 0.0, 0.0]),
    (SamplingParams(top_k=3, top_p=0.9, min_p=0.4), [2 / 3, 1 / 3, 0.0, 0.0]),
]


def assert_frequencies(counts: list[int], expected: list[float]) -> None:
    """Impossible tokens never drawn, certain ones always, the rest within a chi-square
    bound (p = 0.001)."""
    total = sum(counts)
    chi2 = 0.0
    for count, p in zip(counts, expected, strict=True):
        if p in (0.0, 1.0):
            assert count == total * p
        else:
            chi2 += (count - total * p) ** 2 / (total * p)
    assert chi2 < CHI2_3DOF_P999


@pytest.mark.parametrize(("params", "expected"), FREQUENCY_CASES)
def test_frequencies_match_probabilities(params: SamplingParams, expected: list[float]) -> None:
    counts = frequencies(torch.tensor([0.5, 0.25, 0.15, 0.10]).log(), params, draws=8000)
    assert_frequencies(counts.tolist(), expected)


def test_top_p_applies_to_the_top_k_mass() -> None:
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    counts = frequencies(logits, SamplingParams(top_k=2, top_p=0.5), draws=500)
    assert counts.tolist() == [500, 0, 0, 0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=5),
        SamplingParams(temperature=1.5, top_p=0.6),
        SamplingParams(temperature=1.5, min_p=0.3),
        SamplingParams(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05),
    ],
)
@pytest.mark.parametrize("vocab", [64, 2048])
def test_filters_never_pick_outside_the_allowed_set(params: SamplingParams, vocab: int) -> None:
    """At 2,048 tokens top-p takes the CPU's path among the largest probabilities."""
    rows = 400
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 2
    probs = torch.softmax(logits / params.temperature, dim=-1)
    allowed = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        allowed &= probs >= probs.topk(params.top_k, dim=-1).values[:, -1:]
    kept = probs * allowed
    if params.top_p < 1.0:
        ranked, order = kept.sort(dim=-1, descending=True)
        before = ranked.cumsum(dim=-1) - ranked
        inside = before < params.top_p * ranked.sum(dim=-1, keepdim=True)
        allowed &= torch.zeros_like(inside).scatter(1, order, inside)
    if params.min_p > 0.0:
        allowed &= probs >= params.min_p * probs.amax(dim=-1, keepdim=True)
    out = sample(logits, [params] * rows, seeds=list(range(rows)))
    picked = allowed.gather(1, out.next_ids[:, None]).squeeze(1)
    assert picked.all()
    assert (out.next_ids != logits.argmax(dim=-1)).sum() > rows // 10


def test_repetition_penalty_counts_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    batch = make_batch(params, 5, prompts=[[0, 1], [0, 1]], outputs=[[2], [2]])
    penalised = apply_penalties(logits, batch)
    assert penalised[0].tolist() == [1.0, -2.0, 0.25, -0.5, 1.0]
    assert torch.equal(penalised[1], logits[1])


def test_frequency_and_presence_count_output_only() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]])
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    batch = make_batch(params, 5, prompts=[[0, 0, 4]], outputs=[[1, 1, 2]])
    assert apply_penalties(logits, batch)[0].tolist() == [2.0, -2.25, -0.25, -0.5, 1.0]


def test_negative_presence_penalty_raises_seen_tokens() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0]])
    batch = make_batch([SamplingParams(presence_penalty=-1.5)], 3, outputs=[[2, 2]])
    assert apply_penalties(logits, batch)[0].tolist() == [1.0, 0.0, 1.5]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5)]
    assert sample(logits, params, outputs=[[0]]).next_ids.tolist() == [1]
    assert sample(logits, params, prompts=[[0]]).next_ids.tolist() == [0]


def test_logit_bias_moves_greedy_and_sampled_rows_but_not_logprobs() -> None:
    """+100 makes a token all but certain, -100 all but impossible, in greedy and sampled
    rows alike (at any temperature and under top-p); other rows and the logprobs stay the
    model's."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(8))
    best = logits.argmax(dim=-1)
    second = logits.topk(2, dim=-1).indices[:, 1]
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 100}, logprobs=True),
        SamplingParams(temperature=1.0, logit_bias={7: 100}),
        SamplingParams(temperature=0.7, top_p=0.9, logit_bias={7: 100, 8: -3}),
        SamplingParams(temperature=0.0, logit_bias={int(best[3]): -100}),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    for step in range(10):
        out = sample(logits, params, seeds=[1, 2, 3, 4, 5], steps=[step] * 5)
        assert out.next_ids[:3].tolist() == [7, 7, 7]
        assert out.next_ids[3] == second[3] and out.next_ids[4] == best[4]
        assert out.logprobs is not None
        raw = torch.log_softmax(logits, dim=-1)
        torch.testing.assert_close(out.logprobs[0], raw[0, 7])
    assert torch.equal(logits, torch.randn(5, 50, generator=torch.Generator().manual_seed(8)))


def test_min_tokens_rules_out_every_ending_token_until_reached() -> None:
    """Before min_tokens the end-of-sequence tokens and the request's stop tokens cannot be
    drawn (the end-of-sequence ones still can under ignore_eos, where they end nothing);
    from then on they can."""
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.5, 8.0, 7.0]])  # eos 2, stop token 4
    eos = frozenset({2, 3})
    held = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(4,), max_tokens=9)
    loose = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, max_tokens=9)
    picks = [
        sample_with(logits.expand(2, -1), [held, loose], steps=[step, step], eos=eos)
        for step in range(5)
    ]
    assert picks == [[5, 2], [5, 2], [5, 2], [2, 2], [2, 2]]
    assert held.banned_tokens(eos) == (2, 3, 4) and loose.banned_tokens(eos) == ()


def sample_with(
    logits: torch.Tensor, params: list[SamplingParams], steps: list[int], eos: frozenset[int]
) -> list[int]:
    batch = make_batch(params, logits.shape[-1], steps=steps, eos_token_ids=eos)
    return Sampler().sample(logits, batch).next_ids.tolist()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {5: 101}}, "logit_bias values must be in \\[-100, 100\\], got 101"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {5: "1"}}, "logit_bias values must be numbers"),
        ({"min_tokens": -1}, "min_tokens must be 0 or more"),
        ({"min_tokens": 17}, "min_tokens must be at most max_tokens \\(16\\)"),
        ({"min_tokens": 2, "regex": "a+"}, "min_tokens and regex cannot be combined"),
    ],
)
def test_bias_and_min_tokens_are_checked(fields: dict, message: str) -> None:
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**fields)


def test_logit_bias_is_kept_as_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={9: -1, 3: 2.5})
    assert params.logit_bias == ((3, 2.5), (9, -1.0))
    assert SamplingParams(logit_bias=[(9, -1), (3, 2.5)]) == params


def test_logprobs_are_raw_log_softmax_with_sorted_top() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0.5, logprobs=True, top_logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, params, seeds=[1, 2, 3], outputs=[[0, 1], [], [2]])
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    chosen = expected.gather(1, out.next_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen)
    assert out.top_ids.shape == (3, 5)
    assert torch.equal(out.top_ids, expected.argsort(dim=-1, descending=True)[:, :5])
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    row = out.to(CPU).to_token_logprobs(1, 2)
    assert isinstance(row, TokenLogprob)
    assert row.token_id == int(logits[1].argmax())
    assert row.logprob == pytest.approx(float(expected[1].max()))
    assert [i for i, _ in row.top] == out.top_ids[1, :2].tolist()
    assert [lp for _, lp in row.top] == pytest.approx(out.top_logprobs[1, :2].tolist())


def test_logprobs_without_top_alternatives() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(5))
    out = sample(logits, [SamplingParams(logprobs=True), SamplingParams()], seeds=[1, 2])
    assert out.logprobs is not None and out.top_ids is None
    assert out.to_token_logprobs(0, 3).top == ()


def test_mixed_batch_of_greedy_and_sampled_rows() -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(6)) * 0.3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.2, seed=12),
    ]
    sampled_moves = 0
    for step in range(20):
        out = sample(logits, params, seeds=[0, 11, 0, 12], steps=[step] * 4).next_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
        for row in (1, 3):
            alone = sample(logits[row : row + 1], [params[row]], steps=[step]).next_ids
            assert out[row] == alone[0]
            sampled_moves += int(out[row] != logits[row].argmax())
    assert sampled_moves > 20


def test_noise_is_exponential() -> None:
    keys = torch.arange(64, dtype=torch.int64) * 2654435761 % 2**32
    noise = seeded_exponential_noise(keys, 4096)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)
    assert noise.var().item() == pytest.approx(1.0, abs=0.03)
    u = torch.exp(-noise)
    assert (u < 0.5).float().mean().item() == pytest.approx(0.5, abs=0.005)
    assert not torch.equal(noise[0], noise[1])


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_noise_follows_the_pinned_hash() -> None:
    """The seeded stream is part of the contract: changing the hash changes users' outputs.
    Products past 2**63 wrap inside the mixer; the grid is wide enough to hit them."""
    keys = [0, 1, 0xDEADBEEF, 0xFFFFFFFF]
    noise = seeded_exponential_noise(torch.tensor(keys), 300)
    expected = [
        [
            -math.log(((lowbias32(key ^ lowbias32(t ^ 0x85EBCA6B)) >> 8) | 1) * 2.0**-24)
            for t in range(300)
        ]
        for key in keys
    ]
    torch.testing.assert_close(noise, torch.tensor(expected), rtol=1e-6, atol=0.0)


EOS = frozenset({2, 3})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_sync() -> None:
    rows, vocab = 64, 32000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 3
    params = [
        SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
            top_k=[-1, 50, -1, 200][i % 3],
            top_p=[1.0, 0.9][i % 2],
            min_p=[0.0, 0.05][i % 5 == 0],
            frequency_penalty=0.3 * (i % 2),
            repetition_penalty=1.2,
            top_logprobs=3 * (i % 2),
            logprobs=bool(i % 2),
            logit_bias={i % 7: 2.0, 100 + i: 5.0} if i % 3 else {},
            min_tokens=4 * (i % 2),
            stop_token_ids=(int(logits[i].argmax()),),
        )
        for i in range(rows)
    ]
    seeds = [i * 7919 for i in range(rows)]
    steps = [i % 6 for i in range(rows)]
    prompts = [[i, i + 1] for i in range(rows)]
    outputs = [[i, 2 * i, 2 * i] for i in range(rows)]
    batch = make_batch(params, vocab, seeds, steps, prompts, outputs, eos_token_ids=EOS)
    cpu = Sampler().sample(logits, batch)
    cuda = torch.device("cuda")
    batch = make_batch(params, vocab, seeds, steps, prompts, outputs, cuda, EOS)
    logits_gpu = logits.to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = Sampler().sample(logits_gpu, batch)
        kernel = race_sampler().sample(logits_gpu, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    held = [i for i in range(rows) if params[i].min_tokens > steps[i]]
    assert held and all(int(cpu.next_ids[i]) not in params[i].banned_tokens(EOS) for i in held)
    assert torch.equal(gpu.next_ids.cpu(), cpu.next_ids)
    assert torch.equal(kernel.next_ids.cpu(), cpu.next_ids)
    assert gpu.logprobs is not None and cpu.logprobs is not None
    torch.testing.assert_close(gpu.logprobs.cpu(), cpu.logprobs)
    keys = torch.tensor([0, 1, 0xDEADBEEF, 0xFFFFFFFF])
    noise = seeded_exponential_noise(keys.to(cuda), vocab).cpu()
    torch.testing.assert_close(noise, seeded_exponential_noise(keys, vocab), rtol=1e-6, atol=0.0)


def race_sampler() -> Sampler:
    """The sampler with the Triton race kernel, as the engine builds it on CUDA."""
    from aserve.engine.sampler import race_kernel

    race = race_kernel(torch.device("cuda"))
    if race is None:
        pytest.skip("Triton is not installed")
    return Sampler(race)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("params", "expected"), FREQUENCY_CASES)
def test_race_kernel_frequencies_match_probabilities(
    params: SamplingParams, expected: list[float]
) -> None:
    """The kernel draws from the filtered distribution (rows with their own seeds), without
    a host sync; the next step of the same rows draws fresh numbers."""
    sampler = race_sampler()
    cuda = torch.device("cuda")
    draws = 8000
    logits = torch.tensor([0.5, 0.25, 0.15, 0.10]).log().to(cuda).expand(draws, -1)
    batch = make_batch([params] * draws, 4, seeds=list(range(draws)), device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        picks = sampler.sample(logits, batch).next_ids
        later = sampler.sample(logits, batch.at_steps([1] * draws)).next_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if sum(p > 0.0 for p in expected) > 1:
        assert not torch.equal(picks, later)
    assert_frequencies(torch.bincount(picks.cpu(), minlength=4).tolist(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_race_kernel_picks_the_torch_race_winner(top_p: float) -> None:
    """The kernel and the torch race agree token for token, over probabilities (top-p) and
    over the logits themselves (temperature only), whatever the neighbours; greedy rows stay
    argmax."""
    sampler = race_sampler()
    cuda = torch.device("cuda")
    logits = (torch.randn(48, 32000, generator=torch.Generator().manual_seed(5)) * 3).to(cuda)
    params = [
        SamplingParams(temperature=0.0 if i % 8 == 7 else 0.6 + i / 40, top_p=top_p, seed=42 + i)
        for i in range(48)
    ]
    batch = make_batch(params, 32000, steps=[i % 5 for i in range(48)], device=cuda)
    expected = Sampler().sample(logits, batch).next_ids
    assert torch.equal(sampler.sample(logits, batch).next_ids, expected)
    alone = make_batch(params[3:4], 32000, steps=[3], device=cuda)
    assert sampler.sample(logits[3:4], alone).next_ids[0] == expected[3]
    assert torch.equal(expected[7::8], logits.argmax(dim=-1)[7::8])
    greedy = make_batch([SamplingParams(temperature=0.0)] * 48, 32000, device=cuda)
    assert torch.equal(sampler.sample(logits, greedy).next_ids, logits.argmax(dim=-1))


def test_per_row_parameters_are_contiguous_arrays() -> None:
    """The race kernel reads per-row parameters as plain arrays (no strides)."""
    params = [
        SamplingParams(temperature=0.5 + i, top_p=0.9, min_p=0.1, top_k=2 * i) for i in range(3)
    ]
    batch = make_batch(params, 10)
    for name in ("temperature", "top_p", "min_p", "top_k", "seed_keys", "steps", "greedy"):
        assert getattr(batch, name).is_contiguous(), name
    assert batch.temperature.tolist() == [0.5, 1.5, 2.5]
    assert batch.top_k.tolist() == [0, 2, 4]


@pytest.mark.parametrize("vocab", [100, 4096, 5000, 49152, 49155])
def test_row_argmax_is_argmax(vocab: int) -> None:
    """The blocked CPU argmax returns torch's index: ties go to the first maximum (across
    blocks and within one), a NaN wins, and a short last block is handled."""
    generator = torch.Generator().manual_seed(vocab)
    spread = torch.randn(8, vocab, generator=generator)
    ties = torch.randint(0, 3, (8, vocab), generator=generator).float()
    ties[2, -1] = 5.0  # the maximum in the last column only
    ties[3, 7] = ties[3, -2] = 5.0
    ties[4, vocab // 2] = ties[4, -1] = float("nan")
    for scores in (spread, ties, ties[:, :-3]):
        assert torch.equal(row_argmax(scores), scores.argmax(dim=-1))


def sorted_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by a full sort, the row's mass summed in vocabulary order as the CPU path sums it."""
    ranked, order = probs.sort(dim=-1, descending=True)
    before = ranked.cumsum(dim=-1) - ranked
    inside = before < (top_p * probs.sum(dim=-1))[:, None]
    return probs * torch.zeros_like(inside).scatter(1, order, inside)


@pytest.mark.parametrize("temperature", [0.2, 0.7, 1.0])
def test_top_p_among_the_largest_is_the_sorted_cut(temperature: float) -> None:
    """The CPU path's cut, from the `TOP_P_PREFIXES` largest, is the full sort's; rows with
    top_p 1 in the batch keep every token."""
    rows, vocab = 48, 8192
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 3
    probs = torch.softmax(logits / temperature, dim=-1)
    top_p = torch.tensor([[0.5, 0.9, 0.95, 1.0][i % 4] for i in range(rows)])
    cut = _top_p_among_largest(probs, top_p)
    assert cut is not None
    sampled = top_p < 1.0
    assert torch.equal(cut[sampled], sorted_top_p(probs, top_p)[sampled])
    assert torch.equal(cut[~sampled], probs[~sampled])
    assert (cut[sampled] == 0).sum(dim=-1).min() > 0  # the cut drops something in each row


def test_top_p_sorts_a_row_whose_mass_is_spread() -> None:
    """A near-uniform row holds 0.99 of its mass only past the largest prefix: the CPU path
    gives up and the filter sorts, with the same cut."""
    vocab = 2 * TOP_P_PREFIXES[-1]
    probs = torch.softmax(
        torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 0.01, -1
    )
    top_p = torch.tensor([0.99, 0.99])
    assert _top_p_among_largest(probs, top_p) is None
    batch = make_batch([SamplingParams(temperature=1.0, top_p=0.99)] * 2, vocab)
    kept = filter_top_k_top_p_min_p(probs, batch)
    dropped = (kept == 0).sum(dim=-1)
    assert (dropped > 0).all() and (dropped < vocab // 10).all()


def test_top_p_within_top_k_is_the_sorted_cut() -> None:
    """Where every row with top-p has a top-k, the cut comes from `topk`'s sorted values
    (no sort of the vocabulary, on CUDA too): the same probabilities as masking to the top-k
    and sorting the row; rows without top-p keep their top-k."""
    rows, vocab = 32, 4096
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(9)) * 2
    params = [
        SamplingParams(
            temperature=0.8, top_k=[20, 5, 200, 64][i % 4], top_p=[0.8, 0.95, 1.0][i % 3]
        )
        for i in range(rows)
    ]
    batch = make_batch(params, vocab)
    assert batch.top_p_within_top_k
    probs = torch.softmax(logits / 0.8, dim=-1)
    cut = filter_top_k_top_p_min_p(probs, batch)
    k = torch.tensor([p.top_k for p in params])[:, None]
    kth = probs.topk(200, dim=-1).values.gather(1, k - 1)
    masked = probs.masked_fill(probs < kth, 0.0)
    top_p = torch.tensor([p.top_p for p in params])
    expected = torch.where(top_p[:, None] < 1.0, sorted_top_p(masked, top_p), masked)
    assert torch.equal(cut, expected)
    assert ((cut > 0).sum(dim=-1) <= k[:, 0]).all()
    mixed = make_batch([SamplingParams(top_p=0.9), SamplingParams(top_k=5, top_p=0.9)], vocab)
    assert not mixed.top_p_within_top_k  # a row with top-p and no top-k: the sort


def cards(rows: int) -> list[SamplingParams]:
    """Rows that each carry a top-k, as model cards do, with top-p and min-p mixed in."""
    return [
        SamplingParams(
            temperature=[0.3, 0.7, 1.0, 1.5][i % 4],
            top_k=[20, 50, 5, 200][i % 4],
            top_p=[0.8, 0.95, 1.0][i % 3],
            min_p=[0.0, 0.05][i % 2],
            seed=i,
        )
        for i in range(rows)
    ]


def test_race_among_the_top_k_picks_the_whole_rows_winner() -> None:
    """Where every sampled row has a top-k, the race runs on each row's k largest scores:
    the tokens of racing the whole row (here on every one of 512 rows)."""
    rows, vocab = 512, 32000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 3
    batch = make_batch(
        cards(rows), vocab, seeds=list(range(rows)), steps=[i % 7 for i in range(rows)]
    )
    assert batch.sampled_within_top_k
    among_top_k = Sampler().sample(logits, batch).next_ids
    whole_rows = Sampler().sample(logits, replace(batch, sampled_within_top_k=False)).next_ids
    assert torch.equal(among_top_k, whole_rows)
    mixed = make_batch([SamplingParams(temperature=0.7), SamplingParams(top_k=5)], vocab)
    assert not mixed.sampled_within_top_k  # a sampled row without a top-k races its whole row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_race_among_the_top_k_on_cuda_matches_cpu() -> None:
    rows, vocab = 256, 151936
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 3
    steps = [i % 5 for i in range(rows)]
    cpu = Sampler().sample(logits, make_batch(cards(rows), vocab, steps=steps)).next_ids
    cuda = torch.device("cuda")
    batch = make_batch(cards(rows), vocab, steps=steps, device=cuda)
    logits_gpu = logits.to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = race_sampler().sample(logits_gpu, batch).next_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalty_counts_follow_new_tokens_on_cuda_without_host_sync() -> None:
    """The in-place update of a kept batch's counts (scheduler/batch.py) runs behind the step
    in flight: a blocking copy there would wait for it and undo overlap scheduling."""
    cuda = torch.device("cuda")
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.5)]
    batch = make_batch(params, 1000, prompts=[[1, 2], [3]], outputs=[[4], [5]], device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch.count_tokens(params, [[], []], [[6, 7], [8, 8]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch.seen is not None and batch.output_counts is not None
    assert batch.seen[0, [1, 2, 4, 6, 7]].all() and not batch.seen[1].any()
    assert batch.output_counts[1, [5, 8]].tolist() == [1.0, 2.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalty_counts_carried_on_cuda_without_host_sync() -> None:
    """A request staying in a changed batch brings its rows of the counts, copied on the
    device behind the step in flight (scheduler/batch.py)."""
    cuda = torch.device("cuda")
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.5)]
    before = make_batch(params, 1000, prompts=[[1, 2], [3]], outputs=[[4], [5, 5]], device=cuda)
    after = make_batch(params[::-1] + params[:1], 1000, prompts=[[], [], [9]], device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        after.carry_counts(before, [1, 0, None])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert after.seen is not None and after.output_counts is not None
    assert after.seen[1, [1, 2, 4]].all() and after.seen[1].sum() == 3
    assert after.seen[2, 9] and after.seen[2].sum() == 1 and not after.seen[0].any()
    assert after.output_counts[0, 5].item() == 2.0 and after.output_counts[0].sum() == 2.0
