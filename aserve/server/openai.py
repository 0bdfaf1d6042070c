"""The OpenAI wire format: request parsing and validation, response and SSE chunk shapes.

Bodies are validated by the models of `protocol.py` (the same that /openapi.json describes);
everything a client can get wrong is raised as `APIError`, which the app turns into OpenAI's
error object, so nothing invalid reaches the scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from aserve.generation_defaults import SamplingDefaults
from aserve.sampling_params import SamplingError, SamplingParams, TokenLogprob
from aserve.server import protocol
from aserve.server.tool_syntax import ToolSyntax

COMPLETION_DEFAULT_MAX_TOKENS = 16
GENERATE_DEFAULT_MAX_TOKENS = 128


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
    prompt_only: bool = False  # max_tokens 0: the reply holds no generated token
    return_token_ids: bool = False
    messages: list[dict[str, Any]] | None = None
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    constraint_field: str | None = None  # where the output constraint came from, for errors
    tools: list[dict[str, Any]] | None = None  # offered to the model (not with tool_choice none)
    tool_choice: str | dict[str, Any] = "none"  # none, auto, required or a named function
    parallel_tool_calls: bool = True
    tool_syntax: ToolSyntax | None = None  # how the reply writes tool calls, when parsed
    skip_special_tokens: bool = True
    shown_special_ids: frozenset[int] = frozenset()  # kept in the text all the same
    include_stop: bool = False  # the text keeps the stop string or token that ended it
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking_opened: bool | None = None  # with a reasoning parser: the reply starts thinking
    harmony: bool = False  # a harmony reply (gpt-oss): split by server/harmony.py
    responses_api: dict[str, Any] | None = None  # /v1/responses: what its reply echoes
    grammar_after: int | None = None  # a constrained reply's grammar starts after this token
    adapter: int = 0  # the key of the LoRA adapter `model` names (0: the model itself)
    prompt_field: str = "prompt"  # the field that held the prompt, for errors
    images: list[Any] = field(default_factory=list)  # pixels, one image token of the prompt each
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: what fits)


ModelT = TypeVar("ModelT", bound=BaseModel)

# Fields whose value may take several shapes: a wrong value is described by what it may be,
# not by why it failed each shape.
UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "stop": f"a non-empty string or a list of at most {protocol.MAX_STOP_STRINGS} of them",
    "content": "a string or a list of text parts ({'type': 'text', 'text': ...}; the Responses "
    "API's 'input_text' and 'output_text'), and in a user message of chat image parts "
    "({'type': 'image_url', 'image_url': {'url': ...}}; the Responses API's 'input_image') "
    "for models that take images; audio and files are not supported",
}


def parse_body(model: type[ModelT], raw: bytes | dict[str, Any]) -> ModelT:
    """The body (JSON, or a dict another route's body was turned into) validated by
    `model`, or a 400 that names the field and what is wrong."""
    try:
        if isinstance(raw, dict):
            return model.model_validate(raw)
        return model.model_validate_json(raw)
    except ValidationError as error:
        message, param = validation_message(error)
        raise APIError(message, param=param) from None


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """One line for the first problem, and the top-level field it is in."""
    first = error.errors(include_url=False)[0]
    kind, loc = first["type"], first["loc"]
    if not loc:
        if kind == "json_invalid":
            return f"request body is not valid JSON: {first['msg']}", None
        if kind == "model_type":
            return "request body must be a JSON object", None
        return first["msg"].removeprefix("Value error, "), None
    path, union = "", None
    for index, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        if index and isinstance(loc[index - 1], int) and part in protocol.MESSAGE_ROLES:
            continue  # the tag of a message's role, not a field
        if part[:1].isupper() or "[" in part:
            continue  # the branch of a union (`GenerateSampling`, `list[...]`), not a field
        path += f".{part}" if path else part
        if part in UNION_HINTS:
            union = part
            break
    param = str(loc[0])
    if union is not None and loc[-1] != union:
        return f"'{path}' must be {UNION_HINTS[union]}", param
    if kind == "missing":
        return f"'{path}' is required", param
    if kind in ("union_tag_not_found", "union_tag_invalid") and loc[0] == "input":
        kinds = ", ".join(protocol.INPUT_ITEM_TYPES)
        return f"'{path}.type' must be one of {kinds}", param
    if kind in ("union_tag_not_found", "union_tag_invalid"):
        roles = ", ".join(sorted(protocol.MESSAGE_ROLES))
        return f"'{path}.role' must be one of {roles}", param
    return f"'{path}': {first['msg'].removeprefix('Value error, ')}", param


# The request fields that map one to one onto SamplingParams.
SAMPLED_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _sampling_params(
    fields: protocol.SamplingFields,
    defaults: SamplingDefaults,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: int | None = None,
    constraint: dict[str, Any] | None = None,
) -> SamplingParams:
    """The request's sampling fields; those it leaves unset take the server's defaults."""
    chosen = {name: value for name, value in defaults.items() if name != "max_tokens"}
    chosen.update(constraint or {})
    for name in SAMPLED_FIELDS:
        value = getattr(fields, name)
        if value is not None:
            chosen[name] = value
    min_tokens = fields.min_tokens
    if isinstance(fields, protocol.GenerateSampling) and fields.min_new_tokens is not None:
        min_tokens = fields.min_new_tokens
    try:
        return SamplingParams(
            # unset: the rest of the context, known once the prompt is (_make_choices)
            max_tokens=max_tokens if max_tokens is not None else max(1, min_tokens or 0),
            stop_token_ids=tuple(fields.stop_token_ids or ()),
            ignore_eos=bool(fields.ignore_eos),
            logit_bias=_logit_bias(fields.logit_bias),
            min_tokens=min_tokens or 0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            **chosen,
        )
    except SamplingError as error:
        raise APIError(str(error), param=str(error).split()[0]) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    ids: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        ids[int(key)] = value
    return ids


CONSTRAINT_FIELDS = {  # request field: SamplingParams field
    "guided_json": "json_schema",
    "json_schema": "json_schema",
    "guided_regex": "regex",
    "regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "ebnf": "grammar",
}


def _constraint(
    fields: protocol.SamplingFields, response_format: protocol.ResponseFormat | None = None
) -> tuple[str | None, dict[str, Any]]:
    """The request field that constrains the output (OpenAI's `response_format` or one of
    vLLM's and SGLang's) and the constraint as SamplingParams fields; more than one is an
    error."""
    given: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None and response_format.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise APIError(
                "response_format of type json_schema needs json_schema.schema",
                param="response_format",
            )
        given.append(("response_format", {"json_schema": spec.schema_}))
    elif response_format is not None and response_format.type == "structural_tag":
        if response_format.format is None:
            raise APIError(
                "response_format of type structural_tag needs 'format'", param="response_format"
            )
        tag = {"type": "structural_tag", "format": response_format.format}
        given.append(("response_format", {"structural_tag": json.dumps(tag)}))
    for name, target in CONSTRAINT_FIELDS.items():
        value = getattr(fields, name)
        if value is not None:
            given.append((name, {target: tuple(value) if target == "choice" else value}))
    if len(given) > 1:
        raise APIError(
            f"'{given[0][0]}' and '{given[1][0]}' cannot be combined: choose one constraint",
            param=given[1][0],
        )
    return given[0] if given else (None, {})


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _common(
    request: protocol.GenerationFields, kind: str, max_tokens: int | None
) -> dict[str, Any]:
    options = request.stream_options
    return {
        "kind": kind,
        "model": request.model or "",
        "n": request.n or 1,
        "stream": bool(request.stream),
        "include_usage": bool(options is not None and options.include_usage),
        "stop": _stop_strings(request.stop),
        "return_token_ids": bool(request.return_token_ids),
        "max_tokens": max_tokens,
        "skip_special_tokens": request.skip_special_tokens is not False,
        "include_stop": bool(request.include_stop_str_in_output),
        "truncate_prompt_tokens": request.truncate_prompt_tokens,
    }


def text_chars(message: dict[str, Any]) -> int:
    """The characters of a message's text (its text parts' where it carries images)."""
    content = message["content"]
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text", "")) for part in content)


def message_dict(message: protocol.ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: text content, `developer` as `system`, and a
    previous reply's tool calls or a tool result's call id where there are some."""
    content: Any = message.content
    if isinstance(content, list) and any(part.type == "image_url" for part in content):
        content = [part.model_dump(exclude_none=True) for part in content]  # images/split_images
    elif isinstance(content, list):
        content = "".join(part.text for part in content)  # type: ignore[union-attr]
    entry: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": content or "",
    }
    if isinstance(message, protocol.AssistantMessage) and message.tool_calls:
        entry["tool_calls"] = [
            template_call(call.id, call.function.name, call.function.arguments)
            for call in message.tool_calls
        ]
    if isinstance(message, protocol.ToolMessage):
        entry["tool_call_id"] = message.tool_call_id
    return entry


