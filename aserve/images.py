"""A request's images, from what the API carries to the pixels the image encoder reads
(models/vision.py): data URLs and downloaded bytes decoded by Pillow, then made pixels by the
checkpoint's own image processor (transformers', as its model card runs it). CPU work: the
server runs it in the tokenizer's threads.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path
from typing import Any

import torch

from aserve.models.vision import GRID_TOKENS

MAX_IMAGE_BYTES = 20 << 20
"""An image's encoded bytes at most (OpenAI's limit for image inputs)."""
MAX_IMAGES = 16
"""Images a request may carry."""


class ImageError(ValueError):
    """An image that cannot be read; the message says why (the server answers 400)."""


def data_url_bytes(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ImageError("an image data URL is data:image/<type>;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"an image is over {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as error:
        raise ImageError(f"an image's base64 does not decode: {error}") from None


def decoded(data: bytes) -> Any:
    """The image that `data` (PNG, JPEG, WebP, GIF...) holds, in RGB."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as error:
        raise ImageError(f"images need Pillow: pip install pillow ({error})") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ImageError(f"an image does not decode: {error}") from None


class ImageProcessor:
    """The checkpoint's image processor (its preprocessor_config.json): resizing, cropping
    and normalising as transformers' processor does for this model. A grid tower's images
    are resized to whole cells of `grid_cell` pixels, as transformers' Pixtral processor
    asks its image processor to."""

    def __init__(self, model_dir: Path, grid_cell: int | None = None) -> None:
        import transformers

        self.hf = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
        self.options: dict[str, Any] = {}
        if grid_cell is not None:
            self.options["patch_size"] = {"height": grid_cell, "width": grid_cell}

    def pixels(self, images: list[Any]) -> list[torch.Tensor]:
        """Each image's pixels `[3, H, W]` (Qwen-VL's patches `[T, H, W, values]`) in
        float32 (a tensor given is taken as pixels already)."""
        out: list[torch.Tensor] = []
        for image in images:
            if isinstance(image, torch.Tensor):
                out.append(image)
                continue
            processed = self.hf(images=[image], return_tensors="pt", **self.options)
            pixels = processed["pixel_values"]
            if "image_grid_thw" in processed:  # Qwen-VL: patches, flattened, on their grid
                times, height, width = processed["image_grid_thw"][0].tolist()
                out.append(pixels.reshape(times, height, width, -1).float())
            else:
                out.append(pixels[0].float())
        return out


def grid_token_names(model_dir: Path) -> tuple[str, str]:
    """The tokens that close a row of an image's cells and the image, as the checkpoint's
    processor_config.json names them (transformers' Pixtral processor's names without one)."""
    path = model_dir / "processor_config.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    return (
        settings.get("image_break_token", GRID_TOKENS[0]),
        settings.get("image_end_token", GRID_TOKENS[1]),
    )


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages as a chat template reads them when they carry images, and the images:
    each content becomes a list of parts, an image part becoming `{"type": "image"}` (what
    transformers' templates of vision-language models write an image token for), and its
    source collected in order: the URL of OpenAI's `image_url` part, or the image of
    vLLM's offline `image_pil` part. Messages without images come back as they are."""
    if not any(_image_parts(message) for message in messages):
        return messages, []
    images: list[Any] = []
    shaped = []
    for message in messages:
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        template_parts = []
        for part in parts or []:
            kind = part.get("type")
            if kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
                template_parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(part.get("image_pil"))
                template_parts.append({"type": "image"})
            else:
                template_parts.append(part)
        shaped.append({**message, "content": template_parts})
    if len(images) > MAX_IMAGES:
        raise ImageError(f"a request carries {len(images)} images, more than {MAX_IMAGES}")
    return shaped, images


def _image_parts(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") in ("image_url", "image_pil")
        for part in content
    )
