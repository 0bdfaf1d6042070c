"""The fused MoE backend's two decode paths side by side (CUDA; microseconds a layer, prints a
table): the grouped GEMM of layers/moe_triton.py and the matrix-vector products of
layers/moe_gemv_triton.py, for a few tokens each routed to `--top-k` of `--experts`.

    python bench/moe_kernels.py --shape 4096x1408 --experts 128 --top-k 8 --fp8   # GLM-4.5-Air
    python bench/moe_kernels.py --shape 2048x768 --experts 128 --top-k 8          # Qwen3-30B-A3B

Each timed call routes its tokens anew (64 routings in turn), so the chosen experts' weights
come from memory and not from L2 as a real step's do; 100 calls in a CUDA graph, the median
of five graphs' replays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve.layers import moe_triton  # noqa: E402
from aserve.layers.moe_gemv_triton import gemv_experts  # noqa: E402
from aserve.quant.fp8 import quantize_rows  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="MoE decode kernels")
    p.add_argument("--shape", default="4096x1408", help="hidden x expert width")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--fp8", action="store_true", help="FP8 experts with a scale a row")
    return p.parse_args()


def layer_us(run: Callable[[int], object], calls: int = 100) -> float:
    """A call's microseconds: `calls` calls captured in a graph, median of five replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):
            run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            run(i)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    moe_triton.GEMV_TOKENS = 0  # fused_experts groups every batch; gemv_experts is called apart
    hidden, inter = (int(n) for n in args.shape.split("x"))
    device = torch.device("cuda")
    w13 = torch.randn(args.experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) / 64
    w2 = torch.randn(args.experts, hidden, inter, device=device, dtype=torch.bfloat16) / 64
    s13 = s2 = None
    if args.fp8:
        q13, q2 = quantize_rows(w13.flatten(0, 1)), quantize_rows(w2.flatten(0, 1))
        w13, s13 = q13.values.view(w13.shape), q13.scales.view(w13.shape[:2])
        w2, s2 = q2.values.view(w2.shape), q2.scales.view(w2.shape[:2])
    weight_bytes = w13[0].nbytes + w2[0].nbytes
    kind = "fp8" if args.fp8 else "bf16"
    print(f"{kind} experts {hidden}x{inter}, {args.experts} of them, top {args.top_k}")
    print(f"{'tokens':>6} {'grouped us':>11} {'gemv us':>9} {'gemv TB/s':>10}")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        routings = [
            torch.rand(tokens, args.experts, device=device).topk(args.top_k, dim=-1)
            for _ in range(64)
        ]
        weights = [r.values.bfloat16() for r in routings]
        ids = [r.indices for r in routings]

        def timed(experts: Callable[..., torch.Tensor]) -> float:
            return layer_us(
                lambda i: experts(x, w13, w2, weights[i % 64], ids[i % 64], s13, s2)  # noqa: B023
            )

        grouped_us, gemv_us = timed(moe_triton.fused_experts), timed(gemv_experts)
        distinct = statistics.mean(len(set(i.flatten().tolist())) for i in ids)
        rate = distinct * weight_bytes / gemv_us / 1e6
        print(f"{tokens:>6} {grouped_us:>11.1f} {gemv_us:>9.1f} {rate:>10.2f}")


if __name__ == "__main__":
    main()
