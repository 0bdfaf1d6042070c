"""Decode kernels against each other per batch: FlashInfer's with tensor cores or CUDA cores,
and the Triton kernels of attention/triton_decode.py over a bf16 and an FP8 cache.

    python bench/decode_kernels.py

`FlashInferBackend.use_tensor_cores` picks one of FlashInfer's per batch size from these
figures, and `triton_decode.takes_batch` the batches given to the Triton ones. Each
kernel runs 20 times inside a CUDA graph (as in serving), bf16, head dim 128, a context of
`--context` tokens a request, and prints microseconds per call (one layer).

    python bench/decode_kernels.py --variants --batches 64 256 --context 880

times FlashInfer's tensor-core decode on the Llama-3.1-8B shape instead, over KV layouts
and plans: the engine's pool (a slot's K and V side by side, so one head's rows of a page
lie 4 KiB apart), FlashInfer's own NHD (K of a page, then its V) and HND (one head's rows
of a page together), with and without splitting long contexts, and FA3's kernel.

    python bench/decode_kernels.py --fp8-settings --batches 8 32 64 256

times the Triton kernels over an FP8 cache in each (block tokens, warps, stages) setting of a
sweep, whole contexts and 2-8 splits (`--fp8-layouts`: whole contexts over three layouts
of the cache), which is where `triton_decode`'s FP8 settings come from.
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
    """`kernel`: "tensor cores", "cuda cores" or "triton", with " fp8" over an FP8 cache.
    Every kernel gets the same plan: `batch` requests of `context` tokens on consecutive
    pages."""
    num_pages = batch * -(-context // page_size)
    kv_dtype = torch.float8_e4m3fn if kernel.endswith(" fp8") else torch.bfloat16
    if kernel.startswith("triton"):
        from aserve.attention.triton_decode import TritonDecodeWrapper

        wrapper: Any = TritonDecodeWrapper(torch.device("cuda"), batch, num_pages)
        k, v = paged_cache("engine", num_pages, page_size, kv_heads)
        cache: Any = (k.to(kv_dtype), v.to(kv_dtype))
    else:
        tensor_cores = kernel.startswith("tensor cores")
        wrapper = flashinfer_wrapper(batch, num_pages, tensor_cores, "NHD", "auto")
        cache = paged_cache("NHD", num_pages, page_size, kv_heads).to(kv_dtype)
    pages = torch.arange(num_pages)
    plan(wrapper, batch, q_heads, kv_heads, context, page_size, pages, kv_data_type=kv_dtype)
    return time_run(wrapper, batch, q_heads, cache)


VARIANTS = {
    # name: (cache layout, backend, disable_split_kv)
    "engine pool": ("engine", "fa2", False),
    "NHD": ("NHD", "fa2", False),
    "HND": ("HND", "fa2", False),
    "engine, no split": ("engine", "fa2", True),
    "HND, no split": ("HND", "fa2", True),
    "engine, fa3": ("engine", "fa3", False),
}


def time_variant(batch: int, context: int, page_size: int, variant: str) -> float:
    """FlashInfer's tensor-core decode for the Llama-3.1-8B shape (32 q / 8 kv heads) over
    one of VARIANTS, `batch` requests of `context` tokens on pages in shuffled order."""
    layout, backend, no_split = VARIANTS[variant]
    q_heads, kv_heads = 32, 8
    num_pages = batch * -(-context // page_size)
    wrapper = flashinfer_wrapper(
        batch, num_pages, True, "NHD" if layout == "engine" else layout, backend
    )
    cache = paged_cache(layout, num_pages, page_size, kv_heads)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
    options = {"disable_split_kv": True} if no_split else {}
    plan(wrapper, batch, q_heads, kv_heads, context, page_size, order, **options)
    return time_run(wrapper, batch, q_heads, cache)


FP8_LAYOUTS = ("engine", "split K/V", "HND")
FP8_SETTINGS = ((64, 1, 4), (64, 2, 6), (128, 2, 4), (128, 4, 3), (256, 4, 3), (256, 8, 2))
FP8_WHOLE_SWEEP = (
    (64, 1, 4),
    (64, 2, 6),
    (32, 1, 4),
    (32, 1, 8),
    (32, 2, 6),
    (64, 4, 4),
    (16, 1, 8),
)
FP8_SPLIT_SWEEP = ((32, 4, 3), (64, 2, 6), (32, 1, 4), (64, 1, 4), (64, 4, 2))


def time_fp8_setting(
    batch: int,
    q_heads: int,
    context: int,
    page_size: int,
    layout: str,
    setting: tuple[int, int, int],
    splits: int = 1,
) -> float:
    """The Triton decode kernels over an FP8 cache of 8 KV heads in one of FP8_LAYOUTS,
    `batch` requests of `context` tokens on shuffled pages, with one (block tokens, warps,
    stages) setting, the whole-context kernel (`splits` 1) or each context cut in `splits`:
    "engine" is the pool (a slot's K and V side by side, one head's row of 128 bytes every
    2 KiB), "split K/V" K and V apart (every 1 KiB), "HND" one head's rows of a page
    together (K and V of a page side by side)."""
    from aserve.attention import triton_decode
    from aserve.attention.triton_decode import TritonDecodeWrapper

    kv_heads, num_pages = 8, batch * -(-context // page_size)
    shape = (num_pages, page_size, kv_heads, 128)
    if layout == "HND":
        pool = torch.empty(num_pages, 2, kv_heads, page_size, 128, device="cuda")
        k, v = (pool[:, i].transpose(1, 2) for i in (0, 1))
    elif layout == "split K/V":
        pool = torch.empty(2, *shape, device="cuda")
        k, v = pool[0], pool[1]
    else:
        pool = torch.empty(num_pages * page_size, 2, kv_heads, 128, device="cuda")
        k, v = (pool[:, i].view(shape) for i in (0, 1))
    pool.normal_()
    fp8 = pool.to(torch.float8_e4m3fn)  # same strides, so k and v's views carry over
    k, v = (fp8.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (k, v))
    if splits == 1:
        triton_decode.WHOLE_MIN_PROGRAMS = 1
        triton_decode.FP8_WHOLE_SETTINGS = ((0, *setting),)
    else:
        triton_decode.WHOLE_MIN_PROGRAMS = 1 << 30
        triton_decode.FP8_SPLIT_PROGRAMS = splits * batch * kv_heads
        triton_decode.FP8_SPLIT_SETTINGS = ((0, *setting),)
    wrapper = TritonDecodeWrapper(torch.device("cuda"), batch, num_pages)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
    plan(wrapper, batch, q_heads, kv_heads, context, page_size, order, torch.float8_e4m3fn)
    assert wrapper.num_splits == splits
    return time_run(wrapper, batch, q_heads, (k, v))


def paged_cache(layout: str, num_pages: int, page_size: int, kv_heads: int) -> Any:
    """A bf16 KV cache of head dim 128: "engine" gives K/V views of the engine's pool (a
    slot's K and V side by side), "NHD" / "HND" FlashInfer's own layouts."""
    device = torch.device("cuda")
    if layout == "engine":
        pool = torch.randn(
            num_pages * page_size, 2, kv_heads, 128, dtype=torch.bfloat16, device=device
        )
        shape = (num_pages, page_size, kv_heads, 128)
        return pool[:, 0].view(shape), pool[:, 1].view(shape)
    inner = (page_size, kv_heads) if layout == "NHD" else (kv_heads, page_size)
    return torch.randn(num_pages, 2, *inner, 128, dtype=torch.bfloat16, device=device)


def flashinfer_wrapper(
    batch: int, num_pages: int, tensor_cores: bool, layout: str, backend: str
) -> Any:
    """A CUDA-graph decode wrapper of FlashInfer's (static index buffers)."""
    import flashinfer

    device = torch.device("cuda")
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=device),
        layout,
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.zeros(num_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=device),
        backend=backend,
    )


