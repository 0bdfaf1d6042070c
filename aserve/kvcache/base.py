"""The prefix-cache interface that the scheduler talks to (radix tree or naive)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol


class PrefixMatch(NamedTuple):
    """The longest cached page-aligned prefix: its pages and a handle to lock it with."""

    handle: object | None
    pages: list[int]
    length: int


class PrefixCache(Protocol):
    """Keeps KV pages of finished prefixes for reuse, and gives them back under pressure.

    Pages the cache holds are either locked (a running request reads them) or evictable.
    """

    def match(self, token_ids: list[int]) -> PrefixMatch: ...

    def lock(self, handle: object | None) -> None: ...

    def unlock(self, handle: object | None) -> None: ...

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        """Take ownership of `pages` holding the KV of `token_ids` (a whole number of pages).

        Pages whose prefix the cache already holds under other pages are freed, so after the
        call the caller owns none of `pages`.
        """
        ...

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` evictable pages if there are that many; returns the count."""
        ...

    @property
    def evictable_pages(self) -> int: ...

    @property
    def cached_pages(self) -> int: ...

    def owned_pages(self) -> Iterator[int]:
        """Every page the cache holds; for the integrity check."""
        ...
