"""StepSpec: the host-side description of one forward step, and the ForwardBatch built from it.

Rank 0's scheduler turns its plan into a StepSpec; every rank (rank 0 included) builds its
ForwardBatch from the spec with the same code, against its own page table. Tensor-parallel
followers receive the spec packed into one int64 array, so it holds only plain integers:
which rows run, their lengths, prefill token ids, and the page-table writes the planner made
since the previous step (decode input ids are read from each rank's own token table, where
every rank wrote the same sampled ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aserve.forward import ForwardBatch, ForwardMode
from aserve.kvcache.pages import PageTable, PageWrite

_MODES = (ForwardMode.PREFILL, ForwardMode.DECODE)


@dataclass(frozen=True)
class StepSpec:
    """`input_ids` is empty in decode. `page_writes` are what rank 0's planner wrote into its
    page table since the previous step; followers replay them before building the batch."""

    mode: ForwardMode
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    page_writes: list[PageWrite]

    def pack(self) -> bytes:
        """[mode, B, T, W, rows, prefix_lens, extend_lens, input_ids, W x (row, first,
        count), pages...] as int64 bytes."""
        writes = self.page_writes
        header = [_MODES.index(self.mode), len(self.rows), len(self.input_ids), len(writes)]
        fields = [header, self.rows, self.prefix_lens, self.extend_lens, self.input_ids]
        fields += [[w.row, w.first_page_index, len(w.pages)] for w in writes]
        fields += [w.pages for w in writes]
        return np.fromiter(
            (v for part in fields for v in part), dtype=np.int64, count=sum(map(len, fields))
        ).tobytes()

    @classmethod
    def unpack(cls, data: bytes) -> StepSpec:
        values = np.frombuffer(data, dtype=np.int64).tolist()
        mode, size, num_ids, num_writes = values[:4]
        at = 4
        parts = []
        for length in (size, size, size, num_ids, 3 * num_writes):
            parts.append(values[at : at + length])
            at += length
        rows, prefix_lens, extend_lens, input_ids, write_heads = parts
        writes = []
        for i in range(num_writes):
            row, first, count = write_heads[3 * i : 3 * i + 3]
            writes.append(PageWrite(row, first, values[at : at + count]))
            at += count
        return cls(_MODES[mode], rows, prefix_lens, extend_lens, input_ids, writes)


def forward_batch(spec: StepSpec, page_table: PageTable, device: torch.device) -> ForwardBatch:
    """The spec's ForwardBatch on `page_table` (its page writes already applied). Prefill
    input ids come from the spec; decode input ids are read from the device token table,
    where the previous step's sampled ids were written."""
    prefix_lens, extend_lens = spec.prefix_lens, spec.extend_lens
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    rows = torch.tensor(spec.rows, dtype=torch.int64).to(device, non_blocking=True)
    if spec.mode is ForwardMode.DECODE:
        positions = torch.tensor(prefix_lens, dtype=torch.int64).to(device, non_blocking=True)
        token_rows = rows
        input_ids = page_table.tokens[rows, positions].long()
        logit_indices = torch.arange(len(rows), device=device)
    else:
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
        positions = positions.to(device, non_blocking=True)
        token_rows = torch.repeat_interleave(
            torch.tensor(spec.rows, dtype=torch.int64), torch.tensor(extend_lens)
        ).to(device, non_blocking=True)
        input_ids = torch.tensor(spec.input_ids, dtype=torch.int64).to(device, non_blocking=True)
        ends = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0) - 1
        logit_indices = ends.to(device, non_blocking=True)
    return ForwardBatch(
        mode=spec.mode,
        input_ids=input_ids,
        positions=positions,
        out_slots=page_table.slots[token_rows, positions].long(),
        rows=rows,
        row_ids=list(spec.rows),
        prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens),
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64).to(device, non_blocking=True),
        logit_indices=logit_indices,
        page_table=page_table.slots,
    )
