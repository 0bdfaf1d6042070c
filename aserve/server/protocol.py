"""The HTTP API's shapes as pydantic models: the requests the server validates and the replies
it sends, defined once. Handlers parse bodies with these models and `/openapi.json` is
generated from them, so the description and the checks cannot drift apart.

Requests are strict about JSON types (no "1" for 1, no 1.0 for an integer, no 1 for true) and
ignore fields they do not know, as OpenAI's API does. Sampling ranges come from
`aserve.sampling_params.BOUNDS`, the table the offline API checks too. A field left out or
null means "unset": the server's default applies (aserve/generation_defaults.py).

Reply models are used for the description and by the tests; handlers build replies as
plain dicts on the hot path, and the tests check those dicts against these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Tag,
    field_validator,
    model_validator,
)

from aserve.sampling_params import BOUNDS, LOGIT_BIAS, MAX_TOKEN_ID

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 20


def limits(name: str) -> dict[str, float]:
    """The range that `BOUNDS[name]` allows, as pydantic's Field keywords."""
    return {k: v for k, v in BOUNDS[name]._asdict().items() if v is not None}


def bounded(name: str, description: str) -> Any:
    """An optional number field with the range that `BOUNDS[name]` allows."""
    return Field(None, description=description, **limits(name))


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _integral(value: Any) -> Any:
    """JSON Schema counts 3.0 as an integer, so the API does too; 3.5 stays an error."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integer fields: the range first, then the conversion, so the schema states the range.
# Token ids are the exception: a prompt holds thousands, and converting each in Python
# doubled the parse time of a 512-id prompt (82 -> 168 us), so 1.0 is refused there.
INTEGRAL = BeforeValidator(_integral)
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
MaxTokens = Annotated[int, Field(**limits("max_tokens")), INTEGRAL]
TopK = Annotated[int, Field(**limits("top_k")), INTEGRAL]
Seed = Annotated[int, Field(**limits("seed")), INTEGRAL]
TopLogprobs = Annotated[int, Field(**limits("top_logprobs")), INTEGRAL]
N = Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), INTEGRAL]
MinTokens = Annotated[int, Field(**limits("min_tokens")), INTEGRAL]
Bias = Annotated[float, Field(ge=LOGIT_BIAS.ge, le=LOGIT_BIAS.le)]
NonEmptyText = Annotated[str, Field(min_length=1)]


def _keeps_a_token(count: int) -> int:
    if count == 0:
        raise ValueError("0 would keep no token: -1 keeps what the context holds")
    return count


TruncatePromptTokens = Annotated[int, Field(ge=-1), INTEGRAL, AfterValidator(_keeps_a_token)]
TRUNCATE_PROMPT_TOKENS = (
    "vLLM's: keep the prompt's last N tokens (the tokenizer's special tokens kept); -1: as "
    "many as the context holds"
)


# ---- chat messages ---------------------------------------------------------------------


class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


ImageURL = Annotated[
    str,
    Field(min_length=1, description="a data:image/...;base64 URL, or an http(s) URL to fetch"),
]
ImageDetail = Literal["auto", "low", "high"]


class ImageUrl(Strict):
    url: ImageURL
    detail: ImageDetail | None = None


class ImagePart(Strict):
    """An image of a user message, for vision-language models whose images aserve runs."""

    type: Literal["image_url"]
    image_url: ImageUrl


UserContent = str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON text, as OpenAI sends them")


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Strict):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(Strict):
    """OpenAI's newer name for a system message; templates see it as one."""

    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class AssistantMessage(Strict):
    """A previous reply: `content`, `tool_calls` or both; `content` may be null only beside
    `tool_calls`."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
            ]
        }
    )

    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> AssistantMessage:
        if self.content is None and self.tool_calls is None:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        return self


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]
MESSAGE_ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))


# ---- generation requests ---------------------------------------------------------------

Stop = NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)]


class SamplingFields(Strict):
    """The sampling fields that chat, completions and SGLang's /generate share."""

    temperature: float | None = bounded("temperature", "0 is greedy")
    top_p: float | None = bounded("top_p", "nucleus sampling mass")
    top_k: TopK | None = Field(None, description="-1 or 0: no top-k cut")
    min_p: float | None = bounded("min_p", "drop tokens below min_p x the top probability")
    presence_penalty: float | None = bounded("presence_penalty", "OpenAI's presence penalty")
    frequency_penalty: float | None = bounded("frequency_penalty", "OpenAI's frequency penalty")
    repetition_penalty: float | None = bounded("repetition_penalty", "1 is none (vLLM's)")
    seed: Seed | None = Field(None, description="the same seed gives the same tokens")
    stop: Stop | None = Field(None, description="strings that end the text, left out of it")
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, Bias] | None = Field(
        None, description="token id (a decimal string) -> a number added to its logit"
    )
    min_tokens: MinTokens | None = Field(
        None, description="vLLM's: no stop token or stop string ends the output before this"
    )
    skip_special_tokens: bool | None = Field(
        None, description="default true: special tokens' text left out of the reply"
    )
    # Output constraints under vLLM's names and SGLang's (at most one per request)
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression")
    guided_choice: list[str] | None = Field(None, description="vLLM's: one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's: an EBNF grammar")
    json_schema: str | None = Field(None, description="SGLang's: a JSON schema as text")
    regex: str | None = Field(None, description="SGLang's: a regular expression")
    ebnf: str | None = Field(None, description="SGLang's: an EBNF grammar")


class JsonSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's: free text, any JSON object, or JSON that follows `json_schema.schema`; or
    (vLLM's and SGLang's) an xgrammar structural tag, its `format` describing the output."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = Field(None, description="structural_tag: xgrammar's format")


class StreamOptions(Strict):
    include_usage: bool | None = None


class GenerationFields(SamplingFields):
    model: str | None = None
    max_tokens: MaxTokens | None = Field(None, description="default: the rest of the context")
    n: N | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(None, description="vLLM's: token ids in each choice")
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM's: the text ends with the stop string (or token) that ended it"
    )
    response_format: ResponseFormat | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None, description=TRUNCATE_PROMPT_TOKENS
    )


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool | None = None
    max_completion_tokens: MaxTokens | None = Field(None, description="OpenAI's newer max_tokens")
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="needs logprobs: true")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='more variables for the chat template, e.g. {"enable_thinking": false}'
    )
    add_generation_prompt: bool | None = Field(
        None, description="vLLM's, default true: the template opens the assistant's turn"
    )
    continue_final_message: bool | None = Field(
        None, description="vLLM's: the reply continues the last (assistant) message"
    )


# ---- OpenAI's Responses API (/v1/responses) --------------------------------------------


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(Strict):
    """An image of a user turn, for vision-language models whose images aserve runs."""

    type: Literal["input_image"]
    image_url: ImageURL
    detail: ImageDetail | None = None


class InputMessage(Strict):
    """A turn of the conversation (`type` may be left out)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]


class FunctionCallInput(Strict):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(Strict):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningInput(Strict):
    """An earlier reply's reasoning, sent back: not shown to the model again."""

    type: Literal["reasoning"]


INPUT_ITEM_TYPES = {
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
    "reasoning": "Reasoning",
}
"""An input item's `type` -> its branch's tag (capitalized: errors leave tags out of paths)."""


def _input_kind(value: Any) -> str | None:
    kind = value.get("type") or "message" if isinstance(value, dict) else "message"
    return INPUT_ITEM_TYPES.get(kind)


InputItem = Annotated[
    Annotated[InputMessage, Tag("Message")]
    | Annotated[FunctionCallInput, Tag("FunctionCall")]
    | Annotated[FunctionCallOutput, Tag("FunctionCallOutput")]
    | Annotated[ReasoningInput, Tag("Reasoning")],
    Discriminator(_input_kind),
]


def _text_or_items(value: Any) -> str:
    return "Text" if isinstance(value, str) else "Items"


ResponsesInput = Annotated[
    Annotated[str, Tag("Text")] | Annotated[list[InputItem], Field(min_length=1), Tag("Items")],
    Discriminator(_text_or_items),
]


class ResponsesTool(Strict):
    """A function the model may call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(Strict):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(Strict):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(SamplingFields):
    """OpenAI's Responses API, stateless: the whole conversation comes in `input` (aserve
    keeps no responses, so `previous_response_id` is refused)."""

    model: str | None = None
    input: ResponsesInput
    instructions: str | None = Field(None, description="a system message before the input")
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    text: ResponsesText | None = None
    stream: bool | None = None
    store: bool | None = Field(None, description="accepted; nothing is stored")
    previous_response_id: str | None = Field(None, description="refused: nothing is stored")
    metadata: dict[str, str] | None = Field(None, description="returned as given")


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class MessageItem(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["completed", "incomplete", "in_progress"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed", "in_progress"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    incomplete_details: dict[str, str] | None
    model: str
    output: list[MessageItem | FunctionCallItem | ReasoningItem]
    usage: ResponsesUsage | None


class ResponseEvent(BaseModel):
    """One event of a streamed response (`type` says which: response.created, ...,
    response.output_text.delta, ..., response.completed)."""

    type: str
    sequence_number: int


PromptIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_kind(value: Any) -> str:
    """Which shape a prompt has, read from its first element: pydantic then validates that
    shape alone (trying each in turn made a 512-id prompt parse 3x slower)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value and isinstance(value[0], str):
        return "texts"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "batch"
    return "ids"


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Field(min_length=1), Tag("texts")]
    | Annotated[PromptIds, Tag("ids")]
    | Annotated[list[PromptIds], Field(min_length=1), Tag("batch")],
    Discriminator(_prompt_kind),
]


