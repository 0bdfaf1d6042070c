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
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from aserve.config import ServerConfig
from aserve.forward import ForwardMode
from aserve.metrics import StatsLogger
from aserve.runtime import Runtime
from aserve.scheduler.plan import ScheduledBatch
from aserve.scheduler.request import Req
from aserve.server import openai, protocol
from aserve.server.adapters import AdapterRoutes, adapter_folders
from aserve.server.completions import Completions
from aserve.server.embeddings import Embeddings
from aserve.server.fleet import FleetRoutes
from aserve.server.http import error_response, json_response
from aserve.server.image_inputs import template_messages
from aserve.server.limits import MAX_BODY_BYTES
from aserve.server.openai import APIError
from aserve.server.openapi import OPERATIONS, openapi_spec
from aserve.server.scoring import Scoring
from aserve.server.state import ServerState, require_tokenizer

logger = logging.getLogger("aserve.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Served without the API key: what /openapi.json marks open (health, metrics, what a router
# reads), so the description and the check are one list.
OPEN_PATHS = frozenset(op.path for op in OPERATIONS if op.open)


def newly_admitted(planned: ScheduledBatch) -> list[Req]:
    """The requests whose first chunk this prefill batch computed. Read from where each chunk
    started when it was planned: with overlap the next step, maybe the same request's next
    chunk, is already launched (and has moved `cached_len`) when this one is reported."""
    return [r for r, start in zip(planned.reqs, planned.starts) if start == r.prefix_len]


class Server:
    """The application around a `ServerState`: loading, draining, middleware and the small
    routes; the generation routes live in completions.py."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = ServerState.create(config)
        self.metrics = self.state.metrics
        self.stats = StatsLogger(silent=config.silent_output)
        self.scheduler_task: asyncio.Task[None] | None = None

    @property
    def runtime(self) -> Runtime | None:
        return self.state.runtime

    @property
    def model_name(self) -> str:
        return self.state.model_name

    # ---- lifecycle -------------------------------------------------------------------

    async def load(self) -> None:
        """Build the runtime off the loop, then start the scheduler coroutine.

        The load runs on a thread that ends with it. Torch's parallel loading work gives
        that thread a team of OpenMP threads; while a second team lives beside the
        scheduler's, libgomp counts more threads than cores and has idle ones sleep at
        once instead of spinning, so each of a decode step's ~100 parallel regions on CPU
        waited to wake one: the embedded model's step took 12.9 ms over HTTP against 5.0
        with the loader gone (2 cores)."""
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1, thread_name_prefix="aserve-load") as loader:
            runtime = await loop.run_in_executor(loader, Runtime, self.config)
        self.state.loaded(runtime)
        self.scheduler_task = asyncio.create_task(runtime.scheduler.run(self._on_step))

    def _on_step(self, planned: ScheduledBatch, seconds: float) -> None:
        snapshot = self.state.snapshot()
        self.metrics.update_scheduler(snapshot)
        if planned.mode is ForwardMode.DECODE:
            size = len(planned.reqs)
            if self.runtime is not None:
                self.state.pace.on_decode_step(size, self.runtime.scheduler.gpu_wait_share)
            graphs = self.runtime.engine.graphs if self.runtime is not None else None
            rows = sum(planned.extend_lens)  # a verify step's drafts are rows too
            replayed = graphs is not None and rows <= graphs.max_batch_size
            generated = size + planned.accepted
            self.stats.on_step(
                "decode", snapshot, seconds, generated, cuda_graph=replayed, requests=size
            )
            return
        admitted = newly_admitted(planned)
        self.stats.on_step(
            "prefill",
            snapshot,
            seconds,
            sum(planned.extend_lens),
            new_seqs=len(admitted),
            cached_tokens=sum(r.prefix_len for r in admitted),
        )

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let running requests finish within `timeout_s`, abort the rest."""
        self.state.draining = True
        deadline = time.monotonic() + timeout_s
        while self.state.admission.in_use and time.monotonic() < deadline:
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
            return self._refused(error)
        except web.HTTPException as http_error:
            if http_error.status < 400:
                raise
            return self._refused(APIError(http_error.reason, http_error.status))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            logger.exception("request %s %s failed", request.method, request.path)
            return error_response(
                APIError("internal server error", 500, error_type="internal_server_error")
            )

    def _refused(self, error: APIError) -> web.Response:
        """Every refusal is counted by its OpenAI code (or type); a 500 is a fault, not one."""
        if error.status != 500:
            self.metrics.on_rejection(error.code or error.error_type)
        return error_response(error)

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

    # ---- other endpoints ---------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.state.draining or self.state.leaving:
            return json_response({"status": "draining"}, 503)
        if self.runtime is None:
            return json_response({"status": "loading"}, 503)
        return json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        runtime, _ = self.state.ready()
        created = int(time.time())
        card = {
            "id": self.model_name,
            "object": "model",
            "created": created,
            "owned_by": "aserve",
            "max_model_len": runtime.engine.context_length,
            "default_sampling_params": dict(runtime.sampling_defaults),
        }
        adapters = [  # as vLLM lists them: the folder as `root`, the model as `parent`
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "aserve",
                "root": path,
                "parent": self.model_name,
                "max_model_len": runtime.engine.context_length,
            }
            for name, path in adapter_folders(runtime).items()
        ]
        return json_response({"object": "list", "data": [card, *adapters]})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.runtime is not None:
            self.metrics.update_scheduler(self.state.snapshot())
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def tokenize(self, request: web.Request) -> web.Response:
        runtime, limits = self.state.ready()
        with self.state.admission.reserve():
            body = openai.parse_body(protocol.TokenizeRequest, await limits.read_body(request))
            tokenizer = require_tokenizer(runtime)
            if body.messages is not None:
                messages = [openai.message_dict(m) for m in body.messages]
                limits.check_text(sum(map(openai.text_chars, messages)), None, "messages")
                messages, _ = template_messages(runtime, messages)  # an image: its one token
                tokens = await tokenizer.apply_chat_template_async(messages)
            else:
                assert body.prompt is not None
                limits.check_text(len(body.prompt), None, "prompt")
                tokens = await tokenizer.encode_async(body.prompt)
        return json_response(
            {"tokens": tokens, "count": len(tokens), "max_model_len": runtime.engine.context_length}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        runtime, limits = self.state.ready()
        with self.state.admission.reserve():
            body = openai.parse_body(protocol.DetokenizeRequest, await limits.read_body(request))
            vocab = runtime.model_config.vocab_size
            if any(t >= vocab for t in body.tokens):
                raise APIError(
                    f"token ids must be below the vocabulary size {vocab}", param="tokens"
                )
            text = await require_tokenizer(runtime).decode_async(body.tokens)
        return json_response({"prompt": text})

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's: end a /generate request by its rid (or every one); its reply ends with
        finish reason abort. An unknown rid is no error (it may just have finished)."""
        _, limits = self.state.ready()
        body = openai.parse_body(protocol.AbortRequest, await limits.read_body(request))
        if body.rid is None and not body.abort_all:
            raise APIError("send 'rid', or 'abort_all': true", param="rid")
        aborted = self.state.native_rids.abort(None if body.abort_all else body.rid)
        return json_response({"aborted": aborted})

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(self._spec)

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=MAX_BODY_BYTES)
        self._spec = openapi_spec(bearer_auth=self.config.api_key is not None)
        completions = Completions(self.state)
        app.router.add_post("/v1/chat/completions", completions.chat_completions)
        app.router.add_post("/v1/completions", completions.completions)
        app.router.add_post("/v1/responses", completions.responses)
        app.router.add_post("/v1/embeddings", Embeddings(self.state).embeddings)
        Scoring(self.state).add_to(app)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_post("/generate", completions.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/openapi.json", self.openapi)
        FleetRoutes(self.state).add_to(app)
        AdapterRoutes(self.state).add_to(app)
        return app
