"""`/openapi.json`: the API's description, generated from the models that handlers validate
with (protocol.py), so clients, gateways and fuzzers read the shapes the server enforces.

Every route the app serves is listed in `OPERATIONS`; a test checks the two agree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from aserve import __version__
from aserve.server import protocol

REF = "#/components/schemas/{model}"
# The refusals every API route may give: bad input, no API key, body over the limit, a fault
# in this request, the server full or not ready.
API_ERRORS = {
    400: "invalid request",
    401: "missing or invalid API key (with --api-key)",
    413: "request body over the limit that the model's context implies",
    500: "a fault in this request; other requests go on",
    503: "loading, shutting down, or full (--max-queued-requests); see Retry-After",
}
NOT_FOUND = {404: "no such thing (an adapter to unload)"}


class Operation(NamedTuple):
    method: str
    path: str
    summary: str
    request: type[BaseModel] | None = None
    reply: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None
    errors: tuple[int, ...] = tuple(API_ERRORS)
    open: bool = False


# What a router reads of a replica (server/fleet.py): open, 503 until the model is loaded.
FLEET_READS = (
    (
        ("/server_info", "/get_server_info"),
        "Who this replica is (SGLang's shape, read by its router)",
        protocol.ServerInfo,
    ),
    (("/model_info", "/get_model_info"), "The served model (SGLang's shape)", protocol.ModelInfo),
    (("/get_load",), "Requests and tokens held or queued (SGLang's shape)", protocol.Load),
    (("/health_generate",), "200 once the engine has produced a token", protocol.Health),
)

# vLLM's pooling routes (server/scoring.py), each under its paths.
SCORING_ROUTES = (
    (
        ("/v1/score", "/score"),
        "vLLM's pair scores: a reranker's sigmoid, or an embedding model's cosine similarity",
        protocol.ScoreRequest,
        protocol.ScoreList,
    ),
    (
        ("/v1/rerank", "/rerank", "/v2/rerank"),
        "Documents ordered by their score against a query (vLLM's and Cohere's shape)",
        protocol.RerankRequest,
        protocol.RerankList,
    ),
    (
        ("/v1/classify", "/classify"),
        "vLLM's classification, on a *ForSequenceClassification checkpoint",
        protocol.ClassifyRequest,
        protocol.ClassificationList,
    ),
)

OPERATIONS = (
    Operation(
        "post",
        "/v1/chat/completions",
        "OpenAI chat completion; with stream: true, SSE chunks ending with data: [DONE]",
        protocol.ChatCompletionRequest,
        protocol.ChatCompletion,
        protocol.ChatCompletionChunk,
    ),
    Operation(
        "post",
        "/v1/completions",
        "OpenAI text completion; with stream: true, SSE chunks ending with data: [DONE]",
        protocol.CompletionRequest,
        protocol.Completion,
        protocol.Completion,
    ),
    Operation(
        "post",
        "/v1/responses",
        "OpenAI's Responses API, stateless (the conversation in input); with stream: true, "
        "typed events (response.created, ..., response.completed)",
        protocol.ResponsesRequest,
        protocol.ResponseObject,
        protocol.ResponseEvent,
    ),
    Operation(
        "post",
        "/v1/embeddings",
        "OpenAI embeddings, on a server started with --is-embedding (the generation routes "
        "refuse there)",
        protocol.EmbeddingRequest,
        protocol.EmbeddingList,
    ),
    *(
        Operation("post", path, summary, request, reply)
        for paths, summary, request, reply in SCORING_ROUTES
        for path in paths
    ),
    Operation("get", "/v1/models", "The served model", reply=protocol.ModelList, errors=(401, 503)),
    Operation(
        "post",
        "/generate",
        "SGLang's native generation route; with stream: true, SSE events that each carry "
        "an item's output so far, ending with data: [DONE]",
        protocol.GenerateRequest,
        protocol.GenerateReply,
        protocol.GenerateResponse,
    ),
    Operation(
        "post",
        "/abort_request",
        "SGLang's: end a /generate request by its rid, or every one with abort_all",
        protocol.AbortRequest,
        protocol.Aborted,
    ),
    Operation(
        "post",
        "/tokenize",
        "Token ids of a prompt or of chat messages (vLLM's shape)",
        protocol.TokenizeRequest,
        protocol.TokenizeResponse,
    ),
    Operation(
        "post",
        "/detokenize",
        "Text of token ids (vLLM's shape)",
        protocol.DetokenizeRequest,
        protocol.DetokenizeResponse,
    ),
    Operation("get", "/health", "200 when ready; 503 while loading or draining", open=True),
    Operation("get", "/metrics", "Prometheus metrics", open=True),
    Operation("get", "/openapi.json", "This description", open=True),
    *(
        Operation("get", path, summary, reply=reply, errors=(503,), open=True)
        for paths, summary, reply in FLEET_READS
        for path in paths
    ),
    *(
        Operation("post", path, summary, request, protocol.LoraAdapters, errors=errors)
        for prefix in ("/v1", "")
        for path, summary, request, errors in (
            (
                f"{prefix}/load_lora_adapter",
                "Load a LoRA adapter folder at run time (--enable-lora)",
                protocol.LoadLoraAdapter,
                tuple(API_ERRORS),
            ),
            (
                f"{prefix}/unload_lora_adapter",
                "Unload a LoRA adapter no request runs on (404: none of that name)",
                protocol.UnloadLoraAdapter,
                (*API_ERRORS, *NOT_FOUND),
            ),
        )
    ),
    *(
        Operation(
            method,
            "/flush_cache",
            "Drop the prefix cache; 400 while requests run",
            reply=protocol.Flushed,
            errors=(400, 401, 503),
        )
        for method in ("get", "post")
    ),
)


def _schemas() -> dict[str, Any]:
    requests = [op.request for op in OPERATIONS if op.request is not None]
    replies = [m for op in OPERATIONS for m in (op.reply, op.stream) if m is not None]
    replies += [protocol.ErrorResponse, protocol.Health]
    pairs = [(m, "validation") for m in requests] + [(m, "serialization") for m in replies]
    _, top = models_json_schema(pairs, ref_template=REF)
    return top["$defs"]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 describes a stream by its events): a
    JSON chunk in `data`, or the closing `[DONE]`."""
    json_chunk = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": _ref(chunk),
    }
    if chunk is protocol.ResponseEvent:  # the Responses API's stream: typed, no [DONE]
        return {
            "type": "object",
            "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": json_chunk},
            "description": "`event: TYPE` and `data: {ResponseEvent}` frames",
        }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_chunk]}},
        "description": f"`data: {{{chunk.__name__}}}` events, then `data: [DONE]`",
    }