class CompletionRequest(GenerationFields):
    prompt: Prompt
    echo: bool | None = None
    logprobs: LogprobCount | None = None
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = Field(
        None, description="0: nothing generated (with echo and logprobs: the prompt scored)"
    )
    suffix: str | None = Field(
        None,
        description="refused unless empty: the model's own fill-in-the-middle tokens go "
        "in the prompt",
    )

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        """Text after the insertion point (OpenAI's fill-in-the-middle) would need the
        model's FIM tokens around the prompt; ignoring it, as unknown fields are, would give
        an editor's completion request a wrong answer that looks right (vLLM refuses it
        too)."""
        if suffix:
            raise ValueError(
                "not supported: write the model's fill-in-the-middle tokens (for Qwen2.5-Coder "
                "<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>) into the prompt"
            )
        return suffix


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs


PoolingInput = Annotated[
    Annotated[NonEmptyText, Tag("text")]
    | Annotated[
        list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS), Tag("texts")
    ]
    | Annotated[PromptIds, Tag("ids")]
    | Annotated[
        list[PromptIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS), Tag("batch")
    ],
    Discriminator(_prompt_kind),
]
"""A pooling model's inputs: a string, strings, token ids or lists of them."""


class EmbeddingRequest(Strict):
    """OpenAI's embeddings: `input` as a string, strings, token ids or lists of them."""

    input: PoolingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding's float32 values, little-endian"
    )
    dimensions: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(
        None, description="keep the first this many values, made unit length again"
    )
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None, description=TRUNCATE_PROMPT_TOKENS
    )
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


ScoreTexts = (
    NonEmptyText
    | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
)


class ScoreRequest(Strict):
    """vLLM's `/score`: `text_1` against each `text_2`, or the two lists side by side."""

    text_1: ScoreTexts
    text_2: ScoreTexts
    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None, description=TRUNCATE_PROMPT_TOKENS
    )
    user: str | None = None


class Score(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: EmbeddingUsage


class RerankRequest(Strict):
    """vLLM's and Jina's / Cohere's `/rerank`: the documents ordered by their score against
    the query, the best `top_n` of them (all when unset)."""

    query: NonEmptyText
    documents: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    top_n: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    return_documents: bool = True
    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None, description=TRUNCATE_PROMPT_TOKENS
    )
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankList(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassifyRequest(Strict):
    """vLLM's `/classify`: `input` as a string, strings, token ids or lists of them."""

    input: PoolingInput
    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None, description=TRUNCATE_PROMPT_TOKENS
    )
    user: str | None = None


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage


class GenerateSampling(SamplingFields):
    max_new_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = Field(
        None, description="default 128; 0 scores the prompt (with return_logprob)"
    )
    min_new_tokens: MinTokens | None = Field(None, description="SGLang's name for min_tokens")
    no_stop_trim: bool | None = Field(None, description="SGLang's include_stop_str_in_output")
    n: N | None = Field(None, description="outputs per prompt, each an item of the reply list")


GenerateIds = Annotated[
    Annotated[PromptIds, Tag("ids")]
    | Annotated[list[PromptIds], Field(min_length=1), Tag("batch")],
    Discriminator(_prompt_kind),
]


def exactly_one_of(*names: str) -> ConfigDict:
    """The schema of a model whose validator wants exactly one of these fields set."""
    branches = [
        {"required": [name], "properties": {name: {"not": {"type": "null"}}}} for name in names
    ]
    return ConfigDict(json_schema_extra={"oneOf": branches})


