"""Turn a planned batch of requests into the tensors of a ForwardBatch and a SamplingBatch."""

from __future__ import annotations

import torch

from aserve.engine.sampler import PromptScoring, SamplingBatch
from aserve.engine.step import StepSpec
from aserve.forward import ForwardMode
from aserve.kvcache.pages import PageTable
from aserve.models.vision import StepImages, image_pieces
from aserve.scheduler.plan import ScheduledBatch
from aserve.scheduler.request import Req


def step_images(planned: ScheduledBatch) -> StepImages | None:
    """What a prefill step takes of its requests' images, or None where it takes none: for
    the step's spec (`step_spec`) and then its features (`Engine.attach_images`)."""
    if planned.mode is not ForwardMode.PREFILL or not any(req.images for req in planned.reqs):
        return None
    spans = [req.images for req in planned.reqs]
    return image_pieces(spans, planned.starts, planned.extend_lens)


def step_spec(
    planned: ScheduledBatch,
    page_table: PageTable,
    image_levels: int = 1,
    both_ways_prompts: bool = False,
    images: StepImages | None = None,
) -> StepSpec:
    """The plan as plain integers: what every tensor-parallel rank needs to run the step
    (with `images`, `step_images` of a step whose prompts hold images).

    A verify step (speculative decoding) is a decode step of one row per token: request i's
    last token and each of its drafts, at consecutive positions of its page-table row. Each
    row's attention reads the KV up to its own position, which the rows before it store in
    the same layer first, so the rows see what one chunk would (causal attention), and run
    on every decode path (the CPU's C++ layers, CUDA graphs)."""
    reqs = planned.reqs
    if planned.drafts is not None:
        rows: list[int] = []
        positions: list[int] = []
        input_ids: list[int] = []
        for req, start, drafted in zip(reqs, planned.starts, planned.drafts):
            rows.extend([req.slot] * (1 + len(drafted)))
            positions.extend(range(start, start + 1 + len(drafted)))
            input_ids.append(req.all_ids[start])
            input_ids.extend(drafted)
        lens = [1 + len(drafted) for drafted in planned.drafts]
        return StepSpec(
            mode=ForwardMode.DECODE,
            rows=rows,
            prefix_lens=positions,
            extend_lens=[1] * len(rows),
            scored=[0] * len(rows),
            input_ids=input_ids,
            page_writes=page_table.take_writes(),
            rope_positions=_rope_positions(ForwardMode.DECODE, reqs, planned.starts, lens),
            adapters=_adapters(reqs, lens),
        )
    prefix_lens = planned.starts
    input_ids = []
    image_rows: list[int] = []
    both_ways: list[int] = []
    if planned.mode is ForwardMode.PREFILL:
        for req, start, n in zip(reqs, prefix_lens, planned.extend_lens):
            input_ids.extend(req.all_ids[start : start + n])
        assert images is not None or not any(req.images for req in reqs), "no step_images"
        if images is not None:
            image_rows = [row for piece in images.pieces for row in piece.rows]
            both_ways = [
                v for i, held in enumerate(images.blocks) for block in held for v in (i, *block)
            ]
        if both_ways_prompts:  # every prompt whole, attending both ways (`Req.whole_prompt`)
            for i, (start, n) in enumerate(zip(prefix_lens, planned.extend_lens)):
                both_ways += [i, start, start + n]
    return StepSpec(
        mode=planned.mode,
        rows=[r.slot for r in reqs],
        prefix_lens=prefix_lens,
        extend_lens=list(planned.extend_lens),
        scored=list(planned.scored),
        input_ids=input_ids,
        page_writes=page_table.take_writes(),
        rope_positions=_rope_positions(planned.mode, reqs, prefix_lens, planned.extend_lens),
        image_rows=image_rows,
        image_levels=image_levels if image_rows else 0,
        both_ways=both_ways,
        adapters=_adapters(reqs, [1] * len(reqs)),
    )


def _adapters(reqs: list[Req], rows: list[int]) -> list[int]:
    """`StepSpec.adapters`: each request's LoRA adapter id for each of its `rows[i]` rows,
    or nothing where no request takes an adapter."""
    if not any(req.adapter for req in reqs):
        return []
    return [req.adapter for req, n in zip(reqs, rows) for _ in range(n)]


