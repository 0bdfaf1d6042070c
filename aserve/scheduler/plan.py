"""Batch planning: which requests run next, how many tokens each, and which KV pages.

Plain synchronous code with no device work and no awaits, so every policy here is unit
tested on its own. The policy is prefill first: waiting requests are admitted while the
prefill token budget, the running-request cap and the KV pool allow, the last one chunked
if its prompt does not fit the budget; otherwise every decoding request advances one token.
When the pool runs dry, cached prefixes are evicted first and then the newest requests are
retracted to the front of the queue (their output so far is kept). The oldest request alone
always fits: submission refuses requests that could not fit an empty pool.

With sliding-window layers (`SlidingWindow`) every page a request takes comes with a page of
the windowed layers' pool. While that pool has room, requests keep all of theirs, so what
they leave in the prefix cache serves any later prefix; when it runs short, running requests
first drop the windowed pages of their own that their next query's window has passed (a
long context then holds those layers' KV for the window alone), then cached prefixes go.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from aserve.config import SchedulerConfig
from aserve.forward import ForwardMode
from aserve.kvcache.base import PrefixCache
from aserve.kvcache.pages import PageAllocator, PageTable, SlidingWindow, pages_needed
from aserve.scheduler.request import FinishReason, Req, ReqStatus
from aserve.speculative.ngram import NgramIndex

PENDING_TOKEN = -1
MAX_DRAFT_PAUSE = 8  # steps a request whose drafts keep missing goes without (`accept`)
SCORED_ROWS_PER_STEP = 1024
"""Prompt positions of requests asking for prompt logprobs that one step computes logits at:
each is a float32 row of the vocabulary (1,024 x 152k is 0.6 GB), so their chunks are cut
to this budget, shared by the step's scoring requests."""


