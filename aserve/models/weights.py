"""Reading a Hugging Face model folder: its configs, its tensors, or random stand-ins.

The folder comes from `aserve.models.source.resolve_model`; one converted from a GGUF file
points at it, and its tensors are read from there. Tensors keep their Hugging Face names and
stored dtype (or stay quantized); the model decides how to cast and shard them.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from aserve.config import ConfigError
from aserve.layers.moe import ExpertWeights
from aserve.layers.weight import WeightSource
from aserve.models.gguf_weights import GGUF_POINTER, iter_gguf
from aserve.models.mla import LatentHeads
from aserve.models.source import ModelSourceError
from aserve.quant.fp8 import FP8
from aserve.quant.gguf import QuantizedTensor
from aserve.quant.method import QuantizedLinearWeight

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SAFETENSORS_INDEX = "model.safetensors.index.json"


SEPARATE_QUANTIZATION_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
"""Where older AutoGPTQ and AutoAWQ checkpoints keep their settings, config.json having no
`quantization_config`, and the method each file's settings are for."""


def expected_tensors(model: torch.nn.Module) -> set[str]:
    """What a checkpoint must fill in `model`: its parameters, and the weight of each layer
    that keeps a quantized weight in place of a parameter."""
    quantized = {f"{n}.weight" for n, m in model.named_modules() if getattr(m, "quantized", None)}
    return {n for n, _ in model.named_parameters()} | quantized


def load_hf_config(folder: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """config.json (with a separate quantization file's settings as its
    `quantization_config`), and generation_config.json or None (it holds extra eos ids when
    present)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"{folder} has no config.json: not a Hugging Face model folder")
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    config = json.loads(config_file.read_text())
    for name, method in SEPARATE_QUANTIZATION_CONFIGS.items():
        separate = folder / name
        if "quantization_config" not in config and separate.is_file():
            settings = json.loads(separate.read_text())
            config["quantization_config"] = {"quant_method": method, **settings}
    return config, generation


def safetensors_files(folder: Path) -> list[Path]:
    """The index decides when there is one: repos may also hold e.g. consolidated.safetensors
    with other names for the same weights."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else sorted(folder.glob("*.safetensors"))


def iter_weights(
    folder: Path, progress: bool = True, lazy: bool = False, dequantize: bool = False
) -> Iterator[tuple[str, WeightSource | QuantizedTensor]]:
    """Every tensor of the folder as (HF name, CPU tensor in its stored dtype), one at a time.
    `lazy` yields safetensors slices instead, read only where the model indexes them (a
    tensor-parallel rank reads its shard, not the whole tensor). A folder converted from a
    GGUF reads the file it points at: quantized tensors come as `QuantizedTensor`, or
    de-quantized to float32 with `dequantize`."""
    pointer = folder / GGUF_POINTER
    if pointer.is_file():
        pointed = json.loads(pointer.read_text())
        gguf_file = Path(pointed["file"])
        if not gguf_file.is_file():
            raise ModelSourceError(f"{gguf_file}, which {pointer} names, is gone")
        config = json.loads((folder / "config.json").read_text())
        yield from iter_gguf(gguf_file, pointed["tensors"], config, dequantize, progress)
        return
    files = safetensors_files(folder)
    if files:
        yield from iter_safetensors(files, progress, lazy)
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelSourceError(f"{folder} holds no *.safetensors or pytorch_model*.bin weights")
    yield from iter_torch_bins(bins, progress)


def iter_safetensors(
    files: list[Path], progress: bool, lazy: bool = False
) -> Iterator[tuple[str, WeightSource]]:
    total = sum(count_tensors(file) for file in files)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                names = handle.keys()
                for name in names:
                    piece = handle.get_slice(name) if lazy else None
                    # a scalar (an FP8 scale) cannot be sliced: it comes whole
                    yield (
                        name,
                        piece
                        if piece is not None and piece.get_shape()
                        else handle.get_tensor(name),
                    )
                    bar.update()


SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def map_checkpoint_tensor(folder: Path, names: list[str]) -> torch.Tensor | None:
    """The first of `names` that the folder's safetensors hold, read through a memory map
    of its file: the OS reads pages in when they are indexed and may drop them again under
    memory pressure, so the tensor takes no memory of the process's own. None when no
    safetensors file holds one in a float type. The mapping is copy-on-write: nothing can
    change the file through it."""
    for file in safetensors_files(folder):
        with open(file, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
            entry = next((header[name] for name in names if name in header), None)
            if entry is None or entry["dtype"] not in SAFETENSORS_DTYPES:
                continue
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        start, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + header_size + start)
        return flat.view(entry["shape"])
    return None


def count_tensors(file: Path) -> int:
    with safe_open(str(file), framework="pt", device="cpu") as handle:
        return len(handle.keys())


def iter_torch_bins(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Old-style checkpoints; weights_only keeps a pickle from running code, mmap keeps RAM low."""
    for file in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


def is_norm_weight(name: str, param: torch.Tensor) -> bool:
    return name.endswith("norm.weight") or (param.dim() == 1 and "norm" in name)


@torch.no_grad()
def fill_dummy_weights(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights from shapes alone, for --dummy-weight benchmarks.

    Filled in place on each parameter's device, so an 8B model on GPU takes no host memory
    or copies. The same seed gives the same weights on the same device. Layers quantized at
    load get their random float matrices one shard (FP8 experts: one expert) at a time.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif is_norm_weight(name, param):
            param.fill_(1.0)
        elif param.is_floating_point() and param.dtype != FP8:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])
    device = next(module.parameters()).device
    generator = generators.get(device) or torch.Generator(device).manual_seed(seed)
    for layer in module.modules():
        quantized = getattr(layer, "quantized", None)
        if isinstance(quantized, QuantizedLinearWeight):  # --quantization int8 / int4
            for shard, rows in enumerate(quantized.shard_rows):
                weight = torch.empty(rows, quantized.cols, device=device)
                quantized.load(shard, weight.normal_(0.0, 0.02, generator=generator))
        if isinstance(layer, ExpertWeights) and layer.fp8:
            layer.fill_random(0.02, generator)
        if isinstance(layer, LatentHeads):  # a quantized model's heads (dense: parameters)
            layer.fill_random(0.02, generator, device)


def torch_dtype(name: str, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """The --dtype option. auto is float32 on CPU (fast there and exact); on CUDA it is the
    checkpoint's half type, or bfloat16 when it has none (float32 would halve throughput)."""
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ConfigError(f"--dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    if device.type != "cuda":
        return torch.float32
    stored = (config_dtype or "").removeprefix("torch.")
    return DTYPES[stored] if stored in ("float16", "bfloat16") else torch.bfloat16