def template_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A previous call as chat templates read it: its arguments as an object where their
    text is a JSON object, as transformers' templates take them (GLM-4.5's walks their
    items; Llama 3.1's writes them with `tojson`, which would quote the text again) and
    vLLM passes them; other text stays as it came."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        parsed = None
    value = parsed if isinstance(parsed, dict) else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": value}}


RESERVED_TEMPLATE_NAMES = frozenset(
    (
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "conversation",
        "documents",
    )
)
"""What the server itself hands the chat template."""


def parse_chat(raw: bytes, defaults: SamplingDefaults) -> GenerationRequest:
    return chat_request(parse_body(protocol.ChatCompletionRequest, raw), defaults)


def chat_request(
    request: protocol.ChatCompletionRequest, defaults: SamplingDefaults
) -> GenerationRequest:
    if request.top_logprobs and not request.logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    max_tokens = request.max_completion_tokens or request.max_tokens or defaults.get("max_tokens")
    constraint_field, constraint = _constraint(request, request.response_format)
    tools, tool_choice = _tools(request)
    if tool_choice not in ("none", "auto") and constraint_field is not None:
        raise APIError(
            f"tool_choice {json.dumps(tool_choice)} and '{constraint_field}' cannot be combined",
            param="tool_choice",
        )
    params = _sampling_params(
        request,
        defaults,
        max_tokens,
        bool(request.logprobs),
        request.top_logprobs or 0,
        constraint=constraint,
    )
    template_kwargs = request.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(template_kwargs))
    if reserved:
        raise APIError(
            f"chat_template_kwargs cannot set {reserved[0]!r}: the request's own fields do",
            param="chat_template_kwargs",
        )
    continuing = bool(request.continue_final_message)
    opening = request.add_generation_prompt
    if continuing and opening:
        raise APIError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if continuing and request.messages[-1].role != "assistant":
        raise APIError(
            "continue_final_message needs an assistant message last",
            param="continue_final_message",
        )
    template_kwargs = {
        **template_kwargs,
        "add_generation_prompt": opening is not False and not continuing,
        "continue_final_message": continuing,
    }
    return GenerationRequest(
        **_common(request, "chat", max_tokens),
        params=params,
        messages=[message_dict(m) for m in request.messages],
        chat_template_kwargs=template_kwargs,
        constraint_field=constraint_field or ("tool_choice" if tool_choice != "auto" else None),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
    )


