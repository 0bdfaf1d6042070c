"""The generation endpoints: OpenAI chat and text completions (streamed or not) and SGLang's
`/generate`. Each request becomes one `Choice` per prompt and `n`; their deltas are shaped
into one JSON body or a stream of SSE chunks, with latency metrics recorded on the way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from aserve.runtime import Runtime
from aserve.server import openai
from aserve.server.generation import Choice, Delta
from aserve.server.http import json_response, read_json, require_tokenizer, sse
from aserve.server.openai import APIError, GenerationRequest, ResponseHead
from aserve.server.responses import ResponseShaper

if TYPE_CHECKING:
    from aserve.server.app import Server

logger = logging.getLogger("aserve.server")


class Completions:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        runtime = self.server.ready_runtime()
        parsed = openai.parse_chat(await read_json(request))
        tokenizer = require_tokenizer(runtime)
        assert parsed.messages is not None
        try:
            prompt = await tokenizer.apply_chat_template_async(parsed.messages)
        except ValueError as error:
            raise APIError(str(error), param="messages") from None
        return await self._generate(request, runtime, parsed, [prompt])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        runtime = self.server.ready_runtime()
        parsed = openai.parse_completion(await read_json(request))
        prompts = parsed.token_ids
        if parsed.texts:
            tokenizer = require_tokenizer(runtime)
            prompts = list(await asyncio.gather(*(tokenizer.encode_async(t) for t in parsed.texts)))
        return await self._generate(request, runtime, parsed, prompts)

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
                params = dataclasses.replace(
                    parsed.params,
                    max_tokens=max_tokens,
                    seed=None if seed is None else seed + i,
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
        self.server.check_model(parsed.model)
        choices = self._make_choices(runtime, parsed, prompts)
        self.server.check_queue(runtime, len(choices))
        prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
        head = ResponseHead(openai.new_id(prefix), self.server.model_name)
        shaper = ResponseShaper(parsed, head, runtime, choices)
        self.server.active_requests += 1
        started = time.monotonic()
        try:
            if parsed.stream:
                return await self._stream(request, shaper, choices, started)
            results = await asyncio.gather(*(self._collect(c, started) for c in choices))
            return json_response(shaper.full_body(results))
        finally:
            self.server.active_requests -= 1

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
                    self.server.metrics.on_first_token(now - started, len(choice.prompt_ids))
                else:
                    self.server.metrics.on_tokens(len(delta.token_ids), now - previous)
                previous = now
            if delta.finish_reason is not None:
                self.server.metrics.on_finish(
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
        for chunk in shaper.opening_chunks():
            await response.write(sse(chunk))
        async with contextlib.aclosing(self._merged(choices, started)) as merged:
            async for index, item in merged:
                if isinstance(item, BaseException):
                    logger.error("streamed choice failed: %s", item)
                    await response.write(sse(APIError(str(item), 500).body()))
                    break
                chunks = shaper.delta_chunks(index, item)
                if chunks:
                    await response.write(b"".join(sse(chunk) for chunk in chunks))
            else:
                usage_chunk = shaper.usage_chunk()
                if usage_chunk is not None:
                    await response.write(sse(usage_chunk))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _merged(
        self, choices: list[Choice], started: float
    ) -> AsyncIterator[tuple[int, Delta | BaseException]]:
        """Every choice's deltas as they come, with the choice's index; a failed choice gives
        its exception. One choice (n=1, the usual case) is read in place: a task and a queue
        between it and the response would cost two loop wake-ups per token instead of one."""
        if len(choices) == 1:
            try:
                async for delta in self._observed(choices[0], started):
                    yield 0, delta
            except Exception as error:
                yield 0, error
            return
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
            remaining = len(choices)
            while remaining:
                index, item = await events.get()
                if item is None:
                    remaining -= 1
                    continue
                yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native route: text or input_ids in, text and output_ids out."""
        runtime = self.server.ready_runtime()
        body = await read_json(request)
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
            prompts = [await require_tokenizer(runtime).encode_async(parsed.texts[0])]
        choices = self._make_choices(runtime, parsed, prompts[:1])
        self.server.check_queue(runtime, 1)
        self.server.active_requests += 1
        try:
            deltas = await self._collect(choices[0], time.monotonic())
        finally:
            self.server.active_requests -= 1
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