def _rope_positions(
    mode: ForwardMode, reqs: list[Req], starts: list[int], lens: list[int]
) -> list[int]:
    """`StepSpec.rope_positions`: empty unless a request's positions are not its indices
    (Qwen-VL with images, `Req.mrope`); else one a token in decode (each request's rows
    `lens[i]` tokens from `starts[i]`), three rows of them in prefill."""
    if all(req.mrope is None for req in reqs):
        return []
    if mode is ForwardMode.DECODE:
        decoded: list[int] = []
        for req, start, n in zip(reqs, starts, lens):
            shift = 0 if req.mrope is None else req.mrope.shift
            decoded.extend(range(start + shift, start + n + shift))
        return decoded
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    for req, start, n in zip(reqs, starts, lens):
        if req.mrope is None:
            coordinates = (list(range(start, start + n)),) * 3
        else:
            coordinates = req.mrope.coordinates(start, n)
        for row, values in zip(rows, coordinates):
            row.extend(values)
    return rows[0] + rows[1] + rows[2]


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
        carried = self._carried(reqs)
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

    def build_verify(self, planned: ScheduledBatch) -> SamplingBatch:
        """A verify step's batch: a row for each of a request's rows (its last token, then
        each draft), at the step its sample would be taken at when decoding one token a step
        (the seeded draw keys on it, so the samples are those decoding would draw), and with
        penalties counting what decoding would have counted there: the request's tokens and
        the drafts before the row. A request's first row counts its history as `build` does
        (kept from the last step where it can be); its other rows copy that on the device and
        add their drafts. The next step packs afresh."""
        drafts = planned.drafts
        assert drafts is not None
        reqs: list[Req] = []
        steps: list[int] = []
        firsts: list[int] = []
        for req, drafted in zip(planned.reqs, drafts):
            firsts.append(len(reqs))
            reqs.extend([req] * (1 + len(drafted)))
            steps.extend(range(len(req.output_ids), len(req.output_ids) + 1 + len(drafted)))
        carried = self._carried(planned.reqs)
        counts_history = [False] * len(reqs)
        for first, kept in zip(firsts, carried):
            counts_history[first] = kept is None
        params = [r.params for r in reqs]
        batch = SamplingBatch.build(
            params=params,
            seeds=[r.seed for r in reqs],
            steps=steps,
            prompt_ids=[r.vocabulary_prompt_ids if c else [] for r, c in zip(reqs, counts_history)],
            output_ids=[r.output_ids if c else [] for r, c in zip(reqs, counts_history)],
            vocab_size=self.vocab_size,
            device=self.device,
            eos_token_ids=self.eos_token_ids,
        )
        if batch.any_penalties:
            size = len(reqs)
            if self._counted is not None and any(carried):
                from_last: list[int | None] = [None] * size
                since: list[list[int]] = [[]] * size
                for req, first, kept in zip(planned.reqs, firsts, carried):
                    if kept is not None:
                        from_last[first], since[first] = kept[0], req.output_ids[kept[1] :]
                batch.carry_counts(self._counted, from_last)
                batch.count_tokens(params, [[]] * size, since)
            from_first: list[int | None] = [None] * size
            drafted_before: list[list[int]] = [[]] * size
            for first, drafted in zip(firsts, drafts):
                for j in range(1, 1 + len(drafted)):
                    from_first[first + j], drafted_before[first + j] = first, drafted[:j]
            if any(drafted_before):
                batch.carry_counts(batch, from_first)
                batch.count_tokens(params, [[]] * size, drafted_before)
        self._last, self._last_rids = None, ()
        self._counted = batch if batch.any_penalties else None
        self._counted_rows = {
            req.rid: (first, len(req.output_ids)) for req, first in zip(planned.reqs, firsts)
        }
        self._last_steps = []
        return batch

    def _carried(self, reqs: list[Req]) -> list[tuple[int, int] | None]:
        """Each request's (row, output length then) in the last step's counts, where it has
        one and has only grown since."""
        carried: list[tuple[int, int] | None] = [None] * len(reqs)
        if self._counted is not None:
            for i, req in enumerate(reqs):
                row = self._counted_rows.get(req.rid)
                carried[i] = row if row is not None and len(req.output_ids) >= row[1] else None
        return carried

    def _keep(self, batch: SamplingBatch, rids: tuple[int, ...], steps: list[int]) -> None:
        self._last_steps = steps
        self._counted = batch if batch.any_penalties else None
        self._counted_rows = {rid: (i, n) for i, (rid, n) in enumerate(zip(rids, steps))}
