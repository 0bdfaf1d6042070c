"""Scores of text pairs and classes of texts from a pooling model's outputs: what vLLM's
`/score`, `/rerank` and `/classify` routes and its `LLM.score` / `LLM.classify` give.

A pair is scored in one of two ways, by the model the server runs:
- a one-label classifier (a cross-encoder reranker such as a `*ForSequenceClassification`
  conversion of Qwen3-Reranker or bge-reranker-v2-gemma) reads both texts as one sequence
  (the tokenizer's pair encoding, `Tokenizer.encode_pair`) and its logit's sigmoid is the
  score, as sentence-transformers' CrossEncoder gives it;
- an embedding model (`--is-embedding`) embeds each text once and the score is the two
  unit vectors' dot product, their cosine similarity.
A classifier's classes are the softmax of its logits, labelled by `id2label`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aserve.config import ModelConfig


def scoring_refusal(config: ModelConfig, pooling: bool) -> str | None:
    """Why a model cannot score pairs (None where it can)."""
    if not pooling:
        return (
            "this server generates text; scores come from a reranker (a one-label "
            "*ForSequenceClassification checkpoint) or an embedding model (--is-embedding)"
        )
    if config.classifies and config.num_labels != 1:
        return (
            f"this classifier has {config.num_labels} labels; pair scores need a one-label "
            "classifier (a reranker): classify with /classify"
        )
    return None


def classifying_refusal(config: ModelConfig) -> str | None:
    """Why a model cannot classify (None where it can)."""
    if config.classifies:
        return None
    return "this model is no classifier: /classify needs a *ForSequenceClassification checkpoint"


def paired(firsts: list[str], seconds: list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one first text against every second one, or the two lists side by
    side; a ValueError for lists of different lengths."""
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
            "as many as text_2"
        )
    return list(zip(firsts, seconds, strict=True))


@dataclass
class PairPlan:
    """The sequences that score `pairs`: one a pair for a classifier; for an embedding
    model, each distinct text once, with `pair_rows` naming the two rows of each pair."""

    prompts: list[list[int]]
    pair_rows: list[tuple[int, int]] | None

    def scores(self, pooled: list[torch.Tensor]) -> list[float]:
        """Each pair's score from the pooled outputs of `prompts`, in their order."""
        if self.pair_rows is None:
            return [torch.sigmoid(logits[0]).item() for logits in pooled]
        return [torch.dot(pooled[a], pooled[b]).item() for a, b in self.pair_rows]


def plan_pairs(
    config: ModelConfig,
    pairs: list[tuple[str, str]],
    encode: Callable[[str], list[int]],
    encode_pair: Callable[[str, str], list[int]],
) -> PairPlan:
    """The sequences a model runs to score `pairs`."""
    if config.classifies:
        return PairPlan([encode_pair(first, second) for first, second in pairs], None)
    rows: dict[str, int] = {}
    for first, second in pairs:
        rows.setdefault(first, len(rows))
        rows.setdefault(second, len(rows))
    prompts = [encode(text) for text in rows]
    return PairPlan(prompts, [(rows[first], rows[second]) for first, second in pairs])


@dataclass
class Classification:
    """One text's classes: the most likely label and every label's probability."""

    label: str
    probs: list[float]


def classified(config: ModelConfig, logits: torch.Tensor) -> Classification:
    """A classifier's logits `[labels]` as its label and probabilities."""
    probs = torch.softmax(logits.float(), dim=-1)
    return Classification(config.labels[int(probs.argmax())], probs.tolist())
