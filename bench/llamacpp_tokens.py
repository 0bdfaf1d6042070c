"""Greedy tokens of aserve and llama.cpp on the same GGUF file and prompts, side by side
with aserve on the float32 de-quantized weights (the exact values of the file's): where each
prompt's continuations first part, for a new block format or kernel checked against
llama.cpp's own.

    python bench/llamacpp_tokens.py --model /tmp/model.gguf --max-tokens 32

Each engine sums floats in its own order, and llama.cpp rounds activations to 8 bits (aserve
to 16 on CPUs with VNNI, else none), so two candidates within rounding of each other can tip
either way, after which the texts part; a small model's logits are close often. A format
read wrongly parts at once from the float32 run, which is the reference for both engines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve import LLM, SamplingParams  # noqa: E402
from bench.llamacpp_peer import LlamaCppPeer  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "List three uses of a paperclip:",
    "The quick brown fox",
)


def first_difference(ours: list[int], theirs: list[int]) -> int:
    """The first position where the two differ, or their length where they do not."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))


def main() -> None:
    p = argparse.ArgumentParser(description="aserve's and llama.cpp's greedy tokens compared")
    p.add_argument("--model", type=Path, required=True, help="a .gguf file")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {}
    for name, quantization in (("aserve", "auto"), ("float32", "none")):
        llm = LLM(str(args.model), quantization=quantization)
        prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
        runs[name] = [o.token_ids for o in llm.generate(prompts, greedy)]
        llm.close()
    longest = max(map(len, prompts)) + args.max_tokens
    peer = LlamaCppPeer(args.model, torch.get_num_threads(), len(prompts), longest)
    runs["llama.cpp"], _ = peer.generate([(prompt, args.max_tokens) for prompt in prompts])
    peer.close()
    pairs = (("aserve", "llama.cpp"), ("aserve", "float32"), ("llama.cpp", "float32"))
    parted = {
        pair: [first_difference(a, b) for a, b in zip(runs[pair[0]], runs[pair[1]], strict=True)]
        for pair in pairs
    }
    print(f"{args.model.name}: tokens alike before the first difference, of {args.max_tokens}")
    print("  " + " | ".join(f"{a} / {b}" for a, b in pairs) + " | prompt")
    for i, text in enumerate(PROMPTS):
        print(
            "  "
            + " | ".join(f"{parted[pair][i]:>{len(' / '.join(pair))}d}" for pair in pairs)
            + f" | {text}"
        )
    for pair in pairs:
        whole = sum(at == args.max_tokens for at in parted[pair])
        mean = sum(parted[pair]) / len(PROMPTS)
        print(
            f"{' / '.join(pair)}: identical {whole} of {len(PROMPTS)}, "
            f"mean first difference {mean:.1f}"
        )


if __name__ == "__main__":
    main()
