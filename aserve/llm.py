"""The offline Python API: `LLM(model).generate(prompts, params)`.

It drives the same scheduler coroutine as the server, on a private event loop, so offline
results are what the server would return for the same requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from aserve.config import build_config
from aserve.images import data_url_bytes, decoded, split_images
from aserve.runtime import Runtime
from aserve.scheduler.request import FinishReason, Req, SamplingParams, TokenLogprob
from aserve.scheduler.scheduler import StepObserver
from aserve.scoring import (
    Classification,
    classified,
    classifying_refusal,
    paired,
    plan_pairs,
    scoring_refusal,
)
from aserve.tokenizer import Tokenizer

Prompt = str | list[int] | dict[str, Any]
"""Text, token ids, or vLLM's dict: `{"prompt": text}` or `{"prompt_token_ids": ids}` with
`"multi_modal_data": {"image": image or [images]}` (Pillow images, or pixel tensors
`[3, H, W]` as the checkpoint's image processor makes them), one image token an image."""
Conversation = list[dict[str, Any]]
T = TypeVar("T")


@dataclass
class GenerationOutput:
    """One prompt's result. `token_ids` include a final stop token; `text` does not.
    `prompt_logprobs` (with SamplingParams.prompt_logprobs) score prompt tokens 1 to n-1."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class EmbeddingOutput:
    """One input's embedding (float32 values, unit length; `LLM(is_embedding=True)`), or
    None with the `error` that refused it."""

    prompt_token_ids: list[int]
    embedding: list[float] | None
    error: str | None = None


@dataclass
class ScoreOutput:
    """One text pair's score (`LLM.score`): a reranker's sigmoid, or an embedding model's
    cosine similarity."""

    text_1: str
    text_2: str
    score: float


@dataclass
class ClassificationOutput:
    """One input's classes (`LLM.classify`), or None with the `error` that refused it."""

    prompt_token_ids: list[int]
    classification: Classification | None
    error: str | None = None


def _is_single_prompt(prompts: Prompt | Sequence[Prompt]) -> bool:
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    )


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None,
    count: int,
    default: SamplingParams,
) -> list[SamplingParams]:
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)


