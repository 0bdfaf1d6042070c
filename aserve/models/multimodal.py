"""The language model's tensors of a vision-language checkpoint (config.py's
`VISION_LANGUAGE_ARCHITECTURES`), under the names a text model's checkpoint gives them.

Publishers file the language model in one of three ways: under `language_model.` (Gemma 3,
Mistral Small 3.1 and LLaVA as released: `language_model.model.layers.0...`,
`language_model.lm_head.weight`), under `model.language_model.` beside a top-level
`lm_head` (what transformers 5 names its modules; Qwen3-VL), or as a text model's own names
beside a vision tower (Qwen2-VL, Qwen2.5-VL). The vision encoder and its projector are
skipped here: models/vision.py reads them where the checkpoint's images run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

VISION_PARTS = frozenset({"vision_tower", "vision_model", "multi_modal_projector", "visual"})
"""Top-level modules (also under `model.`) of the vision encoder and its projector."""

Tensor = TypeVar("Tensor")


def language_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in a text model's checkpoint, or None for a tensor of the
    vision side."""
    parts = name.split(".")
    owner = parts[1] if parts[0] == "model" and len(parts) > 1 else parts[0]
    if owner in VISION_PARTS:
        return None
    if parts[0] == "language_model":
        return ".".join(parts[1:])
    if parts[:2] == ["model", "language_model"]:
        return ".".join(["model", *parts[2:]])
    return name


def language_model_weights(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The language model's tensors of `weights`, renamed by `language_model_name`."""
    for name, tensor in weights:
        renamed = language_model_name(name)
        if renamed is not None:
            yield renamed, tensor


def checkpoint_names(name: str, vision_language: bool) -> list[str]:
    """The names a text model's tensor `name` may have in the checkpoint, in the order
    tried: its own, then (for a vision-language checkpoint) where publishers file it."""
    if not vision_language:
        return [name]
    first, _, rest = name.partition(".")
    filed = [f"language_model.{name}"]
    if first == "model":
        filed.append(f"model.language_model.{rest}")
    return [name, *filed]


DECODER_PARTS = frozenset({"embed_tokens", "layers", "norm"})
"""A decoder's top-level modules, which a checkpoint of the decoder alone (a `*TextModel`,
EmbeddingGemma's) files without the `model.` that a causal LM's checkpoint puts first."""


def decoder_weights(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """`weights` under a causal LM's names: a bare decoder's tensors moved under `model.`."""
    for name, tensor in weights:
        first = name.partition(".")[0]
        yield (f"model.{name}" if first in DECODER_PARTS else name), tensor
