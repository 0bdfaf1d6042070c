"""Where a prefill step's time goes: a torch profiler table of one 16k-token prefill.

    python bench/prefill_profile.py --model bench/models/llama-3.1-8b --dummy-weight

Runs `--prompts` random prompts of `--input-len` tokens with one output token each (one
prefill step when they fit the prefill budget), once to warm up and once under the profiler,
and prints the GPU kernels by total time with the step's wall time and TFLOP/s of its
products (2 x non-embedding parameters x tokens).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dummy-weight", action="store_true")
    p.add_argument("--prompts", type=int, default=28)
    p.add_argument("--input-len", type=int, default=585)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    llm = LLM(
        args.model,
        dummy_weight=args.dummy_weight,
        max_prefill_length=16384,
        page_size=256,
        max_seq_len_override=4096,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.6)
    generator = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        ids = torch.randint(0, 10000, (args.prompts, args.input_len), generator=generator)
        return ids.tolist()

    llm.generate(prompts(), params)
    torch.cuda.synchronize()
    batch = prompts()
    start = time.perf_counter()
    llm.generate(batch, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model = llm.runtime.engine.model
    weights = sum(
        p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n
    )
    tokens = args.prompts * args.input_len
    # Quantized weights are buffers, not parameters: their products are not counted here.
    counted = "" if args.quantization in ("auto", "none") else " (float parameters only)"
    print(
        f"{tokens} prompt tokens in {seconds * 1e3:.1f} ms: "
        f"{2 * weights * tokens / seconds / 1e12:.0f} TFLOP/s of products{counted}"
    )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(), params)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70
    )
    print(table)


if __name__ == "__main__":
    main()
