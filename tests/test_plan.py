"""The batch planner on its own: admission, chunking, caps, retraction and page accounting."""

from __future__ import annotations

import random

import pytest
import torch

from aserve.config import SchedulerConfig
from aserve.engine.sampler import SamplingBatch
from aserve.engine.step import forward_batch
from aserve.forward import ForwardMode
from aserve.kvcache.pages import PageAllocator, PageTable
from aserve.kvcache.radix import RadixCache
from aserve.scheduler.batch import SamplingBatches, step_spec
from aserve.scheduler.plan import Planner, ScheduledBatch
from aserve.scheduler.request import FinishReason, Req, ReqStatus, SamplingParams
from aserve.server.app import newly_admitted


def make_planner(
    num_pages: int = 64, page_size: int = 1, max_prefill: int = 64, max_running: int = 8
) -> Planner:
    allocator = PageAllocator(num_pages, page_size)
    config = SchedulerConfig(
        max_running_requests=max_running, max_prefill_length=max_prefill, page_size=page_size
    )
    table = PageTable(max_running, 128, page_size, torch.device("cpu"))
    return Planner(config, allocator, RadixCache(allocator), table)


def make_req(rid: int, prompt_len: int, first_token: int = 10) -> Req:
    prompt = [first_token + i for i in range(prompt_len)]
    params = SamplingParams(max_tokens=50)
    return Req(rid=rid, prompt_ids=prompt, params=params, seed=0, max_total_len=prompt_len + 50)


def run_step(planner: Planner, token: int = 3) -> None:
    planned = planner.schedule()
    assert planned is not None
    planner.complete(planned, [token] * len(planned.reqs))
    planner.check_integrity()


def test_prefill_comes_first_and_respects_the_budget() -> None:
    planner = make_planner(max_prefill=10)
    for i in range(3):
        planner.add(make_req(i, 4, first_token=100 * (i + 1)))
    planned = planner.schedule()
    assert planned is not None and planned.mode is ForwardMode.PREFILL
    assert planned.extend_lens == [4, 4, 2]
    assert planned.samples == [True, True, False]
    planner.complete(planned, [1, 1, 1])
    planned = planner.schedule()
    assert planned is not None and planned.mode is ForwardMode.PREFILL
    assert [r.rid for r in planned.reqs] == [2] and planned.extend_lens == [2]
    planner.complete(planned, [1])
    planned = planner.schedule()
    assert planned is not None and planned.mode is ForwardMode.DECODE
    assert len(planned.reqs) == 3
    planner.check_integrity()


def test_long_prompt_is_chunked_and_samples_only_at_the_end() -> None:
    planner = make_planner(max_prefill=4)
    req = make_req(0, 10)
    planner.add(req)
    chunks = []
    while not req.decoding:
        planned = planner.schedule()
        assert planned is not None
        chunks.append((planned.extend_lens[0], planned.samples[0]))
        planner.complete(planned, [7])
    assert chunks == [(4, False), (4, False), (2, True)]
    assert req.output_ids == [7]
    assert req.cached_len == 10


def test_running_cap_keeps_the_rest_waiting() -> None:
    planner = make_planner(max_running=2)
    for i in range(3):
        planner.add(make_req(i, 3, first_token=10 * i))
    planned = planner.schedule()
    assert planned is not None and len(planned.reqs) == 2
    assert len(planner.waiting) == 1


def test_cached_prefix_is_reused_and_at_least_one_token_is_computed() -> None:
    planner = make_planner()
    first = make_req(0, 8)
    planner.add(first)
    run_step(planner)
    planner.finish(first, FinishReason.STOP)
    again = make_req(1, 8)
    planner.add(again)
    planned = planner.schedule()
    assert planned is not None
    assert again.prefix_len == 7 and planned.extend_lens == [1]
    longer = make_req(2, 12)
    planner.add(longer)
    planner.complete(planned, [3])
    planned = planner.schedule()
    assert planned is not None and planned.reqs == [longer]
    assert longer.prefix_len == 8 and planned.extend_lens == [4]


def test_decode_retracts_the_newest_request_when_the_pool_is_full() -> None:
    planner = make_planner(num_pages=13, max_prefill=64)
    a, b = make_req(0, 5, first_token=10), make_req(1, 5, first_token=50)
    planner.add(a)
    planner.add(b)
    run_step(planner)
    run_step(planner)
    assert a.total_len == 7 and b.total_len == 7
    planned = planner.schedule()
    assert planned is not None and planned.reqs == [a]
    assert b.status is ReqStatus.WAITING and b.output_ids == [3, 3]
    assert planner.num_retractions == 1
    planner.check_integrity()


