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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from aserve.config import ServerConfig
from aserve.forward import ForwardMode
from aserve.metrics import Metrics, SchedulerSnapshot, StatsLogger
from aserve.runtime import Runtime
from aserve.scheduler.plan import ScheduledBatch
from aserve.server import openai
from aserve.server.generation import Choice, Delta
from aserve.server.openai import APIError, GenerationRequest, ResponseHead
from aserve.server.responses import ResponseShaper
from aserve.tokenizer import Tokenizer

logger = logging.getLogger("aserve.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/metrics"})
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def error_response(error: APIError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return json_response(error.body(), error.status, headers)


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
        self._scheduler_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------

    async def load(self) -> None:
        """Build the runtime off the loop, then start the scheduler coroutine."""
        loop = asyncio.get_running_loop()
        runtime = await loop.run_in_executor(None, Runtime, self.config)
        self.runtime = runtime
        self._scheduler_task = asyncio.create_task(runtime.scheduler.run(self._on_step))
        logger.info("%s", runtime.engine.describe())

    def _on_step(self, planned: ScheduledBatch, seconds: float) -> None:
        snapshot = self._snapshot()
        self.metrics.update_scheduler(snapshot)
        if planned.mode is ForwardMode.DECODE:
            self.stats.on_step("decode", snapshot, seconds, len(planned.reqs))
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
            self.runtime.close()
        if self._scheduler_task is not None:
            await self._scheduler_task

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

    def _ready_runtime(self) -> Runtime:
        if self.draining:
            raise APIError("server is shutting down", 503, error_type="server_error")
        if self.runtime is None:
            raise APIError("model is still loading", 503, error_type="server_error")
        return self.runtime

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as error:
            raise APIError(f"request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object")
        return body

    def _check_model(self, name: str) -> None:
        if name and name != self.model_name:
            raise APIError(
                f"model '{name}' does not exist; this server serves '{self.model_name}'",
                400,
                param="model",
                code="model_not_found",
            )

    def _check_queue(self, runtime: Runtime, extra: int) -> None:
        limit = self.config.max_queued_requests
        if limit is not None and len(runtime.scheduler.planner.waiting) + extra > limit:
            raise APIError("too many queued requests, retry later", 503, error_type="server_error")

    # ---- generation endpoints ----------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        runtime = self._ready_runtime()
        parsed = openai.parse_chat(await self._json(request))
        tokenizer = self._tokenizer(runtime)
        assert parsed.messages is not None
        try:
            prompt = await tokenizer.apply_chat_template_async(parsed.messages)
        except ValueError as error:
            raise APIError(str(error), param="messages") from None
        return await self._generate(request, runtime, parsed, [prompt])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        runtime = self._ready_runtime()
        parsed = openai.parse_completion(await self._json(request))
        prompts = parsed.token_ids
        if parsed.texts:
            tokenizer = self._tokenizer(runtime)
            prompts = list(await asyncio.gather(*(tokenizer.encode_async(t) for t in parsed.texts)))
        return await self._generate(request, runtime, parsed, prompts)

    @staticmethod
    def _tokenizer(runtime: Runtime) -> Tokenizer:
        if runtime.tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids to /v1/completions")
        return runtime.tokenizer

    def _make_choices(
        self, runtime: Runtime, parsed: GenerationRequest, prompts: list[list[int]]
    ) -> list[Choice]:
        context = runtime.engine.max_seq_len
        choices = []
        for prompt in prompts:
            if parsed.max_tokens is not None and len(prompt) + parsed.max_tokens > context:
                raise APIError(
                    f"this model's context is {context} tokens, but the prompt has "
                    f"{len(prompt)} tokens and max_tokens is {parsed.max_tokens}",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            max_tokens = parsed.max_tokens or context - len(prompt)
            if max_tokens < 1:
                raise APIError(
                    f"this model's context is {context} tokens and the prompt has "
                    f"{len(prompt)} tokens: no room to generate",
                    param="messages",
                    code="context_length_exceeded",
                )
            for i in range(parsed.n):
                seed = parsed.params.seed
                params = openai.SamplingParams(
                    **{
                        **parsed.params.__dict__,
                        "max_tokens": max_tokens,
                        "seed": None if seed is None else seed + i,
                    }
                )
                choice = Choice(runtime.scheduler, runtime.tokenizer, prompt, params, parsed.stop)
                problem = choice.prepare()
                if problem is not None:
                    raise APIError(problem, param="prompt")
                choices.append(choice)
        return choices

    async def _generate(
        self,
        request: web.Request,
        runtime: Runtime,
        parsed: GenerationRequest,
        prompts: list[list[int]],
    ) -> web.StreamResponse:
        self._check_model(parsed.model)
        choices = self._make_choices(runtime, parsed, prompts)
        self._check_queue(runtime, len(choices))
        prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
        head = ResponseHead(openai.new_id(prefix), self.model_name)
        shaper = ResponseShaper(parsed, head, runtime, choices)
        self.active_requests += 1
        started = time.monotonic()
        try:
            if parsed.stream:
                return await self._stream(request, shaper, choices, started)
            results = await asyncio.gather(*(self._collect(c, started) for c in choices))
            return json_response(shaper.full_body(results))
        finally:
            self.active_requests -= 1

    async def _collect(self, choice: Choice, started: float) -> list[Delta]:
        deltas = []
        async for delta in self._observed(choice, started):
            deltas.append(delta)
        return deltas

    async def _observed(self, choice: Choice, started: float) -> AsyncIterator[Delta]:
        """The choice's deltas, with latency metrics recorded on the way."""
        previous = started
        async for delta in choice.run():
            now = time.monotonic()
            if delta.token_ids:
                if not choice.first_token_seen:
                    choice.first_token_seen = True
                    self.metrics.on_first_token(now - started, len(choice.prompt_ids))
                else:
                    self.metrics.on_tokens(len(delta.token_ids), now - previous)
                previous = now
            if delta.finish_reason is not None:
                self.metrics.on_finish(
                    delta.finish_reason,
                    now - started,
                    len(choice.prompt_ids),
                    choice.completion_tokens,
                )
            yield delta

    async def _stream(
        self,
        request: web.Request,
        shaper: ResponseShaper,
        choices: list[Choice],
        started: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        events: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, choice: Choice) -> None:
            try:
                async for delta in self._observed(choice, started):
                    events.put_nowait((index, delta))
                events.put_nowait((index, None))
            except Exception as error:
                events.put_nowait((index, error))

        tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
        try:
            for chunk in shaper.opening_chunks():
                await response.write(sse(chunk))
            remaining = len(choices)
            while remaining:
                index, item = await events.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    logger.error("streamed choice failed: %s", item)
                    await response.write(sse(APIError(str(item), 500).body()))
                    break
                for chunk in shaper.delta_chunks(index, item):
                    await response.write(sse(chunk))
            else:
                usage_chunk = shaper.usage_chunk()
                if usage_chunk is not None:
                    await response.write(sse(usage_chunk))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        finally:
            for task in tasks:
                task.cancel()
        return response

    # ---- other endpoints ---------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return json_response({"status": "draining"}, 503)
        if self.runtime is None:
            return json_response({"status": "loading"}, 503)
        return json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        runtime = self._ready_runtime()
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
        runtime = self._ready_runtime()
        body = await self._json(request)
        tokenizer = self._tokenizer(runtime)
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
        runtime = self._ready_runtime()
        body = await self._json(request)
        tokens = openai.token_id_list(body.get("tokens"), "tokens")
        vocab = runtime.model_config.vocab_size
        if any(t >= vocab for t in tokens):
            raise APIError(f"token ids must be below the vocabulary size {vocab}", param="tokens")
        return json_response({"prompt": self._tokenizer(runtime).decode(tokens)})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native route: text or input_ids in, text and output_ids out."""
        runtime = self._ready_runtime()
        body = await self._json(request)
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise APIError("'sampling_params' must be an object", param="sampling_params")
        completion_body = {
            **sampling,
            "max_tokens": sampling.get("max_new_tokens", sampling.get("max_tokens", 128)),
            "prompt": body.get("input_ids", body.get("text")),
            "stream": False,
        }
        completion_body.pop("max_new_tokens", None)
        parsed = openai.parse_completion(completion_body)
        prompts = parsed.token_ids
        if parsed.texts:
            prompts = [await self._tokenizer(runtime).encode_async(parsed.texts[0])]
        choices = self._make_choices(runtime, parsed, prompts[:1])
        self._check_queue(runtime, 1)
        self.active_requests += 1
        try:
            deltas = await self._collect(choices[0], time.monotonic())
        finally:
            self.active_requests -= 1
        output_ids = [t for d in deltas for t in d.token_ids]
        return json_response(
            {
                "text": "".join(d.text for d in deltas),
                "output_ids": output_ids,
                "meta_info": {
                    "prompt_tokens": len(prompts[0]),
                    "completion_tokens": len(output_ids),
                    "finish_reason": {"type": deltas[-1].finish_reason if deltas else "abort"},
                },
            }
        )

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