class GenerateRequest(Strict):
    """SGLang's native route: `text` or `input_ids` (one prompt or a batch), not both."""

    model_config = exactly_one_of("text", "input_ids")

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: GenerateIds | None = None
    sampling_params: (
        GenerateSampling | Annotated[list[GenerateSampling], Field(min_length=1)] | None
    ) = Field(None, description="for every prompt, or a list with one per prompt")
    rid: str | Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="request id (one per prompt): meta_info.id and /abort_request's key"
    )
    stream: bool | None = Field(None, description="SSE events, each the output so far")
    return_logprob: bool | None = None
    logprob_start_len: Annotated[int, Field(ge=-1), INTEGRAL] | None = Field(
        None, description="the first prompt token given a logprob; -1 (default): the last"
    )
    top_logprobs_num: TopLogprobs | None = None
    return_text_in_logprobs: bool | None = None
    lora_path: (
        NonEmptyText | Annotated[list[NonEmptyText | None], Field(min_length=1)]
    ) | None = Field(
        None,
        description="SGLang's: the LoRA adapter (its --lora-modules name) of every prompt, or "
        "a list with one (or null: the model) per prompt",
    )
    image_data: (
        NonEmptyText
        | Annotated[list[NonEmptyText | list[NonEmptyText] | None], Field(min_length=1)]
    ) | None = Field(
        None,
        description="SGLang's: images as http(s) or data: URLs, or base64; one prompt's a "
        "string or a list, a batch's a list with an entry (string, list or null) each",
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("send exactly one of 'text' and 'input_ids'")
        return self


class AbortRequest(Strict):
    """SGLang's /abort_request: one request by its rid, or every one."""

    rid: str | None = None
    abort_all: bool | None = None


class TokenizeRequest(Strict):
    """vLLM's /tokenize: `prompt` or `messages`, not both."""

    model_config = exactly_one_of("prompt", "messages")

    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(Strict):
    tokens: list[TokenId]


# ---- replies -----------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens taken from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    """With `echo`, the prompt's tokens come first; its first token has no logprob (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ReplyFunction(BaseModel):
    name: str
    arguments: str


class ReplyToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ReplyFunction


class ReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(
        None, description="with --reasoning-parser: the thinking before the answer"
    )
    tool_calls: list[ReplyToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ReplyMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(ReplyToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` frame of a streamed chat completion; the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    """A text completion body, and also each `data:` frame of a streamed one (then
    `finish_reason` is null until the last frame of a choice, and `usage` comes last)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    default_sampling_params: dict[str, float] = Field(
        description="what a request that leaves these fields unset is sampled with"
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "loading", "draining", "unhealthy"]


class ServerInfo(BaseModel):
    """What SGLang's router reads when it adds a worker (its model id: the served name)."""

    model_path: str
    served_model_name: str
    version: str
    dp_size: int
    tp_size: int
    max_running_requests: int
    max_total_num_tokens: int
    max_prefill_tokens: int
    context_length: int
    page_size: int
    device: str


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    model_type: str
    architectures: list[str]


class RankLoad(BaseModel):
    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int = Field(description="KV tokens in use plus the prompt tokens still waiting")


class Load(RootModel[list[RankLoad]]):
    """One entry per data-parallel rank, as SGLang's /get_load answers (aserve has one)."""


class Flushed(BaseModel):
    status: Literal["flushed"]


class LoadLoraAdapter(Strict):
    """vLLM's and SGLang's: load a PEFT adapter folder at run time (`--enable-lora`)."""

    lora_name: NonEmptyText
    lora_path: NonEmptyText


class UnloadLoraAdapter(Strict):
    """vLLM's and SGLang's: unload an adapter no request runs on."""

    lora_name: NonEmptyText


class LoraAdapters(BaseModel):
    """What a load or unload leaves loaded (SGLang's shape): adapter names and folders."""

    success: Literal[True]
    loaded_adapters: dict[str, str]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


LogprobEntry = tuple[float | None, int, str | None]
"""SGLang's logprob of a token: (logprob, token id, its text with return_text_in_logprobs)."""


class GenerateFinish(BaseModel):
    type: FinishReason
    matched: int | str | None = Field(None, description="stop: the stop token or string")
    length: int | None = Field(None, description="length: max_new_tokens")
    message: str | None = Field(None, description="abort: why")


class GenerateMeta(BaseModel):
    id: str
    finish_reason: GenerateFinish | None = Field(description="null until the last event")
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(description="prompt tokens taken from the prefix cache")
    e2e_latency: float | None = Field(None, description="seconds, on the last event")
    input_token_logprobs: list[LogprobEntry] | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    output_top_logprobs: list[list[LogprobEntry]] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta
    index: int | None = Field(None, description="a batch's events: the item they belong to")


class GenerateReply(RootModel[GenerateResponse | list[GenerateResponse]]):
    """One item for one prompt, a list for a batch (a prompt list or n > 1)."""


class Aborted(BaseModel):
    aborted: int = Field(description="requests ended")