def _input_content(item: protocol.InputMessage) -> Any:
    """A Responses turn's content as chat's: text, or with images (a user turn's) chat's
    text and `image_url` parts (images.split_images reads them)."""
    content = item.content
    if isinstance(content, str):
        return content
    if not any(isinstance(part, protocol.InputImage) for part in content):
        return "".join(part.text for part in content)  # type: ignore[union-attr]
    if item.role != "user":
        raise APIError("input_image parts go in user turns", param="input")
    return [
        {"type": "image_url", "image_url": {"url": part.image_url}}
        if isinstance(part, protocol.InputImage)
        else {"type": "text", "text": part.text}
        for part in content
    ]


def parse_responses(raw: bytes, defaults: SamplingDefaults) -> GenerationRequest:
    """OpenAI's Responses API as the chat request it amounts to: the input items as
    messages (a run of function calls as one assistant turn, their outputs as tool
    messages), `instructions` as a system message first, the flat tools as chat's."""
    request = parse_body(protocol.ResponsesRequest, raw)
    if request.previous_response_id is not None:
        raise APIError(
            "aserve stores no responses: send the whole conversation in 'input'",
            param="previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = (
        [protocol.InputMessage(role="user", content=request.input)]
        if isinstance(request.input, str)
        else request.input
    )
    for item in items:
        if isinstance(item, protocol.InputMessage):
            messages.append({"role": item.role, "content": _input_content(item)})
        elif isinstance(item, protocol.FunctionCallInput):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, protocol.FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages:
        raise APIError("'input' holds no message", param="input")
    chat: dict[str, Any] = request.model_dump(
        include=set(protocol.SamplingFields.model_fields), exclude_none=True
    )
    chat.update(
        model=request.model,
        messages=messages,
        stream=request.stream,
        max_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls,
    )
    if request.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, protocol.ResponsesToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    chat["tool_choice"] = choice
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type != "text":
        response_format: dict[str, Any] = {"type": text_format.type}
        if text_format.type == "json_schema":
            if text_format.schema_ is None:
                raise APIError("text.format of type json_schema needs 'schema'", param="text")
            schema = {"name": text_format.name or "output", "schema": text_format.schema_}
            response_format["json_schema"] = schema
        chat["response_format"] = response_format
    parsed = chat_request(parse_body(protocol.ChatCompletionRequest, chat), defaults)
    echoed = {
        "instructions": request.instructions,
        "metadata": request.metadata or {},
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "max_output_tokens": request.max_output_tokens,
        "temperature": parsed.params.temperature,
        "top_p": parsed.params.top_p,
        "text": {
            "format": (text_format or protocol.ResponsesTextFormat(type="text")).model_dump(
                by_alias=True, exclude_none=True
            )
        },
        "store": False,
    }
    if isinstance(echoed["tool_choice"], protocol.ResponsesToolChoice):
        echoed["tool_choice"] = echoed["tool_choice"].model_dump()
    return dataclasses.replace(parsed, responses_api=echoed)


