"""FlashInfer's paged prefill over a bf16 and an FP8 KV cache, per chunk shape.

    python bench/prefill_kernels.py

The FP8 cache (`--kv-cache-dtype fp8_e4m3`) is read by the same FA2 prefill kernels compiled
for FP8 pages; this times one layer of a prefill chunk of `requests` prompts of `length`
tokens each (causal, the whole prompt new) for the Llama-3.1-8B and Qwen3-0.6B shapes, in
microseconds, inside a CUDA graph-free loop between two events.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}
CASES = [(1, 1024), (8, 1024), (16, 512), (64, 256)]


def time_prefill(
    q_heads: int, kv_heads: int, requests: int, length: int, kv_dtype: torch.dtype
) -> float:
    import flashinfer

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
        kv_data_type=kv_dtype,
    )
    q = torch.randn(requests * length, q_heads, 128, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        wrapper.run(q, cache)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        wrapper.run(q, cache)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / 20


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(f"{'shape':<14} {'requests x length':>18} {'bf16 us':>9} {'fp8 us':>9}")
    for name, (q_heads, kv_heads) in SHAPES.items():
        for requests, length in CASES:
            times = [
                time_prefill(q_heads, kv_heads, requests, length, dtype)
                for dtype in (torch.bfloat16, torch.float8_e4m3fn)
            ]
            print(f"{name:<14} {f'{requests} x {length}':>18} {times[0]:>9.1f} {times[1]:>9.1f}")


if __name__ == "__main__":
    main()