class LLM:
    """Load a model and generate offline. Keywords are the CLI's options with underscores,
    e.g. `LLM(dummy_weight=True, page_size=16, cache_type="naive")`."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = build_config(model=model, **options)
        self.runtime = Runtime(self.config)
        # A server is ready before FlashInfer's modules on a first start; offline batches
        # would run their first steps without them, so the offline API waits for them.
        self.runtime.engine.finish_kernel_builds()
        self.scheduler = self.runtime.scheduler
        self.tokenizer = self.runtime.tokenizer
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no params: the model's
        recommended sampling (see aserve/generation_defaults.py), else OpenAI's defaults."""
        return SamplingParams(**self.runtime.sampling_defaults)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """`lora` names the LoRA adapter (one of `lora_modules`) of every prompt, or of each;
        None is the model itself."""
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)
        inputs = [self._inputs(p) for p in prompt_list]
        ids, images = [i for i, _ in inputs], [m for _, m in inputs]
        default = self.default_sampling_params()
        params = _per_prompt(sampling_params, len(ids), default)
        return self._run(ids, params, images, self._adapters(lora, len(ids)))

    def _adapters(self, lora: str | Sequence[str | None] | None, count: int) -> list[int]:
        """`generate`'s and `chat`'s `lora` as the adapters' keys, one a prompt."""
        names = [lora] * count if lora is None or isinstance(lora, str) else list(lora)
        if len(names) != count:
            raise ValueError(f"{len(names)} adapters for {count} prompts")
        slots = self.runtime.engine.adapters
        served = {} if slots is None else slots.names
        for name in names:
            if name is not None and name not in served:
                raise ValueError(f"no LoRA adapter {name!r}: this LLM has {list(served) or 'none'}")
        return [0 if name is None else served[name] for name in names]

    def embed(
        self, prompts: Prompt | Sequence[Prompt], truncate_prompt_tokens: int | None = None
    ) -> list[EmbeddingOutput]:
        """Each prompt's embedding, as vLLM's `LLM.embed` (an LLM made with
        `is_embedding=True`); text is encoded as the tokenizer's defaults say (Qwen3-Embedding's
        appends its end-of-text token). `truncate_prompt_tokens` keeps each prompt's last N
        tokens (text its special tokens too), -1 as many as the model takes."""
        if not self.runtime.engine.pooling:
            raise ValueError("this LLM generates text: make it with is_embedding=True to embed")
        if self.runtime.engine.model_config.classifies:
            raise ValueError("this LLM is a classifier: call classify or score")
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if any(isinstance(p, dict) for p in prompt_list):
            raise ValueError("embed takes text or token ids")
        keep = self._kept_tokens(truncate_prompt_tokens)
        return self._pool([self._encode(p, keep) for p in prompt_list])  # type: ignore[arg-type]

    def score(
        self,
        text_1: str | list[str],
        text_2: str | list[str],
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoreOutput]:
        """Scores of text pairs, as vLLM's `LLM.score`: one `text_1` against each `text_2`,
        or the two lists side by side (aserve/scoring.py says how each model scores); each
        sequence the model runs cut as `embed` cuts it."""
        config = self.runtime.engine.model_config
        refusal = scoring_refusal(config, self.runtime.engine.pooling)
        if refusal is not None:
            raise ValueError(refusal)
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        pairs = paired(firsts, [text_2] if isinstance(text_2, str) else list(text_2))
        tokenizer = self._require_tokenizer()
        keep = self._kept_tokens(truncate_prompt_tokens)
        if keep is None:
            plan = plan_pairs(config, pairs, tokenizer.encode, tokenizer.encode_pair)
        else:  # the same call cuts a text or a pair
            cut = partial(tokenizer.encode_keeping_last, keep)
            plan = plan_pairs(config, pairs, cut, cut)
        vectors = []
        for out in self._pool(plan.prompts):
            if out.embedding is None:
                raise ValueError(f"a text of the pairs could not run: {out.error}")
            vectors.append(torch.tensor(out.embedding))
        scores = plan.scores(vectors)
        return [ScoreOutput(a, b, s) for (a, b), s in zip(pairs, scores, strict=True)]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], truncate_prompt_tokens: int | None = None
    ) -> list[ClassificationOutput]:
        """Each prompt's label and class probabilities, as vLLM's `LLM.classify` (a
        `*ForSequenceClassification` checkpoint); prompts cut as `embed` cuts them."""
        config = self.runtime.engine.model_config
        refusal = classifying_refusal(config)
        if refusal is not None:
            raise ValueError(refusal)
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if any(isinstance(p, dict) for p in prompt_list):
            raise ValueError("classify takes text or token ids")
        keep = self._kept_tokens(truncate_prompt_tokens)
        outs = self._pool([self._encode(p, keep) for p in prompt_list])  # type: ignore[arg-type]
        return [
            ClassificationOutput(
                out.prompt_token_ids,
                None if out.embedding is None else classified(config, torch.tensor(out.embedding)),
                out.error,
            )
            for out in outs
        ]

    def _pool(self, ids: list[list[int]]) -> list[EmbeddingOutput]:
        """What a pooling model gives for each prompt (an embedding or a classifier's
        logits, as a list of floats)."""
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        return self._drive([self.scheduler.make_request(p, params) for p in ids], self._embedding)

    @staticmethod
    async def _embedding(req: Req) -> EmbeddingOutput:
        out = await req.channel.get()  # an embedding request's one output ends it
        vector = None if out.pooled is None else out.pooled.tolist()
        return EmbeddingOutput(req.prompt_ids, vector, out.error)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """Apply the model's chat template to each conversation and generate the reply;
        `chat_template_kwargs` are more variables for the template (vLLM's). Messages may
        carry images as OpenAI's `image_url` parts (data URLs) or vLLM's `image_pil` parts.
        `lora` as `generate` takes it."""
        tokenizer = self._require_tokenizer()
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        ids, images = [], []
        for conversation in conversations:
            messages, sources = split_images(list(conversation))  # type: ignore[arg-type]
            ids.append(
                tokenizer.apply_chat_template(messages, template_kwargs=chat_template_kwargs)
            )
            opened = [decoded(data_url_bytes(s)) if isinstance(s, str) else s for s in sources]
            images.append(self._pixels(opened))
        default = self.default_sampling_params()
        params = _per_prompt(sampling_params, len(ids), default)
        return self._run(ids, params, images, self._adapters(lora, len(ids)))

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass token ids, not text")
        return self.tokenizer

    def _encode(self, prompt: str | list[int], keep: int | None = None) -> list[int]:
        """A prompt's token ids, its last `keep` where that is set."""
        if isinstance(prompt, str):
            tokenizer = self._require_tokenizer()
            return (
                tokenizer.encode(prompt)
                if keep is None
                else tokenizer.encode_keeping_last(keep, prompt)
            )
        ids = [int(t) for t in prompt]
        return ids if keep is None else ids[-keep:]

    def _kept_tokens(self, asked: int | None) -> int | None:
        """How many tokens `truncate_prompt_tokens` keeps of a pooled prompt (-1: all that
        the model takes)."""
        if asked is None:
            return None
        room = self.runtime.scheduler.max_seq_len - 1  # the position after it takes a token
        if asked == -1:
            return room
        if not 1 <= asked <= room:
            raise ValueError(f"truncate_prompt_tokens is {asked}: -1, or 1 to {room}")
        return asked

    def _inputs(self, prompt: Prompt) -> tuple[list[int], list[torch.Tensor]]:
        """A prompt's token ids and its images' pixels."""
        if not isinstance(prompt, dict):
            return self._encode(prompt), []
        text = prompt.get("prompt")
        ids = self._encode(text if text is not None else prompt["prompt_token_ids"])
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        return ids, self._pixels(images if isinstance(images, list) else [images])

    def _pixels(self, images: list[Any]) -> list[torch.Tensor]:
        """Images made pixels by the checkpoint's image processor (tensors are pixels)."""
        if all(isinstance(image, torch.Tensor) for image in images):
            return images
        processor = self.runtime.image_processor
        if processor is None:
            raise ValueError("this model has no image processor: it takes no images")
        return processor.pixels(images)

    def start_scheduler(self, on_step: StepObserver | None = None) -> None:
        """Start the scheduler loop now, calling `on_step(batch, seconds)` after every step
        (profilers and benchmarks watch steps this way); `generate` starts it otherwise."""
        if self._task is not None and not self._task.done():
            raise RuntimeError("the scheduler loop is already running")
        self._task = self._loop.create_task(self.scheduler.run(on_step))

    def _run(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        images: list[list[torch.Tensor]] | None = None,
        adapters: list[int] | None = None,
    ) -> list[GenerationOutput]:
        """A ValueError where a prompt's images and image tokens do not pair up."""
        if self.runtime.engine.pooling:
            raise ValueError(
                "this LLM pools (an embedding model or a classifier): call embed, score or classify"
            )
        each = images or [[] for _ in ids]
        adapters = adapters or [0] * len(ids)
        reqs = [
            self.scheduler.make_request(p, sp, m, a)
            for p, sp, m, a in zip(ids, params, each, adapters, strict=True)
        ]
        return self._drive(reqs, self._collect)

    def _drive(self, reqs: list[Req], collect: Callable[[Req], Awaitable[T]]) -> list[T]:
        """Submit `reqs` and `collect` each one's result; raises the error that ended the
        engine (a dead tensor-parallel rank), if one did."""
        self._raise_if_dead()
        if self._task is None:
            self.start_scheduler()
        outputs = self._loop.run_until_complete(self._collect_all(reqs, collect))
        self._raise_if_dead()
        return outputs

    def _raise_if_dead(self) -> None:
        if self._task is not None and self._task.done() and self._task.exception() is not None:
            raise RuntimeError(f"the engine has stopped: {self._task.exception()}")

    async def _collect_all(
        self, reqs: list[Req], collect: Callable[[Req], Awaitable[T]]
    ) -> list[T]:
        for req in reqs:
            self.scheduler.submit(req)
        return list(await asyncio.gather(*(collect(r) for r in reqs)))

    async def _collect(self, req: Req) -> GenerationOutput:
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: list[TokenLogprob] = []
        while True:
            out = await req.channel.get()
            token_ids.extend(out.token_ids)
            logprobs.extend(out.logprobs)
            prompt_logprobs.extend(out.prompt_logprobs)
            if out.finish_reason is not None:
                break
        text_ids = token_ids
        if out.finish_reason is FinishReason.STOP and token_ids:
            text_ids = token_ids[:-1]
        text = self.tokenizer.decode(text_ids) if self.tokenizer is not None else ""
        return GenerationOutput(
            prompt_token_ids=req.vocabulary_prompt_ids,
            token_ids=token_ids,
            text=text,
            finish_reason=out.finish_reason.value,
            error=out.error,
            logprobs=logprobs if req.params.logprobs else None,
            prompt_logprobs=prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )

    def close(self) -> None:
        """Stop the scheduler and release the loop; the LLM cannot generate afterwards."""
        if self._loop.is_closed():
            return
        self.scheduler.stop()
        if self._task is not None:
            self._loop.run_until_complete(asyncio.wait([self._task]))
            if not self._task.cancelled():
                self._task.exception()  # retrieved: generate() reported it already
        self.runtime.close()
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