def _tools(
    request: protocol.ChatCompletionRequest,
) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
    """The tools to offer (OpenAI's shape) and the choice, defaulting as OpenAI does: auto
    with tools, none without; a choice that names no offered function is a 400."""
    offered = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if offered else "none"
    if isinstance(choice, protocol.NamedToolChoice):
        names = [tool["function"]["name"] for tool in offered]
        if choice.function.name not in names:
            raise APIError(
                f"tool_choice names '{choice.function.name}', which is not among the tools",
                param="tool_choice",
            )
        return offered, choice.model_dump()
    if choice != "none" and not offered:
        raise APIError(f"tool_choice '{choice}' needs 'tools'", param="tool_choice")
    return (offered if choice != "none" else None), choice


def parse_completion(raw: bytes, defaults: SamplingDefaults) -> GenerationRequest:
    request = parse_body(protocol.CompletionRequest, raw)
    prompt = request.prompt
    texts: list[str] = []
    token_ids: list[list[int]] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt[0], str):
        texts = list(prompt)  # type: ignore[arg-type]
    elif isinstance(prompt[0], int):
        token_ids = [list(prompt)]  # type: ignore[arg-type]
    else:
        token_ids = [list(p) for p in prompt]  # type: ignore[union-attr]
    max_tokens = request.max_tokens or defaults.get("max_tokens") or COMPLETION_DEFAULT_MAX_TOKENS
    prompt_only = request.max_tokens == 0  # one token is drawn to end it, then dropped
    if prompt_only:
        max_tokens = 1
    logprobs = request.logprobs
    constraint_field, constraint = _constraint(request, request.response_format)
    return GenerationRequest(
        **_common(request, "completion", int(max_tokens)),
        # With echo, OpenAI's logprobs cover the prompt's tokens too.
        params=_sampling_params(
            request,
            defaults,
            int(max_tokens),
            logprobs is not None,
            logprobs or 0,
            logprobs if request.echo and logprobs is not None else None,
            constraint,
        ),
        echo=bool(request.echo),
        prompt_only=prompt_only,
        texts=texts,
        token_ids=token_ids,
        constraint_field=constraint_field,
    )


@dataclass
class NativeRequest:
    """SGLang's /generate: a GenerationRequest per prompt (its sampling_params and `n`), the
    rid each was given, and how the reply reports logprobs."""

    prompts: list[GenerationRequest]
    rids: list[str | None]
    batched: bool  # the reply is a list: a list of prompts, or n > 1
    stream: bool
    return_logprob: bool
    logprob_start_len: int  # -1: the last prompt token's logprob alone
    return_text_in_logprobs: bool
    image_sources: list[list[str]]  # each prompt's image URLs, in its image tokens' order

    @property
    def size(self) -> int:
        return sum(p.n for p in self.prompts)


