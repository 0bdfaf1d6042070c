"""Tokenizer access: encoding, chat templates and decoding of a model folder's tokenizer.

The server calls the `*_async` methods. A prompt of up to `INLINE_CHARS` characters is
tokenized on the event loop at once (a tenth of a millisecond or so). Longer ones wait for
the next turn of the loop and are encoded together: by one call on the loop if the turn's
prompts are `INLINE_TURN_CHARS` characters in all or fewer, else in a small thread pool,
where the `tokenizers` library releases the GIL while it works, one call per group of
`POOL_GROUP_CHARS` so the first requests of a burst reach the scheduler while the rest are
still being encoded. One pool call per prompt was slower under load: each hop there and back
waits for the GIL, which a busy loop gives up only every switch interval (5 ms), so under
256 streams on an H200 new requests reached the scheduler about one a step; encoding them
all on the loop instead cost it about 1 ms per 4,000-character prompt of a byte-level BPE.
Generated tokens become text through `IncrementalDetokenizer`, which decodes only a few
tokens per step and so runs on the loop itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 4
MAX_PARTIAL_TOKENS = 3
MAX_UNSETTLED_PUSHES = 8
# A normalizer may join characters before the model sees them (NFC composes a Hangul syllable
# from three jamo): the text-length bound allows four input characters per output character.
NORMALIZER_SLACK = 4
# Prompts this long or shorter are tokenized on the event loop (a byte-level BPE takes about
# 0.3 ms per 1,000 characters on a laptop core); longer ones in the pool, batched per turn.
INLINE_CHARS = 512
# A turn's batch of at most this many characters in all is encoded on the loop (a few ms at
# most); a bigger one, a burst's, in the pool.
INLINE_TURN_CHARS = 16384
# A burst goes to the pool in groups of about this many characters, each handed out as soon
# as it is encoded: the scheduler prefills the first group while the pool encodes the next,
# instead of every request of the burst waiting for the last one's ids.
POOL_GROUP_CHARS = 65536

T = TypeVar("T")


def _hand_out(
    job: asyncio.Future[list[list[int]]], futures: list[asyncio.Future[list[int]]]
) -> None:
    """Each waiting request its ids, or the batch's error; a request that gave up is skipped."""
    error = job.exception() if not job.cancelled() else asyncio.CancelledError()
    for i, future in enumerate(futures):
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(job.result()[i])


def _groups(texts: Sequence[str], group_chars: int) -> list[tuple[int, int]]:
    """Consecutive (start, end) index ranges of `texts`, each ending once it holds
    `group_chars` characters or more."""
    groups: list[tuple[int, int]] = []
    start = chars = 0
    for i, text in enumerate(texts):
        chars += len(text)
        if chars >= group_chars:
            groups.append((start, i + 1))
            start, chars = i + 1, 0
    if start < len(texts):
        groups.append((start, len(texts)))
    return groups


def _kept_lengths(lengths: list[int], room: int) -> list[int]:
    """How many tokens each part of a text (one, or a pair) keeps in `room`: the longer part
    is cut first, down to the other's length, then both alike (the second first on ties)."""
    if len(lengths) == 1:
        return [min(lengths[0], room)]
    first, second = lengths
    over = max(0, first + second - room)
    gap = min(over, abs(first - second))
    if first > second:
        first -= gap
    else:
        second -= gap
    over -= gap
    return [first - over // 2, second - (over + 1) // 2]


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).exists() for name in TOKENIZER_FILES)


def chars_per_token_bound(hf: Any) -> int | None:
    """The most characters of input text that one token can stand for, or None where this
    tokenizer gives no such bound. A text of more characters than the context times this
    cannot fit, which the server tells without tokenizing it.

    For BPE a token stands for its piece: byte-level pieces have one character per byte and
    SentencePiece-style pieces one per character, so the longest piece bounds it. BPE that
    fuses a run of unknown characters into one token (no byte fallback) has no bound.
    """
    from tokenizers.models import BPE

    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, BPE):
        return None
    if backend.model.fuse_unk and not backend.model.byte_fallback:
        return None
    longest = max(len(piece) for piece in hf.get_vocab())
    return longest if backend.normalizer is None else longest * NORMALIZER_SLACK