def _responses(op: Operation) -> dict[str, Any]:
    if op.path in ("/health", "/health_generate"):
        health = {"content": {"application/json": {"schema": _ref(protocol.Health)}}}
        return {
            "200": {"description": "ready", **health},
            "503": {"description": "not ready (loading, draining, or no token came)", **health},
        }
    if op.path == "/metrics":
        text = {"text/plain": {"schema": {"type": "string"}}}
        return {"200": {"description": "Prometheus text exposition format", "content": text}}
    if op.path == "/openapi.json":
        return {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}}
    content: dict[str, Any] = {}
    if op.reply is not None:
        content["application/json"] = {"schema": _ref(op.reply)}
    if op.stream is not None:
        content["text/event-stream"] = {"schema": _event(op.stream)}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    error = {"application/json": {"schema": _ref(protocol.ErrorResponse)}}
    for status in op.errors:
        description = (API_ERRORS | NOT_FOUND)[status]
        responses[str(status)] = {"description": description, "content": error}
    return responses


def openapi_spec(bearer_auth: bool) -> dict[str, Any]:
    """The description of this server; with `bearer_auth` (--api-key) the API routes say
    they need the key."""
    paths: dict[str, Any] = {}
    for op in OPERATIONS:
        operation: dict[str, Any] = {"summary": op.summary, "responses": _responses(op)}
        if op.request is not None:
            body = {"application/json": {"schema": _ref(op.request)}}
            operation["requestBody"] = {"required": True, "content": body}
        if bearer_auth and not op.open:
            operation["security"] = [{"bearer": []}]
        paths.setdefault(op.path, {})[op.method] = operation
    components: dict[str, Any] = {"schemas": _schemas()}
    if bearer_auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "aserve", "version": __version__},
        "paths": paths,
        "components": components,
    }
