"""Turn a planned batch of requests into the tensors of a ForwardBatch and a SamplingBatch."""

from __future__ import annotations

import torch

from aserve.engine.sampler import SamplingBatch
from aserve.forward import ForwardBatch, ForwardMode
from aserve.kvcache.pages import PageTable
from aserve.scheduler.plan import ScheduledBatch


def build_forward_batch(
    planned: ScheduledBatch, page_table: PageTable, device: torch.device
) -> ForwardBatch:
    """Prefill input ids come from the host-side token lists; decode input ids are read from
    the device token table, where the previous step's sampler left them."""
    reqs = planned.reqs
    prefix_lens = [r.cached_len for r in reqs]
    seq_lens = [p + n for p, n in zip(prefix_lens, planned.extend_lens)]
    rows = torch.tensor([r.slot for r in reqs], dtype=torch.int64)
    if planned.mode is ForwardMode.DECODE:
        positions = torch.tensor(prefix_lens, dtype=torch.int64)
        token_rows = rows
        input_ids = None
    else:
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
        token_rows = torch.repeat_interleave(rows, torch.tensor(planned.extend_lens))
        input_ids = torch.tensor(
            [t for r, p, s in zip(reqs, prefix_lens, seq_lens) for t in r.all_ids[p:s]],
            dtype=torch.int64,
        ).to(device, non_blocking=True)
    rows = rows.to(device, non_blocking=True)
    token_rows = token_rows.to(device, non_blocking=True)
    positions = positions.to(device, non_blocking=True)
    if input_ids is None:
        input_ids = page_table.tokens[token_rows, positions].long()
    ends = torch.tensor(planned.extend_lens, dtype=torch.int64).cumsum(0) - 1
    return ForwardBatch(
        mode=planned.mode,
        input_ids=input_ids,
        positions=positions,
        out_slots=page_table.slots[token_rows, positions].long(),
        rows=rows,
        prefix_lens=prefix_lens,
        extend_lens=list(planned.extend_lens),
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64).to(device, non_blocking=True),
        logit_indices=ends.to(device, non_blocking=True),
        page_table=page_table.slots,
    )


def build_sampling_batch(
    planned: ScheduledBatch, vocab_size: int, device: torch.device, fused: bool
) -> SamplingBatch:
    reqs = planned.reqs
    return SamplingBatch.build(
        params=[r.params for r in reqs],
        seeds=[r.seed for r in reqs],
        steps=[len(r.output_ids) for r in reqs],
        prompt_ids=[r.prompt_ids for r in reqs],
        output_ids=[r.output_ids for r in reqs],
        vocab_size=vocab_size,
        device=device,
        fused=fused,
    )