@dataclass
class ScheduledBatch:
    """Requests of one step with the tokens each computes from position `starts[i]` on;
    `samples[i]` is False for a chunk that does not yet reach the end of its request's
    sequence; `scored[i]` asks for logits at that many positions at the end of the chunk
    (prompt logprobs).
    `output_slots[i]` is where request i's sampled token goes in its `output_ids` (set at
    launch).

    A verify step (`drafts` set; speculative decoding) runs each decoding request's last
    token and `drafts[i]` after it as decode rows (`batch.step_spec`) and samples every
    row: the sample after each draft is what decoding would have taken there, so the drafts
    up to the first that differs from its sample are accepted, and that sample too."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    samples: list[bool]
    starts: list[int]
    scored: list[int]
    output_slots: list[int] = field(default_factory=list)
    drafts: list[list[int]] | None = None
    accepted: int = 0  # drafts the model agreed with (set as the verify step's results come)


class Planner:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        cache: PrefixCache,
        page_table: PageTable,
        window: SlidingWindow | None = None,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.page_table = page_table
        self.window = window
        self.page_size = allocator.page_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0
        self.window_pages_dropped = 0
        self._dropped_this_step = False
        self.prompt_tokens_admitted = 0
        self.prompt_tokens_cached = 0
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        # rows a verify step may take: on CUDA the largest decode graph (the scheduler sets
        # it), past which a step would run eagerly
        self.max_verify_rows = config.max_prefill_length

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch | None:
        self._dropped_this_step = False
        batch = self._plan_prefill() or self._plan_decode()
        while batch is None and len(self.running) > 1 and self._starved():
            self.retract(self.running[-1])
            batch = self._plan_prefill() or self._plan_decode()
        return batch

    def _starved(self) -> bool:
        """Running requests want a step but none could be planned: the pool is full."""
        return any(not r.decoding or self._wants_decode(r) for r in self.running)

    def _reserve(self, num_pages: int) -> bool:
        """Make `num_pages` free (in both pools with a sliding window), evicting unlocked
        cached prefixes if needed."""
        short = num_pages - self.allocator.free_pages
        window_allocator = self.window.allocator if self.window else None
        short_window = num_pages - window_allocator.free_pages if window_allocator else 0
        if short_window > 0 and not self._dropped_this_step:
            # Once a step: no request's next position moves while a step is planned, so a
            # second pass would free nothing (and cost a pass over hundreds of requests).
            self._dropped_this_step = True
            for req in self.running:
                self._drop_behind_window(req)
            assert window_allocator is not None
            short_window = num_pages - window_allocator.free_pages
        if short > 0 or short_window > 0:
            self.cache.evict(short, short_window)
        if window_allocator and window_allocator.free_pages < num_pages:
            return False
        return self.allocator.free_pages >= num_pages

    def _alloc(self, req: Req, num_pages: int) -> None:
        """Append `num_pages` reserved pages (and window pages) to `req`, mapped in its row."""
        new_pages = self.allocator.alloc(num_pages)
        assert new_pages is not None
        self.page_table.write_pages(req.slot, len(req.pages), new_pages)
        if self.window is not None:
            window_pages = self.window.allocator.alloc(num_pages)
            assert window_pages is not None
            self.page_table.write_pages(req.slot, len(req.window_pages), window_pages, True)
            req.window_pages.extend(window_pages)
        req.pages.extend(new_pages)

    def _grow(self, req: Req, num_tokens: int) -> bool:
        """Give `req` KV pages for positions up to `num_tokens`; False if the pool is full."""
        need = pages_needed(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        self._alloc(req, need)
        return True

    def _drop_behind_window(self, req: Req) -> None:
        """Free the request's own window pages that no query from `cached_len` on reads.
        Nothing reads their page-table entries again, so those stay as they are."""
        if self.window is None:
            return
        first = max(req.window_kept_from, req.prefix_len // self.page_size)
        end = min(self.window.first_kept_page(req.cached_len), len(req.window_pages))
        if end <= first:
            return
        dropped = [p for p in req.window_pages[first:end] if p]
        self.window.allocator.free(dropped)
        self.window_pages_dropped += len(dropped)
        req.window_pages[first:end] = [0] * (end - first)
        req.window_kept_from = end

    def _plan_prefill(self) -> ScheduledBatch | None:
        """Prefill chunks within the step's token budget (one that holds an image whose
        features attend both ways may run past it: `whole_images`)."""
        budget = self.config.max_prefill_length
        scored_budget = SCORED_ROWS_PER_STEP
        reqs: list[Req] = []
        extends: list[int] = []
        scored: list[int] = []
        for req in self.running:
            if req.decoding or budget <= 0:
                continue
            n = min(req.extend_len, budget, req.unscored_ahead + scored_budget)
            n = whole_images(req, req.cached_len, n)
            if n == 0:
                continue
            if not self._grow(req, req.cached_len + n):
                break
            reqs.append(req)
            extends.append(n)
            scored.append(req.scored_rows(n))
            budget -= n
            scored_budget -= scored[-1]
        while self.waiting and budget > 0 and self._can_admit():
            req = self.waiting[0]
            n = self._admit(req, budget, scored_budget)
            if n == 0:
                break
            self.waiting.popleft()
            reqs.append(req)
            extends.append(n)
            scored.append(req.scored_rows(n))
            budget -= n
            scored_budget -= scored[-1]
        if not reqs:
            return None
        samples = [r.cached_len + n == r.total_len for r, n in zip(reqs, extends)]
        return ScheduledBatch(
            ForwardMode.PREFILL, reqs, extends, samples, [r.cached_len for r in reqs], scored
        )

    def _can_admit(self) -> bool:
        return (
            len(self.running) < self.config.max_running_requests and self.page_table.free_rows > 0
        )

    def _admit(self, req: Req, budget: int, scored_budget: int) -> int:
        """Match the cached prefix, take a row and pages; returns the tokens to prefill now
        (0 when the budget is 0 or the pool cannot hold even the first chunk, leaving `req`
        waiting). A request scoring its prompt matches only what comes before the positions
        it scores: those need their logits."""
        if budget <= 0:
            return 0
        match = self.cache.match(req.cache_key(req.all_ids[: req.reusable_len]))
        self.cache.lock(match.handle)
        req.cached_len = match.length  # what `unscored_ahead` counts from
        n = min(req.extend_len, budget, req.unscored_ahead + scored_budget)
        n = whole_images(req, req.cached_len, n)
        need = pages_needed(match.length + n, self.page_size) - len(match.pages)
        if n == 0 or not self._reserve(need):
            self.cache.unlock(match.handle)
            req.cached_len = 0
            return 0
        req.slot = self.page_table.alloc_row()
        req.pages, req.window_pages = [], []
        if match.pages:
            self.page_table.write_pages(req.slot, 0, match.pages)
            req.pages = list(match.pages)
        if self.window is not None and match.window_pages:
            self.page_table.write_pages(req.slot, 0, match.window_pages, True)
            req.window_pages = list(match.window_pages)
        self._alloc(req, need)
        req.window_kept_from = 0
        req.prefix_len = req.cached_len = match.length
        if not req.output_ids:
            req.cached_tokens = match.length
        req.cache_handle = match.handle
        req.status = ReqStatus.RUNNING
        self.prompt_tokens_admitted += req.total_len
        self.prompt_tokens_cached += match.length
        self.running.append(req)
        return n

    def _plan_decode(self) -> ScheduledBatch | None:
        """Every decoding request one token on. A step runs this for hundreds of requests,
        and one in a page's worth needs a new page: the others are passed over cheaply."""
        reqs = [r for r in self.running if self._wants_decode(r)]
        retracted = False
        for req in reqs:
            if req.total_len <= len(req.pages) * self.page_size:
                continue
            while req.status is ReqStatus.RUNNING and not self._grow(req, req.total_len):
                self.retract(self.running[-1])
                retracted = True
        if retracted:
            reqs = [r for r in self.running if self._wants_decode(r)]
        if not reqs:
            return None
        size = len(reqs)
        starts = [r.cached_len for r in reqs]
        drafts = self._draft(reqs) if self.config.speculative_algorithm else None
        if drafts is not None and any(drafts):
            extends = [1 + len(d) for d in drafts]
            return ScheduledBatch(
                ForwardMode.DECODE, reqs, extends, [True] * size, starts, [0] * size, [], drafts
            )
        return ScheduledBatch(
            ForwardMode.DECODE, reqs, [1] * size, [True] * size, starts, [0] * size
        )

    def may_draft(self) -> bool:
        """Some decoding request may draft in the next step (speculative decoding): the step
        in flight must be read first, for its tokens."""
        return self.config.speculative_algorithm is not None and any(
            r.decoding and not r.draft_pause for r in self.running
        )

    def _draft(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's drafted tokens (speculative decoding), within its length limits,
        the step's rows (`max_verify_rows`), the pages free (a request short of them drafts
        none) and its grammar."""
        config = self.config
        budget = self.max_verify_rows - len(reqs)
        drafts: list[list[int]] = []
        for req in reqs:
            room = min(
                config.speculative_num_draft_tokens,
                req.params.max_tokens - len(req.output_ids) - 1,
                req.max_total_len - req.total_len - 1,
                budget,
            )
            draft = []
            if req.draft_pause:
                req.draft_pause -= 1
            elif room > 0 and req.output_ids[-1] != PENDING_TOKEN:
                draft = self._lookup(req, room)
                if draft and req.matcher is not None:
                    draft = grammar_allowed(req, draft)
            if draft and not self._grow(req, req.total_len + len(draft)):
                draft = []
            budget -= len(draft)
            self.draft_tokens += len(draft)
            drafts.append(draft)
        return drafts

    def _lookup(self, req: Req, count: int) -> list[int]:
        index = req.ngram
        if index is None:
            config = self.config
            index = req.ngram = NgramIndex(
                config.speculative_ngram_min_match_window_size,
                config.speculative_ngram_max_match_window_size,
            )
            index.extend(req.vocabulary_prompt_ids)
        index.extend(req.output_ids[len(index.tokens) - len(req.prompt_ids) :])
        return index.propose(count)

    @staticmethod
    def _wants_decode(req: Req) -> bool:
        """Decoding and not already at its length limit (with overlap, the token that reaches
        the limit may still be in flight)."""
        return (
            req.decoding
            and len(req.output_ids) < req.params.max_tokens
            and req.total_len < req.max_total_len
        )

    def launched(self, batch: ScheduledBatch) -> None:
        """Account for a step as soon as it is launched: its KV counts as computed and each
        sampling request gets a pending token, so the next step can be planned before this
        one's results are known (overlap scheduling)."""
        batch.output_slots = [-1] * len(batch.reqs)
        verifies = batch.drafts is not None
        for i, (req, n, keep) in enumerate(zip(batch.reqs, batch.extend_lens, batch.samples)):
            if req.status is ReqStatus.FINISHED:  # ended while this step's forward ran
                continue
            # a verify step's drafts count once accepted (`accept`)
            req.cached_len += 1 if verifies else n
            if batch.scored[i]:
                req.scored_len = max(req.scored_len, req.cached_len)
            if keep:
                req.decoding = True
                batch.output_slots[i] = len(req.output_ids)
                req.output_ids.append(PENDING_TOKEN)

    def complete(self, batch: ScheduledBatch, next_ids: list[int]) -> None:
        """Launch accounting and results at once (steps that are not overlapped)."""
        self.launched(batch)
        for req, slot, token in zip(batch.reqs, batch.output_slots, next_ids):
            if slot >= 0:
                req.output_ids[slot] = token

    def accept(self, req: Req, tokens: list[int]) -> None:
        """A verify step's result for a request that drafted: `tokens` are its drafts the
        model agreed with, which follow the step's first token (already in the output slot
        that launch made); their KV, computed by the step, now counts. A request none of
        whose drafts are taken drafts nothing for its next 1, 2, 4, then 8 steps while that
        goes on: each draft costs a verify row (on a CPU ~15% of a one-token step each)."""
        req.output_ids.extend(tokens)
        req.cached_len += len(tokens)
        self.accepted_draft_tokens += len(tokens)
        req.draft_misses = 0 if tokens else req.draft_misses + 1
        if req.draft_misses:
            req.draft_pause = min(2 ** (req.draft_misses - 1), MAX_DRAFT_PAUSE)

    def _release(self, req: Req) -> None:
        """Hand the request's computed whole pages to the prefix cache, free the rest."""
        whole = req.cached_len // self.page_size
        tokens = req.cache_key(req.all_ids[: whole * self.page_size])
        self.cache.insert(tokens, req.pages[:whole], req.window_pages[:whole])
        self.allocator.free(req.pages[whole:])
        if self.window is not None:
            self.window.allocator.free(p for p in req.window_pages[whole:] if p)
        self.cache.unlock(req.cache_handle)
        self.page_table.free_row(req.slot)
        req.pages, req.window_pages, req.slot, req.cache_handle = [], [], -1, None
        req.cached_len = req.prefix_len = 0
        req.decoding = False
        self.running.remove(req)

    def retract(self, req: Req) -> None:
        """Send a running request back to the front of the queue, keeping its output."""
        self._release(req)
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retractions += 1

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        if req.status is ReqStatus.RUNNING:
            self._release(req)
        elif req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    def owned_pages(self) -> list[int]:
        """Pages held by running requests beyond their cached prefix; for integrity checks."""
        pages: list[int] = []
        for req in self.running:
            pages.extend(req.pages[req.prefix_len // self.page_size :])
        return pages

    def owned_window_pages(self) -> list[int]:
        """Window pages held by running requests beyond their cached prefix."""
        pages: list[int] = []
        for req in self.running:
            pages.extend(p for p in req.window_pages[req.prefix_len // self.page_size :] if p)
        return pages

    def check_integrity(self) -> None:
        """Every usable page is exactly one of: free, in the prefix cache, owned by a request
        (in each pool, with a sliding window)."""
        _check_pages(
            "KV",
            self.allocator,
            list(self.cache.owned_pages()),
            self.owned_pages(),
        )
        if self.window is not None:
            _check_pages(
                "sliding-window KV",
                self.window.allocator,
                list(self.cache.owned_window_pages()),
                self.owned_window_pages(),
            )


def grammar_allowed(req: Req, draft: list[int]) -> list[int]:
    """The drafts' longest run that the request's grammar allows from where it stands, up
    to a token that would end it (a stop token ends the reply: it is sampled, not drafted,
    and no row after it could be masked). The matcher is left as it was. A request still
    thinking before its grammar starts drafts up to the token that starts it, likewise."""
    if req.grammar_after is not None:
        return draft[: draft.index(req.grammar_after)] if req.grammar_after in draft else draft
    matcher = req.matcher
    taken = allowed = 0
    for token in draft:
        if not matcher.accept_token(token):
            break
        taken += 1
        if matcher.is_terminated():
            break
        allowed += 1
    if taken:
        matcher.rollback(taken)
    return draft[:allowed]


def _check_pages(what: str, allocator: PageAllocator, cached: list[int], owned: list[int]) -> None:
    free = allocator.free_page_ids()
    everything = free + cached + owned
    expected = set(range(1, allocator.num_pages))
    if len(everything) != len(set(everything)) or set(everything) != expected:
        seen: set[int] = set()
        doubles = {p for p in everything if p in seen or seen.add(p)}
        raise AssertionError(
            f"{what} page accounting broken: {len(free)} free, {len(cached)} cached, "
            f"{len(owned)} owned of {len(expected)}; doubly owned {sorted(doubles)[:8]}, "
            f"leaked {sorted(expected - set(everything))[:8]}"
        )


def whole_images(req: Req, start: int, n: int) -> int:
    """A chunk of `n` tokens from `start` that ends at no point inside an image whose
    features attend to each other both ways (Gemma 3): cut before the image, or, where the
    chunk starts within or at it, taken to its end (past the step's budget if need be). A
    prompt that runs whole (`Req.whole_prompt`) is one such block."""
    if req.whole_prompt:
        return len(req.prompt_ids) - start
    end = start + n
    for span in req.images:
        if span.both_ways and span.features_start < end < span.features_end:
            first, last = span.features_start, span.features_end
            return first - start if first > start else last - start
    return n
