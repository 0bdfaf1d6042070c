"""Unit tests of the page allocator, the page table and the radix / naive prefix caches."""

from __future__ import annotations

import pytest
import torch

from aserve.kvcache.naive import NaiveCache
from aserve.kvcache.pages import PageAllocator, PageTable, pages_needed
from aserve.kvcache.radix import RadixCache


def all_pages_accounted(allocator: PageAllocator, cache: RadixCache | NaiveCache) -> bool:
    pages = allocator.free_page_ids() + list(cache.owned_pages())
    return sorted(pages) == list(range(1, allocator.num_pages))


def test_allocator_never_hands_out_the_dummy_page() -> None:
    allocator = PageAllocator(num_pages=5, page_size=4)
    pages = allocator.alloc(4)
    assert pages is not None and sorted(pages) == [1, 2, 3, 4]
    assert allocator.alloc(1) is None
    allocator.free(pages)
    assert allocator.free_pages == 4


def test_allocator_refuses_more_than_free_and_takes_nothing() -> None:
    allocator = PageAllocator(num_pages=4, page_size=1)
    assert allocator.alloc(5) is None
    assert allocator.free_pages == 3


def test_allocator_rejects_double_free() -> None:
    allocator = PageAllocator(num_pages=4, page_size=1)
    pages = allocator.alloc(2)
    assert pages is not None
    allocator.free(pages)
    with pytest.raises(RuntimeError):
        allocator.free(pages[:1])
    with pytest.raises(RuntimeError):
        allocator.free([0])