def plan(
    wrapper: Any,
    batch: int,
    q_heads: int,
    kv_heads: int,
    context: int,
    page_size: int,
    pages: torch.Tensor,
    kv_data_type: torch.dtype = torch.bfloat16,
    **options: Any,
) -> None:
    """Plan `batch` requests of `context` tokens, request i on the i-th run of `pages`."""
    pages_per_seq = -(-context // page_size)
    wrapper.plan(
        torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq,
        pages.to(torch.int32),
        torch.full((batch,), context - (pages_per_seq - 1) * page_size, dtype=torch.int32),
        num_qo_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        page_size=page_size,
        q_data_type=torch.bfloat16,
        kv_data_type=kv_data_type,
        **options,
    )


def time_run(wrapper: Any, batch: int, q_heads: int, cache: Any) -> float:
    q = torch.randn(batch, q_heads, 128, dtype=torch.bfloat16, device="cuda")
    return us_per_call_in_graph(lambda: wrapper.run(q, cache), REPLAYS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--variants", action="store_true", help="layouts and plans, 8B shape")
    p.add_argument("--fp8", action="store_true", help="also each kernel over an FP8 cache")
    p.add_argument("--fp8-layouts", action="store_true", help="Triton FP8 kernel per layout")
    p.add_argument("--fp8-settings", action="store_true", help="Triton FP8 kernels' settings")
    args = p.parse_args()
    if args.fp8_layouts or args.fp8_settings:
        kv_bytes = 2 * 8 * 128 * args.context  # K and V, 8 heads, FP8, a request
        print(f"Triton FP8 decode, context {args.context}, pages of {args.page_size}")
        print(
            f"{'shape':<34} {'batch':>5} {'layout':<10} {'tokens,warps,stages':<20} splits us TB/s"
        )
        shapes = SHAPES if args.fp8_layouts else {"llama-3.1-8b": (32, 8)}
        for name, (q_heads, _) in shapes.items():
            for batch in args.batches:
                runs = [(lay, s, 1) for lay in FP8_LAYOUTS for s in FP8_SETTINGS]
                if args.fp8_settings:
                    runs = [("engine", s, 1) for s in FP8_WHOLE_SWEEP]
                    if batch <= 96:
                        runs += [("engine", s, n) for n in (2, 4, 8) for s in FP8_SPLIT_SWEEP]
                for layout, setting, splits in runs:
                    us = time_fp8_setting(
                        batch, q_heads, args.context, args.page_size, layout, setting, splits
                    )
                    rate = batch * kv_bytes / us / 1e6
                    row = f"{name:<34} {batch:>5} {layout:<10} {str(setting):<20} {splits:>6}"
                    print(f"{row} {us:.1f} {rate:.2f}")
        return
    if args.variants:
        kv_bytes = 2 * 8 * 128 * 2 * args.context  # K and V, 8 heads, bf16, a request
        print(f"Llama-3.1-8B, tensor cores, context {args.context}, pages of {args.page_size}")
        print(f"{'variant':<18} {'batch':>5} {'us/layer':>9} {'TB/s':>6}")
        for batch in args.batches:
            for variant in VARIANTS:
                try:
                    us = time_variant(batch, args.context, args.page_size, variant)
                except Exception as error:  # a backend this build or layout lacks
                    print(f"{variant:<18} {batch:>5} failed: {str(error)[:80]}")
                    continue
                rate = batch * kv_bytes / us / 1e6
                print(f"{variant:<18} {batch:>5} {us:>9.1f} {rate:>6.2f}")
        return
    print(f"us per layer, context {args.context}, pages of {args.page_size}")
    kernels = ["tensor cores", "cuda cores", "triton"]
    if args.fp8:
        kernels += ["tensor cores fp8", "cuda cores fp8", "triton fp8"]
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