def test_finish_and_abort_return_pages() -> None:
    planner = make_planner(num_pages=32)
    reqs = [make_req(i, 6, first_token=20 * i) for i in range(3)]
    for req in reqs:
        planner.add(req)
    run_step(planner)
    planner.finish(reqs[0], FinishReason.STOP)
    planner.finish(reqs[1], FinishReason.ABORT)
    planner.check_integrity()
    assert planner.running == [reqs[2]]
    planner.finish(reqs[2], FinishReason.LENGTH)
    planner.cache.evict(1000)
    assert planner.allocator.free_pages == planner.allocator.usable_pages
    assert planner.page_table.free_rows == 8


def test_forward_batch_takes_slots_from_the_host_mirror_and_ids_from_the_token_table() -> None:
    """A step's KV slots come from the page table's host mirror and decode input ids from
    the device token table, where the previous step recorded its sampled ids: the slots
    must agree with the device page table the planner wrote."""
    planner = make_planner(num_pages=64, page_size=4, max_prefill=64)
    reqs = [make_req(i, n, first_token=30 * i) for i, n in enumerate((5, 9, 3))]
    for req in reqs:
        planner.add(req)
    table = planner.page_table
    for mode in (ForwardMode.PREFILL, ForwardMode.DECODE):
        planned = planner.schedule()
        assert planned is not None and planned.mode is mode
        batch = forward_batch(step_spec(planned, table), table, torch.device("cpu"))
        rows = torch.tensor([r.slot for r in reqs]).repeat_interleave(
            torch.tensor(planned.extend_lens)
        )
        assert torch.equal(batch.out_slots, table.slots[rows, batch.positions].long())
        if mode is ForwardMode.DECODE:
            assert torch.equal(batch.input_ids, table.tokens[rows, batch.positions])
        else:
            assert batch.input_ids.tolist() == [t for r in reqs for t in r.prompt_ids]
        ends = torch.tensor(planned.extend_lens).cumsum(0) - 1
        assert torch.equal(batch.logit_indices, ends)
        next_ids = torch.tensor([7, 8, 9])
        table.tokens.view(-1).index_copy_(0, batch.record_index, next_ids)
        assert table.tokens[[r.slot for r in reqs], batch.seq_lens].tolist() == [7, 8, 9]
        planner.complete(planned, next_ids.tolist())
    assert [r.all_ids[-2:] for r in reqs] == [[7, 7], [8, 8], [9, 9]]


def decode_batch(reqs: list[Req]) -> ScheduledBatch:
    size = len(reqs)
    starts = [r.cached_len for r in reqs]
    return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * size, [True] * size, starts, [0] * size)


def counted_afresh(reqs: list[Req], vocab_size: int) -> SamplingBatch:
    """The requests' sampling batch packed from their whole histories, nothing kept."""
    return SamplingBatch.build(
        [r.params for r in reqs],
        [r.seed for r in reqs],
        [len(r.output_ids) for r in reqs],
        [r.prompt_ids for r in reqs],
        [r.output_ids for r in reqs],
        vocab_size,
        torch.device("cpu"),
    )


