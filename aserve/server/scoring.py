"""vLLM's pooling routes beside `/v1/embeddings`: `/score` and `/rerank` (text pairs scored
by a reranker or an embedding model) and `/classify` (a classifier's labels), each also
under `/v1/` (and `/v2/rerank`, Cohere's path). aserve/scoring.py says how a model scores;
the requests run on the same scheduler as every other, one pooled step each.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from aiohttp import web

from aserve.runtime import Runtime
from aserve.scoring import (
    PairPlan,
    classified,
    classifying_refusal,
    paired,
    plan_pairs,
    scoring_refusal,
)
from aserve.server import protocol
from aserve.server.embeddings import (
    input_ids,
    pooling_kept_tokens,
    pooling_request,
    run_pooling,
)
from aserve.server.http import json_response
from aserve.server.limits import InputLimits
from aserve.server.openai import APIError, parse_body
from aserve.server.state import ServerState, require_tokenizer
from aserve.server.truncation import PARAM


class Scoring:
    """The score, rerank and classify routes; they hold admission places for their
    sequences, as the generation routes do for their choices."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def add_to(self, app: web.Application) -> None:
        for prefix in ("", "/v1"):
            app.router.add_post(f"{prefix}/score", self.score)
            app.router.add_post(f"{prefix}/rerank", self.rerank)
            app.router.add_post(f"{prefix}/classify", self.classify)
        app.router.add_post("/v2/rerank", self.rerank)

    async def score(self, request: web.Request) -> web.Response:
        runtime, limits = self._scoring_runtime()
        parsed = parse_body(protocol.ScoreRequest, await limits.read_body(request))
        self.state.check_model(parsed.model or "")
        firsts = [parsed.text_1] if isinstance(parsed.text_1, str) else parsed.text_1
        seconds = [parsed.text_2] if isinstance(parsed.text_2, str) else parsed.text_2
        try:
            pairs = paired(firsts, seconds)
        except ValueError as error:
            raise APIError(str(error), param="text_1") from None
        scores, tokens = await self._scores(
            runtime, limits, pairs, "text_2", parsed.truncate_prompt_tokens
        )
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._list_response("score", data, tokens)

    async def rerank(self, request: web.Request) -> web.Response:
        runtime, limits = self._scoring_runtime()
        parsed = parse_body(protocol.RerankRequest, await limits.read_body(request))
        self.state.check_model(parsed.model or "")
        pairs = [(parsed.query, document) for document in parsed.documents]
        scores, tokens = await self._scores(
            runtime, limits, pairs, "documents", parsed.truncate_prompt_tokens
        )
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        results: list[dict[str, Any]] = []
        for index in order[: parsed.top_n]:
            result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
            if parsed.return_documents:
                result["document"] = {"text": parsed.documents[index]}
            results.append(result)
        return json_response(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": self.state.model_name,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        )

    async def classify(self, request: web.Request) -> web.Response:
        runtime, limits = self.state.ready()
        config = runtime.engine.model_config
        refusal = classifying_refusal(config)
        if refusal is not None:
            raise APIError(refusal, code="classification_not_served")
        with self.state.admission.reserve() as places:
            parsed = parse_body(protocol.ClassifyRequest, await limits.read_body(request))
            self.state.check_model(parsed.model or "")
            given = parsed.input
            places.resize(1 if isinstance(given, str) or isinstance(given[0], int) else len(given))
            keep = pooling_kept_tokens(runtime, parsed.truncate_prompt_tokens)
            prompts = await input_ids(runtime, limits, given, keep)
            reqs = [pooling_request(runtime, i, prompt) for i, prompt in enumerate(prompts)]
            pooled = await run_pooling(runtime, reqs)
        data = []
        for index, logits in enumerate(pooled):
            classes = classified(config, logits)
            data.append(
                {
                    "index": index,
                    "label": classes.label,
                    "probs": classes.probs,
                    "num_classes": len(classes.probs),
                }
            )
        return self._list_response("classify", data, sum(len(p) for p in prompts))

    def _list_response(self, kind: str, data: list[dict[str, Any]], tokens: int) -> web.Response:
        """vLLM's list of `/score` or `/classify` results, with the prompt tokens used."""
        return json_response(
            {
                "id": f"{kind}-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": self.state.model_name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def _scoring_runtime(self) -> tuple[Runtime, InputLimits]:
        runtime, limits = self.state.ready()
        refusal = scoring_refusal(runtime.engine.model_config, runtime.engine.pooling)
        if refusal is not None:
            raise APIError(refusal, code="scores_not_served")
        return runtime, limits

    async def _scores(
        self,
        runtime: Runtime,
        limits: InputLimits,
        pairs: list[tuple[str, str]],
        param: str,
        truncate: int | None,
    ) -> tuple[list[float], int]:
        """Each pair's score, and the tokens the model ran for them; with `truncate`
        (`truncate_prompt_tokens`) each sequence the model runs (a text, or a
        cross-encoder's pair) is cut from its start to fit."""
        for first, second in pairs:
            limits.check_text(len(first) + len(second), None, param)
        tokenizer = require_tokenizer(runtime)
        config = runtime.engine.model_config
        keep = pooling_kept_tokens(runtime, truncate)
        encode: Callable[..., list[int]] = tokenizer.encode
        encode_pair: Callable[..., list[int]] = tokenizer.encode_pair
        if keep is not None:  # the same call cuts a text or a pair
            encode = encode_pair = partial(tokenizer.encode_keeping_last, keep)
        with self.state.admission.reserve() as places:
            try:
                plan: PairPlan = await asyncio.to_thread(
                    plan_pairs, config, pairs, encode, encode_pair
                )
            except ValueError as error:
                raise APIError(f"truncate_prompt_tokens is {keep}: {error}", param=PARAM) from None
            places.resize(len(plan.prompts))
            reqs = [pooling_request(runtime, i, p, param) for i, p in enumerate(plan.prompts)]
            pooled = await run_pooling(runtime, reqs)
        return plan.scores(pooled), sum(len(p) for p in plan.prompts)
