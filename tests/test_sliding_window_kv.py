"""Sliding-window layers' own KV pages (Gemma 3, gpt-oss): the prefix cache's matches end
where a window is whole, pages the windows have passed are dropped when their pool runs
short, and the models still generate transformers' tokens with a pool that forces drops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import SchedulerConfig
from aserve.kvcache.pages import PageAllocator, PageTable, SlidingWindow
from aserve.kvcache.radix import RadixCache
from aserve.scheduler.plan import Planner
from aserve.scheduler.request import Req
from aserve.server.state import scheduler_snapshot
from tests.test_gemma import LONG_PROMPTS
from tests.test_models import hf_model
from tests.tiny_models import hf_greedy_tokens, make_tiny_model


def window_cache(
    window: int, page_size: int = 1, pages: int = 64
) -> tuple[RadixCache, PageAllocator, SlidingWindow]:
    allocator = PageAllocator(pages, page_size)
    sliding = SlidingWindow(PageAllocator(pages, page_size), window)
    return RadixCache(allocator, sliding), allocator, sliding


def test_a_match_ends_where_the_next_querys_window_is_held() -> None:
    """A query at position q reads q - 3 .. q with a window of 4: a match of length L needs
    window pages for positions L - 3 .. L - 1."""
    cache, allocator, sliding = window_cache(window=4)
    tokens = list(range(100, 110))
    pages = allocator.alloc(10)
    held = sliding.allocator.alloc(7)
    assert pages is not None and held is not None
    window_pages = [held[0], held[1], held[2], 0, 0, 0, *held[3:]]  # 3-5 dropped
    cache.insert(tokens, pages, window_pages)
    whole = cache.match(tokens + [1])
    assert whole.length == 10 and whole.window_pages == window_pages
    # 7 positions match, but the window of a query at 7 (positions 4-6) lacks 4 and 5; the
    # last end whose window is held is 3 (positions 0-2)
    part = cache.match(tokens[:7] + [1])
    assert part.length == 3 and part.pages == pages[:3]
    assert part.window_pages == window_pages[:3]
    cache.lock(part.handle)  # the handle ends at the match: locking it holds 3 pages
    assert cache.evictable_pages == 7
    cache.unlock(part.handle)
    assert cache.match(tokens + [1]).length == 10  # the cut split a node, lost nothing
    cache.evict(10, 10)
    assert cache.cached_pages == 0
    assert sliding.allocator.free_pages == sliding.allocator.usable_pages


def test_a_match_with_no_whole_window_is_empty_and_pages_count() -> None:
    """With pages of 2, a window of 4 at a match of 6 needs positions 3-5: pages 1 and 2."""
    cache, allocator, sliding = window_cache(window=4, page_size=2)
    tokens = list(range(8))
    pages = allocator.alloc(4)
    held = sliding.allocator.alloc(1)
    assert pages is not None and held is not None
    cache.insert(tokens, pages, [0, 0, 0, held[0]])
    assert cache.match(tokens + [9]).length == 0  # page 2 (positions 4-5) is not held
    assert cache.match(tokens).length == 0


def held_in_unlocked_nodes(cache: RadixCache) -> int:
    """The evictable window pages counted the slow way."""
    return sum(
        sum(1 for page in node.window_pages if page)
        for node in cache._nodes()
        if node.lock_ref == 0
    )


def test_evictable_window_pages_follow_locks_splits_hand_overs_and_evictions() -> None:
    cache, allocator, sliding = window_cache(window=2)
    tokens = [5, 6, 7, 8, 9]
    pages, held = allocator.alloc(5), sliding.allocator.alloc(2)
    assert pages is not None and held is not None
    cache.insert(tokens, pages, [0, 0, 0, *held])
    assert cache.evictable_window_pages == held_in_unlocked_nodes(cache) == 2
    match = cache.match(tokens[:4] + [1])  # splits the node after 4 pages, and locks it
    cache.lock(match.handle)
    assert cache.evictable_window_pages == held_in_unlocked_nodes(cache) == 1
    offered = sliding.allocator.alloc(3)
    assert offered is not None
    cache.insert(tokens[:3], allocator.alloc(3) or [], offered)  # hands over into a lock
    assert cache.evictable_window_pages == held_in_unlocked_nodes(cache) == 1
    cache.unlock(match.handle)
    assert cache.evictable_window_pages == held_in_unlocked_nodes(cache) == 5
    cache.evict(5, 5)
    assert cache.evictable_window_pages == 0 and cache.cached_pages == 0
    assert sliding.allocator.free_pages == sliding.allocator.usable_pages


def test_insert_hands_over_window_pages_the_tree_lacks_and_frees_the_rest() -> None:
    cache, allocator, sliding = window_cache(window=2)
    tokens = [5, 6, 7, 8]
    first, held = allocator.alloc(4), sliding.allocator.alloc(2)
    assert first is not None and held is not None
    cache.insert(tokens, first, [0, 0, *held])
    second, offered = allocator.alloc(4), sliding.allocator.alloc(4)
    assert second is not None and offered is not None
    free_before = sliding.allocator.free_pages
    cache.insert(tokens, second, offered)
    kept = [offered[0], offered[1], *held]
    assert cache.match(tokens + [1]).window_pages == kept
    assert sorted(cache.owned_window_pages()) == sorted(kept)
    assert sliding.allocator.free_pages == free_before + 2  # offered[2:] were duplicates
    assert allocator.free_pages == allocator.usable_pages - 4  # `second` freed whole


def make_window_planner(
    window: int, window_pages: int, page_size: int = 1, max_prefill: int = 8
) -> Planner:
    allocator = PageAllocator(64, page_size)
    sliding = SlidingWindow(PageAllocator(window_pages, page_size), window)
    config = SchedulerConfig(
        max_running_requests=4, max_prefill_length=max_prefill, page_size=page_size
    )
    table = PageTable(4, 64, page_size, torch.device("cpu"), windowed=True)
    return Planner(config, allocator, RadixCache(allocator, sliding), table, sliding)


def make_req(rid: int, prompt: list[int], max_tokens: int) -> Req:
    params = SamplingParams(max_tokens=max_tokens)
    return Req(rid, prompt, params, seed=0, max_total_len=len(prompt) + max_tokens)


def test_window_pages_are_dropped_only_when_their_pool_runs_short() -> None:
    """Two requests decode to 30 tokens each with a window of 4 and 16 window pages: they
    run to the end, dropping what their windows passed once the pool is short, and the page
    table maps every position a query still reads to a held window page."""
    planner = make_window_planner(window=4, window_pages=17)
    reqs = [make_req(i, [10 * (i + 1) + t for t in range(6)], 24) for i in range(2)]
    for req in reqs:
        planner.add(req)
    dropped_any = False
    while planner.running or planner.waiting:
        planned = planner.schedule()
        assert planned is not None
        for req, start in zip(planned.reqs, planned.starts):
            first = max(0, start - 3)
            held = req.window_pages[first:]
            assert all(held)
            table = planner.page_table.window_pages
            assert table is not None and list(table[req.slot, first : len(req.pages)]) == held
            dropped_any |= 0 in req.window_pages
        planner.complete(planned, [3] * len(planned.reqs))
        for req in list(planner.running):
            if len(req.output_ids) == req.params.max_tokens:
                planner.finish(req, req.finish_reason or "length")  # type: ignore[arg-type]
        planner.check_integrity()
    assert dropped_any and planner.window_pages_dropped > 0
    assert planner.window is not None
    window_allocator = planner.window.allocator
    cached = sorted(planner.cache.owned_window_pages())
    assert window_allocator.free_pages + len(cached) == window_allocator.usable_pages


def test_nothing_is_dropped_while_the_window_pool_has_room() -> None:
    planner = make_window_planner(window=4, window_pages=64)
    req = make_req(0, list(range(10, 16)), 20)
    planner.add(req)
    while len(req.output_ids) < 20:
        planned = planner.schedule()
        assert planned is not None
        planner.complete(planned, [3])
    assert 0 not in req.window_pages and len(req.window_pages) == len(req.pages)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_a_short_window_pool_generates_as_transformers(tmp_path: Path, family: str) -> None:
    """Gemma 2's, Gemma 3's and gpt-oss's tiny models (windows of 4) with a window pool of 9
    pages of 4 beside 63: three long prompts prefilled in chunks of 8 and decoded together
    drop window pages and still give transformers' greedy tokens; the next turn of a
    conversation run alone (its last window kept) hits the prefix cache."""
    folder = make_tiny_model(family, tmp_path / family)
    hf = hf_model(folder)
    expected = [hf_greedy_tokens(hf, prompt, 16) for prompt in LONG_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    options = {"page_size": 4, "max_prefill_length": 8, "num_pages": 64}
    with LLM(str(folder), swa_full_tokens_ratio=0.12, **options) as llm:
        engine = llm.runtime.engine
        assert engine.kv_window == 4 and engine.window_pages == 8
        windowed = engine.pool.windowed
        assert any(windowed) and not all(windowed)
        for layer, kv in zip(windowed, engine.pool.kv):
            assert kv.shape[0] == (8 if layer else 64) * 4
        outputs = llm.generate(LONG_PROMPTS, greedy)
        assert [o.token_ids for o in outputs] == expected
        assert llm.scheduler.planner.window_pages_dropped > 0
        llm.scheduler.check_integrity()
        # what the stats lines print: with nothing running, every page held is evictable
        usage = scheduler_snapshot(llm.scheduler)
        assert usage.total_window_tokens == 7 * 4 and usage.total_kv_tokens == 63 * 4
        assert usage.used_window_tokens == usage.used_kv_tokens == 0
        cache = llm.scheduler.cache
        assert cache.evictable_window_pages == len(list(cache.owned_window_pages())) > 0
        # a conversation run alone (no pool pressure: its last window is kept), next turn
        first = llm.generate([LONG_PROMPTS[0]], greedy)[0].token_ids
        assert first == expected[0]
        turn = LONG_PROMPTS[0] + first[:-1] + [5, 6, 7]
        planner = llm.scheduler.planner
        cached_before = planner.prompt_tokens_cached
        reply = llm.generate([turn], greedy)[0].token_ids
        assert planner.prompt_tokens_cached - cached_before >= 44
        assert reply == hf_greedy_tokens(hf, turn, 16)
        llm.scheduler.check_integrity()
