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
embedding models; the conversion keeps it as `gguf_pooling_type`): none (0) is a generative
model's, pooled at its last token; the mean (1), the first token (2) and the last (3) serve,
the conversion writing them as sentence-transformers files (`write_pooling_files`) with the
Dense modules that llama.cpp's converter stores as `dense_2` and `dense_3` (EmbeddingGemma's,
written when it is run with `--sentence-transformers-dense-modules`), so that a GGUF pools
as llama.cpp pools it. Rank (4) is a reranker's file, which serves as a classifier
(models/source.py `reranker_settings`), not as embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from aserve.config import ConfigError
from aserve.forward import ForwardBatch

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
GGUF_POOLING_TYPE = "gguf_pooling_type"
"""config.json's key for a converted GGUF's `{arch}.pooling_type`."""
GGUF_POOLING_NAMES = {0: "none", 1: "mean", 2: "CLS", 3: "last token", 4: "rank"}
GGUF_POOLING_MODES = {1: "mean_tokens", 2: "cls_token", 3: "lasttoken"}
"""llama.cpp's pooling types -> sentence-transformers' modes; none (0) is a generative
model's file, pooled at its last token."""


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
    if gguf_pooling not in (None, 0, *GGUF_POOLING_MODES):
        name = GGUF_POOLING_NAMES.get(gguf_pooling, f"type {gguf_pooling}")
        raise ConfigError(
            f"this GGUF file pools by {name}: aserve embeds a GGUF file pooled by the mean, the "
            "first token or the last (pooling_type 1 to 3)"
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


def write_pooling_files(folder: Path, mode: str, dense: list[torch.Tensor]) -> None:
    """Into `folder`, the sentence-transformers files `read_pooling` reads: the pooling by
    `mode` (one of `MODES`), a Dense module (`[out, in]`, no bias, no activation) for each
    of `dense`, in order, then normalising."""
    kinds = [TAKEN[0], POOLING, *[DENSE] * len(dense), TAKEN[3]]
    paths = ["", "1_Pooling", *[f"{2 + i}_Dense" for i in range(len(dense))]]
    paths.append(f"{len(paths)}_Normalize")
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": kind}
        for i, (kind, path) in enumerate(zip(kinds, paths, strict=True))
    ]
    (folder / MODULES).write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir()
    settings = {f"pooling_mode_{name}": name == mode for name in MODES}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(settings, indent=2))
    for path, weight in zip(paths[2:-1], dense, strict=True):
        (folder / path).mkdir()
        layer = {"in_features": weight.shape[1], "out_features": weight.shape[0], "bias": False}
        layer["activation_function"] = IDENTITY
        (folder / path / "config.json").write_text(json.dumps(layer, indent=2))
        save_file({"linear.weight": weight.contiguous()}, str(folder / path / "model.safetensors"))


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
