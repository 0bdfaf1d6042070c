"""The scheduler coroutine: plan a batch, run it on the engine, finish it, repeat.

It lives on the server's event loop and is the only owner of requests, pages and the prefix
cache; handlers talk to it through `submit` and `abort` and read their request's channel.

On CUDA, steps overlap: step N+1 is planned and launched before step N's results are read
(`ASERVE_DISABLE_OVERLAP=1` turns it off; on CPU a step is synchronous, so it is off there).
With speculative decoding a step waits for the one before whenever a request may draft:
drafts are looked up in the tokens it sampled, and how many of its drafts it accepts moves
where the next step starts. Steps where no request drafts (their drafts kept missing) still
overlap.
A step whose sampling needs step N's tokens (a grammar's mask, penalties) is launched in two
parts: its forward, then, once step N is read while that forward runs, its sampling.
On CPU the forward runs on the loop's own thread, and handlers run between steps. Running it
in an executor thread was measured slower on a 2-core machine (SmolLM2, 16 x 64 tokens:
14.1 s against 9.3 s): two OpenMP thread teams, the loop thread's and the executor's, spin
against each other for the same cores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from aserve.config import ConfigError, SchedulerConfig
from aserve.constrained.grammar import GrammarCompiler, GrammarError, new_matcher
from aserve.constrained.masks import TokenMasks
from aserve.engine.engine import Engine, StepLogits
from aserve.engine.followers import Followers
from aserve.engine.sampler import SampleOutput
from aserve.engine.step import forward_batch
from aserve.forward import ForwardBatch, ForwardMode
from aserve.kvcache.base import PrefixCache
from aserve.kvcache.naive import NaiveCache
from aserve.kvcache.pages import PageAllocator, SlidingWindow
from aserve.kvcache.radix import RadixCache
from aserve.models.mrope import MropePositions
from aserve.scheduler.batch import SamplingBatches, prompt_scoring, step_images, step_spec
from aserve.scheduler.plan import Planner, ScheduledBatch
from aserve.scheduler.request import (
    FinishReason,
    Req,
    ReqOutput,
    ReqStatus,
    SamplingParams,
    TokenLogprob,
)
from aserve.scheduler.timing import StepTimer, step_timing_window

logger = logging.getLogger(__name__)

StepObserver = Callable[[ScheduledBatch, float], None]
IDLE_KERNEL_POLL_S = 0.5  # how often an idle loop looks for FlashInfer's builds to end


class Forwarded(NamedTuple):
    """A step whose forward is queued and whose sampling is not yet."""

    planned: ScheduledBatch
    batch: ForwardBatch
    logits: StepLogits
    started: float
    gpu_start: torch.cuda.Event | None  # a timing event before the forward (ASERVE_STEP_TIMING)


class InFlight(NamedTuple):
    """A launched step: its plan, its (host) results and the event marking them ready."""

    planned: ScheduledBatch
    out: SampleOutput
    done: torch.cuda.Event | None
    started: float
    gpu_start: torch.cuda.Event | None
    launch_s: float  # host time from the start of planning to the sampling launched
    launch_cpu_s: float  # the loop thread's CPU time in that span
    halfway: torch.cuda.Event | None = None  # an eager forward's middle layer (ForwardBatch)


def make_prefix_cache(
    kind: str, allocator: PageAllocator, window: SlidingWindow | None = None
) -> PrefixCache:
    return RadixCache(allocator, window) if kind == "radix" else NaiveCache(allocator, window)


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        followers: Followers | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.engine = engine
        self.grammars = grammars
        on_cuda = engine.device.type == "cuda"
        self.token_masks = TokenMasks(engine.model_config.vocab_size, pinned=on_cuda)
        self.config = config
        self.followers = followers
        self.allocator = PageAllocator(engine.num_pages, config.page_size)
        self.window = None
        if engine.window_pages:
            window_allocator = PageAllocator(engine.window_pages, config.page_size)
            self.window = SlidingWindow(window_allocator, engine.kv_window)
        cache_type = config.cache_type
        if engine.model_config.linear_attention is not None:
            if config.speculative_algorithm is not None:
                raise ConfigError(
                    "speculative decoding is not supported for models with linear attention "
                    "(a rejected draft would need their recurrent states rolled back)"
                )
            if cache_type == "radix":
                logger.info(
                    "prefix cache off: linear attention layers keep a state a request, not "
                    "one a token, so no prompt prefix can be reused"
                )
            cache_type = "naive"
        self.cache = make_prefix_cache(cache_type, self.allocator, self.window)
        self.planner = Planner(config, self.allocator, self.cache, engine.page_table, self.window)
        if engine.graphs is not None:
            self.planner.max_verify_rows = engine.graphs.max_batch_size
        self.eos_ids = frozenset(engine.model_config.eos_token_ids)
        self.vocab_size = engine.model_config.vocab_size
        self.max_seq_len = engine.max_seq_len
        self._next_rid = 0
        self._wake = asyncio.Event()
        self._stopping = False
        self._running = False
        self._fatal: Exception | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sampling_batches = SamplingBatches(self.vocab_size, engine.device, self.eos_ids)
        self.overlap = engine.device.type == "cuda" and not os.environ.get("ASERVE_DISABLE_OVERLAP")
        window = step_timing_window(engine.device)
        self.timer = None if window is None else StepTimer(window)
        self.gpu_wait_share = 0.0

    def note_decode_launch(self, gpu_idle: bool) -> None:
        """Average, over the last ~8 decode launches, of whether the GPU had already finished
        the step in flight when the next one was launched: with overlap it then sat waiting
        for the loop, which is the bound (streams, handlers, planning). Streams read it to
        gather tokens into fewer events (`StreamPace`)."""
        self.gpu_wait_share += (float(gpu_idle) - self.gpu_wait_share) / 8

    def make_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        images: list[torch.Tensor] | None = None,
        adapter_key: int = 0,
    ) -> Req:
        """A request of `prompt_ids`; with `images` (pixels `[3, H, W]` as the checkpoint's
        image processor makes them), each image token of the prompt takes an image's
        positions (`Engine.expand_images`: a ValueError where they do not pair up); of the
        LoRA adapter of `adapter_key` where not 0 (a ValueError once it is unloaded)."""
        self._next_rid += 1
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        spans = []
        if images:
            prompt_ids, spans = self.engine.expand_images(prompt_ids, images)
        req = Req(rid=self._next_rid, prompt_ids=list(prompt_ids), params=params, seed=seed)
        if adapter_key:
            assert self.engine.adapters is not None
            req.adapter = self.engine.adapters.slot_of(adapter_key)
            req.adapter_key = adapter_key
        req.images = spans
        req.whole_prompt = self.engine.whole_prompts
        if spans and spans[0].grid is not None:
            req.mrope = MropePositions.of(spans)
        req.max_total_len = min(len(req.prompt_ids) + params.max_tokens, self.max_seq_len)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * (len(req.prompt_ids) - 1)
        return req

    def check_request(self, req: Req) -> str | None:
        """Why `req` can never run, or None. Submission ends such a request with an error.

        A request always fits an empty KV pool: the engine caps the context at the pool size.
        """
        n = len(req.prompt_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.max_seq_len:
            return (
                f"the prompt has {n} tokens but the context holds {self.max_seq_len} "
                "(prompt plus at least one generated token)"
            )
        ids = req.prompt_ids
        if req.images:  # their positions hold ids past the vocabulary
            inside = {i for span in req.images for i in range(span.start, span.end)}
            ids = [t for i, t in enumerate(ids) if i not in inside]
            if req.params.prompt_logprobs is not None:
                return "prompt logprobs are not given for prompts with images"
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # builtins: 100k ids
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            return f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        biased = req.params.logit_bias
        if biased and biased[-1][0] >= self.vocab_size:  # pairs sorted by id
            return (
                f"logit_bias names token {biased[-1][0]}, outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        if req.adapter_key:
            assert self.engine.adapters is not None
            try:
                self.engine.adapters.slot_of(req.adapter_key)  # slots never move
            except ValueError as error:
                return str(error)
        if req.params.constraint is not None and self.grammars is None:
            return "constrained output needs the model's tokenizer, and this model has none"
        first_scored = req.params.prompt_logprobs_from
        if req.params.prompt_logprobs is not None and first_scored > max(n - 1, 1):
            return (
                f"prompt logprobs from token {first_scored} asked of a prompt of {n} tokens "
                "(the last one's is the latest there is)"
            )
        return None

    def holds_adapter(self, key: int) -> int:
        """How many requests waiting or running take the LoRA adapter of `key`."""
        planner = self.planner
        return sum(req.adapter_key == key for req in (*planner.waiting, *planner.running))

    def submit(self, req: Req) -> None:
        problem = self.check_request(req)
        if problem is None and req.params.constraint is not None:
            problem = self._attach_matcher(req)
        if problem is not None:
            self._finish(req, FinishReason.ERROR, problem)
            return
        self.planner.add(req)
        self._wake.set()

    def _attach_matcher(self, req: Req) -> str | None:
        """Give a constrained request its matcher, compiling its grammar here unless the
        caller did (the server compiles off the event loop); why it failed, or None."""
        assert self.grammars is not None
        if req.grammar is None:
            try:
                req.grammar = self.grammars.compile(req.params)
            except GrammarError as error:
                return str(error)
        req.matcher = new_matcher(req.grammar)
        return None

    def abort(self, req: Req) -> None:
        """Ask for `req` to end; its pages are freed before the next step is planned."""
        req.aborted = True
        self._wake.set()

    def flush_cache(self) -> bool:
        """Drop every cached prefix (SGLang's /flush_cache) if no request is queued or running;
        False, and nothing dropped, otherwise. Pages a step still in flight writes are safe to
        free: a later step that takes them is queued behind it on the same stream."""
        if self.planner.running or self.planner.waiting:
            return False
        self.cache.evict(self.cache.evictable_pages)
        return True

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def fail(self, error: Exception) -> None:
        """End the loop with `error`, which every request gets and `run` raises. Callable
        from any thread: the tensor-parallel watcher reports a dead rank through it."""
        self._fatal = error
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self, on_step: StepObserver | None = None) -> None:
        """Plan, launch, finish. With overlap, step N+1 is planned and launched before the
        results of step N are read, so the GPU never waits for the host in between.

        Behind an eager forward (a prefill chunk) the next step is planned once the GPU has
        passed that forward's middle layer. Launched straight behind it, the next chunk's
        hundreds of kernels filled the stream's launch queue and the launch spun on the host
        until the GPU drained it (a 16k-token chunk of Qwen3-0.6B on an H200: 25 ms of the
        loop's time, 12 with the queue empty), holding up every handler; half a chunk's GPU
        time (18 ms there) still covers the launch. Requests submitted meanwhile join the
        plan."""
        if self._running:
            raise RuntimeError("the scheduler loop is already running")
        self._running = True
        self._loop = asyncio.get_running_loop()
        pending: InFlight | None = None
        try:
            while not self._stopping:
                self._check_fatal()
                self._apply_aborts()
                if pending is not None and not self._overlaps(pending):
                    await self._finish_step(pending, on_step)
                    pending = None
                if pending is not None and pending.halfway is not None:
                    await self._reached(pending.halfway)
                plan_started = time.perf_counter()
                plan_cpu = time.thread_time() if self.timer is not None else 0.0
                planned = self.planner.schedule()
                if planned is None:
                    if pending is not None:
                        await self._finish_step(pending, on_step)
                        pending = None
                        continue
                    if self.timer is not None:
                        self.timer.idle()
                    self._wake.clear()
                    await self._idle()
                    continue
                if self.timer is not None:
                    self.timer.resume(plan_started)
                in_flight = pending.done if pending is not None else None
                if planned.mode is ForwardMode.DECODE and in_flight is not None:
                    self.note_decode_launch(in_flight.query())
                try:
                    if pending is not None and self._needs_last_tokens(planned):
                        forwarded = self._launch_forward(planned)
                        previous, pending = pending, None
                        launched = await self._finish_step(previous, on_step, forwarded)
                        assert launched is not None
                    else:
                        launched = self._launch(planned)
                    if self.timer is not None:
                        launched = launched._replace(
                            launch_s=time.perf_counter() - plan_started,
                            launch_cpu_s=time.thread_time() - plan_cpu,
                        )
                except Exception as error:
                    if self.followers is not None:
                        raise self.followers.explain(error) from error
                    self._fail_batch(planned, error)
                    continue
                if pending is not None:
                    await self._finish_step(pending, on_step)
                pending = launched
            if pending is not None:
                await self._finish_step(pending, on_step)
        except Exception as error:
            self._fatal = self._fatal or error
            raise
        finally:
            self._abort_everything()

    def _overlaps(self, pending: InFlight) -> bool:
        """The next step may be planned while `pending` runs: not after a verify step (where
        each request goes on depends on what it accepts), nor while a request may draft."""
        return self.overlap and pending.planned.drafts is None and not self.planner.may_draft()

    async def _idle(self) -> None:
        """Wait for work. While FlashInfer's modules still build (a server made ready before
        them), look for their end every half second and take them here, idle, rather than
        in the next request's step (capturing the other decode graphs takes ~1 s)."""
        while self.engine.awaits_kernels:
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_KERNEL_POLL_S)
                return
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                self.engine.take_built_kernels()
        await self._wake.wait()

    def _check_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    @staticmethod
    def _needs_last_tokens(planned: ScheduledBatch) -> bool:
        """Penalties count the tokens generated so far and a grammar's mask follows them: a
        step that samples with either launches its forward, then reads the step in flight
        (advancing the matchers) while that forward runs, then launches its sampling."""
        return any(
            keep and Scheduler._steers_sampling(r) for r, keep in zip(planned.reqs, planned.samples)
        )

    def _launch(self, planned: ScheduledBatch) -> InFlight:
        return self._launch_sampling(self._launch_forward(planned))

    def _launch_forward(self, planned: ScheduledBatch) -> Forwarded:
        """Queue the step's forward (the followers get its spec first)."""
        started = time.perf_counter()
        encoder, both_ways = self.engine.images, self.engine.model_config.bidirectional
        levels = 1 if encoder is None else encoder.levels
        taken = step_images(planned)
        spec = step_spec(planned, self.engine.page_table, levels, both_ways, taken)
        if self.followers is not None:
            self.followers.send(spec)
        batch = forward_batch(spec, self.engine.page_table, self.engine.device)
        if taken is not None:
            self.engine.attach_images(batch, taken.pieces)
        if self.engine.device.type == "cuda" and not batch.is_decode:
            batch.halfway = torch.cuda.Event()
        gpu_start = StepTimer.mark() if self.timer is not None else None
        return Forwarded(planned, batch, self.engine.forward_logits(batch), started, gpu_start)

    def _launch_sampling(self, step: Forwarded) -> InFlight:
        """Queue the step's sampling; on CUDA the sampled ids are copied to host memory
        behind it, and a CUDA event marks when they are there. A request that ended while
        the forward ran samples unconstrained (its token is discarded)."""
        planned = step.planned
        if planned.drafts is None:
            sampling = self.sampling_batches.build(planned)
        else:
            sampling = self.sampling_batches.build_verify(planned)
        scoring = prompt_scoring(planned, self.engine.device)
        matchers = [
            r.matcher
            if keep and r.status is not ReqStatus.FINISHED and r.grammar_after is None
            else None
            for r, keep in zip(planned.reqs, planned.samples)
        ]
        if planned.drafts is None:
            masks = self.token_masks.build(matchers)
        else:
            masks = self.token_masks.build_verify(matchers, planned.drafts)
        out = self.engine.sample(step.batch, step.logits, sampling, scoring, masks)
        self.planner.launched(planned)
        if self.engine.device.type != "cuda":
            return InFlight(planned, out, None, step.started, None, 0.0, 0.0)
        done = torch.cuda.Event(enable_timing=self.timer is not None)
        out = out.to("cpu", non_blocking=True)
        done.record()
        return InFlight(
            planned, out, done, step.started, step.gpu_start, 0.0, 0.0, step.batch.halfway
        )

    async def _finish_step(
        self, step: InFlight, on_step: StepObserver | None, then: Forwarded | None = None
    ) -> InFlight | None:
        """Wait for a launched step without blocking the loop, then hand out its tokens.
        With `then` (the next step's forward, queued), the requests whose next sampling
        follows their tokens (a grammar, penalties) take theirs first, `then`'s sampling is
        launched (returned) and the rest of the batch is handed out while it runs: the GPU
        waits only for the matchers, not for every request's bookkeeping.

        The loop yields here at least once a step: this is where handlers run, stream the
        previous step's tokens and submit new requests. With overlap the next step is already
        queued behind this one, so their work hides behind two steps of GPU time, not one.
        The CUDA event is polled between yields. Polling was chosen over waiting in an
        executor thread (a thread hop per step); measuring the two against each other is
        still to do.
        """
        await asyncio.sleep(0)
        wait_started = time.perf_counter()
        if step.done is not None:
            await self._reached(step.done)
        results_started = time.perf_counter()
        planned, out = step.planned, step.out
        next_ids = out.next_ids.tolist()
        if out.prompt_logprobs is not None:
            self._record_prompt_logprobs(planned, out)
        rows = range(len(planned.reqs))
        launched = None
        try:
            if then is not None:
                steering = [self._steers_sampling(req) for req in planned.reqs]
                first, rows = [i for i in rows if steering[i]], [i for i in rows if not steering[i]]
                self._process_results(planned, out, next_ids, first)
                launched = self._launch_sampling(then)
        finally:  # a failed launch fails its own step, never this one's requests
            self._process_results(planned, out, next_ids, rows)
            if on_step is not None:
                on_step(planned, time.perf_counter() - step.started)
            if self.timer is not None and step.gpu_start is not None and step.done is not None:
                finished = time.perf_counter()
                waited = results_started - wait_started
                self.timer.finished(
                    step.gpu_start,
                    step.done,
                    step.launch_s,
                    step.launch_cpu_s,
                    waited,
                    finished - results_started,
                )
        return launched

    async def _reached(self, event: torch.cuda.Event) -> None:
        """Yield to the loop until the GPU has passed `event`."""
        while not event.query():
            self._check_fatal()
            await asyncio.sleep(0)

    @staticmethod
    def _steers_sampling(req: Req) -> bool:
        return req.params.has_penalties or req.matcher is not None

    def _process_results(
        self, planned: ScheduledBatch, out: SampleOutput, next_ids: list[int], rows: Iterable[int]
    ) -> None:
        verified = _verified(planned.drafts, next_ids) if planned.drafts is not None else None
        for i in rows:
            req, slot = planned.reqs[i], planned.output_slots[i]
            if slot < 0 or req.status is ReqStatus.FINISHED:
                continue
            first_row, tokens = (i, [next_ids[i]]) if verified is None else verified[i]
            # An aborted request keeps its token too: it ends at the next loop turn, and a
            # step launched before then may read its tokens (penalties count them).
            req.output_ids[slot] = tokens[0]
            if req.aborted:
                continue
            reason = None
            for j, token in enumerate(tokens):
                reason = self._finish_reason(req, token, slot + 1 + j)
                if req.matcher is not None and reason is None:
                    if req.grammar_after is None:
                        reason = self._advance_matcher(req, token)
                    elif token == req.grammar_after:  # the thinking has ended: the grammar starts
                        req.grammar_after = None
                if reason is not None:
                    del tokens[j + 1 :]
                    break
            if planned.drafts is not None and planned.drafts[i]:
                self.planner.accept(req, tokens[1:])
                planned.accepted += len(tokens) - 1
            logprobs = ()
            if req.params.logprobs:
                top = req.params.top_logprobs
                logprobs = tuple(
                    out.to_token_logprobs(first_row + j, top) for j in range(len(tokens))
                )
            prompt = self._prompt_logprobs(req) if slot == 0 else ()
            if reason is None:
                req.channel.put_nowait(ReqOutput(tuple(tokens), logprobs, prompt_logprobs=prompt))
                continue
            del req.output_ids[slot + len(tokens) :]
            pooled = out.pooled[i] if out.pooled is not None else None
            self._finish(req, reason, None, tuple(tokens), logprobs, prompt, pooled)

    @staticmethod
    def _record_prompt_logprobs(planned: ScheduledBatch, out: SampleOutput) -> None:
        """File each scored row's logprob under its prompt position (a position scored twice,
        after a retraction, gets the same values again)."""
        assert out.prompt_logprobs is not None
        chosen = out.prompt_logprobs.tolist()
        top_ids = [] if out.prompt_top_ids is None else out.prompt_top_ids.tolist()
        top_values = [] if out.prompt_top_logprobs is None else out.prompt_top_logprobs.tolist()
        row = 0
        for req, start, n, scored in zip(
            planned.reqs, planned.starts, planned.extend_lens, planned.scored
        ):
            if not scored:
                row += 1
                continue
            k = req.params.prompt_logprobs or 0
            for position in range(start + n - scored, start + n):
                if position < len(req.prompt_logprobs):
                    top = tuple(zip(top_ids[row][:k], top_values[row][:k])) if k else ()
                    token = req.prompt_ids[position + 1]
                    req.prompt_logprobs[position] = TokenLogprob(token, chosen[row], top)
                row += 1

    @staticmethod
    def _prompt_logprobs(req: Req) -> tuple[TokenLogprob, ...]:
        """What goes out with the first token: the logprob of every prompt position it
        scores, all filled by then (the steps that computed them came back earlier or with
        this one)."""
        if req.params.prompt_logprobs is None:
            return ()
        wanted = req.prompt_logprobs[req.score_from :]
        filled = tuple(lp for lp in wanted if lp is not None)
        if len(filled) != len(wanted):
            logger.error(
                "request %d: %d prompt logprobs missing", req.rid, len(wanted) - len(filled)
            )
        return filled

    @staticmethod
    def _advance_matcher(req: Req, token: int) -> FinishReason | None:
        """Feed the grammar its token; STOP once it is complete (a grammar that ends can only
        be followed by a stop token, which `ignore_eos` would otherwise keep sampling)."""
        if not req.matcher.accept_token(token):
            logger.error("request %d: the grammar refused token %d it allowed", req.rid, token)
            return FinishReason.STOP
        return FinishReason.STOP if req.matcher.is_terminated() else None

    def _fail_batch(self, planned: ScheduledBatch, error: Exception) -> None:
        """A step that raised ends its requests with an error; the loop and others go on."""
        logger.exception("a %s step of %d requests failed", planned.mode.value, len(planned.reqs))
        for req in planned.reqs:
            self._finish(req, FinishReason.ERROR, f"internal error: {error!r}")

    def _finish_reason(self, req: Req, token: int, produced: int) -> FinishReason | None:
        """Why the request ends with its `produced`-th token, if it does."""
        if token in req.params.stop_token_ids or (
            token in self.eos_ids and not req.params.ignore_eos
        ):
            return FinishReason.STOP
        total = len(req.prompt_ids) + produced
        if produced >= req.params.max_tokens or total >= req.max_total_len:
            return FinishReason.LENGTH
        return None

    def _finish(
        self,
        req: Req,
        reason: FinishReason,
        error: str | None = None,
        tokens: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
        pooled: torch.Tensor | None = None,
    ) -> None:
        self.planner.finish(req, reason, error)
        out = ReqOutput(tokens, logprobs, reason, error, prompt_logprobs, pooled)
        req.channel.put_nowait(out)

    def _apply_aborts(self) -> None:
        for req in [r for r in (*self.planner.running, *self.planner.waiting) if r.aborted]:
            self._finish(req, FinishReason.ABORT)

    def _abort_everything(self) -> None:
        """Requests left when the loop ends are aborted, or get the error that ended it."""
        reason = FinishReason.ABORT if self._fatal is None else FinishReason.ERROR
        error = None if self._fatal is None else str(self._fatal)
        for req in [*self.planner.running, *self.planner.waiting]:
            self._finish(req, reason, error)

    def check_integrity(self) -> None:
        self.planner.check_integrity()


def _verified(drafts: list[list[int]], next_ids: list[int]) -> list[tuple[int, list[int]]]:
    """A verify step's tokens for each request, with the logits row of the first: its
    samples up to the first whose draft it differs from (that one included). Each sample is
    the token decoding would have taken after the drafts before it, so while they agree
    the drafts were right."""
    verified = []
    row = 0
    for drafted in drafts:
        sampled = next_ids[row : row + 1 + len(drafted)]
        kept = 1
        while kept <= len(drafted) and sampled[kept - 1] == drafted[kept - 1]:
            kept += 1
        verified.append((row, sampled[:kept]))
        row += 1 + len(drafted)
    return verified
