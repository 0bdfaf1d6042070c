"""A chat request's images, from their URLs to pixels: data URLs decoded, http(s) URLs
fetched (with a time limit and aserve.images' size limit), then decoded and processed in the
tokenizer's threads, off the event loop. Any failure is a 400 that says which image and why.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import torch

from aserve.images import (
    MAX_IMAGE_BYTES,
    ImageError,
    ImageProcessor,
    data_url_bytes,
    decoded,
    split_images,
)
from aserve.runtime import Runtime
from aserve.server.openai import APIError
from aserve.tokenizer import Tokenizer

FETCH_TIMEOUT_S = 20.0


def template_messages(
    runtime: Runtime, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages as the template reads them and their images' URLs (`split_images`);
    a 400 where they do not hold or this model takes no images (before any is fetched)."""
    try:
        shaped, sources = split_images(messages)
    except ImageError as error:
        raise APIError(str(error), param="messages") from None
    if sources and runtime.image_processor is None:
        raise APIError("this model takes no images: send text alone", param="messages")
    return shaped, sources


async def image_pixels(
    runtime: Runtime, tokenizer: Tokenizer, sources: list[Any], param: str = "messages"
) -> list[torch.Tensor]:
    """Each image URL's pixels, in order; a 400 (naming `param`) where this model takes no
    images or an image cannot be had."""
    processor = runtime.image_processor
    if processor is None:
        raise APIError("this model takes no images: send text alone", param=param)
    fetched = (_bytes_of(i, url, param) for i, url in enumerate(sources))
    blobs = await asyncio.gather(*fetched)
    try:
        return await tokenizer.run_in_pool(_pixels, processor, blobs)
    except ImageError as error:
        raise APIError(str(error), param=param) from None


def _pixels(processor: ImageProcessor, blobs: list[bytes]) -> list[torch.Tensor]:
    return processor.pixels([decoded(blob) for blob in blobs])


async def _bytes_of(index: int, url: str, param: str) -> bytes:
    """Image `index`'s bytes: a data URL's, or an http(s) URL's body."""
    try:
        if url.startswith("data:"):
            return data_url_bytes(url)
        if url.startswith(("http://", "https://")):
            return await _fetched(url)
        raise ImageError("an image URL is a data: URL or an http(s) one")
    except ImageError as error:
        raise APIError(f"image {index}: {error}", param=param) from None


async def _fetched(url: str) -> bytes:
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url) as response:
                if response.status != 200:
                    raise ImageError(f"fetching {url} gave HTTP {response.status}")
                data = await response.content.read(MAX_IMAGE_BYTES + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        raise ImageError(f"fetching {url} failed: {error!r}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{url} is over {MAX_IMAGE_BYTES >> 20} MiB")
    return data
