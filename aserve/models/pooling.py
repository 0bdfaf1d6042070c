"""What a model folder's sentence-transformers files say of its embeddings, checked against
what aserve computes: the last token's final hidden state, made unit length
(`DecoderForCausalLM.embed`). Qwen3-Embedding, gte-Qwen2 and e5-mistral publish exactly
that (a `Pooling` module with `pooling_mode_lasttoken`, then `Normalize`); a model pooled
otherwise (mean, CLS) or with layers after the pooling (`Dense`) is refused in one line
rather than served with wrong vectors. A folder without these files is taken as pooled at
its last token, as vLLM takes a decoder's. A GGUF file says it in `{arch}.pooling_type`
(llama.cpp's converter writes it for embedding models; the conversion keeps it as
`gguf_pooling_type`): last (3) serves, none (0) is a generative model's, mean (1), CLS (2)
and rank (4, a reranker's score) are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from aserve.config import ConfigError
from aserve.models.source import GGUF_POOLING_TYPE

MODULES = "modules.json"
POOLING = "sentence_transformers.models.Pooling"
TAKEN = (
    "sentence_transformers.models.Transformer",
    POOLING,
    "sentence_transformers.models.Normalize",
)
"""The modules whose work aserve does: the model, its pooling, the normalisation."""
GGUF_POOLING_NAMES = {0: "none", 1: "mean", 2: "CLS", 3: "last token", 4: "rank"}
GGUF_POOLING_TAKEN = (0, 3)  # none: a generative model's file, pooled at its last token


def check_pooling(model_dir: Path) -> None:
    """Refuse a folder whose sentence-transformers modules (or GGUF file) ask for other
    embeddings than the last token's, made unit length."""
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    gguf_pooling = config.get(GGUF_POOLING_TYPE)
    if gguf_pooling is not None and gguf_pooling not in GGUF_POOLING_TAKEN:
        name = GGUF_POOLING_NAMES.get(gguf_pooling, f"type {gguf_pooling}")
        raise ConfigError(
            f"this GGUF file pools by {name}: aserve embeds with the last token's hidden state "
            "(pooling_type last)"
        )
    modules_file = model_dir / MODULES
    if not modules_file.is_file():
        return
    for module in json.loads(modules_file.read_text()):
        kind = str(module.get("type", ""))
        if kind not in TAKEN:
            raise ConfigError(
                f"{modules_file} has a {kind.rpartition('.')[2]} module after the model: aserve "
                "embeds with the last token's hidden state, made unit length, and nothing more"
            )
        if kind != POOLING:
            continue
        settings_file = model_dir / str(module.get("path", "")) / "config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        modes = sorted(
            key.removeprefix("pooling_mode_")
            for key, value in settings.items()
            if key.startswith("pooling_mode_") and value is True
        )
        if modes != ["lasttoken"]:
            raise ConfigError(
                f"{settings_file} pools by {', '.join(modes) or 'nothing'}: aserve embeds with "
                "the last token's hidden state (pooling_mode_lasttoken)"
            )