def test_sampling_batch_is_reused_only_while_nothing_in_it_changes() -> None:
    """The same requests in the same order keep their packed parameters and get only new
    steps (the hash keys follow each request's output length), penalties' token counts
    the tokens sampled since; another order or a row short of its min_tokens packs afresh."""
    batches = SamplingBatches(
        vocab_size=100, device=torch.device("cpu"), eos_token_ids=frozenset({2})
    )
    plain = [make_req(i, 4) for i in range(3)]
    first = batches.build(decode_batch(plain))
    for r in plain:
        r.output_ids.append(7)
    again = batches.build(decode_batch(plain))
    assert again.temperature is first.temperature and again.seed_keys is first.seed_keys
    assert first.steps is not None and again.steps is not None
    assert first.steps.tolist() == [0, 0, 0] and again.steps.tolist() == [1, 1, 1]
    assert not torch.equal(again.keys, first.keys)
    reordered = batches.build(decode_batch(plain[::-1]))
    assert reordered.temperature is not first.temperature
    penalised = make_req(6, 4)
    penalised.params = SamplingParams(max_tokens=50, presence_penalty=0.5)
    repeated = make_req(8, 4)
    repeated.params = SamplingParams(max_tokens=50, repetition_penalty=1.3)
    reqs = [*plain, penalised, repeated]
    step = batches.build(decode_batch(reqs))
    for tokens in ([7, 9, 9, 11, 12], [7, 9, 13, 13, 13]):  # two steps' tokens, a row each
        for r, token in zip(reqs, tokens):
            r.output_ids.append(token)
        again = batches.build(decode_batch(reqs))
        assert again.temperature is step.temperature  # reused, the counts updated in place
        fresh = counted_afresh(reqs, 100)
        assert again.seen is not None and fresh.seen is not None
        assert again.output_counts is not None and fresh.output_counts is not None
        assert torch.equal(again.seen, fresh.seen)
        assert torch.equal(again.output_counts, fresh.output_counts)
    assert again.output_counts[3, [11, 13]].tolist() == [1, 1]  # the presence-penalty row
    assert again.output_counts[4].sum() == 0 and not again.seen[3].any()
    assert again.seen[4, [12, 13]].all()  # the repetition-penalty row: prompt and outputs
    held = make_req(7, 4)
    held.params = SamplingParams(max_tokens=50, min_tokens=2, logit_bias={5: 1.5})
    reqs = [*plain, held]
    for _ in range(2):  # the end-of-sequence token stays ruled out: a new batch a step
        step = batches.build(decode_batch(reqs))
        assert step.bias is not None and step.any_min_tokens
        assert sorted(zip(step.bias.ids.tolist(), step.bias.values.tolist())) == [
            (2, float("-inf")),
            (5, 1.5),
        ]
        assert batches.build(decode_batch(reqs)).temperature is not step.temperature
        held.output_ids.append(7)
    step = batches.build(decode_batch(reqs))  # reached: the bias alone, kept while it holds
    assert step.bias is not None and not step.any_min_tokens
    assert step.bias.ids.tolist() == [5] and step.bias.rows.tolist() == [3]
    assert batches.build(decode_batch(reqs)).temperature is step.temperature


def test_prefill_stats_count_each_admission_once_under_overlap() -> None:
    """The `#new-seq` of a prefill line is reported after the next step launched, which may
    be the same request's next chunk: it is read from where each chunk was planned to start."""
    planner = make_planner(max_prefill=10)
    short, long = make_req(0, 4), make_req(1, 12, first_token=200)
    planner.add(short)
    planner.add(long)
    first = planner.schedule()
    assert first is not None
    planner.launched(first)
    second = planner.schedule()
    assert second is not None and second.reqs == [long]
    planner.launched(second)  # both launched before the first is reported, as with overlap
    assert newly_admitted(first) == [short, long]
    assert newly_admitted(second) == []


def test_penalty_counts_follow_requests_across_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches whose requests change (joining, leaving, reordered) pack afresh, but a request
    of the last step brings its rows of the counts along: every step's tables equal those
    counted from whole histories."""
    rng = random.Random(5)
    batches = SamplingBatches(vocab_size=50, device=torch.device("cpu"), eos_token_ids=frozenset())
    carried = 0
    carry = SamplingBatch.carry_counts

    def counting(self: SamplingBatch, previous: SamplingBatch, rows: list[int | None]) -> None:
        nonlocal carried
        carried += 1
        carry(self, previous, rows)

    monkeypatch.setattr(SamplingBatch, "carry_counts", counting)
    kinds = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.2, "repetition_penalty": 1.1},
        {},
    ]
    reqs = []
    for i in range(6):
        req = make_req(i, rng.randrange(2, 6), first_token=rng.randrange(40))
        req.params = SamplingParams(max_tokens=50, **kinds[i % 4])
        reqs.append(req)
    chosen = reqs[:3]
    for step in range(14):
        if step % 3 == 2:  # a new composition: some leave, some join, the order shuffled
            chosen = rng.sample(reqs, rng.randrange(2, 6))
        batch = batches.build(decode_batch(chosen))
        fresh = counted_afresh(chosen, 50)
        for mine, theirs in ((batch.seen, fresh.seen), (batch.output_counts, fresh.output_counts)):
            assert (mine is None) == (theirs is None)
            assert mine is None or torch.equal(mine, theirs), step
        for r in chosen:
            r.output_ids.append(rng.randrange(50))
    assert carried >= 3
