"""Prometheus metrics under vLLM's names, and the periodic stats lines that SGLang prints.

Every metric is vLLM's name with the prefix `aserve:` in place of `vllm:`, so dashboards and
alerts written for vLLM map one to one. Each `Metrics` owns its registry and each
`StatsLogger` its window, so two servers in one process (tests, the offline API) never mix
numbers. Both are fed by hooks that the event loop calls per token or per step, so every
labelled child is made once up front and a hook is a few additions.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

logger = logging.getLogger("aserve.stats")

FINISH_REASONS = ("stop", "length", "abort", "error")


def _per_decade(mantissas: tuple[float, ...], first: int, last: int) -> tuple[float, ...]:
    """The mantissas in every decade from 10**first to 10**last, as vLLM builds its buckets:
    fine where values cluster, few series in all."""
    return tuple(round(m * 10.0**e, 6) for e in range(first, last + 1) for m in mantissas)


LATENCY_BUCKETS = _per_decade((1, 2, 5), -3, 2)
ITL_BUCKETS = _per_decade((1, 2.5, 5, 7.5), -3, 1)
TOKEN_BUCKETS = _per_decade((1, 2, 5), 0, 5)

StepKind = Literal["prefill", "decode"]
_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)


class SchedulerSnapshot(NamedTuple):
    """The scheduler after a step, as metrics and stats lines read it.

    `used_kv_tokens` counts KV tokens held by requests; evictable cached prefixes count as
    free, as in SGLang's token usage and vLLM's KV cache usage. The `*_window_tokens`
    fields count the sliding-window layers' own pool alike (0 where there is none). The
    `*_total` fields are the planner's monotonic counters passed as read
    (`prompt_tokens_admitted`, `prompt_tokens_cached`, `num_retractions`, and speculative
    decoding's `draft_tokens`, `accepted_draft_tokens`), so the scheduler keeps no reporting
    state.
    """

    running: int
    waiting: int
    used_kv_tokens: int
    total_kv_tokens: int
    prompt_tokens_admitted_total: int
    prompt_tokens_cached_total: int
    retractions_total: int
    used_window_tokens: int = 0
    total_window_tokens: int = 0
    draft_tokens_total: int = 0
    accepted_draft_tokens_total: int = 0

    @property
    def kv_usage(self) -> float:
        return self.used_kv_tokens / self.total_kv_tokens if self.total_kv_tokens else 0.0

    @property
    def window_usage(self) -> float:
        """The sliding-window layers' own pool's usage (0 where there is none)."""
        windowed = self.total_window_tokens
        return self.used_window_tokens / windowed if windowed else 0.0

    def usage_text(self) -> str:
        """`token usage: U` for the stats lines, and the sliding-window pool's as SGLang
        writes it where there is one."""
        text = f"token usage: {self.kv_usage:.2f}"
        if self.total_window_tokens:
            text += f", swa token usage: {self.window_usage:.2f}"
        return text


class TokenSeries:
    """The two series that move with every streamed token, generated tokens and the
    inter-token latency histogram, kept as plain numbers and turned into samples when
    scraped. prometheus_client's counter and histogram take a lock and walk the buckets on
    every observation: about 1 us a token of the one loop's time under hundreds of streams."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.generated = 0
        self.gap_counts = [0] * (len(ITL_BUCKETS) + 1)  # the last one is +Inf
        self.gap_sum = 0.0

    def on_tokens(self, num_tokens: int, gap_s: float) -> None:
        """`num_tokens` later tokens of one request, each `gap_s` after the one before."""
        self.generated += num_tokens
        self.gap_counts[bisect.bisect_left(ITL_BUCKETS, gap_s)] += num_tokens
        self.gap_sum += gap_s * num_tokens

    def collect(self) -> Iterator[Metric]:
        labels = [self.model_name]
        generated = CounterMetricFamily(
            "aserve:generation_tokens", "Generated tokens.", labels=["model_name"]
        )
        generated.add_metric(labels, self.generated)
        yield generated
        itl = HistogramMetricFamily(
            "aserve:inter_token_latency_seconds",
            "Gap between consecutive tokens of a request.",
            labels=["model_name"],
        )
        bounds = [floatToGoString(b) for b in ITL_BUCKETS] + ["+Inf"]
        cumulative, running = [], 0
        for bound, count in zip(bounds, self.gap_counts):
            running += count
            cumulative.append((bound, running))
        itl.add_metric(labels, cumulative, self.gap_sum)
        yield itl


def _increase(before: int, now: int) -> int:
    """How far a monotonic total moved; a smaller reading means its source restarted."""
    return now - before if now >= before else now


class Metrics:
    """The Prometheus metrics of one served model; every series has the label `model_name`.

    ================================  =========  ==============================================
    name (after `aserve:`)            type       meaning
    ================================  =========  ==============================================
    prompt_tokens_total               counter    prompts, counted at their first token
    generation_tokens_total           counter    generated tokens
    num_requests_running              gauge      requests holding KV pages
    num_requests_waiting              gauge      requests queued for admission
    kv_cache_usage_perc               gauge      used / total KV tokens, 0..1
    swa_kv_cache_usage_perc           gauge      the same for the sliding-window layers' own
                                                 KV pool (SGLang's swa token usage; 0 where
                                                 the model has none)
    prefix_cache_queries_total        counter    tokens looked up in the prefix cache
    prefix_cache_hits_total           counter    of those, tokens found cached
    prefix_cache_hit_rate             gauge      hits / queries since the planner started
    num_preemptions_total             counter    requests retracted to the queue for KV room
    time_to_first_token_seconds       histogram  submission to first token
    inter_token_latency_seconds       histogram  gap between two tokens of one request
    e2e_request_latency_seconds       histogram  submission to finish
    request_prompt_tokens             histogram  prompt tokens per finished request
    request_generation_tokens         histogram  generated tokens per finished request
    request_success_total             counter    finished requests by `finished_reason`
    requests_rejected_total           counter    refused requests by `reason`: the error's
                                                 OpenAI code (queue_full, model_loading,
                                                 shutting_down, context_length_exceeded,
                                                 request_too_large, invalid_api_key, ...) or
                                                 its type (invalid_request_error)
    ================================  =========  ==============================================

    Token counters move as tokens arrive, not at finish, so `rate()` follows the load live.
    Re-prefills after a retraction count again as prefix cache queries, as in vLLM.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._prompt_tokens = self._make(Counter, "prompt_tokens", "Prefilled prompt tokens.")
        self._tokens = TokenSeries(model_name)
        self.registry.register(self._tokens)
        self._running = self._make(Gauge, "num_requests_running", "Requests holding KV pages.")
        self._waiting = self._make(Gauge, "num_requests_waiting", "Requests in the queue.")
        self._kv_usage = self._make(Gauge, "kv_cache_usage_perc", "KV cache usage, 0..1.")
        self._window_usage = self._make(
            Gauge, "swa_kv_cache_usage_perc", "Sliding-window layers' KV pool usage, 0..1."
        )
        self._prefix_queries = self._make(
            Counter, "prefix_cache_queries", "Tokens looked up in the prefix cache."
        )
        self._prefix_hits = self._make(
            Counter, "prefix_cache_hits", "Tokens found in the prefix cache."
        )
        self._hit_rate = self._make(
            Gauge, "prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens."
        )
        self._preemptions = self._make(
            Counter, "num_preemptions", "Requests retracted to the queue for KV room."
        )
        self._draft_tokens = self._make(
            Counter, "spec_decode_num_draft_tokens", "Tokens drafted for speculative decoding."
        )
        self._accepted_tokens = self._make(
            Counter,
            "spec_decode_num_accepted_tokens",
            "Drafted tokens the model agreed with (each a decode step saved).",
        )
        self._ttft = self._make(
            Histogram,
            "time_to_first_token_seconds",
            "Submission to first token.",
            buckets=LATENCY_BUCKETS,
        )
        self._e2e = self._make(
            Histogram,
            "e2e_request_latency_seconds",
            "Submission to finish.",
            buckets=LATENCY_BUCKETS,
        )
        self._request_prompt_tokens = self._make(
            Histogram, "request_prompt_tokens", "Prompt tokens per request.", buckets=TOKEN_BUCKETS
        )
        self._request_generation_tokens = self._make(
            Histogram,
            "request_generation_tokens",
            "Generated tokens per request.",
            buckets=TOKEN_BUCKETS,
        )
        success = Counter(
            "aserve:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._rejected = Counter(
            "aserve:requests_rejected",
            "Refused requests by reason (the error's code or type).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self._last = SchedulerSnapshot(0, 0, 0, 0, 0, 0, 0)

    def _make(self, kind: type[_Metric], name: str, doc: str, **kwargs: Any) -> _Metric:
        metric = kind(f"aserve:{name}", doc, ["model_name"], registry=self.registry, **kwargs)
        return metric.labels(self.model_name)

    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        """A request's first token, `ttft_s` after submission: its prompt is now prefilled."""
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(prompt_tokens)
        self._tokens.generated += 1

    def on_tokens(self, num_tokens: int, seconds_since_previous_token: float) -> None:
        """Later tokens of one request that arrived together; each is observed with an equal
        share of the gap, so the histogram stays per token."""
        self._tokens.on_tokens(num_tokens, seconds_since_previous_token / num_tokens)

    def on_finish(
        self, reason: str, e2e_s: float, prompt_tokens: int, generation_tokens: int
    ) -> None:
        """A request's terminal reply; `reason` is one of `FINISH_REASONS` (or a
        `FinishReason`, whose members hash and compare as their values)."""
        self._success[reason].inc()
        self._e2e.observe(e2e_s)
        self._request_prompt_tokens.observe(prompt_tokens)
        self._request_generation_tokens.observe(generation_tokens)

    def on_embedding(self, e2e_s: float, prompt_tokens: int) -> None:
        """One input of an embedding request, embedded `e2e_s` after submission: its tokens
        are prefilled prompt tokens, its end a finish by "stop" that generated nothing."""
        self._prompt_tokens.inc(prompt_tokens)
        self.on_finish("stop", e2e_s, prompt_tokens, 0)

    def on_rejection(self, reason: str) -> None:
        """A request refused at the edge; `reason` comes from aserve's own error codes, so
        the label's values are few."""
        self._rejected.labels(self.model_name, reason).inc()

    def update_scheduler(self, snapshot: SchedulerSnapshot) -> None:
        """Set the gauges, and advance the counters by how far the planner's totals moved."""
        last, self._last = self._last, snapshot
        self._running.set(snapshot.running)
        self._waiting.set(snapshot.waiting)
        self._kv_usage.set(snapshot.kv_usage)
        self._window_usage.set(snapshot.window_usage)
        queries, hits = snapshot.prompt_tokens_admitted_total, snapshot.prompt_tokens_cached_total
        self._prefix_queries.inc(_increase(last.prompt_tokens_admitted_total, queries))
        self._prefix_hits.inc(_increase(last.prompt_tokens_cached_total, hits))
        self._preemptions.inc(_increase(last.retractions_total, snapshot.retractions_total))
        self._draft_tokens.inc(_increase(last.draft_tokens_total, snapshot.draft_tokens_total))
        accepted = snapshot.accepted_draft_tokens_total
        self._accepted_tokens.inc(_increase(last.accepted_draft_tokens_total, accepted))
        self._hit_rate.set(hits / queries if queries else 0.0)

    def render(self) -> tuple[bytes, str]:
        """The body and content type of a /metrics reply."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class StatsLogger:
    """SGLang's load lines on the logger "aserve.stats", so its users read aserve at a glance.

    Every prefill batch logs a `Prefill batch.` line. Decode steps log a `Decode batch.` line
    once at least `interval_s` seconds passed since the window opened (the start of the first
    step after the previous line). Its gen throughput is the decode tokens of the window over
    the seconds spent in steps, prefill included: idle time between requests does not dilute
    it. With speculative decoding a request may take several tokens a step: the line then
    adds SGLang's `accept len`, the tokens a request took a step on average. `silent`
    (`--silent-output`) turns both lines off.
    """

    def __init__(
        self,
        interval_s: float = 5.0,
        silent: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.silent = silent
        self._clock = clock
        self._window_start: float | None = None
        self._tokens = 0
        self._request_steps = 0
        self._busy_s = 0.0

    def on_step(
        self,
        kind: StepKind,
        snapshot: SchedulerSnapshot,
        step_s: float,
        num_tokens: int,
        *,
        new_seqs: int = 0,
        cached_tokens: int = 0,
        cuda_graph: bool = False,
        requests: int | None = None,
    ) -> None:
        """A step of `step_s` seconds just ended. `num_tokens` is what a prefill batch computed
        or a decode batch generated, by `requests` requests (`num_tokens` unless some took
        drafted tokens too); `new_seqs` and `cached_tokens` count the requests that a
        prefill batch admitted and their cached prefix; `cuda_graph` whether a decode batch
        replayed a graph."""
        if self.silent:
            return
        now = self._clock()
        if self._window_start is None:
            self._window_start = now - step_s
        self._busy_s += step_s
        if kind == "prefill":
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                "%s, #running-req: %d, #queue-req: %d",
                new_seqs,
                num_tokens,
                cached_tokens,
                snapshot.usage_text(),
                snapshot.running,
                snapshot.waiting,
            )
            return
        self._tokens += num_tokens
        self._request_steps += num_tokens if requests is None else requests
        if now - self._window_start < self.interval_s:
            return
        accepted = ""
        if self._tokens != self._request_steps:
            accepted = f"accept len: {self._tokens / self._request_steps:.2f}, "
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, %s, %scuda graph: %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            snapshot.running,
            snapshot.used_kv_tokens,
            snapshot.usage_text(),
            accepted,
            cuda_graph,
            self._tokens / self._busy_s if self._busy_s > 0 else 0.0,
            snapshot.waiting,
        )
        self._window_start, self._tokens, self._busy_s = None, 0, 0.0
        self._request_steps = 0
