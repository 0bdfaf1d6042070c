"""Decode kernels against each other per batch: FlashInfer's with tensor cores or CUDA cores,
and the Triton kernels of attention/triton_decode.py.

    python bench/decode_kernels.py

`FlashInferBackend.use_tensor_cores` picks one of FlashInfer's per batch size from these
figures, and `triton_decode.MAX_BATCH` the largest batch given to the Triton ones. Each
kernel runs 20 times inside a CUDA graph (as in serving), bf16, head dim 128, a context of
`--context` tokens a request, and prints microseconds per call (one layer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import us_per_call_in_graph  # noqa: E402

SHAPES = {"qwen3-0.6b (16 q / 8 kv heads)": (16, 8), "llama-3.1-8b (32 q / 8 kv heads)": (32, 8)}
REPLAYS = 20


def time_kernel(
    batch: int, q_heads: int, kv_heads: int, context: int, page_size: int, kernel: str
) -> float:
    """`kernel`: "tensor cores", "cuda cores" or "triton". Both kinds of wrapper get the same
    plan: `batch` requests of `context` tokens on consecutive pages."""
    device = torch.device("cuda")
    head_dim = 128
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    q = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=device)
    if kernel == "triton":
        wrapper, cache = triton_wrapper(batch, kv_heads, num_pages, page_size)
    else:
        wrapper, cache = flashinfer_wrapper(batch, kv_heads, num_pages, page_size, kernel)
    wrapper.plan(
        torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq,
        torch.arange(num_pages, dtype=torch.int32),
        torch.full((batch,), context - (pages_per_seq - 1) * page_size, dtype=torch.int32),
        num_qo_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    return us_per_call_in_graph(lambda: wrapper.run(q, cache), REPLAYS)


def flashinfer_wrapper(
    batch: int, kv_heads: int, num_pages: int, page_size: int, kernel: str
) -> tuple[Any, torch.Tensor]:
    """A CUDA-graph decode wrapper of FlashInfer's and a paged cache of its own layout."""
    import flashinfer

    device = torch.device("cuda")
    cache = torch.randn(num_pages, 2, page_size, kv_heads, 128, dtype=torch.bfloat16, device=device)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=kernel == "tensor cores",
        paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.zeros(num_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=device),
    )
    return wrapper, cache


def triton_wrapper(
    batch: int, kv_heads: int, num_pages: int, page_size: int
) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    """The Triton kernels' wrapper (static buffers, as in a graph) and K/V views of a pool of
    the engine's layout (K and V of a slot side by side)."""
    from aserve.attention.triton_decode import TritonDecodeWrapper

    device = torch.device("cuda")
    pool = torch.randn(num_pages * page_size, 2, kv_heads, 128, dtype=torch.bfloat16, device=device)
    shape = (num_pages, page_size, kv_heads, 128)
    return TritonDecodeWrapper(device, batch, num_pages), (
        pool[:, 0].view(shape),
        pool[:, 1].view(shape),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    args = p.parse_args()
    print(f"us per layer, context {args.context}, pages of {args.page_size}")
    kernels = ("tensor cores", "cuda cores", "triton")
    print(f"{'shape':<34} {'batch':>5} " + " ".join(f"{k:>12}" for k in kernels))
    for name, (q_heads, kv_heads) in SHAPES.items():
        for batch in args.batches:
            times = [
                time_kernel(batch, q_heads, kv_heads, args.context, args.page_size, kernel)
                for kernel in kernels
            ]
            print(f"{name:<34} {batch:>5} " + " ".join(f"{t:>12.1f}" for t in times))


if __name__ == "__main__":
    main()
