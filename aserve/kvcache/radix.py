"""Radix prefix cache: finished requests leave their KV pages in a tree keyed by token ids.

Every edge holds a whole number of pages, so a match is always page aligned and a page is
never shared between a cached prefix and a request's private tail. A node is locked while a
running request reads its pages (the lock counts up to the root); unlocked leaves are evicted
least-recently-used first.

With a sliding window (`SlidingWindow`), each node also holds the windowed layers' page of
each of its pages, or 0 where the request that computed it had dropped it. A prefix is only
usable up to a point whose window is whole, so a match ends at the last such point; a
request that inserts a page the tree lacks (0) hands its page over.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from aserve.kvcache.base import PrefixMatch
from aserve.kvcache.pages import PageAllocator, SlidingWindow


class RadixNode:
    __slots__ = ("key", "pages", "window_pages", "children", "parent", "lock_ref", "last_access")

    def __init__(
        self,
        key: tuple[int, ...],
        pages: list[int],
        window_pages: list[int],
        parent: RadixNode | None,
    ) -> None:
        self.key = key
        self.pages = pages
        self.window_pages = window_pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, allocator: PageAllocator, window: SlidingWindow | None = None) -> None:
        self._allocator = allocator
        self._window = window
        self._page_size = allocator.page_size
        self._root = RadixNode((), [], [], None)
        self._root.lock_ref = 1
        self._clock = itertools.count(1)
        self._evictable_pages = 0
        self._cached_pages = 0
        self._evictable_window_pages = 0

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def cached_pages(self) -> int:
        return self._cached_pages

    @property
    def evictable_window_pages(self) -> int:
        return self._evictable_window_pages

    @staticmethod
    def _held(node: RadixNode) -> int:
        """The node's window pages (those its requests had not dropped)."""
        return sum(1 for page in node.window_pages if page)

    def _first_page(self, token_ids: tuple[int, ...] | list[int], start: int) -> tuple[int, ...]:
        return tuple(token_ids[start : start + self._page_size])

    def _common_pages(self, key: tuple[int, ...], token_ids: list[int], start: int) -> int:
        """How many whole pages of `key` equal `token_ids[start:]`."""
        size = self._page_size
        limit = min(len(key), len(token_ids) - start) // size
        pages = 0
        while pages < limit:
            offset = pages * size
            if key[offset : offset + size] != tuple(
                token_ids[start + offset : start + offset + size]
            ):
                break
            pages += 1
        return pages

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node` after `num_pages` pages; returns the new upper part."""
        cut = num_pages * self._page_size
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            node.key[:cut], node.pages[:num_pages], node.window_pages[:num_pages], parent
        )
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        parent.children[self._first_page(node.key, 0)] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[num_pages:]
        node.window_pages = node.window_pages[num_pages:]
        node.parent = upper
        upper.children[self._first_page(node.key, 0)] = node
        return upper

    def match(self, token_ids: list[int]) -> PrefixMatch:
        node, pages, window_pages, matched = self._root, [], [], 0
        path: list[RadixNode] = []
        now = next(self._clock)
        while True:
            child = node.children.get(self._first_page(token_ids, matched))
            if child is None:
                break
            common = self._common_pages(child.key, token_ids, matched)
            if common == 0:
                break
            if common * self._page_size < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            pages.extend(child.pages)
            window_pages.extend(child.window_pages)
            matched += len(child.key)
            node = child
            path.append(child)
        if self._window is not None:
            usable = self._usable_pages(window_pages)
            if usable < len(pages):
                node = self._node_ending_at(path, usable)
                del pages[usable:], window_pages[usable:]
                matched = usable * self._page_size
        return PrefixMatch(node, pages, matched, window_pages)

    def _usable_pages(self, window_pages: list[int]) -> int:
        """The longest prefix, in pages, after which the next query's window is held."""
        assert self._window is not None
        missing_before = [0]  # pages without a window page among the first i
        for page in window_pages:
            missing_before.append(missing_before[-1] + (page == 0))
        for end in range(len(window_pages), 0, -1):
            first = self._window.first_kept_page(end * self._page_size)
            if missing_before[end] == missing_before[first]:
                return end
        return 0

    def _node_ending_at(self, path: list[RadixNode], num_pages: int) -> RadixNode:
        """The node of `path` whose pages end after `num_pages` (split there if needed)."""
        end = 0
        for node in path:
            end += len(node.pages)
            if end > num_pages:
                keep = len(node.pages) - (end - num_pages)
                return self._split(node, keep) if keep else node.parent or self._root
            if end == num_pages:
                return node
        return self._root

    def lock(self, handle: object | None) -> None:
        node = handle if isinstance(handle, RadixNode) else None
        while node is not None and node is not self._root:
            if node.lock_ref == 0:
                self._evictable_pages -= len(node.pages)
                self._evictable_window_pages -= self._held(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: object | None) -> None:
        node = handle if isinstance(handle, RadixNode) else None
        while node is not None and node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_pages += len(node.pages)
                self._evictable_window_pages += self._held(node)
            node = node.parent

    def insert(self, token_ids: list[int], pages: list[int], window_pages: list[int]) -> None:
        size = self._page_size
        assert len(token_ids) == len(pages) * size, "insert takes whole pages"
        if self._window is None:
            window_pages = []
        else:
            assert len(window_pages) == len(pages), "a window page (or 0) beside every page"
        node, matched = self._root, 0
        now = next(self._clock)
        while matched < len(token_ids):
            child = node.children.get(self._first_page(token_ids, matched))
            first = matched // size
            if child is None:
                new_pages = pages[first:]
                leaf = RadixNode(tuple(token_ids[matched:]), new_pages, window_pages[first:], node)
                leaf.last_access = now
                node.children[leaf.key[:size]] = leaf
                self._cached_pages += len(new_pages)
                self._evictable_pages += len(new_pages)
                self._evictable_window_pages += self._held(leaf)
                return
            common = self._common_pages(child.key, token_ids, matched)
            if common * size < len(child.key):
                child = self._split(child, common)
            duplicates = [p for p, q in zip(pages[first : first + common], child.pages) if p != q]
            self._allocator.free(duplicates)
            if window_pages:
                self._take_window_pages(child, window_pages[first : first + common])
            child.last_access = now
            matched += len(child.key)
            node = child

    def _take_window_pages(self, node: RadixNode, offered: list[int]) -> None:
        """Keep the offered window pages where `node` has none, free the others."""
        assert self._window is not None
        duplicates = []
        for i, (page, held) in enumerate(zip(offered, node.window_pages)):
            if page and not held:
                node.window_pages[i] = page
                self._evictable_window_pages += node.lock_ref == 0
            elif page and page != held:
                duplicates.append(page)
        self._window.allocator.free(duplicates)

    def evict(self, num_pages: int, num_window_pages: int = 0) -> int:
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = freed_window = 0
        while (freed < num_pages or freed_window < num_window_pages) and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._first_page(leaf.key, 0)]
            self._allocator.free(leaf.pages)
            if self._window is not None:
                held = [p for p in leaf.window_pages if p]
                self._window.allocator.free(held)
                freed_window += len(held)
                self._evictable_window_pages -= len(held)
            freed += len(leaf.pages)
            self._cached_pages -= len(leaf.pages)
            self._evictable_pages -= len(leaf.pages)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _evictable_leaves(self) -> Iterator[RadixNode]:
        return (n for n in self._nodes() if not n.children and n.lock_ref == 0)

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def owned_pages(self) -> Iterator[int]:
        for node in self._nodes():
            yield from node.pages

    def owned_window_pages(self) -> Iterator[int]:
        for node in self._nodes():
            yield from (p for p in node.window_pages if p)
