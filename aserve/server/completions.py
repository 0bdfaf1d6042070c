"""The generation endpoints: OpenAI chat and text completions (streamed or not) and SGLang's
`/generate`. Each request becomes one `Choice` per prompt and `n`; their deltas are shaped
into one JSON body or a stream of SSE chunks, with latency metrics recorded on the way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from aiohttp import web
from jinja2 import TemplateError

from aserve.constrained.grammar import GrammarError
from aserve.runtime import Runtime
from aserve.sampling_params import MAX_SEED, SamplingError
from aserve.server import openai
from aserve.server.generation import Choice, Delta
from aserve.server.harmony import forcing_tag as harmony_forcing_tag
from aserve.server.harmony import is_harmony
from aserve.server.http import json_response, sse
from aserve.server.image_inputs import image_pixels, template_messages
from aserve.server.limits import InputLimits
from aserve.server.native import NativeShaper
from aserve.server.openai import APIError, GenerationRequest, ResponseHead
from aserve.server.reasoning import THINK_END, closes_thinking, opens_thinking
from aserve.server.responses import ResponseShaper
from aserve.server.responses_api import ResponsesShaper, item_id
from aserve.server.state import ServerState, require_tokenizer
from aserve.server.streaming import ChoiceStream, EventWriter, Shaper
from aserve.server.tools import special_marker_ids, tool_syntax
from aserve.server.truncation import encode_keeping_last, keep_last, kept_tokens
from aserve.tokenizer import Tokenizer

logger = logging.getLogger("aserve.server")
THINK_TAIL_TOKENS = 4  # enough of a prompt's end to see whether it opens <think>


def prompt_room(runtime: Runtime, parsed: GenerationRequest) -> tuple[int, int]:
    """The model's context, and what it leaves a prompt: all but `max_tokens` (one token
    where that is unset or 0)."""
    context = runtime.engine.max_seq_len
    return context, max(1, context - (parsed.max_tokens or 1))


class Completions:
    """The generation routes. Each holds its admission places from its first line to its
    terminal reply, whatever that is, so the server's bound holds under any burst."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, openai.parse_chat)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: a chat request in another shape (server/responses_api.py)."""
        return await self._chat(request, openai.parse_responses)

    async def _chat(
        self, request: web.Request, parse: Callable[[bytes, Any], GenerationRequest]
    ) -> web.StreamResponse:
        runtime, limits = self.state.ready_to_generate()
        with self.state.admission.reserve() as places:
            parsed = parse(await limits.read_body(request), runtime.sampling_defaults)
            parsed = dataclasses.replace(parsed, adapter=self.state.adapter_of(parsed.model))
            places.resize(parsed.n)
            assert parsed.messages is not None
            chars = sum(openai.text_chars(m) for m in parsed.messages)
            limits.check_text(chars, parsed.max_tokens, "messages")
            tokenizer = require_tokenizer(runtime)
            messages, sources = template_messages(runtime, parsed.messages)
            if sources:
                images = await image_pixels(runtime, tokenizer, sources)
                parsed = dataclasses.replace(parsed, images=images)
            try:
                prompt = await tokenizer.apply_chat_template_async(
                    messages, parsed.tools, parsed.chat_template_kwargs
                )
            except ValueError as error:
                raise APIError(str(error), param="messages") from None
            except TemplateError as error:  # the template's own raise_exception, say
                raise APIError(f"the chat template failed: {error}", param="messages") from None
            prompt = self._chat_kept(runtime, parsed, prompt)
            if is_harmony(tokenizer.hf.chat_template):
                parsed = await self._with_harmony(tokenizer, parsed)
            else:
                if parsed.tools:
                    parsed = await self._with_tools(
                        tokenizer, parsed, self.state.config.tool_call_parser
                    )
                if self.state.config.reasoning_parser is not None:
                    parsed = self._with_thinking(tokenizer, parsed, prompt)
            return await self._generate(request, runtime, parsed, [prompt])

    @staticmethod
    def _chat_kept(runtime: Runtime, parsed: GenerationRequest, prompt: list[int]) -> list[int]:
        """A rendered chat cut to the last tokens `truncate_prompt_tokens` keeps; a cut
        would drop images' tokens where the chat carries images, so there it is a 400."""
        keep = kept_tokens(parsed.truncate_prompt_tokens, *prompt_room(runtime, parsed))
        if keep is not None and len(prompt) > keep and parsed.images:
            raise APIError(
                f"{len(prompt)} tokens with images: truncate_prompt_tokens cuts no prompt "
                "that holds images",
                param="truncate_prompt_tokens",
            )
        return keep_last(prompt, keep)

    @staticmethod
    async def _with_harmony(tokenizer: Tokenizer, parsed: GenerationRequest) -> GenerationRequest:
        """gpt-oss replies in harmony: decoded with its markers (special tokens), split into
        reasoning, content and tool calls by their channels, with or without a reasoning
        parser; tool_choice "required" or a named function is a grammar that lets the model
        think, then makes it call (harmony.forcing_tag)."""
        parsed = dataclasses.replace(parsed, harmony=True, skip_special_tokens=False)
        if not parsed.tools or parsed.tool_choice == "auto":
            return parsed
        tag = await tokenizer.run_in_pool(harmony_forcing_tag, parsed.tools, parsed.tool_choice)
        return dataclasses.replace(
            parsed, params=dataclasses.replace(parsed.params, structural_tag=tag)
        )

    @staticmethod
    async def _with_tools(
        tokenizer: Tokenizer, parsed: GenerationRequest, parser: str
    ) -> GenerationRequest:
        """Tool calls are parsed from the reply in the parser's syntax (by default the one
        the template teaches), whose markers stay in the text where the vocabulary holds
        them as special tokens (Mistral's [TOOL_CALLS]); with tool_choice "required" or a
        named function a grammar writes them."""
        syntax = tool_syntax(parser, tokenizer.hf.chat_template)
        shown = special_marker_ids(syntax, tokenizer)
        parsed = dataclasses.replace(parsed, tool_syntax=syntax, shown_special_ids=shown)
        if parsed.tool_choice == "auto":
            return parsed
        tag = await tokenizer.run_in_pool(
            syntax.forcing_tag, parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls
        )
        return dataclasses.replace(
            parsed, params=dataclasses.replace(parsed.params, structural_tag=tag)
        )

    @staticmethod
    def _with_thinking(
        tokenizer: Tokenizer, parsed: GenerationRequest, prompt: list[int]
    ) -> GenerationRequest:
        """Where the reply's thinking starts, from the prompt's end; a constrained reply
        thinks freely and its grammar starts after `</think>` (as vLLM and SGLang do),
        unless the prompt closed the block already or the tag is no single token, where the
        grammar writes the reply from its first token."""
        tail = tokenizer.decode(prompt[-THINK_TAIL_TOKENS:], skip_special_tokens=False)
        opened = opens_thinking(tail)
        if parsed.params.constraint is None:
            return dataclasses.replace(parsed, thinking_opened=opened)
        end = tokenizer.single_token(THINK_END)
        if end is None or closes_thinking(tail):
            return dataclasses.replace(parsed, thinking_opened=False)
        return dataclasses.replace(parsed, thinking_opened=opened, grammar_after=end)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        runtime, limits = self.state.ready_to_generate()
        with self.state.admission.reserve() as places:
            raw = await limits.read_body(request)
            parsed = openai.parse_completion(raw, runtime.sampling_defaults)
            parsed = dataclasses.replace(parsed, adapter=self.state.adapter_of(parsed.model))
            places.resize(parsed.n * (len(parsed.texts) or len(parsed.token_ids)))
            prompts = await self._tokenized(runtime, limits, parsed)
            return await self._generate(request, runtime, parsed, prompts)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native route: a prompt or a batch, text or token ids, whole or streamed
        (server/native.py shapes the reply)."""
        runtime, limits = self.state.ready_to_generate()
        with self.state.admission.reserve() as places:
            native = openai.parse_generate(
                await limits.read_body(request), runtime.sampling_defaults
            )
            places.resize(native.size)
            prompts = await asyncio.gather(
                *(self._tokenized(runtime, limits, parsed) for parsed in native.prompts)
            )
            choices: list[Choice] = []
            rids: list[str] = []
            for parsed, (prompt,), rid, sources in zip(
                native.prompts, prompts, native.rids, native.image_sources, strict=True
            ):
                parsed = self._scored_from(native, parsed, prompt)
                adapter = self.state.adapter_of(parsed.model, "lora_path")
                parsed = dataclasses.replace(parsed, adapter=adapter)
                if sources:
                    tokenizer = require_tokenizer(runtime)
                    images = await image_pixels(runtime, tokenizer, sources, "image_data")
                    parsed = dataclasses.replace(parsed, images=images)
                grammar = await self._grammar(runtime, parsed)
                made = self._make_choices(runtime, parsed, [prompt], grammar)
                choices += made
                base = rid or openai.new_id("gen")
                rids += [base] if len(made) == 1 else [f"{base}-{i}" for i in range(len(made))]
            with self.state.native_rids.hold(rids, choices):
                shaper = NativeShaper(native, runtime.tokenizer, choices, rids, time.monotonic())
                return await self._respond(request, shaper, choices, native.stream)

    @staticmethod
    def _scored_from(
        native: openai.NativeRequest, parsed: GenerationRequest, prompt: list[int]
    ) -> GenerationRequest:
        """With return_logprob, the prompt is scored from logprob_start_len (-1: its last
        token alone); the first token has no logprob, so a start of 0 scores from token 1."""
        if not native.return_logprob:
            return parsed
        start = native.logprob_start_len
        if start >= len(prompt):
            raise APIError(
                f"logprob_start_len is {start}, but the prompt has {len(prompt)} tokens",
                param="logprob_start_len",
            )
        first = max(1, len(prompt) - 1 if start < 0 else start)
        params = dataclasses.replace(parsed.params, prompt_logprobs_from=first)
        return dataclasses.replace(parsed, params=params)

    async def _tokenized(
        self, runtime: Runtime, limits: InputLimits, parsed: GenerationRequest
    ) -> list[list[int]]:
        keep = kept_tokens(parsed.truncate_prompt_tokens, *prompt_room(runtime, parsed))
        if not parsed.texts:
            return [keep_last(ids, keep) for ids in parsed.token_ids]
        for text in parsed.texts:
            limits.check_text(len(text), parsed.max_tokens, "prompt")
        tokenizer = require_tokenizer(runtime)
        if keep is not None:
            cut = (encode_keeping_last(tokenizer, text, keep) for text in parsed.texts)
            return list(await asyncio.gather(*cut))
        return list(await asyncio.gather(*(tokenizer.encode_async(t) for t in parsed.texts)))

    @staticmethod
    async def _grammar(runtime: Runtime, parsed: GenerationRequest) -> Any:
        """The request's output constraint compiled in the tokenizer's pool (every choice
        shares it), or None without one; a bad one is a 400 naming its field."""
        if parsed.params.constraint is None:
            return None
        param = parsed.constraint_field
        grammars = runtime.scheduler.grammars
        if grammars is None:
            raise APIError("constrained output needs the model's tokenizer", param=param)
        try:
            return await grammars.compile_async(parsed.params)
        except GrammarError as error:
            raise APIError(str(error), param=param) from None

    def _make_choices(
        self,
        runtime: Runtime,
        parsed: GenerationRequest,
        prompts: list[list[int]],
        grammar: Any = None,
    ) -> list[Choice]:
        context = runtime.engine.max_seq_len
        choices = []
        for prompt in prompts:
            if parsed.max_tokens is not None and len(prompt) + parsed.max_tokens > context:
                raise APIError(
                    f"this model's context is {context} tokens, but the prompt has "
                    f"{len(prompt)} tokens and max_tokens is {parsed.max_tokens}",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            max_tokens = parsed.max_tokens or context - len(prompt)
            if max_tokens < 1:
                raise APIError(
                    f"this model's context is {context} tokens and the prompt has "
                    f"{len(prompt)} tokens: no room to generate",
                    param="messages",
                    code="context_length_exceeded",
                )
            for i in range(parsed.n):
                seed = parsed.params.seed
                try:
                    params = dataclasses.replace(
                        parsed.params,
                        max_tokens=max_tokens,
                        seed=None if seed is None else (seed + i) % (MAX_SEED + 1),
                    )
                except SamplingError as error:  # min_tokens past the room the prompt left
                    raise APIError(str(error), param="min_tokens") from None
                choice = Choice(
                    runtime.scheduler,
                    runtime.tokenizer,
                    prompt,
                    params,
                    parsed.stop,
                    parsed.skip_special_tokens,
                    parsed.include_stop,
                    parsed.prompt_only,
                    parsed.grammar_after,
                    grammar=grammar,
                    shown_special_ids=parsed.shown_special_ids,
                    images=parsed.images,
                    adapter=parsed.adapter,
                )
                problem = choice.prepare()
                if problem is not None:
                    biased = problem.startswith("logit_bias")
                    raise APIError(problem, param="logit_bias" if biased else parsed.prompt_field)
                choices.append(choice)
        return choices

    async def _generate(
        self,
        request: web.Request,
        runtime: Runtime,
        parsed: GenerationRequest,
        prompts: list[list[int]],
    ) -> web.StreamResponse:
        grammar = await self._grammar(runtime, parsed)
        choices = self._make_choices(runtime, parsed, prompts, grammar)
        if parsed.responses_api is not None:
            head = ResponseHead(item_id("resp"), self.state.name_of(parsed.adapter))
            shaper: Shaper = ResponsesShaper(parsed, head, choices[0])
        else:
            prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
            head = ResponseHead(openai.new_id(prefix), self.state.name_of(parsed.adapter))
            shaper = ResponseShaper(parsed, head, runtime, choices)
        return await self._respond(request, shaper, choices, parsed.stream)

    async def _respond(
        self, request: web.Request, shaper: Shaper, choices: list[Choice], stream: bool
    ) -> web.StreamResponse:
        """Run the choices to their end: one JSON body, or their SSE events as they come."""
        started = time.monotonic()
        if stream:
            # Submit, then let the loop turn before preparing the response: the handlers of a
            # burst resume together once their prompts are encoded, and this way the scheduler
            # plans its first prefill after all of them have submitted, not after all have
            # also written their headers (about half of a handler's work; 256 chat streams on
            # an H200 spent ~60 ms in such a run of handlers).
            for choice in choices:
                choice.start()
            try:
                await asyncio.sleep(0)
                return await self._stream(request, shaper, choices, started)
            finally:
                for choice in choices:
                    choice.cancel()
        results = await asyncio.gather(*(self._collect(c, started) for c in choices))
        return json_response(shaper.full_body(results))

    async def _collect(self, choice: Choice, started: float) -> list[Delta]:
        deltas = []
        async for delta in choice.run():
            self._observe(choice, delta, started)
            deltas.append(delta)
        return deltas

    def _observe(self, choice: Choice, delta: Delta, started: float) -> None:
        """Latency metrics of a delta as it goes out."""
        now = time.monotonic()
        if delta.token_ids:
            if not choice.first_token_seen:
                choice.first_token_seen = True
                self.state.metrics.on_first_token(now - started, len(choice.prompt_ids))
            else:
                self.state.metrics.on_tokens(len(delta.token_ids), now - choice.last_token_at)
            choice.last_token_at = now
        if delta.finish_reason is not None:
            self.state.metrics.on_finish(
                delta.finish_reason, now - started, len(choice.prompt_ids), choice.completion_tokens
            )

    async def _stream(
        self,
        request: web.Request,
        shaper: Shaper,
        choices: list[Choice],
        started: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        # aiohttp sends the headers with the first write; the events after go straight out
        await response.write(shaper.opening_events())
        observe = partial(self._observe, started=started)
        writer = EventWriter(request, response)
        stream = ChoiceStream(shaper, choices, observe, writer, self.state.pace)
        failure = await stream.run()
        if failure is not None:
            logger.error("streamed choice failed: %s", failure[1])
            await response.write(sse(APIError(str(failure[1]), 500).body()))
        else:
            await response.write(shaper.closing_events())
        await response.write(shaper.DONE)
        await response.write_eof()
        return response
