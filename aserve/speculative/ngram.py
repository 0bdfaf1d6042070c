"""N-gram drafts (prompt lookup): guess a request's next tokens from its own text.

Outputs that quote, edit or summarise their prompt, code that repeats its names and answers
that restate a question copy runs of earlier tokens. Where the last few tokens of a sequence
occurred before, the tokens that followed them then are a cheap guess at what follows now;
the model checks the guess in one forward of all its tokens (the scheduler's verify step),
and every guessed token it agrees with is a step saved. No draft model, no training.
"""

from __future__ import annotations

from collections.abc import Sequence

CANDIDATES_PER_LOOKUP = 64
"""Earlier occurrences of the last `min_match` tokens a lookup compares, the latest first:
a common token (a space, a newline) occurs thousands of times in a long prompt, and the
latest ones are the likeliest to continue alike."""


class NgramIndex:
    """One request's tokens and, for each run of `min_match` of them, where it ended.

    `propose` finds the longest suffix of the sequence, `min_match` to `max_match` tokens,
    that also occurred earlier, and returns what followed that occurrence (the latest of the
    longest matches). Tokens are appended as the request grows; indexing costs one dict
    update a token, a lookup at most `CANDIDATES_PER_LOOKUP` x `max_match` comparisons.
    """

    def __init__(self, min_match: int, max_match: int) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(
                f"n-gram match sizes must be 1 <= min <= max, got {min_match}, {max_match}"
            )
        self.min_match = min_match
        self.max_match = max_match
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # runs ending before this position are in `_ends`

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the longest earlier match of the sequence's
        end; empty where nothing matches."""
        tokens = self.tokens
        size = len(tokens)
        if count <= 0 or size <= self.min_match:
            return []
        self._index_before(size)
        n = self.min_match
        ends = self._ends.get(tuple(tokens[size - n :]))
        if not ends:
            return []
        best_end, best_len = -1, 0
        for end in reversed(ends[-CANDIDATES_PER_LOOKUP:]):
            length = n
            while (
                length < self.max_match
                and end - length > 0
                and tokens[end - length - 1] == tokens[size - length - 1]
            ):
                length += 1
            if length > best_len:
                best_end, best_len = end, length
                if length == self.max_match:
                    break
        return tokens[best_end : best_end + count]

    def _index_before(self, size: int) -> None:
        """Index every run that ends before the last token (what follows it is known)."""
        n = self.min_match
        tokens = self.tokens
        for end in range(max(self._indexed, n), size):
            self._ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self._indexed = max(self._indexed, size)
