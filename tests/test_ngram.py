"""The n-gram index that drafts tokens from a request's own text (speculative decoding)."""

from __future__ import annotations

import random

import pytest

from aserve.speculative.ngram import CANDIDATES_PER_LOOKUP, NgramIndex


def index_of(tokens: list[int], min_match: int = 1, max_match: int = 12) -> NgramIndex:
    index = NgramIndex(min_match, max_match)
    index.extend(tokens)
    return index


def brute_force(tokens: list[int], count: int, min_match: int, max_match: int) -> list[int]:
    """The longest earlier match of the end (its latest occurrence), by trying every end."""
    best_end, best_len = -1, 0
    for end in range(len(tokens) - 1, min_match - 1, -1):
        length = 0
        while (
            length < max_match
            and end - length > 0
            and tokens[end - length - 1] == tokens[len(tokens) - length - 1]
        ):
            length += 1
        if length >= min_match and length > best_len:
            best_end, best_len = end, length
    return tokens[best_end : best_end + count] if best_len else []


def test_the_tokens_after_the_earlier_occurrence_are_proposed() -> None:
    index = index_of([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert index.propose(2) == [4, 5]
    assert index.propose(10) == [4, 5, 9, 1, 2, 3]  # as many as there are after it


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    # "7 8 9" occurred after "6" once (-> 10) and without "6" later (-> 11)
    index = index_of([6, 7, 8, 9, 10, 7, 8, 9, 11, 6, 7, 8, 9])
    assert index.propose(1) == [10]
    # with at most 3 tokens matched, both matches are as long: the latest wins
    assert index_of([6, 7, 8, 9, 10, 7, 8, 9, 11, 6, 7, 8, 9], max_match=3).propose(1) == [11]


def test_no_draft_without_a_match_or_below_the_minimum() -> None:
    assert index_of([1, 2, 3, 4]).propose(4) == []
    assert index_of([5, 1, 2, 9, 2]).propose(1) == [9]
    assert index_of([5, 1, 2, 9, 2], min_match=2).propose(1) == []
    assert index_of([1, 2, 1, 2], min_match=2).propose(3) == [1, 2]
    assert index_of([3]).propose(2) == []
    assert index_of([1, 2, 1, 2]).propose(0) == []


def test_growing_the_sequence_keeps_the_index_right() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(40)]
    index = NgramIndex(2, 5)
    index.extend(tokens[:3])
    for size in range(3, len(tokens)):
        assert index.propose(3) == brute_force(tokens[:size], 3, 2, 5), size
        index.extend(tokens[size : size + 1])


@pytest.mark.parametrize("min_match,max_match", [(1, 12), (2, 4), (3, 3)])
def test_lookups_match_a_brute_force_search(min_match: int, max_match: int) -> None:
    rng = random.Random(min_match)
    for trial in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, CANDIDATES_PER_LOOKUP))]
        expected = brute_force(tokens, 4, min_match, max_match)
        assert index_of(tokens, min_match, max_match).propose(4) == expected, (trial, tokens)


def test_bad_match_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramIndex(0, 2)