def backend_decode(hf: Any) -> Callable[..., str] | None:
    """The `tokenizers` decode that `hf.decode` wraps, where calling it directly gives the same
    text: that saves about 3 us of Python per call, and the detokenizer decodes on every step."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(hf)
    plain = (
        isinstance(hf, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not hf.clean_up_tokenization_spaces
    )
    return hf.backend_tokenizer.decode if plain else None


def byte_level_decoder(hf: Any) -> bool:
    """Whether the backend decodes byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): token strings
    joined and mapped back to bytes, so ids that split where a character ends decode to the
    two texts joined. SentencePiece (Metaspace) and word-level decoders do not: they drop or
    add spaces at the start of a piece."""
    from tokenizers import decoders

    return isinstance(hf.backend_tokenizer.decoder, decoders.ByteLevel)


def light_model_config(model_dir: Path) -> Any | None:
    """A stand-in for the model config that AutoTokenizer consults, where tokenizer_config.json
    names the tokenizer class (then the config only lends its model type). Left to itself
    AutoTokenizer loads the model's configuration class, which in transformers 5 imports
    torch.distributed.tensor and sympy: about 50 MiB more resident for no tokenizer behaviour.
    None where the class must come from the model type's own mapping."""
    from transformers import PreTrainedConfig

    tokenizer_file = model_dir / "tokenizer_config.json"
    config_file = model_dir / "config.json"
    if not tokenizer_file.is_file() or not config_file.is_file():
        return None
    if not json.loads(tokenizer_file.read_text()).get("tokenizer_class"):
        return None
    config = PreTrainedConfig()
    config.model_type = json.loads(config_file.read_text()).get("model_type", "")
    return config


def processor_chat_template(model_dir: Path) -> str | None:
    """A vision-language checkpoint's chat template where its processor keeps it
    (chat_template.json, as LLaVA's were published), not its tokenizer."""
    path = model_dir / "chat_template.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def load_hf_tokenizer(model_dir: Path) -> Any:
    """The fast tokenizer class that tokenizer_config.json names, imported by itself; any
    other folder through AutoTokenizer. AutoTokenizer's import pulls in transformers' model
    registry: with transformers 5.17 and scikit-learn installed (the GPU machine), the
    generation utilities, torch.distributed.tensor and scikit-learn, 3 s alone and up to 14 s
    beside the engine's start. A class named directly loads the same tokenizer (tested)."""
    import transformers

    config_file = model_dir / "tokenizer_config.json"
    name = (
        json.loads(config_file.read_text()).get("tokenizer_class")
        if config_file.is_file()
        else None
    )
    named = getattr(transformers, name, None) if isinstance(name, str) else None
    if isinstance(named, type) and issubclass(named, transformers.PreTrainedTokenizerFast):
        return named.from_pretrained(str(model_dir))
    return transformers.AutoTokenizer.from_pretrained(
        str(model_dir), config=light_model_config(model_dir)
    )


