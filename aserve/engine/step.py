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
    """The spec's ForwardBatch on `page_table` (its page writes already applied).

    Everything but decode input ids is known on the host (KV slots from the page table's host
    mirror), so the batch's integers travel in one host-to-device copy. Decode input ids are
    the previous step's sampled ids, which only the device knows while that step is in
    flight: one gather from the token table fetches them.
    """
    prefix_lens, extend_lens = spec.prefix_lens, spec.extend_lens
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    rows = np.asarray(spec.rows, dtype=np.int64)
    size = len(rows)
    if spec.mode is ForwardMode.DECODE:
        positions = np.asarray(prefix_lens, dtype=np.int64)
        token_rows = rows
        input_ids = np.zeros(size, dtype=np.int64)
        logit_indices = np.arange(size, dtype=np.int64)
    else:
        extends = np.asarray(extend_lens, dtype=np.int64)
        ends = np.cumsum(extends)
        token_rows = np.repeat(rows, extends)
        offsets = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - extends, extends)
        positions = np.repeat(np.asarray(prefix_lens, dtype=np.int64), extends) + offsets
        input_ids = np.asarray(spec.input_ids, dtype=np.int64)
        logit_indices = ends - 1
    out_slots = page_table.slot_ids(token_rows, positions)
    record_index = rows * page_table.width + np.asarray(seq_lens, dtype=np.int64)
    parts = [input_ids, out_slots, positions, rows, logit_indices, record_index]
    if spec.mode is ForwardMode.DECODE:
        parts.append(rows * page_table.width + positions)
    packed = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
    tokens = len(positions)
    token_inputs = packed[: 3 * tokens].view(3, tokens)
    # rows, logit indices, record index and, in decode, where each input id is in the table
    per_request = packed[3 * tokens :].view(-1, size)
    if spec.mode is ForwardMode.DECODE:
        torch.index_select(page_table.tokens.view(-1), 0, per_request[3], out=token_inputs[0])
    return ForwardBatch(
        mode=spec.mode,
        token_inputs=token_inputs,
        rows=per_request[0],
        row_ids=list(spec.rows),
        prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens),
        seq_lens=seq_lens,
        logit_indices=per_request[1],
        record_index=per_request[2],
        page_table=page_table.slots,
    )
