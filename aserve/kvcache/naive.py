"""The cache that caches nothing (`--cache naive`): every request computes its whole prompt."""

from __future__ import annotations

from collections.abc import Iterator

from aserve.kvcache.base import PrefixMatch
from aserve.kvcache.pages import PageAllocator, SlidingWindow


class NaiveCache:
    def __init__(self, allocator: PageAllocator, window: SlidingWindow | None = None) -> None:
        self._allocator = allocator
        self._window = window

    def match(self, token_ids: list[int]) -> PrefixMatch:
        return PrefixMatch(None, [], 0, [])

    def lock(self, handle: object | None) -> None:
        pass

    def unlock(self, handle: object | None) -> None:
        pass

    def insert(self, token_ids: list[int], pages: list[int], window_pages: list[int]) -> None:
        self._allocator.free(pages)
        if self._window is not None:
            self._window.allocator.free(p for p in window_pages if p)

    def evict(self, num_pages: int, num_window_pages: int = 0) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0

    @property
    def evictable_window_pages(self) -> int:
        return 0

    def owned_pages(self) -> Iterator[int]:
        return iter(())

    def owned_window_pages(self) -> Iterator[int]:
        return iter(())
