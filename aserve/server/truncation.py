"""vLLM's `truncate_prompt_tokens`: a prompt cut from its start to its last N tokens, so
that a client with texts longer than the context (an embedding pipeline's documents, a
chat's long history) gets an answer over their end instead of a 400. Text keeps the
special tokens its tokenizer adds ([CLS] ... [SEP], BOS); token ids and a rendered chat,
whose special tokens are already in place, keep their last N as they are.
"""

from __future__ import annotations

from aserve.server.openai import APIError
from aserve.tokenizer import Tokenizer

PARAM = "truncate_prompt_tokens"


def kept_tokens(asked: int | None, context: int, room: int) -> int | None:
    """How many of a prompt's tokens to keep: None keeps them all, -1 as many as `room`
    (what the context leaves the prompt); more than the model's `context` is a 400, as in
    vLLM."""
    if asked is None:
        return None
    if asked == -1:
        return room
    if asked > context:
        raise APIError(
            f"{PARAM} is {asked}, but this model's context is {context} tokens", param=PARAM
        )
    return asked


async def encode_keeping_last(tokenizer: Tokenizer, text: str, keep: int) -> list[int]:
    """A text encoded in the tokenizer's pool and cut to `keep` tokens."""
    try:
        return await tokenizer.run_in_pool(tokenizer.encode_keeping_last, keep, text)
    except ValueError as error:
        raise APIError(f"{PARAM} is {keep}: {error}", param=PARAM) from None


def keep_last(ids: list[int], keep: int | None) -> list[int]:
    """Token ids cut to their last `keep` (all of them for None)."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]
