"""Small HTTP helpers the server's handlers share: JSON replies, errors, SSE frames."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from aserve.server.openai import APIError


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def error_response(error: APIError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return json_response(error.body(), error.status, headers)


SSE_DONE = b"data: [DONE]\n\n"
"""What ends an OpenAI (and SGLang) stream."""


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
