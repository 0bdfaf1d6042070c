"""Small HTTP helpers the server's handlers share: JSON bodies, errors, SSE frames."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from aserve.runtime import Runtime
from aserve.server.openai import APIError
from aserve.tokenizer import Tokenizer


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def error_response(error: APIError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return json_response(error.body(), error.status, headers)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as error:
        raise APIError(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    return body


def require_tokenizer(runtime: Runtime) -> Tokenizer:
    if runtime.tokenizer is None:
        raise APIError("this model has no tokenizer: send token ids to /v1/completions")
    return runtime.tokenizer
