"""The OpenAI wire format: request parsing and validation, response and SSE chunk shapes.

Everything a client can get wrong is caught here and raised as `APIError`, which the app
turns into OpenAI's error object; nothing invalid reaches the scheduler.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aserve.sampling_params import SamplingError, SamplingParams, TokenLogprob

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_N = 16


class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class GenerationRequest:
    """A validated chat or completion request: one prompt per choice group, token ids or
    text still to tokenize (`texts` / `messages`), and what to send back."""

    kind: str
    model: str
    params: SamplingParams
    max_tokens: int | None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    echo: bool = False
    return_token_ids: bool = False
    messages: list[dict[str, Any]] | None = None
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(f"'{name}' must be {_kind_names(kinds)}", param=name)
    if not isinstance(value, kinds):
        raise APIError(f"'{name}' must be {_kind_names(kinds)}", param=name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    return float(_get(body, name, (int, float), default))


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > 16:
        raise APIError("'stop' takes at most 16 strings", param="stop")
    return stop


def token_id_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise APIError(f"'{name}' must be a list of non-negative token ids", param=name)
    return value


def _sampling_params(
    body: dict[str, Any], max_tokens: int | None, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    stop_token_ids = body.get("stop_token_ids") or []
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 1,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=int(_get(body, "top_k", (int,), -1)),
            min_p=_number(body, "min_p", 0.0),
            seed=_get(body, "seed", (int,)),
            stop_token_ids=tuple(token_id_list(stop_token_ids, "stop_token_ids")),
            ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    except SamplingError as error:
        raise APIError(str(error), param=str(error).split()[0]) from None


def _common(body: dict[str, Any], kind: str) -> dict[str, Any]:
    n = int(_get(body, "n", (int,), 1))
    if not 1 <= n <= MAX_N:
        raise APIError(f"'n' must be between 1 and {MAX_N}", param="n")
    stream_options = _get(body, "stream_options", (dict,), {})
    return {
        "kind": kind,
        "model": _get(body, "model", (str,), ""),
        "n": n,
        "stream": bool(_get(body, "stream", (bool,), False)),
        "include_usage": bool(stream_options.get("include_usage", False)),
        "stop": _stop_strings(body),
        "return_token_ids": bool(_get(body, "return_token_ids", (bool,), False)),
    }


def _max_tokens(body: dict[str, Any], default: int | None) -> int | None:
    value = _get(body, "max_completion_tokens", (int,)) or _get(body, "max_tokens", (int,))
    if value is None:
        return default
    if value < 1:
        raise APIError("'max_tokens' must be at least 1", param="max_tokens")
    return value


def message_text(message: Any, index: int) -> dict[str, str]:
    if not isinstance(message, dict) or message.get("role") not in (
        "system",
        "user",
        "assistant",
        "developer",
        "tool",
    ):
        raise APIError(
            f"messages[{index}] needs a role of system, user or assistant", param="messages"
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(
                    f"messages[{index}].content: only text parts are supported", param="messages"
                )
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise APIError(f"messages[{index}].content must be a string", param="messages")
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": content}


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    want_logprobs = bool(_get(body, "logprobs", (bool,), False))
    top = int(_get(body, "top_logprobs", (int,), 0))
    if top and not want_logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    max_tokens = _max_tokens(body, None)
    return GenerationRequest(
        **_common(body, "chat"),
        params=_sampling_params(body, max_tokens, want_logprobs, top),
        max_tokens=max_tokens,
        messages=[message_text(m, i) for i, m in enumerate(messages)],
    )


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    prompt = body.get("prompt")
    texts: list[str] = []
    token_ids: list[list[int]] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        token_ids = [token_id_list(p, "prompt") for p in prompt]
    elif isinstance(prompt, list) and prompt:
        token_ids = [token_id_list(prompt, "prompt")]
    else:
        raise APIError(
            "'prompt' must be a string, a list of strings, token ids or lists of token ids",
            param="prompt",
        )
    logprobs = _get(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise APIError("'logprobs' must be between 0 and 20", param="logprobs")
    max_tokens = _max_tokens(body, COMPLETION_DEFAULT_MAX_TOKENS)
    return GenerationRequest(
        **_common(body, "completion"),
        params=_sampling_params(body, max_tokens, logprobs is not None, logprobs or 0),
        max_tokens=max_tokens,
        echo=bool(_get(body, "echo", (bool,), False)),
        texts=texts,
        token_ids=token_ids,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ResponseHead:
    """The fields every body and chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def chat_logprobs(entries: list[tuple[str, TokenLogprob, list[str]]]) -> dict[str, Any]:
    """OpenAI chat logprobs from (token text, logprob, top-token texts) per token."""
    return {
        "content": [
            {
                "token": text,
                "logprob": lp.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())}
                    for t, (_, v) in zip(top_texts, lp.top)
                ],
            }
            for text, lp, top_texts in entries
        ]
    }


def completion_logprobs(
    entries: list[tuple[str, TokenLogprob, list[str]]], text_offset: int
) -> dict[str, Any]:
    """OpenAI legacy completion logprobs: parallel lists, top as {token: logprob} maps."""
    offsets, position = [], text_offset
    for text, _, _ in entries:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": [text for text, _, _ in entries],
        "token_logprobs": [lp.logprob for _, lp, _ in entries],
        "top_logprobs": [{t: v for t, (_, v) in zip(tops, lp.top)} for _, lp, tops in entries],
        "text_offset": offsets,
    }


def chat_chunk(
    head: ResponseHead,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }


def completion_chunk(
    head: ResponseHead,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }


def usage_chunk(head: ResponseHead, kind: str, usage_body: dict[str, int]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": head.id,
        "object": obj,
        "created": head.created,
        "model": head.model,
        "choices": [],
        "usage": usage_body,
    }


def full_body(
    head: ResponseHead, kind: str, choices: list[dict[str, Any]], usage_body: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": choices,
        "usage": usage_body,
    }
