"""What the HTTP handlers share: the runtime once loaded, its input limits, admission, metrics
and the draining flag. The scheduler owns requests, pages and the cache; this holds only what
the edge needs to accept or refuse a request."""

from __future__ import annotations

from dataclasses import dataclass, field

from aserve.config import ServerConfig
from aserve.kvcache.pages import PageAllocator
from aserve.metrics import Metrics, SchedulerSnapshot
from aserve.runtime import Runtime
from aserve.scheduler.request import StreamPace
from aserve.scheduler.scheduler import Scheduler
from aserve.server.admission import Admission
from aserve.server.limits import InputLimits
from aserve.server.native import RunningRids
from aserve.server.openai import APIError
from aserve.tokenizer import Tokenizer

ROUTER_PLACEHOLDER_MODEL = "unknown"


@dataclass
class ServerState:
    config: ServerConfig
    model_name: str
    metrics: Metrics
    admission: Admission
    runtime: Runtime | None = None
    limits: InputLimits | None = None
    pace: StreamPace = field(default_factory=StreamPace)  # --stream-interval, shared
    native_rids: RunningRids = field(default_factory=RunningRids)  # /generate's, by rid
    leaving: bool = False  # told to stop: /health is 503, requests still taken (--drain-delay)
    draining: bool = False  # requests refused, the running ones finishing

    @classmethod
    def create(cls, config: ServerConfig) -> ServerState:
        name = config.model_name
        queued = config.max_queued_requests
        capacity = None if queued is None else config.scheduler.max_running_requests + queued
        pace = StreamPace(config.stream_interval)
        return cls(config, name, Metrics(name), Admission(capacity), pace=pace)

    def loaded(self, runtime: Runtime) -> None:
        tokenizer = runtime.tokenizer
        chars_per_token = tokenizer.max_chars_per_token if tokenizer is not None else None
        self.limits = InputLimits.for_model(runtime.engine.max_seq_len, chars_per_token)
        self.runtime = runtime

    def ready(self) -> tuple[Runtime, InputLimits]:
        """The runtime and its limits, or a 503 while loading or draining."""
        if self.draining:
            raise APIError(
                "server is shutting down", 503, error_type="server_error", code="shutting_down"
            )
        if self.runtime is None or self.limits is None:
            raise APIError(
                "model is still loading", 503, error_type="server_error", code="model_loading"
            )
        return self.runtime, self.limits

    def ready_to_generate(self) -> tuple[Runtime, InputLimits]:
        """As `ready`, and a 400 on an embedding server (`--is-embedding`)."""
        runtime, limits = self.ready()
        if runtime.engine.model_config.classifies:
            raise APIError(
                "this server runs a classifier: send inputs to /classify, or text pairs to "
                "/score and /rerank",
                code="generation_not_served",
            )
        if runtime.engine.pooling:
            raise APIError(
                "this server serves embeddings (--is-embedding): send inputs to /v1/embeddings",
                code="generation_not_served",
            )
        return runtime, limits

    def snapshot(self) -> SchedulerSnapshot:
        """The scheduler as metrics, stats lines and /get_load read it (once loaded)."""
        assert self.runtime is not None
        return scheduler_snapshot(self.runtime.scheduler)

    @property
    def adapters(self) -> dict[str, int]:
        """The LoRA adapters served beside the model, by name: their keys (none while the
        model loads)."""
        slots = None if self.runtime is None else self.runtime.engine.adapters
        return {} if slots is None else dict(slots.names)

    def adapter_of(self, name: str, param: str = "model") -> int:
        """The key of the LoRA adapter a request's `model` names, or 0 for the model itself.
        A request may leave the model out; SGLang's router, which sends every request
        through its own typed schema, fills an omitted one with its placeholder name."""
        if not name or name == self.model_name or name == ROUTER_PLACEHOLDER_MODEL:
            return 0
        adapters = self.adapters
        if name in adapters:
            return adapters[name]
        served = ", ".join(f"'{n}'" for n in [self.model_name, *adapters])
        raise APIError(
            f"model '{name}' does not exist; this server serves {served}",
            400,
            param=param,
            code="model_not_found",
        )

    def check_model(self, name: str) -> None:
        """A route that serves the model alone (embeddings, scores): an adapter's name is a
        400 too."""
        if self.adapter_of(name):
            raise APIError(
                f"LoRA adapter '{name}' serves chat and text completions; this route serves "
                f"'{self.model_name}'",
                400,
                param="model",
                code="model_not_found",
            )

    def name_of(self, adapter_key: int) -> str:
        """What a reply calls the model of an adapter's key (the model's own name for 0)."""
        names = {key: name for name, key in self.adapters.items()}
        return names.get(adapter_key, self.model_name)


def require_tokenizer(runtime: Runtime) -> Tokenizer:
    if runtime.tokenizer is None:
        raise APIError("this model has no tokenizer: send token ids to /v1/completions")
    return runtime.tokenizer


def scheduler_snapshot(scheduler: Scheduler) -> SchedulerSnapshot:
    """The scheduler's requests and KV pools as metrics and stats lines count them."""
    planner, cache = scheduler.planner, scheduler.cache
    used, total = _pool_tokens(scheduler.allocator, cache.evictable_pages)
    used_window = total_window = 0
    if scheduler.window is not None:
        windowed = scheduler.window.allocator
        used_window, total_window = _pool_tokens(windowed, cache.evictable_window_pages)
    return SchedulerSnapshot(
        running=len(planner.running),
        waiting=len(planner.waiting),
        used_kv_tokens=used,
        total_kv_tokens=total,
        prompt_tokens_admitted_total=planner.prompt_tokens_admitted,
        prompt_tokens_cached_total=planner.prompt_tokens_cached,
        retractions_total=planner.num_retractions,
        used_window_tokens=used_window,
        total_window_tokens=total_window,
        draft_tokens_total=planner.draft_tokens,
        accepted_draft_tokens_total=planner.accepted_draft_tokens,
    )


def _pool_tokens(allocator: PageAllocator, evictable_pages: int) -> tuple[int, int]:
    """A KV pool's tokens held by requests (cached prefixes that may be evicted count as
    free) and its usable tokens."""
    usable, free = allocator.usable_pages, allocator.free_pages + evictable_pages
    return (usable - free) * allocator.page_size, usable * allocator.page_size
