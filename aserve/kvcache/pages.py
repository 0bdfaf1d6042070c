"""KV pages: the free-page allocator and the device page table.

A page holds `page_size` consecutive token slots of the KV pool. Page 0 is never handed out:
padded batch rows (CUDA-graph padding) write their K/V there. The page table maps
(request slot, position) to a KV slot index, `page * page_size + position % page_size`.

A model with sliding-window layers (Gemma 3, gpt-oss) keeps those layers' K/V in pages of
their own (`SlidingWindow`): when they run short, a request drops the ones its window has
passed, so a long context holds its windowed layers' KV for the window alone. The page
table then maps each position twice, to the whole-context layers' slot and to the windowed
layers' one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from aserve.kvcache.pool import zeros_on


class PageAllocator:
    """Free list of KV pages. Cheap host-side bookkeeping; the KV tensors live in `KVPool`."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is the dummy page)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        """`count` pages, or None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        if count == 0:
            return []
        pages = self._free[-count:]
        del self._free[-count:]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for page in pages:
            if page <= 0 or self._is_free[page]:
                raise RuntimeError(f"page {page} freed twice or never allocated")
            self._is_free[page] = True
            self._free.append(page)

    def free_page_ids(self) -> list[int]:
        return list(self._free)


class SlidingWindow(NamedTuple):
    """The windowed layers' pages: their allocator and the window (positions a query reads,
    itself included). A query at position q reads keys from q - size + 1 on, so a request's
    page whose last position is before that for its next query may be dropped."""

    allocator: PageAllocator
    size: int

    def first_kept_page(self, next_position: int) -> int:
        """The first page a query at `next_position` (or later) still reads."""
        return int(first_read_page(next_position, self.size, self.allocator.page_size))


def first_read_page(positions: int | np.ndarray, window: int, page_size: int) -> int | np.ndarray:
    """The first page a query at each of `positions` (an int or an array) reads under a
    window of `window` positions, its own included."""
    return np.maximum(positions - window + 1, 0) // page_size


class PageWrite(NamedTuple):
    """One `PageTable.write_pages` call, as recorded for tensor-parallel followers."""

    row: int
    first_page_index: int
    pages: list[int]
    window: bool = False


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PageTable:
    """Per request slot, the KV slot of every position; plus the token ids at those positions.

    Both live on the engine's device: a decode step gathers its input ids, which only the
    device knows while the previous step is in flight, without a host round trip. Row
    `max_running_requests` is the dummy row that padded batch entries use. One column more
    than the context: a step that fills the context still writes its sampled token somewhere.
    `pages` mirrors the rows' page ids on the host, from which `slot_ids` and `page_layout`
    describe a batch without device work. With `windowed`, `window_slots` and
    `window_pages` map the same positions to the windowed layers' pages (page 0 where a
    request has dropped or never held one: nothing reads those positions).
    """

    def __init__(
        self,
        max_running_requests: int,
        max_seq_len: int,
        page_size: int,
        device: torch.device,
        windowed: bool = False,
    ) -> None:
        width = self.row_width(max_seq_len, page_size)
        rows = max_running_requests + 1
        self.page_size = page_size
        self.dummy_row = max_running_requests
        self.width = width
        # committed page by page as rows fill (on CPU): 25 MiB for 256 rows of 8,192 positions
        self.slots = zeros_on((rows, width), torch.int32, device)
        self.tokens = zeros_on((rows, width), torch.int64, device)
        self.pages = np.zeros((rows, width // page_size), dtype=np.int32)
        self.window_slots = zeros_on((rows, width), torch.int32, device) if windowed else None
        self.window_pages = np.zeros_like(self.pages) if windowed else None
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        # Bumped whenever a row is mapped from its first page (a request admitted or
        # re-admitted), so state kept per row across decode steps can tell its owner changed.
        self.row_generations = np.zeros(rows, dtype=np.int64)
        self._page_offsets = torch.arange(page_size, dtype=torch.int32)
        self._journal: list[PageWrite] | None = None

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def record_writes(self) -> None:
        """From now on keep every `write_pages` call until `take_writes` (rank 0 under tensor
        parallelism: the followers' page tables must see the same writes)."""
        self._journal = []

    def take_writes(self) -> list[PageWrite]:
        """The writes recorded since the last call (none unless `record_writes` was called)."""
        if not self._journal:
            return []
        writes, self._journal = self._journal, []
        return writes

    def write_pages(
        self, row: int, first_page_index: int, pages: list[int], window: bool = False
    ) -> None:
        """Map the positions covered by `pages` (page `first_page_index` of the row onwards),
        for the windowed layers with `window`."""
        if not pages:
            return
        if self._journal is not None:
            self._journal.append(PageWrite(row, first_page_index, list(pages), window))
        if first_page_index == 0 and not window:
            self.row_generations[row] += 1
        host, device = self._tables(window)
        host[row, first_page_index : first_page_index + len(pages)] = pages
        size = self.page_size
        slots = torch.tensor(pages, dtype=torch.int32)[:, None] * size + self._page_offsets
        start = first_page_index * size
        device[row, start : start + len(pages) * size].copy_(slots.flatten(), non_blocking=True)

    def _tables(self, window: bool) -> tuple[np.ndarray, torch.Tensor]:
        if not window:
            return self.pages, self.slots
        assert self.window_pages is not None and self.window_slots is not None
        return self.window_pages, self.window_slots

    @staticmethod
    def row_width(max_seq_len: int, page_size: int) -> int:
        """Columns of a row: the context plus one, in whole pages."""
        return pages_needed(max_seq_len + 1, page_size) * page_size

    @classmethod
    def bytes_per_row(cls, max_seq_len: int, page_size: int, windowed: bool = False) -> int:
        """Device memory of one row: its slot (int32, twice when `windowed`) and token
        (int64) columns."""
        return cls.row_width(max_seq_len, page_size) * (4 * (1 + windowed) + 8)

    def slot_ids(self, rows: np.ndarray, positions: np.ndarray, window: bool = False) -> np.ndarray:
        """The KV slot of each (row, position), from the host mirror (int64)."""
        size = self.page_size
        pages = self._tables(window)[0][rows, positions // size].astype(np.int64)
        return pages * size + positions % size

    def page_layout(
        self,
        row_ids: list[int],
        seq_lens: list[int],
        window: bool = False,
        first_pages: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows' KV as FlashInfer's paged layout, on the host: page index pointers
        `[B + 1]`, tokens in each row's last page `[B]`, and the page ids, row after row.
        `first_pages` leaves each row's pages before it out (the windowed layers' dropped
        ones): attention masks by the distance between a query and a key, which leaving
        whole pages off the front does not change."""
        lens = np.asarray(seq_lens, dtype=np.int32)
        counts = -(-lens // self.page_size)
        skip = np.zeros_like(counts) if first_pages is None else first_pages.astype(np.int32)
        indptr = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(counts - skip, out=indptr[1:])
        last = lens - (counts - 1) * self.page_size
        widest = int(counts.max(initial=0))
        grid = self._tables(window)[0][np.asarray(row_ids, dtype=np.int64), :widest]
        columns = np.arange(widest)
        return indptr, last, grid[(columns < counts[:, None]) & (columns >= skip[:, None])]
