"""Turn a planned batch of requests into the tensors of a ForwardBatch and a SamplingBatch."""

from __future__ import annotations

import torch

from aserve.engine.sampler import PromptScoring, SamplingBatch
from aserve.engine.step import StepSpec
from aserve.forward import ForwardMode
from aserve.kvcache.pages import PageTable
from aserve.scheduler.plan import ScheduledBatch


def step_spec(planned: ScheduledBatch, page_table: PageTable) -> StepSpec:
    """The plan as plain integers: what every tensor-parallel rank needs to run the step."""
    reqs = planned.reqs
    prefix_lens = planned.starts
    input_ids: list[int] = []
    if planned.mode is ForwardMode.PREFILL:
        for req, start, n in zip(reqs, prefix_lens, planned.extend_lens):
            input_ids.extend(req.all_ids[start : start + n])
    return StepSpec(
        mode=planned.mode,
        rows=[r.slot for r in reqs],
        prefix_lens=prefix_lens,
        extend_lens=list(planned.extend_lens),
        scored=list(planned.scored),
        input_ids=input_ids,
        page_writes=page_table.take_writes(),
    )


def prompt_scoring(planned: ScheduledBatch, device: torch.device) -> PromptScoring | None:
    """The targets of a step's logits rows, laid out as `forward_batch` takes them (the
    scored positions at a chunk's end, else its last): the prompt token after each scored
    position. None for a step without scored chunks."""
    if not any(planned.scored):
        return None
    targets: list[int] = []
    top = 0
    for req, start, n, scored in zip(
        planned.reqs, planned.starts, planned.extend_lens, planned.scored
    ):
        if not scored:
            targets.append(0)
            continue
        prompt = req.prompt_ids
        end = start + n
        targets.extend(
            prompt[p + 1] if p + 1 < len(prompt) else 0 for p in range(end - scored, end)
        )
        top = max(top, req.params.prompt_logprobs or 0)
    return PromptScoring(torch.tensor(targets).to(device, non_blocking=True), top)


class SamplingBatches:
    """Builds each step's SamplingBatch. A step that runs the same requests in the same order
    as the last one, none short of its min_tokens, reuses its packed parameters and copies
    only the rows' steps, which the hash keys follow; penalties' token counts take the
    tokens sampled since, in place. Steady decode is such a step. Any other step packs
    afresh, but a request of the last step keeps its rows of the counts (copied on the
    device) rather than counting its whole prompt and output again."""

    def __init__(
        self, vocab_size: int, device: torch.device, eos_token_ids: frozenset[int]
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self._last_rids: tuple[int, ...] = ()
        self._last: SamplingBatch | None = None
        self._last_steps: list[int] = []
        # The last step's batch, whatever its kind: its count tables' rows by request id.
        self._counted: SamplingBatch | None = None
        self._counted_rows: dict[int, tuple[int, int]] = {}

    def build(self, planned: ScheduledBatch) -> SamplingBatch:
        reqs = planned.reqs
        rids = tuple(r.rid for r in reqs)
        steps = [len(r.output_ids) for r in reqs]
        params = [r.params for r in reqs]
        last = self._last
        if last is not None and rids == self._last_rids:
            grown = all(n >= m for n, m in zip(steps, self._last_steps, strict=True))
            if grown:
                if last.any_penalties:
                    new_ids = [r.output_ids[m:] for r, m in zip(reqs, self._last_steps)]
                    last.count_tokens(params, [[]] * len(reqs), new_ids)
                self._keep(last, rids, steps)
                return last.at_steps(steps)
        # Each request's row in the last step's counts, where it has one and has only grown.
        carried: list[tuple[int, int] | None] = [None] * len(reqs)
        if self._counted is not None:
            for i, (rid, n) in enumerate(zip(rids, steps)):
                row = self._counted_rows.get(rid)
                carried[i] = row if row is not None and n >= row[1] else None
        batch = SamplingBatch.build(
            params=params,
            seeds=[r.seed for r in reqs],
            steps=steps,
            prompt_ids=[[] if c else r.vocabulary_prompt_ids for r, c in zip(reqs, carried)],
            output_ids=[[] if c else r.output_ids for r, c in zip(reqs, carried)],
            vocab_size=self.vocab_size,
            device=self.device,
            eos_token_ids=self.eos_token_ids,
        )
        if self._counted is not None and batch.any_penalties and any(carried):
            batch.carry_counts(self._counted, [c[0] if c else None for c in carried])
            new_ids = [r.output_ids[c[1] :] if c else [] for r, c in zip(reqs, carried)]
            batch.count_tokens(params, [[]] * len(reqs), new_ids)
        reusable = not batch.any_min_tokens
        self._last, self._last_rids = (batch, rids) if reusable else (None, ())
        self._keep(batch, rids, steps)
        return batch

    def _keep(self, batch: SamplingBatch, rids: tuple[int, ...], steps: list[int]) -> None:
        self._last_steps = steps
        self._counted = batch if batch.any_penalties else None
        self._counted_rows = {rid: (i, n) for i, (rid, n) in enumerate(zip(rids, steps))}
