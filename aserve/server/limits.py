"""Size limits that follow from the model, checked before any work is spent on a request.

A prompt that cannot fit the context is refused before it is tokenized: no token of the
vocabulary stands for more than `chars_per_token` characters (aserve/tokenizer.py), so a text
longer than the context times that needs more tokens than the context holds. The body limit
follows from the same number: JSON may spell one character in up to 12 bytes (an escaped
surrogate pair), so a body of more than 12 x context x chars_per_token bytes cannot carry a
prompt that fits. Bodies are read only up to that limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from aserve.server.openai import APIError

JSON_BYTES_PER_CHAR = 12
MIN_BODY_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True)
class InputLimits:
    context: int
    chars_per_token: int | None
    max_body_bytes: int

    @classmethod
    def for_model(cls, context: int, chars_per_token: int | None) -> InputLimits:
        if chars_per_token is None:
            return cls(context, None, MAX_BODY_BYTES)
        body = JSON_BYTES_PER_CHAR * context * chars_per_token
        return cls(context, chars_per_token, min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, body)))

    def check_text(self, chars: int, max_tokens: int | None, param: str) -> None:
        """400 if a prompt text of `chars` characters cannot fit beside `max_tokens` (at
        least one) generated tokens."""
        if max_tokens is not None and max_tokens >= self.context:
            raise APIError(
                f"this model's context is {self.context} tokens, but max_tokens is "
                f"{max_tokens}: no room for a prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        room = self.context - (max_tokens or 1)
        if self.chars_per_token is None or chars <= room * self.chars_per_token:
            return
        needed = -(-chars // self.chars_per_token)
        and_max = f", and max_tokens is {max_tokens}" if max_tokens else ""
        raise APIError(
            f"this model's context is {self.context} tokens, but a prompt of {chars} "
            f"characters needs at least {needed} (no token of this model stands for more than "
            f"{self.chars_per_token} characters){and_max}",
            param=param,
            code="context_length_exceeded",
        )

    async def read_body(self, request: web.Request) -> bytes:
        """The body, or a 413 as soon as it is known to be over the limit."""
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise self._too_large(f"{declared} bytes")
        if declared is not None:
            return await request.read()
        chunks, size = [], 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(f"over {self.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, size: str) -> APIError:
        why = (
            f" (a prompt that fills the {self.context}-token context, JSON-escaped)"
            if self.chars_per_token is not None
            else ""
        )
        return APIError(
            f"the request body has {size}; this server takes at most "
            f"{self.max_body_bytes} bytes{why}",
            413,
            code="request_too_large",
        )
