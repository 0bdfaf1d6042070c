"""The routes a router or a fleet manager calls on a replica, in SGLang's shapes.

SGLang's router (`sglang-router`) asks a new worker who it is (`/server_info`, `/model_info`:
the served model name becomes the router's model id), polls `/health` (503 while loading or
draining takes the replica out of rotation), polls `/get_load` for its power-of-two policy,
and fans `/flush_cache` and `/metrics` out to every worker. The older names
(`/get_server_info`, `/get_model_info`) answer too. Nothing here reaches into the engine
beyond what the metrics already read; a flush is the scheduler's own decision.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

import aserve
from aserve.sampling_params import SamplingParams
from aserve.server.generation import Choice
from aserve.server.http import json_response
from aserve.server.openai import APIError
from aserve.server.state import ServerState

HEALTH_GENERATE_TIMEOUT_S = 20.0


class FleetRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def add_to(self, app: web.Application) -> None:
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        app.router.add_get("/get_load", self.load)
        app.router.add_route("GET", "/flush_cache", self.flush_cache)
        app.router.add_route("POST", "/flush_cache", self.flush_cache)
        app.router.add_get("/health_generate", self.health_generate)

    async def server_info(self, request: web.Request) -> web.Response:
        runtime, _ = self.state.ready()
        config = runtime.config  # as run: a small GPU may have lowered the batch limits
        snapshot = self.state.snapshot()
        return json_response(
            {
                "model_path": config.engine.model_path or str(runtime.model_dir),
                "served_model_name": self.state.model_name,
                "version": aserve.__version__,
                "dp_size": 1,
                "tp_size": config.engine.tensor_parallel_size,
                "max_running_requests": config.scheduler.max_running_requests,
                "max_total_num_tokens": snapshot.total_kv_tokens,
                "max_prefill_tokens": config.scheduler.max_prefill_length,
                "context_length": runtime.engine.context_length,
                "page_size": config.scheduler.page_size,
                "device": str(runtime.engine.device),
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        runtime, _ = self.state.ready()
        model = runtime.model_config
        return json_response(
            {
                "model_path": self.state.config.engine.model_path or str(runtime.model_dir),
                "tokenizer_path": str(runtime.model_dir) if runtime.tokenizer else None,
                "is_generation": True,
                "model_type": model.model_type,
                "architectures": [model.architecture],
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        """One entry per data-parallel rank, as SGLang answers; `num_tokens` is the work held
        or queued: KV tokens in use plus the prompts still waiting."""
        runtime, _ = self.state.ready()
        snapshot = self.state.snapshot()
        waiting_tokens = sum(len(r.prompt_ids) for r in runtime.scheduler.planner.waiting)
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": snapshot.running + snapshot.waiting,
                    "num_waiting_reqs": snapshot.waiting,
                    "num_tokens": snapshot.used_kv_tokens + waiting_tokens,
                }
            ]
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        runtime, _ = self.state.ready()
        if not runtime.scheduler.flush_cache():
            raise APIError(
                "the prefix cache was not flushed: requests are queued or running",
                code="server_busy",
            )
        return json_response({"status": "flushed"})

    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy only if the engine produces a token: a replica whose scheduler is stuck
        still answers /health, not this."""
        runtime = self.state.runtime
        if runtime is None:
            return json_response({"status": "loading"}, 503)
        if self.state.leaving or self.state.draining:
            return json_response({"status": "draining"}, 503)
        first = runtime.model_config.bos_token_id or 0
        params = SamplingParams(max_tokens=1, temperature=0.0)
        choice = Choice(runtime.scheduler, None, [first], params, [])
        if choice.prepare() is not None:
            return json_response({"status": "unhealthy"}, 503)

        async def one_token() -> bool:
            return sum([len(delta.token_ids) async for delta in choice.run()]) > 0

        try:
            produced = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError):
            produced = False
        if not produced:
            return json_response({"status": "unhealthy"}, 503)
        return json_response({"status": "ok"})
