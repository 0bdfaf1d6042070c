"""The peer: Hugging Face transformers on the same model and workload.

`run_hf` uses `generate`: requests run in fixed batches of `batch_size` (left padded), each
batch generating the longest output length it holds; only the tokens each request asked for
are counted. `run_hf_continuous` uses transformers' continuous batching (`generate_batch`,
paged attention), which takes one output length for all requests: it generates the longest
length of the workload for every request and counts every token it generated, so give it a
workload of one output length for a like-for-like figure.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def load_hf_model(
    model_dir: Path, dummy_weight: bool, dtype: torch.dtype, device: str
) -> torch.nn.Module:
    import transformers

    if dummy_weight:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def run_hf(
    model: torch.nn.Module,
    workload: list[tuple[list[int], int]],
    batch_size: int,
    temperature: float,
    cache_implementation: str | None = None,
) -> tuple[int, float]:
    """Generate the workload; returns (output tokens counted, seconds)."""
    device = next(model.parameters()).device
    counted, started = 0, time.perf_counter()
    for start in range(0, len(workload), batch_size):
        chunk = workload[start : start + batch_size]
        longest = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for row, (prompt, _) in enumerate(chunk):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        new_tokens = max(n for _, n in chunk)
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=None,
            top_k=None,
            eos_token_id=None,
            pad_token_id=0,
            cache_implementation=cache_implementation,
        )
        assert out.shape[1] - longest == new_tokens
        counted += sum(n for _, n in chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return counted, time.perf_counter() - started


def run_hf_continuous(
    model: torch.nn.Module, workload: list[tuple[list[int], int]], temperature: float
) -> tuple[int, float]:
    """Generate the workload with `generate_batch`; returns (tokens generated, seconds).
    Not under inference mode: its worker thread updates tensors that it made in place."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max(n for _, n in workload),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_p=None,
        top_k=None,
        eos_token_id=-1,
        pad_token_id=0,
    )
    started = time.perf_counter()
    outputs = model.generate_batch(  # type: ignore[operator]
        inputs=[prompt for prompt, _ in workload], generation_config=config
    )
    seconds = time.perf_counter() - started
    return sum(len(o.generated_tokens) for o in outputs.values()), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face folder")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    from bench.common import random_workload

    workload = random_workload(args.num_seqs, (args.input_len,) * 2, (args.output_len,) * 2, seed=0)
    model = load_hf_model(args.model, False, torch.float32, "cpu")
    tokens, seconds = run_hf(model, workload, args.batch_size, 0.0)
    print(f"transformers: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")


if __name__ == "__main__":
    main()