def parse_generate(raw: bytes, defaults: SamplingDefaults) -> NativeRequest:
    """SGLang's /generate: each prompt a completion of its own."""
    request = parse_body(protocol.GenerateRequest, raw)
    texts: list[str] = []
    token_ids: list[list[int]] = []
    if isinstance(request.text, str):
        texts = [request.text]
    elif request.text is not None:
        texts = list(request.text)
    elif request.input_ids and isinstance(request.input_ids[0], int):
        token_ids = [list(request.input_ids)]  # type: ignore[arg-type]
    else:
        token_ids = [list(p) for p in request.input_ids or []]  # type: ignore[union-attr]
    listed = isinstance(request.text, list) or (
        request.input_ids is not None and isinstance(request.input_ids[0], list)
    )
    count = len(texts) or len(token_ids)
    sampling = request.sampling_params or protocol.GenerateSampling()
    samplings = sampling if isinstance(sampling, list) else [sampling] * count
    rids = [request.rid] if isinstance(request.rid, str) else request.rid or [None] * count
    lora = request.lora_path
    adapters = lora if isinstance(lora, list) else [lora or ""] * count
    for name, values in (("sampling_params", samplings), ("rid", rids), ("lora_path", adapters)):
        if len(values) != count:
            raise APIError(
                f"'{name}' lists {len(values)} entries for {count} prompt(s): give one each",
                param=name,
            )
    if len(set(rids)) != count and None not in rids:
        raise APIError("each prompt needs its own rid", param="rid")
    logprobs = bool(request.return_logprob)
    top = (request.top_logprobs_num or 0) if logprobs else 0
    prompts = [
        dataclasses.replace(
            _native_prompt(fields, defaults, logprobs, top, texts[i : i + 1], token_ids[i : i + 1]),
            model=adapters[i] or "",
        )
        for i, fields in enumerate(samplings)
    ]
    start = -1 if request.logprob_start_len is None else request.logprob_start_len
    images = _native_images(request.image_data, count, listed)
    return NativeRequest(
        prompts=prompts,
        rids=list(rids),
        batched=listed or any(p.n > 1 for p in prompts),
        stream=bool(request.stream),
        return_logprob=logprobs,
        logprob_start_len=start,
        return_text_in_logprobs=bool(request.return_text_in_logprobs),
        image_sources=images,
    )


def _native_images(given: Any, count: int, listed: bool) -> list[list[str]]:
    """SGLang's `image_data` as each prompt's image URLs (base64 made a data URL): one
    prompt's a string or a list of them, a batch's a list with an entry each."""
    if given is None:
        return [[] for _ in range(count)]
    if not listed:
        one = [given] if isinstance(given, str) else given
        if not all(isinstance(item, str) for item in one):
            raise APIError("one prompt's 'image_data' is a string or strings", param="image_data")
        return [[_image_url(item) for item in one]]
    if not isinstance(given, list) or len(given) != count:
        raise APIError(
            f"'image_data' of a batch lists an entry (a string, a list or null) for each of "
            f"its {count} prompts",
            param="image_data",
        )
    entries = [[] if e is None else [e] if isinstance(e, str) else e for e in given]
    return [[_image_url(item) for item in entry] for entry in entries]


def _image_url(given: str) -> str:
    """An image URL as the chat route reads them: base64 alone becomes a data URL."""
    if given.startswith(("data:", "http://", "https://")):
        return given
    return f"data:image/unknown;base64,{given}"


def _native_prompt(
    sampling: protocol.GenerateSampling,
    defaults: SamplingDefaults,
    logprobs: bool,
    top: int,
    texts: list[str],
    token_ids: list[list[int]],
) -> GenerationRequest:
    """One prompt of /generate; with return_logprob its prompt is scored too (from where
    logprob_start_len says, once its length is known)."""
    max_tokens = sampling.max_new_tokens
    if max_tokens is None:
        max_tokens = int(defaults.get("max_tokens") or GENERATE_DEFAULT_MAX_TOKENS)
    prompt_only = max_tokens == 0  # one token is drawn to end it, then dropped
    constraint_field, constraint = _constraint(sampling)
    params = _sampling_params(
        sampling,
        defaults,
        1 if prompt_only else max_tokens,
        logprobs,
        top,
        top if logprobs else None,
        constraint,
    )
    return GenerationRequest(
        kind="completion",
        model="",
        params=params,
        max_tokens=1 if prompt_only else max_tokens,
        n=sampling.n or 1,
        prompt_only=prompt_only,
        constraint_field=constraint_field,
        stop=_stop_strings(sampling.stop),
        skip_special_tokens=sampling.skip_special_tokens is not False,
        include_stop=bool(sampling.no_stop_trim),
        texts=texts,
        token_ids=token_ids,
        prompt_field="text" if texts else "input_ids",
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the prefix cache supplied as its
    `prompt_tokens_details.cached_tokens`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
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
    entries: list[tuple[str, TokenLogprob | None, list[str]]], text_offset: int
) -> dict[str, Any]:
    """OpenAI legacy completion logprobs: parallel lists, top as {token: logprob} maps; an
    entry without a logprob (an echoed prompt's first token) is null in both."""
    offsets, position = [], text_offset
    for text, _, _ in entries:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": [text for text, _, _ in entries],
        "token_logprobs": [None if lp is None else lp.logprob for _, lp, _ in entries],
        "top_logprobs": [
            None if lp is None else {t: v for t, (_, v) in zip(tops, lp.top)}
            for _, lp, tops in entries
        ],
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