def test_pages_needed_rounds_up() -> None:
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_page_table_maps_positions_to_slots() -> None:
    table = PageTable(
        max_running_requests=2, max_seq_len=10, page_size=4, device=torch.device("cpu")
    )
    row = table.alloc_row()
    table.write_pages(row, 0, [3, 1])
    table.write_pages(row, 2, [2])
    assert table.slots[row, :12].tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert table.slots.shape[1] >= 11


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_match_is_page_aligned_and_returns_inserted_pages(page_size: int) -> None:
    allocator = PageAllocator(num_pages=32, page_size=page_size)
    cache = RadixCache(allocator)
    tokens = list(range(100, 112))
    pages = allocator.alloc(len(tokens) // page_size)
    assert pages is not None
    cache.insert(tokens, pages, [])
    match = cache.match(tokens[:7] + [999, 998])
    aligned = 7 // page_size * page_size
    assert match.length == aligned
    assert match.pages == pages[: aligned // page_size]
    assert cache.match([1, 2, 3, 4]).length == 0
    assert all_pages_accounted(allocator, cache)


def test_radix_insert_frees_duplicate_pages_and_keeps_shared_ones() -> None:
    allocator = PageAllocator(num_pages=16, page_size=2)
    cache = RadixCache(allocator)
    first = allocator.alloc(3)
    assert first is not None
    cache.insert([1, 2, 3, 4, 5, 6], first, [])
    match = cache.match([1, 2, 3, 4, 9, 9])
    cache.lock(match.handle)
    own = allocator.alloc(1)
    assert own is not None
    cache.insert([1, 2, 3, 4, 9, 9], match.pages + own, [])
    cache.unlock(match.handle)
    assert cache.cached_pages == 4
    duplicate = allocator.alloc(3)
    assert duplicate is not None
    cache.insert([1, 2, 3, 4, 5, 6], duplicate, [])
    assert cache.cached_pages == 4
    assert all_pages_accounted(allocator, cache)
    assert cache.match([1, 2, 3, 4, 5, 6]).pages == first


def test_radix_locked_prefix_survives_eviction() -> None:
    allocator = PageAllocator(num_pages=16, page_size=1)
    cache = RadixCache(allocator)
    for tokens in ([1, 2, 3], [1, 2, 7], [5, 6]):
        pages = allocator.alloc(len(tokens))
        assert pages is not None
        cache.insert(tokens, pages, [])
    match = cache.match([1, 2, 3])
    cache.lock(match.handle)
    assert cache.evictable_pages == cache.cached_pages - 3
    freed = cache.evict(100)
    assert freed == 3
    assert cache.match([1, 2, 3]).length == 3
    assert cache.match([5, 6]).length == 0
    cache.unlock(match.handle)
    assert cache.evictable_pages == 3
    assert cache.evict(100) == 3
    assert cache.cached_pages == 0
    assert allocator.free_pages == allocator.usable_pages


def test_radix_evicts_least_recently_used_first() -> None:
    allocator = PageAllocator(num_pages=16, page_size=1)
    cache = RadixCache(allocator)
    for tokens in ([1, 1], [2, 2], [3, 3]):
        pages = allocator.alloc(2)
        assert pages is not None
        cache.insert(tokens, pages, [])
    cache.match([1, 1])
    assert cache.evict(2) == 2
    assert cache.match([2, 2]).length == 0
    assert cache.match([1, 1]).length == 2
    assert cache.match([3, 3]).length == 2


def test_radix_split_node_keeps_lock_counts() -> None:
    allocator = PageAllocator(num_pages=16, page_size=1)
    cache = RadixCache(allocator)
    pages = allocator.alloc(6)
    assert pages is not None
    cache.insert([1, 2, 3, 4, 5, 6], pages, [])
    whole = cache.match([1, 2, 3, 4, 5, 6])
    cache.lock(whole.handle)
    part = cache.match([1, 2, 3, 9])
    assert part.length == 3
    cache.lock(part.handle)
    cache.unlock(whole.handle)
    assert cache.evictable_pages == 3
    cache.unlock(part.handle)
    assert cache.evictable_pages == 6


def test_naive_cache_frees_everything_it_is_given() -> None:
    allocator = PageAllocator(num_pages=8, page_size=1)
    cache = NaiveCache(allocator)
    pages = allocator.alloc(3)
    assert pages is not None
    cache.insert([1, 2, 3], pages, [])
    assert allocator.free_pages == allocator.usable_pages
    assert cache.match([1, 2, 3]).length == 0


def test_page_layout_from_the_host_mirror_matches_the_device_table() -> None:
    """FlashInfer's description of a batch, built on the host, names the same pages as the
    slots of the device table, including the dummy row that padded graph entries use."""
    table = PageTable(
        max_running_requests=4, max_seq_len=40, page_size=8, device=torch.device("cpu")
    )
    table.write_pages(2, 0, [5, 9])
    table.write_pages(0, 0, [3])
    table.write_pages(2, 2, [4])
    table.write_pages(0, 1, [7, 1, 6])
    rows, lens = [2, 0, table.dummy_row], [17, 25, 1]
    indptr, last, pages = table.page_layout(rows, lens)
    assert indptr.tolist() == [0, 3, 7, 8]
    assert last.tolist() == [1, 1, 1]
    expected = [int(table.slots[r, p]) // 8 for r, n in zip(rows, lens) for p in range(0, n, 8)]
    assert pages.tolist() == expected == [5, 9, 4, 3, 7, 1, 6, 0]


def test_float16_pool_rounds_to_nearest_and_takes_half_the_bytes() -> None:
    """`--kv-cache-dtype float16` for a float32 model: stored as torch casts to float16,
    read back widened (exactly), half of float32's bytes a token."""
    from aserve.kvcache.pool import KVPool

    pool = KVPool(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"), torch.float16)
    assert pool.quantized and not pool.scaled and pool.kv[0].dtype == torch.float16
    kv = torch.randn(5, 2, 2, 16, generator=torch.Generator().manual_seed(0)) * 30
    slots = torch.tensor([3, 9, 17, 22, 30])
    pool.store(1, slots, kv)
    back = pool.gather(1, slots)
    assert back.dtype == torch.float32 and torch.equal(back, kv.half().float())
    assert torch.equal(pool.gather(0, slots), torch.zeros_like(kv)), "another layer untouched"
    per_token = [KVPool.bytes_per_token(2, 2, 16, dt) for dt in (torch.float32, torch.float16)]
    assert per_token == [512, 256]
