"""Tokenizer access: encoding, chat templates and decoding of a model folder's tokenizer.

Tokenizing a long prompt can take milliseconds, so the server calls the `*_async` methods,
which run on a small thread pool and never block the event loop (the `tokenizers` library
releases the GIL while it works).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).exists() for name in TOKENIZER_FILES)


class Tokenizer:
    def __init__(self, model_dir: Path, num_threads: int = 1) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="aserve-tokenizer")

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The model's chat template with the assistant turn opened, as token ids."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    async def encode_async(self, text: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, text)

    async def apply_chat_template_async(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.apply_chat_template, messages)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
