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


def make_tiny_nomic_bert(folder: Path) -> Any:
    """A tiny nomic-bert (nomic-embed-text's layout) as its Hugging Face folder: config.json
    in nomic's keys, random weights under its names, the tiny encoders' WordPiece tokenizer.
    transformers has no nomic-bert, so this returns the reference: its forward written here
    from nomic's modeling code (token type 0 added to the word embeddings and normalised; per
    layer a fused QKV, rotary positions over whole heads in halves of base 1000, attention
    both ways, the output projection added and normalised, `fc2(fc11(x) * silu(fc12(x)))`
    added and normalised; no biases but the LayerNorms'), ids -> final hidden states."""
    folder.mkdir(parents=True, exist_ok=True)
    hidden, heads, inter, layers, vocab = 64, 4, 96, 2, 120
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1

    weights = {
        "embeddings.word_embeddings.weight": rand(vocab, hidden),
        "embeddings.token_type_embeddings.weight": rand(2, hidden),
        "emb_ln.weight": 1 + rand(hidden),
        "emb_ln.bias": rand(hidden),
    }
    for i in range(layers):
        at = f"encoder.layers.{i}."
        weights |= {
            at + "attn.Wqkv.weight": rand(3 * hidden, hidden),
            at + "attn.out_proj.weight": rand(hidden, hidden),
            at + "mlp.fc11.weight": rand(inter, hidden),
            at + "mlp.fc12.weight": rand(inter, hidden),
            at + "mlp.fc2.weight": rand(hidden, inter),
            **{at + f"norm{n}.weight": 1 + rand(hidden) for n in (1, 2)},
            **{at + f"norm{n}.bias": rand(hidden) for n in (1, 2)},
        }
    save_file(weights, str(folder / "model.safetensors"))
    config = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "n_embd": hidden,
        "n_head": heads,
        "n_inner": inter,
        "n_layer": layers,
        "n_positions": 8192,
        "max_trained_positions": 80,
        "vocab_size": vocab,
        "type_vocab_size": 2,
        "layer_norm_epsilon": 1e-12,
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None,
        "activation_function": "swiglu",
        "prenorm": False,
        "causal": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    write_word_piece_tokenizer(folder)
    w = weights
    size = hidden // heads

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.layer_norm(
            x, (hidden,), w[f"{name}.weight"], w[f"{name}.bias"], 1e-12
        )

    def forward(ids: list[int]) -> torch.Tensor:
        x = norm(
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.token_type_embeddings.weight"][0],
            "emb_ln",
        )
        inv_freq = 1.0 / (1000 ** (torch.arange(0, size, 2).float() / size))
        angles = torch.outer(torch.arange(len(ids)).float(), inv_freq)
        cos, sin = (
            torch.cat((angles.cos(), angles.cos()), -1),
            torch.cat((angles.sin(), angles.sin()), -1),
        )

        def rotate(t: torch.Tensor) -> torch.Tensor:  # [tokens, heads, size]
            halves = torch.cat((-t[..., size // 2 :], t[..., : size // 2]), -1)
            return t * cos[:, None] + halves * sin[:, None]

        for i in range(layers):
            at = f"encoder.layers.{i}."
            q, k, v = (x @ w[at + "attn.Wqkv.weight"].T).view(len(ids), 3, heads, size).unbind(1)
            q, k = rotate(q), rotate(k)
            scores = torch.einsum("qhd,khd->hqk", q, k) / size**0.5
            mixed = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), hidden)
            x = norm(x + mixed @ w[at + "attn.out_proj.weight"].T, at + "norm1")
            up, gate = x @ w[at + "mlp.fc11.weight"].T, x @ w[at + "mlp.fc12.weight"].T
            x = norm(
                x + (up * torch.nn.functional.silu(gate)) @ w[at + "mlp.fc2.weight"].T, at + "norm2"
            )
        return x

    return forward
