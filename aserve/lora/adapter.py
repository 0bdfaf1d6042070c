"""LoRA adapters as PEFT saves them: a folder with adapter_config.json and
adapter_model.safetensors (or adapter_model.bin).

An adapter adds `scaling * B (A x)` to the output of each linear layer it targets, A `[r, in]`
and B `[out, r]`, with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). The
scaling is folded into B here, once. What is refused, in one line: DoRA (`use_dora`), trained
biases, modules saved whole (`modules_to_save`: a fine-tuned embedding or LM head), LoRA on
embeddings, per-module alphas, GPT-2's transposed layout, and targets this server's layers do
not hold (experts of MoE layers, say).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from aserve.config import ConfigError

# PEFT's saved keys: base_model.model.<module>.lora_A.weight (older files keep the adapter's
# own name, "default", before .weight)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoraPair:
    """One targeted layer's matrices: `a` `[r, in]`, `b` `[out, r]` with the scaling in it."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter: its pairs by the module name the checkpoint gives the layer
    (`model.layers.3.self_attn.q_proj`), in float32 on the host."""

    name: str
    path: Path
    pairs: dict[str, LoraPair]

    @property
    def rank(self) -> int:
        return max(pair.rank for pair in self.pairs.values())


def read_adapter(name: str, path: str | Path, max_rank: int | None = None) -> Adapter:
    """The adapter in folder `path`, checked; a ConfigError (one line) names what is wrong."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(f"LoRA adapter {name!r}: {folder} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as error:
        raise ConfigError(f"LoRA adapter {name!r}: adapter_config.json: {error}") from None
    _check_config(name, config)
    tensors = _read_tensors(name, folder)
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ConfigError(
                f"LoRA adapter {name!r}: tensor {key} is not a LoRA matrix of a linear layer "
                "(embeddings' LoRA, DoRA magnitudes and trained biases are not supported)"
            )
        sides.setdefault(match["module"], {})[match["side"]] = tensor
    pairs = {}
    for module, both in sides.items():
        if set(both) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter {name!r}: {module} has lora_A or lora_B alone")
        a, b = both["A"].float(), both["B"].float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ConfigError(
                f"LoRA adapter {name!r}: {module}'s lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not make a product"
            )
        rank = a.shape[0]
        if max_rank is not None and rank > max_rank:
            raise ConfigError(
                f"LoRA adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}"
            )
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        pairs[module] = LoraPair(a.contiguous(), (b * scaling).contiguous())
    if not pairs:
        raise ConfigError(f"LoRA adapter {name!r}: {folder} holds no LoRA matrices")
    return Adapter(name, folder, pairs)


def _check_config(name: str, config: dict[str, object]) -> None:
    refused = [
        (config.get("peft_type", "LORA") != "LORA", f"a {config.get('peft_type')} adapter"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none", f"trained biases (bias: {config.get('bias')})"),
        (bool(config.get("modules_to_save")), "modules saved whole (modules_to_save)"),
        (bool(config.get("alpha_pattern")), "per-module alphas (alpha_pattern)"),
        (bool(config.get("fan_in_fan_out")), "GPT-2's transposed layers (fan_in_fan_out)"),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"LoRA adapter {name!r}: {what} is not supported")


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    safetensors_file = folder / "adapter_model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = folder / "adapter_model.bin"
    if bin_file.is_file():
        try:
            return torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as error:  # a pickle of anything but tensors
            raise ConfigError(f"LoRA adapter {name!r}: {bin_file}: {error}") from None
    raise ConfigError(
        f"LoRA adapter {name!r}: {folder} has neither adapter_model.safetensors nor "
        "adapter_model.bin"
    )
