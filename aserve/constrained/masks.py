"""The allowed-token bitmasks of one step: filled on the host by the constrained rows'
matchers (32 tokens a word, xgrammar's layout), applied by the sampler as -inf logits on the
logits' device. Only constrained rows get a mask row, so a batch with one constrained
request moves one row, not the batch's."""

from __future__ import annotations

import os
from typing import Any

import torch


class TokenMasks:
    """Builds a step's bitmask rows for the batch rows that have a matcher; several rows are
    filled by xgrammar's batch matcher on a few threads (its C++ releases the GIL). For a
    CUDA device they are `pinned`: a copy from pageable memory would wait for the stream,
    i.e. for the forward that the masks are built beside (torch's pinned-memory cache keeps
    a block until the copies that read it are done)."""

    def __init__(self, vocab_size: int, pinned: bool = False) -> None:
        self.words = (vocab_size + 31) // 32
        self.pinned = pinned
        self._batch: Any = None

    def build(self, matchers: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bitmask rows for the batch rows whose matcher is not None, and those rows."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        mask = torch.empty(len(rows), self.words, dtype=torch.int32, pin_memory=self.pinned)
        if len(rows) == 1:
            matchers[rows[0]].fill_next_token_bitmask(mask, 0)
        else:
            self._batch_matcher().batch_fill_next_token_bitmask([matchers[r] for r in rows], mask)
        return mask, torch.tensor(rows).pin_memory() if self.pinned else torch.tensor(rows)

    def _batch_matcher(self) -> Any:
        if self._batch is None:
            import xgrammar

            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        return self._batch


def apply_token_masks(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """Disallowed tokens of row `rows[j]` (bit clear in `mask[j]`) get -inf, in place."""
    device = logits.device
    mask, rows = mask.to(device, non_blocking=True), rows.to(device, non_blocking=True)
    bits = torch.arange(32, device=device, dtype=torch.int32)
    allowed = (mask[:, :, None] >> bits) & 1  # [rows, words, 32]
    allowed = allowed.view(len(rows), -1)[:, : logits.shape[-1]].bool()
    selected = logits.index_select(0, rows)
    logits.index_copy_(0, rows, selected.masked_fill(~allowed, float("-inf")))
