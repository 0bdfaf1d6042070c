"""OpenAI's `/v1/embeddings`, on a server started with `--is-embedding`: each input runs as
a prompt whose last token's normalised hidden state, unit length, is its embedding
(`DecoderForCausalLM.embed`), batched with the other requests by the same scheduler.

Text is encoded as the tokenizer's defaults say (Qwen3-Embedding's appends its end-of-text
token, which it pools). `dimensions` keeps the leading values and makes them unit length
again, as Matryoshka-trained models (Qwen3-Embedding) are read; `encoding_format: base64`
(what the openai SDK asks for unless told otherwise) sends each embedding's float32 values,
little-endian.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import torch
from aiohttp import web

from aserve.runtime import Runtime
from aserve.scheduler.request import FinishReason, Req, SamplingParams
from aserve.server import protocol
from aserve.server.http import json_response
from aserve.server.limits import InputLimits
from aserve.server.openai import APIError, parse_body
from aserve.server.state import ServerState, require_tokenizer
from aserve.server.truncation import encode_keeping_last, keep_last, kept_tokens

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
"""An embedding request's one step: its prompt, whose output ends it."""


class Embeddings:
    """The embeddings route; it holds admission places for its inputs, as the generation
    routes do for their choices."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def embeddings(self, request: web.Request) -> web.Response:
        runtime, limits = self.state.ready()
        if not runtime.engine.pooling or runtime.engine.model_config.classifies:
            raise APIError(
                "this server generates text or classifies; start it with --is-embedding on an "
                "embedding model to serve embeddings",
                code="embeddings_not_served",
            )
        with self.state.admission.reserve() as places:
            parsed = parse_body(protocol.EmbeddingRequest, await limits.read_body(request))
            self.state.check_model(parsed.model or "")
            hidden = runtime.engine.model_config.hidden_size
            if parsed.dimensions is not None and parsed.dimensions > hidden:
                raise APIError(
                    f"dimensions is {parsed.dimensions}, but this model's embeddings have {hidden}",
                    param="dimensions",
                )
            given = parsed.input
            places.resize(1 if isinstance(given, str) or isinstance(given[0], int) else len(given))
            keep = pooling_kept_tokens(runtime, parsed.truncate_prompt_tokens)
            prompts = await input_ids(runtime, limits, given, keep)
            reqs = [pooling_request(runtime, i, prompt) for i, prompt in enumerate(prompts)]
            started = time.monotonic()
            vectors = await run_pooling(runtime, reqs)
        elapsed = time.monotonic() - started
        for prompt in prompts:
            self.state.metrics.on_embedding(elapsed, len(prompt))
        data = [
            {"object": "embedding", "index": i, "embedding": encoded(v, parsed)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(p) for p in prompts)
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": self.state.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


def pooling_kept_tokens(runtime: Runtime, asked: int | None) -> int | None:
    """What `truncate_prompt_tokens` keeps of a pooling route's input (-1: all that fits)."""
    room = runtime.scheduler.max_seq_len - 1  # the position after the input takes its token
    return kept_tokens(asked, runtime.engine.context_length, room)


async def input_ids(
    runtime: Runtime, limits: InputLimits, given: Any, keep: int | None = None
) -> list[list[int]]:
    """A pooling route's inputs as token ids: text encoded in the tokenizer's pool; each cut
    to its last `keep` tokens where the request asks (`truncate_prompt_tokens`)."""
    if isinstance(given, str):
        given = [given]
    if not isinstance(given[0], str):
        rows = [given] if isinstance(given[0], int) else [list(ids) for ids in given]
        return [keep_last(ids, keep) for ids in rows]
    for text in given:
        limits.check_text(len(text), None, "input")
    tokenizer = require_tokenizer(runtime)
    if keep is not None:
        cut = (encode_keeping_last(tokenizer, text, keep) for text in given)
        return list(await asyncio.gather(*cut))
    return list(await asyncio.gather(*(tokenizer.encode_async(t) for t in given)))


def pooling_request(runtime: Runtime, index: int, prompt: list[int], param: str = "input") -> Req:
    """Input `index`'s request on a pooling model, or a 400 (naming `param`) that says why
    it cannot run."""
    scheduler = runtime.scheduler
    room = scheduler.max_seq_len - 1  # the position after the prompt takes its one token
    if len(prompt) > room:
        raise APIError(
            f"input {index} has {len(prompt)} tokens, but this model's context holds "
            f"{room} for an input",
            param=param,
            code="context_length_exceeded",
        )
    req = scheduler.make_request(prompt, ONE_TOKEN)
    problem = scheduler.check_request(req)
    if problem is not None:
        raise APIError(f"input {index}: {problem}", param=param)
    return req


async def run_pooling(runtime: Runtime, reqs: list[Req]) -> list[torch.Tensor]:
    """What the model pools for every request (an embedding, or a classifier's logits);
    requests still running when the client goes (the handler is cancelled) are aborted and
    free their pages."""
    scheduler = runtime.scheduler
    for req in reqs:
        scheduler.submit(req)
    try:
        outs = await asyncio.gather(*(req.channel.get() for req in reqs))
    finally:
        for req in reqs:
            if req.finish_reason is None:
                scheduler.abort(req)
    pooled = []
    for out in outs:
        if out.finish_reason is FinishReason.ERROR or out.pooled is None:
            raise APIError(out.error or "the model failed", 500, error_type="server_error")
        pooled.append(out.pooled)
    return pooled


def encoded(vector: torch.Tensor, parsed: protocol.EmbeddingRequest) -> list[float] | str:
    """One embedding as the request asks: cut to `dimensions` and made unit length again,
    then a list of numbers or base64 of float32 values."""
    if parsed.dimensions is not None and parsed.dimensions < vector.shape[0]:
        vector = torch.nn.functional.normalize(vector[: parsed.dimensions], dim=0)
    if parsed.encoding_format == "base64":
        return base64.b64encode(vector.contiguous().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
