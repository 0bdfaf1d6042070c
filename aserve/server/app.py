"""The aiohttp application: routes, auth, start-up while loading, and draining shutdown.

One process, one event loop: handlers, the tokenizer pool's futures and the scheduler
coroutine share it. The model loads in a worker thread after the port is bound, so /health
answers 503 (loading) at once and 200 only when the model is ready.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from aserve.config import ServerConfig
from aserve.forward import ForwardMode
from aserve.metrics import Metrics, SchedulerSnapshot, StatsLogger
from aserve.runtime import Runtime
from aserve.scheduler.plan import ScheduledBatch
from aserve.server import openai
from aserve.server.completions import Completions
from aserve.server.http import error_response, json_response, read_json, require_tokenizer
from aserve.server.openai import APIError

logger = logging.getLogger("aserve.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/metrics"})
DEFAULT_NAME = "SmolLM2-135M-Instruct"


class Server:
    """Holds the runtime once loaded, the metrics, and the draining flag."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.runtime: Runtime | None = None
        self.draining = False
        self.model_name = config.served_model_name or config.engine.model_path or DEFAULT_NAME
        self.metrics = Metrics(self.model_name)
        self.stats = StatsLogger(silent=config.silent_output)
        self.active_requests = 0
        self.scheduler_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------

    async def load(self) -> None:
        """Build the runtime off the loop, then start the scheduler coroutine."""
        loop = asyncio.get_running_loop()
        runtime = await loop.run_in_executor(None, Runtime, self.config)
        self.runtime = runtime
        self.scheduler_task = asyncio.create_task(runtime.scheduler.run(self._on_step))

    def _on_step(self, planned: ScheduledBatch, seconds: float) -> None:
        snapshot = self._snapshot()
        self.metrics.update_scheduler(snapshot)
        if planned.mode is ForwardMode.DECODE:
            graphs = self.runtime.engine.graphs if self.runtime is not None else None
            replayed = graphs is not None and len(planned.reqs) <= graphs.max_batch_size
            self.stats.on_step("decode", snapshot, seconds, len(planned.reqs), cuda_graph=replayed)
            return
        first_chunks = [
            r for r, n in zip(planned.reqs, planned.extend_lens) if r.cached_len - n == r.prefix_len
        ]
        self.stats.on_step(
            "prefill",
            snapshot,
            seconds,
            sum(planned.extend_lens),
            new_seqs=len(first_chunks),
            cached_tokens=sum(r.prefix_len for r in first_chunks),
        )

    def _snapshot(self) -> SchedulerSnapshot:
        assert self.runtime is not None
        scheduler = self.runtime.scheduler
        allocator, planner = scheduler.allocator, scheduler.planner
        page_size = allocator.page_size
        free = allocator.free_pages + scheduler.cache.evictable_pages
        return SchedulerSnapshot(
            running=len(planner.running),
            waiting=len(planner.waiting),
            used_kv_tokens=(allocator.usable_pages - free) * page_size,
            total_kv_tokens=allocator.usable_pages * page_size,
            prompt_tokens_admitted_total=planner.prompt_tokens_admitted,
            prompt_tokens_cached_total=planner.prompt_tokens_cached,
            retractions_total=planner.num_retractions,
        )

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let running requests finish within `timeout_s`, abort the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.runtime is not None:
            self.runtime.scheduler.stop()
        if self.scheduler_task is not None:
            await asyncio.wait([self.scheduler_task])
        if self.runtime is not None:
            self.runtime.close()

    # ---- middleware ------------------------------------------------------------------

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """API key check, and every failure turned into an OpenAI error object."""
        try:
            if self.config.api_key and request.path not in OPEN_PATHS:
                self._check_api_key(request)
            return await handler(request)
        except APIError as error:
            return error_response(error)
        except web.HTTPException as http_error:
            if http_error.status < 400:
                raise
            return error_response(APIError(http_error.reason, http_error.status))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            logger.exception("request %s %s failed", request.method, request.path)
            return error_response(
                APIError("internal server error", 500, error_type="internal_server_error")
            )

    def _check_api_key(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        assert self.config.api_key is not None
        if not hmac.compare_digest(token.encode(), self.config.api_key.encode()):
            raise APIError(
                "missing or invalid API key",
                401,
                error_type="invalid_request_error",
                code="invalid_api_key",
            )

    # ---- helpers ---------------------------------------------------------------------

    def ready_runtime(self) -> Runtime:
        if self.draining:
            raise APIError("server is shutting down", 503, error_type="server_error")
        if self.runtime is None:
            raise APIError("model is still loading", 503, error_type="server_error")
        return self.runtime

    def check_model(self, name: str) -> None:
        if name and name != self.model_name:
            raise APIError(
                f"model '{name}' does not exist; this server serves '{self.model_name}'",
                400,
                param="model",
                code="model_not_found",
            )

    def check_queue(self, runtime: Runtime, extra: int) -> None:
        limit = self.config.max_queued_requests
        if limit is not None and len(runtime.scheduler.planner.waiting) + extra > limit:
            raise APIError("too many queued requests, retry later", 503, error_type="server_error")

    # ---- other endpoints ---------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return json_response({"status": "draining"}, 503)
        if self.runtime is None:
            return json_response({"status": "loading"}, 503)
        return json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        runtime = self.ready_runtime()
        card = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "aserve",
            "max_model_len": runtime.engine.max_seq_len,
        }
        return json_response({"object": "list", "data": [card]})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.runtime is not None:
            self.metrics.update_scheduler(self._snapshot())
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def tokenize(self, request: web.Request) -> web.Response:
        runtime = self.ready_runtime()
        body = await read_json(request)
        tokenizer = require_tokenizer(runtime)
        if isinstance(body.get("messages"), list):
            messages = [openai.message_text(m, i) for i, m in enumerate(body["messages"])]
            tokens = await tokenizer.apply_chat_template_async(messages)
        elif isinstance(body.get("prompt"), str):
            tokens = await tokenizer.encode_async(body["prompt"])
        else:
            raise APIError("send 'prompt' (a string) or 'messages'", param="prompt")
        return json_response(
            {"tokens": tokens, "count": len(tokens), "max_model_len": runtime.engine.max_seq_len}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        runtime = self.ready_runtime()
        body = await read_json(request)
        tokens = openai.token_id_list(body.get("tokens"), "tokens")
        vocab = runtime.model_config.vocab_size
        if any(t >= vocab for t in tokens):
            raise APIError(f"token ids must be below the vocabulary size {vocab}", param="tokens")
        return json_response({"prompt": require_tokenizer(runtime).decode(tokens)})

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=64 * 1024 * 1024)
        completions = Completions(self)
        app.router.add_post("/v1/chat/completions", completions.chat_completions)
        app.router.add_post("/v1/completions", completions.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_post("/generate", completions.generate)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app
