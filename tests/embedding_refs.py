"""What the embedding tests on CPU and on CUDA compare against: transformers' pooled base
model, and aserve's embeddings as tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from aserve import LLM

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 12, 250, 31, 8, 19, 60, 2, 88], [300, 4, 4, 61], [9]]


def reference(folder: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' base model (no LM head): the last token's final hidden state, made
    unit length, as Qwen3-Embedding's model card pools it."""
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        rows = [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
    return [torch.nn.functional.normalize(row, dim=0) for row in rows]


def embedded(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outputs = llm.embed(prompts)
    assert all(out.error is None and out.embedding is not None for out in outputs)
    return [torch.tensor(out.embedding) for out in outputs]


def sentence_transformers_files(
    folder: Path, pooling: dict[str, bool], dense: list[torch.Tensor] | None = None
) -> None:
    """modules.json, the Pooling module's config and Dense modules of these weights
    (`[out, in]`, no bias, no activation), as sentence-transformers saves them."""
    kinds = ["Transformer", "Pooling", *["Dense"] * len(dense or []), "Normalize"]
    paths = ["", "1_Pooling", *[f"{2 + i}_Dense" for i in range(len(dense or []))], "9"]
    modules = [
        {"idx": i, "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(zip(kinds, paths, strict=True))
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    settings = {f"pooling_mode_{mode}": on for mode, on in pooling.items()}
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **settings})
    )
    for path, weight in zip(paths[2:], dense or [], strict=False):
        (folder / path).mkdir(exist_ok=True)
        identity = "torch.nn.modules.linear.Identity"
        settings = {"in_features": weight.shape[1], "out_features": weight.shape[0]}
        settings |= {"bias": False, "activation_function": identity}
        (folder / path / "config.json").write_text(json.dumps(settings))
        save_file({"linear.weight": weight.contiguous()}, str(folder / path / "model.safetensors"))


LAST = {"cls_token": False, "mean_tokens": False, "lasttoken": True}
MEAN = {**LAST, "lasttoken": False, "mean_tokens": True}
CLS = {**LAST, "lasttoken": False, "cls_token": True}
DENSE = [torch.randn(96, 64, generator=torch.Generator().manual_seed(5)) / 8, torch.eye(96)[:48]]


def pooled_reference(
    hidden: torch.Tensor, mode: str, dense: list[torch.Tensor] | None
) -> torch.Tensor:
    """sentence-transformers' pooling of one prompt's final hidden states `[tokens, width]`
    (the last token's, their mean or the first's), its Dense modules, then unit length."""
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[mode]
    for weight in dense or []:
        pooled = weight @ pooled
    return torch.nn.functional.normalize(pooled, dim=0)


def make_embedding_gemma(
    folder: Path, overrides: dict[str, Any] | None = None
) -> tuple[Any, list[torch.Tensor]]:
    """A tiny EmbeddingGemma: Gemma 3's text model alone (`Gemma3TextModel`, its tensors
    without `model.`), attending both ways, a window of 4 on its first layer (which
    transformers reads as less than 3 away); its sentence-transformers files pool by the
    mean, then two Dense modules. Returns the model and the Dense modules' weights."""
    import transformers

    from tests.tiny_models import COMMON, FAMILIES

    settings = {**COMMON, **FAMILIES["gemma3"], **(overrides or {})}
    settings["use_bidirectional_attention"] = True
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(transformers.Gemma3TextConfig(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or param.dim() == 2:
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    width = settings["hidden_size"]
    dense = [torch.randn(96, width, generator=torch.Generator().manual_seed(5)) / 8]
    dense.append(torch.eye(96)[:48])
    sentence_transformers_files(folder, MEAN, dense)
    return model.eval(), dense


ENCODERS = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel"}
ENCODER_PROMPTS = [[2, 17, 42, 9, 100, 3, 77, 12, 110, 31, 8, 19, 60, 5, 88, 3], [2, 4, 4, 61, 3]]
"""Token ids under the tiny encoders' vocabulary of 120, none the padding id (XLM-R's 1)."""
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away"]


def make_tiny_encoder(
    family: str, folder: Path, labels: int = 0, overrides: dict[str, Any] | None = None
) -> Any:
    """A tiny BERT (`bert`) or XLM-RoBERTa (`xlm-roberta`, positions from padding id 1 + 1),
    its weights and LayerNorms random, with a WordPiece tokenizer of a few words (and a
    plural's `##s`) that wraps
    a text in [CLS] ... [SEP] (a pair in [CLS] ... [SEP] ... [SEP], the second part of token
    type 1); with `labels`, its `*ForSequenceClassification`; `overrides` change its
    shapes. Returns transformers' model."""
    import transformers

    settings = {
        "vocab_size": 120,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "max_position_embeddings": 80,
        **(overrides or {}),
    }
    torch.manual_seed(0)
    if labels:
        settings["num_labels"] = labels
    if family == "bert":
        config = transformers.BertConfig(**settings)
        kind = transformers.BertForSequenceClassification if labels else transformers.BertModel
    else:
        config = transformers.XLMRobertaConfig(**settings, pad_token_id=1)
        classifier = transformers.XLMRobertaForSequenceClassification
        kind = classifier if labels else transformers.XLMRobertaModel
    model = kind(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1) if param.dim() == 2 else param.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    write_word_piece_tokenizer(folder)
    return model.eval()


def make_tiny_modern_bert(folder: Path, labels: int = 0, **settings: Any) -> Any:
    """A tiny ModernBERT (`ModernBertModel`; with `labels`, its classifier) of 4 layers, the
    first whole and the others windowed 4 tokens either way, random weights and norms, with
    the tiny encoders' WordPiece tokenizer ([CLS] ... [SEP]). Returns transformers' model."""
    import transformers

    config = transformers.ModernBertConfig(
        **{
            "vocab_size": 120,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "local_attention": 8,
            "global_attn_every_n_layers": 3,
            "max_position_embeddings": 80,
            "pad_token_id": 0,
            "cls_token_id": 2,
            "sep_token_id": 3,
            "num_labels": labels or 2,
            **settings,
        }
    )
    torch.manual_seed(0)
    kind = (
        transformers.ModernBertForSequenceClassification if labels else transformers.ModernBertModel
    )
    model = kind(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1) if param.dim() == 2 else param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    write_word_piece_tokenizer(folder)
    return model.eval()


def write_word_piece_tokenizer(folder: Path) -> None:
    """The tiny encoders' WordPiece tokenizer: BERT's special tokens, `WORDS` and a
    plural's `##s`; a text as [CLS] ... [SEP]."""
    import transformers

    vocabulary = folder / "vocab.txt"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocabulary.write_text("\n".join([*specials, *WORDS, "##s"]))
    transformers.BertTokenizerFast(str(vocabulary)).save_pretrained(folder)
