"""Server-side sampling defaults: what a request gets for the sampling fields it leaves unset.

A small model sampled at OpenAI's temperature 1.0 rambles; its authors say how to sample it.
As vLLM does with `--generation-config auto`, the defaults come from the model folder's
generation_config.json (GGUF files carry theirs as `general.sampling.*` metadata, which the
conversion writes there). The embedded SmolLM2 has none, so it gets what its model card
recommends, plus a repeat penalty that its 4-bit file needs. `--generation-config none`
keeps OpenAI's defaults, a folder path reads that folder's generation_config.json instead,
and `--default-sampling '{"temperature": 0.5}'` overrides any of them. Resolved once at
start-up; requests that set a field keep theirs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aserve.config import ConfigError, ServerConfig
from aserve.sampling_params import BOUNDS

logger = logging.getLogger(__name__)

# generation_config.json's names -> the API's; vLLM reads the same six.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# SmolLM2-135M-Instruct's model card samples with temperature 0.2 and top_p 0.9. On the
# embedded Q4_1 file that alone left the README's question ("What is the capital of
# France?", 100 seeds, up to 512 tokens) answered with Paris 66 times and 27 replies looping
# to the token limit; with llama.cpp's long-time default repeat penalty of 1.1 added, 95
# and 1 (bench/NOTES.md).
EMBEDDED_MODEL_DEFAULTS: dict[str, float] = {
    "temperature": 0.2,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
}

SamplingDefaults = Mapping[str, float]


def from_generation_config(generation_config: Mapping[str, Any] | None) -> dict[str, float]:
    """The sampling fields a generation_config.json sets; a value outside the API's range is
    skipped with a warning rather than stopping the server."""
    defaults: dict[str, float] = {}
    for source, name in GENERATION_CONFIG_FIELDS.items():
        value = (generation_config or {}).get(source)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not BOUNDS[name].admits(value):
            logger.warning("generation_config.json: %s=%s is out of range; not used", source, value)
            continue
        defaults[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return defaults


def read_generation_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None


def resolve_defaults(
    config: ServerConfig, model_generation_config: Mapping[str, Any] | None, embedded: bool
) -> tuple[dict[str, float], str]:
    """The defaults and a few words on where they came from, for the start-up log.
    `model_generation_config` is the model folder's generation_config.json, if it has one."""
    source = config.generation_config
    if source == "none":
        defaults, origin = {}, "--generation-config none"
    elif source == "auto":
        defaults = from_generation_config(model_generation_config)
        origin = "the model's generation_config.json"
        if not defaults and embedded:
            defaults = dict(EMBEDDED_MODEL_DEFAULTS)
            origin = "SmolLM2's model card, with a repeat penalty"
    else:
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"--generation-config {source}: not auto, none or a folder")
        defaults = from_generation_config(read_generation_config(folder))
        origin = f"{folder / 'generation_config.json'}"
    if config.default_sampling:
        defaults |= dict(config.default_sampling)
        origin += " and --default-sampling"
    return defaults, origin


def describe(defaults: SamplingDefaults) -> str:
    if not defaults:
        return "OpenAI's (temperature 1, top_p 1)"
    return ", ".join(f"{name}={value:g}" for name, value in sorted(defaults.items()))
