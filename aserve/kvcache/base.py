"""The prefix-cache interface that the scheduler talks to (radix tree or naive)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol


class PrefixMatch(NamedTuple):
    """The longest cached page-aligned prefix: its pages and a handle to lock it with; with
    sliding-window pages, their ids beside `pages` (0 where the cache holds none), and the
    match ends where the window before it is whole."""

    handle: object | None
    pages: list[int]
    length: int
    window_pages: list[int]


class PrefixCache(Protocol):
    """Keeps KV pages of finished prefixes for reuse, and gives them back under pressure.

    Pages the cache holds are either locked (a running request reads them) or evictable.
    """

    def match(self, token_ids: list[int]) -> PrefixMatch: ...

    def lock(self, handle: object | None) -> None: ...

    def unlock(self, handle: object | None) -> None: ...

    def insert(self, token_ids: list[int], pages: list[int], window_pages: list[int]) -> None:
        """Take ownership of `pages` holding the KV of `token_ids` (a whole number of pages),
        and of the non-zero `window_pages` beside them (empty without a sliding window).

        Pages whose prefix the cache already holds under other pages are freed, so after the
        call the caller owns none of `pages`.
        """
        ...

    def evict(self, num_pages: int, num_window_pages: int = 0) -> int:
        """Free at least `num_pages` evictable pages and `num_window_pages` sliding-window
        pages if there are that many; returns the count of the first."""
        ...

    @property
    def evictable_pages(self) -> int: ...

    @property
    def cached_pages(self) -> int: ...

    @property
    def evictable_window_pages(self) -> int: ...

    def owned_pages(self) -> Iterator[int]:
        """Every page the cache holds; for the integrity check."""
        ...

    def owned_window_pages(self) -> Iterator[int]:
        """Every sliding-window page the cache holds; for the integrity check."""
        ...
