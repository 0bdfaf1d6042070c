"""How an embedding model pools, from its folder's sentence-transformers files, and the
pooling itself (`Pooler`).

A `Pooling` module picks the last token's final hidden state (Qwen3-Embedding, gte-Qwen2,
e5-mistral: `pooling_mode_lasttoken`), their mean over the prompt (EmbeddingGemma:
`pooling_mode_mean_tokens`) or the first token's (`pooling_mode_cls_token`); `Dense` modules
after it (EmbeddingGemma's two, without activation) multiply the pooled vector, and the
result is made unit length, as vLLM does for every embedding. A folder without these files
is taken as pooled at its last token, as vLLM takes a decoder's. Pooling by the mean or the
first token reads every position of the prompt in one step: such prompts are prefilled
whole and never from the prefix cache (`Pooling.whole_prompt`). Other modules or modes
are refused in one line rather than served with wrong vectors.

A GGUF file says its pooling in `{arch}.pooling_type` (llama.cpp's converter writes it for
embedding models; the conversion keeps it as `gguf_pooling_type`): last (3) serves, none (0)
is a generative model's, mean (1), CLS (2) and rank (4, a reranker's score) are refused (a
GGUF file does not carry the Dense modules that follow the pooling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aserve.config import ConfigError
from aserve.forward import ForwardBatch
from aserve.models.source import GGUF_POOLING_TYPE

MODULES = "modules.json"
POOLING = "sentence_transformers.models.Pooling"
DENSE = "sentence_transformers.models.Dense"
TAKEN = (
    "sentence_transformers.models.Transformer",
    POOLING,
    DENSE,
    "sentence_transformers.models.Normalize",
)
"""The modules whose work aserve does: the model, its pooling, dense layers, normalising."""
MODES = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}
"""sentence-transformers' pooling modes aserve pools by (`pooling_mode_*`)."""
IDENTITY = "torch.nn.modules.linear.Identity"
ACTIVATIONS = {
    IDENTITY: None,
    "torch.nn.modules.activation.Tanh": torch.tanh,
}
"""A Dense module's activations aserve applies."""
GGUF_POOLING_NAMES = {0: "none", 1: "mean", 2: "CLS", 3: "last token", 4: "rank"}
GGUF_POOLING_TAKEN = (0, 3)  # none: a generative model's file, pooled at its last token


@dataclass(frozen=True)
class Pooling:
    """An embedding model's pooling: `mode` "last", "mean" or "cls", then the Dense
    modules in order, each its folder and its activation's name (`ACTIVATIONS`)."""

    mode: str = "last"
    dense: tuple[tuple[Path, str], ...] = ()

    @property
    def whole_prompt(self) -> bool:
        """Whether the pooling reads every position of the prompt in one step."""
        return self.mode != "last"


def read_pooling(model_dir: Path) -> Pooling:
    """The pooling that a folder's sentence-transformers modules (or GGUF file) ask for;
    a ConfigError for one that aserve does not compute."""
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    gguf_pooling = config.get(GGUF_POOLING_TYPE)
    if gguf_pooling is not None and gguf_pooling not in GGUF_POOLING_TAKEN:
        name = GGUF_POOLING_NAMES.get(gguf_pooling, f"type {gguf_pooling}")
        raise ConfigError(
            f"this GGUF file pools by {name}: aserve embeds a GGUF file with the last token's "
            "hidden state (pooling_type last)"
        )
    modules_file = model_dir / MODULES
    if not modules_file.is_file():
        return Pooling()
    mode, dense = "last", []
    for module in json.loads(modules_file.read_text()):
        kind = str(module.get("type", ""))
        folder = model_dir / str(module.get("path", ""))
        if kind not in TAKEN:
            raise ConfigError(
                f"{modules_file} has a {kind.rpartition('.')[2]} module: aserve pools (last "
                "token, mean or first token), applies Dense modules and normalises, nothing more"
            )
        if kind == POOLING:
            mode = _pooling_mode(folder / "config.json")
        elif kind == DENSE:
            dense.append((folder, _dense_activation(folder)))
    return Pooling(mode, tuple(dense))


def _pooling_mode(settings_file: Path) -> str:
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    modes = sorted(
        key.removeprefix("pooling_mode_")
        for key, value in settings.items()
        if key.startswith("pooling_mode_") and value is True
    )
    if len(modes) != 1 or modes[0] not in MODES:
        raise ConfigError(
            f"{settings_file} pools by {', '.join(modes) or 'nothing'}: aserve pools by one of "
            f"{', '.join('pooling_mode_' + m for m in MODES)}"
        )
    return MODES[modes[0]]


def _dense_activation(folder: Path) -> str:
    """A Dense module's activation, checked to be one aserve applies, and its weights to be
    there."""
    settings_file = folder / "config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    activation = str(settings.get("activation_function", IDENTITY))
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"{settings_file}: a Dense module's activation {activation!r} is not "
            f"one aserve applies ({', '.join(ACTIVATIONS)})"
        )
    if not (folder / "model.safetensors").is_file():
        raise ConfigError(f"{folder} holds no model.safetensors for its Dense module")
    return activation


class Pooler(nn.Module):
    """Pools the final hidden states of a step's rows into one vector a request, then its
    Dense modules, in float32 (made unit length by the caller)."""

    def __init__(self, pooling: Pooling, device: torch.device) -> None:
        super().__init__()
        from safetensors.torch import load_file

        self.mode = pooling.mode
        self.layers = nn.ModuleList()
        self.activations = []
        for folder, activation in pooling.dense:
            tensors = load_file(folder / "model.safetensors", device=str(device))
            weight = tensors["linear.weight"].float()
            layer = nn.Linear(weight.shape[1], weight.shape[0], "linear.bias" in tensors)
            layer = layer.to(device)
            layer.weight.data.copy_(weight)
            if layer.bias is not None:
                layer.bias.data.copy_(tensors["linear.bias"].float())
            self.layers.append(layer)
            self.activations.append(ACTIVATIONS[activation])

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """`[requests, width]` for the requests whose prompts end in this step (those at
        `batch.logit_indices`), from `hidden` `[tokens, hidden]`: with mean or first-token
        pooling every such prompt is whole in the step (`Pooling.whole_prompt`)."""
        if self.mode == "last":
            pooled = hidden[batch.logit_indices].float()
        else:
            assert not any(batch.prefix_lens), "mean and first-token pooling take whole prompts"
            lengths = torch.tensor(batch.extend_lens, device=hidden.device)
            ends = torch.cumsum(lengths, 0)
            ending = torch.searchsorted(ends, batch.logit_indices, right=True)
            if self.mode == "cls":
                pooled = hidden[(ends - lengths)[ending]].float()
            else:
                request = torch.repeat_interleave(
                    torch.arange(len(lengths), device=hidden.device), lengths
                )
                sums = torch.zeros(len(lengths), hidden.shape[1], device=hidden.device)
                sums.index_add_(0, request, hidden.float())
                pooled = (sums / lengths[:, None])[ending]
        for layer, activation in zip(self.layers, self.activations, strict=True):
            pooled = layer(pooled)
            if activation is not None:
                pooled = activation(pooled)
        return pooled