class Tokenizer:
    """A model folder's tokenizer; `special_ids` are the ids that skip_special_tokens drops."""

    def __init__(self, model_dir: Path, num_threads: int = 1) -> None:
        self.hf = load_hf_tokenizer(model_dir)
        if not self.hf.chat_template:
            self.hf.chat_template = processor_chat_template(model_dir)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="aserve-tokenizer")
        # Texts waiting for the next batch, by add_special_tokens (plain prompts / chats).
        self._batches: dict[bool, list[tuple[str, asyncio.Future[list[int]]]]] = {
            True: [],
            False: [],
        }
        self._backend_decode = backend_decode(self.hf)
        self.concatenative = self._backend_decode is not None and byte_level_decoder(self.hf)
        self.special_ids = self._ids_dropped_when_skipping_special()
        self.max_chars_per_token = chars_per_token_bound(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one sequence, the tokenizer's way of joining a pair (a
        cross-encoder's query and document)."""
        return list(self.hf(first, text_pair=second)["input_ids"])

    def encode_keeping_last(self, limit: int, *texts: str) -> list[int]:
        """A text (or a pair, as `encode_pair` joins it) in at most `limit` tokens: cut from
        its start, the special tokens the tokenizer adds kept (transformers' truncation from
        the left); a pair's longer part loses tokens first. vLLM's `truncate_prompt_tokens`.
        The backend's encodings are cut and joined here: transformers' own truncation is a
        setting of the shared backend, which another thread of the pool could change."""
        backend = self.hf.backend_tokenizer
        parts = [backend.encode(text, add_special_tokens=False) for text in texts]
        room = limit - backend.num_special_tokens_to_add(len(parts) == 2)
        if room < len(parts):
            raise ValueError(
                f"keeping {limit} tokens leaves no room for the text beside the "
                f"{limit - room} special tokens this tokenizer adds"
            )
        for part, kept in zip(parts, _kept_lengths([len(p) for p in parts], room), strict=True):
            part.truncate(kept, direction="left")
        return list(backend.post_process(*parts, add_special_tokens=True).ids)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The model's chat template with the assistant turn opened, as token ids; `tools`
        (OpenAI's shape) are rendered as the template renders them; `template_kwargs` are
        more variables for it (`enable_thinking`, ...)."""
        return self.encode_chat(self.render_chat(messages, tools, template_kwargs))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's text (Python's Jinja: bound to the GIL wherever it runs);
        `template_kwargs` may also switch the assistant turn's opening off or continue the
        last message instead (`add_generation_prompt`, `continue_final_message`)."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        options = {"add_generation_prompt": True, **(template_kwargs or {})}
        return self.hf.apply_chat_template(list(messages), tools=tools, tokenize=False, **options)

    def single_token(self, text: str) -> int | None:
        """The id of the one token that is exactly `text`, or None (a tag such as
        `</think>` that the vocabulary spells in pieces)."""
        ids = self.hf.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self.decode(ids, False) == text else None

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat: its special tokens are already in the text."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """`encode` (or `encode_chat`) of each text in one call: a fast tokenizer encodes the
        batch in Rust, without the GIL, across cores."""
        ids = self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return [list(one) for one in ids]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _ids_dropped_when_skipping_special(self) -> frozenset[int]:
        """Ids that decode to text, but to nothing with skip_special_tokens=True. The detokenizer
        leaves them out of its window, where they would be context that shows no text."""
        candidates = set(self.hf.added_tokens_decoder) | set(self.hf.all_special_ids)
        return frozenset(
            i for i in candidates if not self.decode([i], True) and self.decode([i], False)
        )

    async def encode_async(self, text: str) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.encode(text)
        return await self._encode_batched(text, add_special_tokens=True)

    async def apply_chat_template_async(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(messages, tools, template_kwargs)
        if len(text) <= INLINE_CHARS:
            return self.encode_chat(text)
        return await self._encode_batched(text, add_special_tokens=False)

    async def _encode_batched(self, text: str, add_special_tokens: bool) -> list[int]:
        """Join the batch that goes to the pool at the next turn of the loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        batch = self._batches[add_special_tokens]
        batch.append((text, future))
        if len(batch) == 1:
            loop.call_soon(self._send_batch, add_special_tokens)
        return await future

    def _send_batch(self, add_special_tokens: bool) -> None:
        """A turn's texts: encoded here when they are few characters in all (a request
        arriving alone then skips the pool hop and its GIL waits), else in the pool."""
        batch, self._batches[add_special_tokens] = self._batches[add_special_tokens], []
        texts = [text for text, _ in batch]
        loop = asyncio.get_running_loop()
        futures = [future for _, future in batch]
        if sum(map(len, texts)) <= INLINE_TURN_CHARS:
            job: asyncio.Future[list[list[int]]] = loop.create_future()
            try:
                job.set_result(self.encode_many(texts, add_special_tokens))
            except Exception as error:
                job.set_exception(error)
            _hand_out(job, futures)
            return
        for start, end in _groups(texts, POOL_GROUP_CHARS):
            job = loop.run_in_executor(
                self._pool, self.encode_many, texts[start:end], add_special_tokens
            )
            job.add_done_callback(partial(_hand_out, futures=futures[start:end]))

    async def decode_async(self, token_ids: Sequence[int]) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.decode, token_ids)

    async def run_in_pool(self, work: Callable[..., T], *args: Any) -> T:
        """Other work that belongs with the tokenizer off the event loop (grammar compiles)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class IncrementalDetokenizer:
    """Turns generated token ids, a few at a time, into text that only ever grows.

    Byte-level BPE tokens can end inside a multi-byte character, which decodes as U+FFFD, so
    text is only released up to a token boundary where the decoded text is complete; the rest
    waits for the tokens that complete its character. The concatenation of every `push` and the
    final `flush` equals decoding all pushed ids at once, whatever the chunking. That needs a
    prefix-stable decode (byte-level BPE and SentencePiece are; `clean_up_tokenization_spaces`
    is not) and, for SentencePiece byte fallback, byte runs that are valid UTF-8: a broken run
    decodes to U+FFFD as a whole, also where it was already sent.

    Each push decodes a window: the tokens read by the previous push as context, then the
    unread ones. Context is needed because decoding from a token on can differ from decoding
    through it (SentencePiece drops the space of the first word), and it must start where a
    character starts (SentencePiece decodes a byte run as a whole), which a read offset does.
    When the window ends inside a character, the read offset moves to the latest of the last
    `MAX_PARTIAL_TOKENS` boundaries (an unfinished UTF-8 character has at most three bytes)
    where the text is complete. Output that never completes a character there (a model emitting
    stray bytes) would keep the window growing, so after `MAX_UNSETTLED_PUSHES` such pushes the
    offset moves before the last token if decoding the two sides apart gives the whole text; for
    byte-level BPE that proves no character spans the boundary.

    With `prompt_ids`, the last prompt tokens are the first context, so the output reads as a
    continuation of the prompt (a SentencePiece reply keeps the space before its first word).
    Ids that `skip_special_tokens` removes never enter the window, but for `shown_special_ids`
    (a tool-call syntax's markers that the vocabulary holds as special tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        shown_special_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._tokenizer = tokenizer
        # The dropped ids never reach a decode, so one without skipping shows the rest.
        self._skip = skip_special_tokens and not shown_special_ids
        self._dropped = (
            tokenizer.special_ids - shown_special_ids if skip_special_tokens else frozenset()
        )
        self._ids = self._prompt_context(self._kept_tail(prompt_ids))
        self._read = len(self._ids)
        self._prefix = len(self._decode(self._ids))
        self._unsettled = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that these tokens complete; may be empty."""
        new = self._kept(token_ids)
        if not new:
            return ""
        self._ids.extend(new)
        boundary, text = len(self._ids), self._decode(self._ids)
        if text.endswith(REPLACEMENT):
            boundary, text = self._complete_boundary(text)
        out = text[self._prefix :]
        if boundary > self._read:
            self._move_read_offset(boundary, out)
        return out

    def flush(self) -> str:
        """What is still held back once generation has ended (a character that never got
        completed comes out as U+FFFD, as a full decode gives it); a later push starts afresh."""
        out = self._decode(self._ids)[self._prefix :]
        self._ids, self._read, self._prefix = [], 0, 0
        return out

    def _complete_boundary(self, text: str) -> tuple[int, str]:
        """The latest token boundary where the window's text is complete, and that text."""
        end = len(self._ids)
        for boundary in range(end - 1, max(self._read, end - 1 - MAX_PARTIAL_TOKENS), -1):
            head = self._decode(self._ids[:boundary])
            if not head.endswith(REPLACEMENT):
                return boundary, head
        self._unsettled += 1
        if self._unsettled > MAX_UNSETTLED_PUSHES:
            head = self._decode(self._ids[: end - 1])
            if head + self._decode(self._ids[end - 1 :]) == text:
                return end - 1, head
        return self._read, text[: self._prefix]

    def _move_read_offset(self, boundary: int, read_text: str) -> None:
        """Read up to `boundary`; the tokens read until now become the only context.
        `read_text` is what the window decoded to from the old read offset to `boundary`: with
        a byte-level decoder it is those tokens' own decode (both offsets end characters),
        which saves a decode a push; other decoders decode them again."""
        start = self._read
        self._ids = self._ids[start:]
        self._read = boundary - start
        if self._tokenizer.concatenative:
            self._prefix = len(read_text)
        else:
            self._prefix = len(self._decode(self._ids[: self._read]))
        self._unsettled = 0

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last prompt tokens from a character start on, or none if the prompt ends inside a
        character (then the output decodes as it would on its own)."""
        for start in range(max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS), len(prompt_ids)):
            text = self._decode(prompt_ids[start:])
            if not text.startswith(REPLACEMENT):
                return [] if text.endswith(REPLACEMENT) else prompt_ids[start:]
        return []

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        return [i for i in token_ids if i not in self._dropped]

    def _kept_tail(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last `PROMPT_CONTEXT_TOKENS` kept ids of the prompt, read from its end: the
        server makes one detokenizer per request, and a burst's prompts are long."""
        tail: list[int] = []
        for i in reversed(prompt_ids):
            if i not in self._dropped:
                tail.append(i)
                if len(tail) == PROMPT_CONTEXT_TOKENS:
                    break
        return tail[::-1]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, self._skip) if token_ids else ""
