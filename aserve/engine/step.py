"""StepSpec: the host-side description of one forward step, and the ForwardBatch built from it.

Rank 0's scheduler turns its plan into a StepSpec; every rank (rank 0 included) builds its
ForwardBatch from the spec with the same code, against its own page table. Tensor-parallel
followers receive the spec packed into one int64 array, so it holds only plain integers:
which rows run, their lengths, which want logits at every position (prompt logprobs: every
rank's LM head takes part), prefill token ids, and the page-table writes the planner made
since the previous step (decode input ids are read from each rank's own token table, where
every rank wrote the same sampled ids, except in a verify step of speculative decoding, whose
drafted ids only rank 0's host knows: its rows are a request's last token and its drafts,
each a decode row of the request's page-table row, their ids given).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from aserve.forward import ForwardBatch, ForwardMode
from aserve.kvcache.pages import PageTable, PageWrite

_MODES = (ForwardMode.PREFILL, ForwardMode.DECODE)


@dataclass(frozen=True)
class StepSpec:
    """`input_ids` is empty in decode but for a verify step's rows; request i wants logits
    at the last `scored[i]` positions of its chunk (prompt logprobs), at its last alone
    where that is 0. `page_writes` are what rank 0's planner wrote into its page table since
    the previous step; followers replay them before building the batch. `rope_positions`
    are the tokens' rotary positions where they are not their indices (Qwen-VL's requests
    with images, models/mrope.py): one a token in decode, three a token in prefill (every
    token's time, then height, then width coordinate); empty otherwise. In a prefill with
    images, `image_rows` are the step's tokens that take image features (rank 0's encoder's,
    which every rank gets by a broadcast: `Engine.share_images`), `image_levels` how many
    features each takes (Qwen3-VL's inner layers' beside its own), and `both_ways` the
    `(request, first, last)` blocks of Gemma 3's images that attend both ways, flattened.
    `adapters` holds each row's LoRA adapter id (0: none), or nothing where no row takes
    one."""

    mode: ForwardMode
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    scored: list[int]
    input_ids: list[int]
    page_writes: list[PageWrite]
    rope_positions: list[int] = field(default_factory=list)
    image_rows: list[int] = field(default_factory=list)
    image_levels: int = 0
    both_ways: list[int] = field(default_factory=list)
    adapters: list[int] = field(default_factory=list)

    def pack(self) -> bytes:
        """[mode, B, T, W, R, I, L, O, A, rows, prefix_lens, extend_lens, scored, input_ids,
        rope_positions, image_rows, both_ways, adapters, W x (row, first, count, window),
        pages...] as int64 bytes."""
        writes = self.page_writes
        header = [_MODES.index(self.mode), len(self.rows), len(self.input_ids), len(writes)]
        header += [len(self.rope_positions), len(self.image_rows), self.image_levels]
        header += [len(self.both_ways), len(self.adapters)]
        fields = [header, self.rows, self.prefix_lens, self.extend_lens, self.scored]
        fields += [self.input_ids, self.rope_positions, self.image_rows, self.both_ways]
        fields.append(self.adapters)
        fields += [[w.row, w.first_page_index, len(w.pages), int(w.window)] for w in writes]
        fields += [w.pages for w in writes]
        return np.fromiter(
            (v for part in fields for v in part), dtype=np.int64, count=sum(map(len, fields))
        ).tobytes()

    @classmethod
    def unpack(cls, data: bytes) -> StepSpec:
        values = np.frombuffer(data, dtype=np.int64).tolist()
        mode, size, num_ids, num_writes, num_rope, num_images, levels = values[:7]
        num_blocks, num_adapters = values[7:9]
        at = 9
        parts = []
        lengths = (size, size, size, size, num_ids, num_rope, num_images, num_blocks)
        for length in (*lengths, num_adapters, 4 * num_writes):
            parts.append(values[at : at + length])
            at += length
        rows, prefix_lens, extend_lens, scored, input_ids, rope, images, blocks = parts[:8]
        adapters, write_heads = parts[8:]
        writes = []
        for i in range(num_writes):
            row, first, count, window = write_heads[4 * i : 4 * i + 4]
            writes.append(PageWrite(row, first, values[at : at + count], bool(window)))
            at += count
        return cls(
            _MODES[mode],
            rows,
            prefix_lens,
            extend_lens,
            scored,
            input_ids,
            writes,
            rope,
            images,
            levels,
            blocks,
            adapters,
        )


def forward_batch(spec: StepSpec, page_table: PageTable, device: torch.device) -> ForwardBatch:
    """The spec's ForwardBatch on `page_table` (its page writes already applied).

    Everything but decode input ids is known on the host (KV slots from the page table's host
    mirror), so the batch's integers travel in one host-to-device copy. Decode input ids are
    the previous step's sampled ids, which only the device knows while that step is in
    flight: one gather from the token table fetches them (a verify step gives its own).
    Logits are taken at each request's last token, and at the scored tokens of a chunk;
    `sample_rows` then picks the last ones.
    """
    prefix_lens, extend_lens = spec.prefix_lens, spec.extend_lens
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    rows = np.asarray(spec.rows, dtype=np.int64)
    size = len(rows)
    sample_rows = np.zeros(0, dtype=np.int64)
    given_ids = bool(spec.input_ids)
    if spec.mode is ForwardMode.DECODE:
        positions = np.asarray(prefix_lens, dtype=np.int64)
        token_rows = rows
        input_ids = (
            np.asarray(spec.input_ids, dtype=np.int64) if given_ids else np.zeros(size, np.int64)
        )
        logit_indices = np.arange(size, dtype=np.int64)
    else:
        extends = np.asarray(extend_lens, dtype=np.int64)
        ends = np.cumsum(extends)
        token_rows = np.repeat(rows, extends)
        offsets = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - extends, extends)
        positions = np.repeat(np.asarray(prefix_lens, dtype=np.int64), extends) + offsets
        input_ids = np.asarray(spec.input_ids, dtype=np.int64)
        logit_indices = ends - 1
        if any(spec.scored):
            scored = np.asarray(spec.scored, dtype=np.int64)
            wanted = offsets >= np.repeat(extends - scored, extends)
            wanted[ends - 1] = True
            logit_indices = np.flatnonzero(wanted).astype(np.int64)
            sample_rows = np.searchsorted(logit_indices, ends - 1).astype(np.int64)
    slots = [page_table.slot_ids(token_rows, positions)]
    if page_table.window_slots is not None:
        slots.append(page_table.slot_ids(token_rows, positions, window=True))
    record_index = rows * page_table.width + np.asarray(seq_lens, dtype=np.int64)
    per_request = [rows, record_index]
    if spec.mode is ForwardMode.DECODE:
        per_request.append(rows * page_table.width + positions)
    rope_positions, mrope = positions, None
    if spec.rope_positions:
        rope_positions = np.asarray(spec.rope_positions, dtype=np.int64)
        if spec.mode is ForwardMode.PREFILL:
            mrope = rope_positions.reshape(3, -1)
            rope_positions = mrope[0]  # rope reads `mrope_positions` in this step
    per_token = [input_ids, slots[0], rope_positions, *slots[1:]]
    adapters = np.zeros(0, dtype=np.int64)
    if spec.adapters:  # one a row; a prefill's rows are requests of `extend_lens` tokens
        adapters = np.asarray(spec.adapters, dtype=np.int64)
        if spec.mode is ForwardMode.PREFILL:
            adapters = np.repeat(adapters, np.asarray(extend_lens, dtype=np.int64))
    parts = [*per_token, *per_request, logit_indices, sample_rows, adapters]
    packed = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
    tokens = len(positions)
    token_end = len(per_token) * tokens
    token_inputs = packed[:token_end].view(len(per_token), tokens)
    # rows, record index and, in decode, where each input id is in the table
    request_end = token_end + len(per_request) * size
    per_request_view = packed[token_end:request_end].view(-1, size)
    logits_end = request_end + len(logit_indices)
    samples_end = logits_end + len(sample_rows)
    if spec.mode is ForwardMode.DECODE and not given_ids:
        torch.index_select(page_table.tokens.view(-1), 0, per_request_view[2], out=token_inputs[0])
    return ForwardBatch(
        mode=spec.mode,
        token_inputs=token_inputs,
        rows=per_request_view[0],
        row_ids=list(spec.rows),
        prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens),
        seq_lens=seq_lens,
        logit_indices=packed[request_end:logits_end],
        record_index=per_request_view[1],
        page_table=page_table.slots,
        sample_rows=packed[logits_end:samples_end] if len(sample_rows) else None,
        window_page_table=page_table.window_slots,
        mrope_positions=None if mrope is None else torch.from_numpy(mrope).to(device),
        image_rows=torch.tensor(spec.image_rows, device=device) if spec.image_rows else None,
        image_levels=spec.image_levels,
        both_ways=_both_ways(spec.both_ways, size),
        adapter_ids=packed[samples_end:] if len(adapters) else None,
    )


def _both_ways(flat: list[int], size: int) -> list[list[tuple[int, int]]] | None:
    """`StepSpec.both_ways` as each request's `[first, last)` blocks (None: no such image)."""
    if not flat:
        return None
    blocks: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for i in range(0, len(flat), 3):
        request, first, last = flat[i : i + 3]
        blocks[request].append((first, last))
    return blocks
