"""What the embedding tests on CPU and on CUDA compare against: transformers' pooled base
model, and aserve's embeddings as tensors."""

from __future__ import annotations

from pathlib import Path

import torch

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
