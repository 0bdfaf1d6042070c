"""Embeddings on CUDA in bf16 (FlashInfer prefill, in chunks and from prefix hits) against
transformers' base model and the float32 CPU engine (run on the GPU machine; skipped without
CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM
from tests.embedding_refs import (
    ENCODER_PROMPTS,
    ENCODERS,
    PROMPTS,
    embedded,
    make_embedding_gemma,
    make_tiny_encoder,
    make_tiny_modern_bert,
    make_tiny_nomic_bert,
    pooled_reference,
    reference,
)
from tests.test_gpu import KERNEL_SHAPES
from tests.tiny_models import make_tiny_model, write_word_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bf16_embeddings_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    """Cosine similarity past 0.999 with transformers' float32 pooled base model; the same
    vectors (to bf16 rounding) in chunks of 4 tokens and from prefix hits."""
    folder = make_tiny_model(family, tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    expected = reference(folder, PROMPTS)
    llm = make_llm(folder, device="cuda", dtype="bfloat16", is_embedding=True)
    assert type(llm.runtime.engine.attn).__name__ == "FlashInferBackend"
    assert llm.runtime.engine.graphs is None
    got = embedded(llm, PROMPTS)
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.dot(ours, theirs).item() > 0.999
    again = embedded(llm, PROMPTS)
    chunked = make_llm(
        folder, device="cuda", dtype="bfloat16", is_embedding=True, max_prefill_length=4
    )
    for first, hit, piece in zip(got, again, embedded(chunked, PROMPTS), strict=True):
        assert torch.dot(first, hit).item() > 0.9999
        assert torch.dot(first, piece).item() > 0.999


def test_bf16_classifier_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """A classifier's probabilities within 0.02 of transformers' float32 classifier, and a
    one-label reranker's scores within 0.02 of the float32 CPU engine's, on CUDA in bf16."""
    import transformers

    labels = {"id2label": {0: "no", 1: "maybe", 2: "yes"}}
    shapes = {**KERNEL_SHAPES, "head_dim": 64}
    folder = make_tiny_model("qwen3", tmp_path / "labels", overrides={**shapes, **labels})
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = [torch.softmax(model(torch.tensor([p])).logits[0], -1) for p in PROMPTS]
    llm = make_llm(folder, device="cuda", dtype="bfloat16")
    assert llm.runtime.engine.pooling and llm.runtime.engine.graphs is None
    for out, theirs in zip(llm.classify(PROMPTS), expected, strict=True):
        assert out.classification is not None
        torch.testing.assert_close(
            torch.tensor(out.classification.probs), theirs, atol=0.02, rtol=0
        )
    reranker = make_tiny_model(
        "qwen3", tmp_path / "reranker", overrides={**shapes, "num_labels": 1}
    )
    write_word_tokenizer(reranker, 320)
    on_gpu = make_llm(reranker, device="cuda", dtype="bfloat16")
    query, documents = "w5 w17 w42", ["w9 w100 w3", "w5 w17 w77 w12", "w250"]
    with LLM(str(reranker)) as cpu:
        exact = [s.score for s in cpu.score(query, documents)]
    assert [s.score for s in on_gpu.score(query, documents)] == pytest.approx(exact, abs=0.02)


def test_bf16_embedding_gemma_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """EmbeddingGemma's layout on CUDA in bf16 (attention both ways through FlashInfer's
    prefill with a mask, the windowed layer less than 3 away on either side, mean pooling,
    two Dense modules): cosine similarity past 0.999 with transformers' float32 model
    pooled so, for prompts shorter and longer than the window, in a batch and alone."""
    hf, dense = make_embedding_gemma(tmp_path, {**KERNEL_SHAPES, "head_dim": 64})
    prompts = [*PROMPTS, list(range(3, 40))]
    with torch.inference_mode():
        hidden = [hf(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    expected = [pooled_reference(h, "mean", dense) for h in hidden]
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16", is_embedding=True)
    assert type(llm.runtime.engine.attn).__name__ == "FlashInferBackend"
    got = embedded(llm, prompts)
    alone = [embedded(llm, [p])[0] for p in prompts]
    for ours, single, theirs in zip(got, alone, expected, strict=True):
        assert torch.dot(ours, theirs).item() > 0.999
        assert torch.dot(ours, single).item() > 0.9999


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("head_dim", [64, 32])
def test_bf16_encoders_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str, head_dim: int
) -> None:
    """BERT and XLM-RoBERTa on CUDA in bf16, heads of 64 (BERT-base's) and 32 (bge-small's):
    [CLS] embeddings within cosine 0.999 of transformers' float32 encoder, in a batch and
    alone; a cross-encoder's scores within 0.02 of the float32 CPU engine's."""
    shapes = {"hidden_size": 2 * head_dim, "num_attention_heads": 2}
    model = make_tiny_encoder(family, tmp_path / "embeds", overrides=shapes)
    with torch.inference_mode():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in ENCODER_PROMPTS]
    expected = [pooled_reference(h, "cls", None) for h in hidden]
    llm = make_llm(tmp_path / "embeds", device="cuda", dtype="bfloat16", is_embedding=True)
    got = embedded(llm, ENCODER_PROMPTS)
    alone = embedded(llm, ENCODER_PROMPTS[1:])
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.dot(ours, theirs).item() > 0.999
    assert torch.dot(alone[0], got[1]).item() > 0.9999
    make_tiny_encoder(family, tmp_path / "ranks", labels=1, overrides=shapes)
    on_gpu = make_llm(tmp_path / "ranks", device="cuda", dtype="bfloat16")
    query, documents = "the cat sat", ["on the mat", "a dog ran far away", "the cat sat"]
    with LLM(str(tmp_path / "ranks")) as cpu:
        exact = [s.score for s in cpu.score(query, documents)]
    assert [s.score for s in on_gpu.score(query, documents)] == pytest.approx(exact, abs=0.02)


def test_bf16_modern_bert_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """ModernBERT on CUDA in bf16, heads of 64: windowed layers attending 4 tokens either
    way beside whole ones, through FlashInfer's prefill; [CLS] embeddings within cosine
    0.999 of transformers' float32 model for prompts longer than the window, and a
    classifier's probabilities within 0.02."""
    shapes = {"hidden_size": 256, "intermediate_size": 384}
    model = make_tiny_modern_bert(tmp_path / "embeds", **shapes)
    prompts = [list(range(5, 40)), [2, 9, 17, 3]]
    with torch.inference_mode():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    llm = make_llm(tmp_path / "embeds", device="cuda", dtype="bfloat16", is_embedding=True)
    assert type(llm.runtime.engine.attn).__name__ == "FlashInferBackend"
    for ours, h in zip(embedded(llm, prompts), hidden, strict=True):
        assert torch.dot(ours, pooled_reference(h, "cls", None)).item() > 0.999
    classifier = make_tiny_modern_bert(tmp_path / "labels", 3, classifier_pooling="mean", **shapes)
    with torch.inference_mode():
        expected = [torch.softmax(classifier(torch.tensor([p])).logits[0], -1) for p in prompts]
    on_gpu = make_llm(tmp_path / "labels", device="cuda", dtype="bfloat16")
    for out, theirs in zip(on_gpu.classify(prompts), expected, strict=True):
        assert out.classification is not None
        torch.testing.assert_close(
            torch.tensor(out.classification.probs), theirs, atol=0.02, rtol=0
        )


def test_bf16_nomic_bert_close_to_its_reference(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """nomic-bert on CUDA in bf16 (rotary positions rotated in torch, SwiGLU, heads of 16
    through the torch prefill): [CLS] embeddings within cosine 0.999 of the float32
    reference written from nomic's modeling code."""
    reference = make_tiny_nomic_bert(tmp_path)
    prompts = [[2, 17, 42, 9, 100, 3, 77, 12, 110, 31, 8, 19, 60, 5, 88, 3], [2, 4, 4, 61, 3]]
    with torch.inference_mode():
        expected = [pooled_reference(reference(p), "cls", None) for p in prompts]
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16", is_embedding=True)
    for ours, theirs in zip(embedded(llm, prompts), expected, strict=True):
        assert torch.dot(ours, theirs).item() > 0.999
