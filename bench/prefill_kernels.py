"""FlashInfer's paged prefill over a bf16 and an FP8 KV cache, per chunk shape.

    python bench/prefill_kernels.py [--long]

Times one layer of a prefill chunk of `requests` prompts of `length` tokens each (causal,
the whole prompt new) for the Llama-3.1-8B and Qwen3-0.6B shapes, in microseconds, inside a
CUDA graph-free loop between two events: over a bf16 pool, over an FP8 pool read by the FA2
kernels compiled for FP8 pages, and over the FP8 pool widened to bf16 first and read by the
bf16 kernels (what the engine does, attention/flashinfer.py's `WidenedPrefill`, the copy
included in the time). `--long` adds single prompts of 16k and 32k tokens.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}
CASES = [(1, 1024), (8, 1024), (16, 512), (64, 256), (16, 1024)]
LONG_CASES = [(1, 16384), (1, 32768)]


def time_prefill(q_heads: int, kv_heads: int, requests: int, length: int, mode: str) -> float:
    """us a layer; `mode` is "bf16", "fp8" or "widened"."""
    import flashinfer

    from aserve.attention.flashinfer import WidenedPrefill

    kv_dtype = torch.bfloat16 if mode == "bf16" else torch.float8_e4m3fn

    device, page_size = torch.device("cuda"), 256
    pages_per_seq = -(-length // page_size)
    num_pages = requests * pages_per_seq
    pool = torch.randn(num_pages * page_size, 2, kv_heads, 128, device=device, dtype=torch.bfloat16)
    pool = pool.to(kv_dtype)
    shape = (num_pages, page_size, kv_heads, 128)
    cache = (pool[:, 0].view(shape), pool[:, 1].view(shape))
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=device), "NHD", backend="fa2"
    )
    wrapper.plan(
        torch.arange(requests + 1, dtype=torch.int32) * length,
        torch.arange(requests + 1, dtype=torch.int32) * pages_per_seq,
        torch.arange(num_pages, dtype=torch.int32).to(device),
        torch.full((requests,), length - (pages_per_seq - 1) * page_size, dtype=torch.int32),
        num_qo_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim_qk=128,
        page_size=page_size,
        causal=True,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16 if mode == "widened" else kv_dtype,
    )
    q = torch.randn(requests * length, q_heads, 128, device=device, dtype=torch.bfloat16)
    # The widened pages in reverse order: a gather, as the engine's pages are scattered.
    widened = WidenedPrefill(wrapper, torch.arange(num_pages - 1, -1, -1, device=device))

    def run() -> None:
        if mode == "widened":
            wrapper.run(q, widened.widen(pool, page_size, torch.bfloat16))
        else:
            wrapper.run(q, cache)

    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="add prompts of 16k and 32k tokens")
    args = parser.parse_args()
    print(f"{'shape':<14} {'requests x length':>18} {'bf16 us':>9} {'fp8 us':>9} {'widened':>9}")
    for name, (q_heads, kv_heads) in SHAPES.items():
        for requests, length in CASES + (LONG_CASES if args.long else []):
            times = [
                time_prefill(q_heads, kv_heads, requests, length, mode)
                for mode in ("bf16", "fp8", "widened")
            ]
            cells = "".join(f"{t:>10.1f}" for t in times)
            print(f"{name:<14} {f'{requests} x {length}':>18}{cells}", flush=True)


if __name__ == "__main__":
    main()
