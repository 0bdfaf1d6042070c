"""The allowed-token bitmasks of one step: filled on the host by the constrained rows'
matchers (32 tokens a word, xgrammar's layout), applied by the sampler as -inf logits on the
logits' device. Only constrained rows get a mask row, so a batch with one constrained
request moves one row, not the batch's; the rows and their batch indices share one buffer,
so on CUDA one copy and one kernel apply them."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch


class StepMasks(NamedTuple):
    """`count` bitmask rows of `words` words, then the batch rows they belong to, in one
    int32 buffer."""

    buffer: torch.Tensor
    count: int
    words: int

    @property
    def bitmask(self) -> torch.Tensor:
        return self.buffer[: self.count * self.words].view(self.count, self.words)

    @property
    def rows(self) -> torch.Tensor:
        return self.buffer[self.count * self.words :]


class TokenMasks:
    """Builds a step's masks for the batch rows that have a matcher; several rows are
    filled by xgrammar's batch matcher on a few threads (its C++ releases the GIL). For a
    CUDA device the buffer is `pinned`: a copy from pageable memory would wait for the
    stream, i.e. for the forward that the masks are built beside (torch's pinned-memory
    cache keeps a block until the copies that read it are done)."""

    def __init__(self, vocab_size: int, pinned: bool = False) -> None:
        self.words = (vocab_size + 31) // 32
        self.pinned = pinned
        self._batch: Any = None

    def build(self, matchers: list[Any]) -> StepMasks | None:
        """Masks for the batch rows whose matcher is not None."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        masks = self._masks_of(rows)
        if len(rows) == 1:
            matchers[rows[0]].fill_next_token_bitmask(masks.bitmask, 0)
        else:
            self._batch_matcher().batch_fill_next_token_bitmask(
                [matchers[r] for r in rows], masks.bitmask
            )
        return masks

    def build_verify(self, matchers: list[Any], drafts: list[list[int]]) -> StepMasks | None:
        """A verify step's masks (speculative decoding): request i's rows, its last token
        then each of `drafts[i]`, where its matcher is not None, each masked as the matcher
        stands after the drafts before that row (which its grammar allows: the planner
        keeps only such drafts). The matchers are rolled back to where they were."""
        rows: list[int] = []
        first = 0
        for matcher, drafted in zip(matchers, drafts, strict=True):
            if matcher is not None:
                rows.extend(range(first, first + 1 + len(drafted)))
            first += 1 + len(drafted)
        if not rows:
            return None
        masks = self._masks_of(rows)
        index = 0
        for matcher, drafted in zip(matchers, drafts):
            if matcher is None:
                continue
            for token in drafted:
                matcher.fill_next_token_bitmask(masks.bitmask, index)
                index += 1
                matcher.accept_token(token)
            matcher.fill_next_token_bitmask(masks.bitmask, index)
            index += 1
            if drafted:
                matcher.rollback(len(drafted))
        return masks

    def _masks_of(self, rows: list[int]) -> StepMasks:
        """Unfilled masks for batch rows `rows`."""
        n = len(rows)
        buffer = torch.empty(n * self.words + n, dtype=torch.int32, pin_memory=self.pinned)
        masks = StepMasks(buffer, n, self.words)
        masks.rows.copy_(torch.tensor(rows, dtype=torch.int32))
        return masks

    def _batch_matcher(self) -> Any:
        if self._batch is None:
            import xgrammar

            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        return self._batch


def apply_token_masks(logits: torch.Tensor, masks: StepMasks) -> None:
    """Disallowed tokens of each masked row (bit clear) get -inf, in place."""
    if logits.is_cuda:
        from aserve.constrained.masks_cuda import apply_masks_cuda

        buffer = masks.buffer.to(logits.device, non_blocking=True)
        apply_masks_cuda(logits, buffer, masks.count, masks.words)
        return
    rows = masks.rows.long()
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (masks.bitmask[:, :, None] >> bits) & 1  # [rows, words, 32]
    allowed = allowed.view(masks.count, -1)[:, : logits.shape[-1]].bool()
    selected = logits.index_select(0, rows)
    logits.index_copy_(0, rows, selected.masked_fill(~allowed, float("-inf")))
