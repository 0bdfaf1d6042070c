"""The cache that caches nothing (`--cache naive`): every request computes its whole prompt."""

from __future__ import annotations

from collections.abc import Iterator

from aserve.kvcache.base import PrefixMatch
from aserve.kvcache.pages import PageAllocator


class NaiveCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self._allocator = allocator

    def match(self, token_ids: list[int]) -> PrefixMatch:
        return PrefixMatch(None, [], 0)

    def lock(self, handle: object | None) -> None:
        pass

    def unlock(self, handle: object | None) -> None:
        pass

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        self._allocator.free(pages)

    def evict(self, num_pages: int) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0

    def owned_pages(self) -> Iterator[int]:
        return iter(())
