"""aserve's products for quantized weights against the float product of the same weight
de-quantized, per shape and row count (microseconds a product; prints a table): on CPU
against MKL float32, on CUDA against cuBLAS bfloat16.

    python bench/quant_kernels.py                      # SmolLM2-135M's shapes
    python bench/quant_kernels.py --shapes 4096x4096 --rows 1 16 512
    python bench/quant_kernels.py --bits 4 --group 16 --levels   # Q3_K-like, IQ4-like rows
    python bench/quant_kernels.py --device cuda --shapes 6144x4096 4096x4096 28672x4096 \
        4096x14336 --rows 1 16 64 256 1024 4096
    python bench/quant_kernels.py --fp8 --shapes 6144x4096 28672x4096 4096x14336 --rows 1 4 16
    python bench/quant_kernels.py --fp8-one-row --shapes 6144x4096 4096x4096 28672x4096 4096x14336

`--qtypes IQ2_XXS IQ3_XXS ...` (CUDA) times random weights of llama.cpp's formats: the
engine's form (book entries for the formats of runs), the same weight in 4-bit codes, and
cuBLAS bfloat16 on it de-quantized, the weights rotating past L2 (`Rotating`).

`--fp8` times products of a few rows with FP8 weights (CUDA): the engine's choice, a sweep
of the one-row GEMV's and `fp8_cuda.few_rows`'s settings, `torch._scaled_mm` with the rows
quantized, and the bfloat16 GEMV and cuBLAS on the same weight.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve.layers.cpu_gemm import PackedWeight  # noqa: E402
from aserve.quant.codes import Codes  # noqa: E402
from aserve.quant.gguf import IQ4_LEVELS  # noqa: E402
from aserve.quant.native import NativeWeight, native_kernels  # noqa: E402

SMOLLM2 = ["960x576", "576x576", "3072x576", "576x1536", "49152x576"]


def us_per_call(run: Callable[[], object], seconds: float = 0.5) -> float:
    """The median of timed batches of calls after one warm-up call."""
    run()
    timings = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(timings) < 3:
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return sorted(timings)[len(timings) // 2] * 1e6


def us_per_cuda_call(run: Callable[[], object], calls: int = 20) -> float:
    """GPU time of one call: `calls` calls captured in a CUDA graph (as decode runs them),
    replayed, so that Python's launch cost does not hide the kernels' own time."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def products(codes: Codes, device: str) -> tuple[Callable, Callable, Callable[[int], object]]:
    """(ours, float reference, activations of a row count) on `device`."""
    if device == "cuda":
        from aserve.quant.cuda import CudaWeight

        weight = CudaWeight(codes, torch.device("cuda"), torch.bfloat16)
        dense = codes.dequantize().to("cuda", torch.bfloat16)
        return (
            weight.linear,
            lambda x, bias: torch.nn.functional.linear(x, dense),
            lambda rows: torch.randn(rows, codes.shape[1], device="cuda", dtype=torch.bfloat16),
        )
    ours, mkl = NativeWeight(codes), PackedWeight(codes.dequantize())
    return ours.linear, mkl.linear, lambda rows: torch.randn(rows, codes.shape[1])


FP8_CONFIGS = [(8, 1024, 4, 2), (4, 2048, 8, 2), (16, 1024, 8, 2)]
"""(rows, columns a program reads at a time, warps, stages) of the one-row GEMV tried by
`--fp8`."""

ONE_ROW_SWEEP = [
    (8, 512, 8, 2),
    (16, 512, 8, 2),
    (32, 512, 8, 2),
    (8, 1024, 4, 2),
    (8, 1024, 4, 3),
    (16, 1024, 8, 2),
    (4, 2048, 4, 2),
    (8, 2048, 8, 2),
    (2, 4096, 4, 1),
    (4, 4096, 8, 1),
]
"""Settings of the one-row FP8 GEMV that `--fp8-one-row` times (those whose columns do not
divide a shape's row are left out for it)."""

FEW_ROWS_CONFIGS = [
    (64, 128, 1, 4, 4),
    (64, 128, 1, 4, 6),
    (64, 256, 1, 4, 4),
    (128, 128, 1, 4, 4),
    (128, 128, 1, 8, 4),
    (128, 256, 1, 8, 3),
    (64, 128, 2, 4, 4),
    (64, 128, 4, 4, 4),
    (128, 128, 2, 8, 4),
    (64, 512, 1, 4, 3),
]
"""(outputs, columns a program reads at a time, splits of K, warps, stages) of
`fp8_cuda.few_rows` tried by `--fp8`."""


TOKEN_SCALED_CONFIGS: list[tuple[int, int, int, int, int, int, bool]] = [
    (64, 64, 128, 1, 4, 4, False),
    (64, 128, 128, 1, 4, 4, False),
    (64, 256, 128, 1, 8, 3, False),
    (128, 64, 128, 1, 4, 4, False),
    (128, 128, 128, 1, 8, 4, False),
    (128, 256, 128, 1, 8, 3, False),
    (64, 128, 128, 2, 4, 4, False),
    (64, 64, 128, 4, 4, 4, False),
    (128, 128, 128, 2, 8, 4, False),
    (64, 128, 256, 1, 4, 3, False),
    (32, 128, 128, 1, 4, 4, True),
    (64, 128, 128, 1, 4, 4, True),
    (32, 64, 128, 1, 4, 5, True),
    (32, 128, 128, 4, 4, 4, True),
    (64, 128, 128, 2, 4, 4, True),
    (16, 128, 128, 2, 4, 5, True),
    (128, 128, 128, 4, 8, 4, False),
    (64, 128, 128, 4, 4, 4, False),
    (128, 256, 128, 2, 8, 3, False),
    (256, 128, 128, 1, 8, 3, False),
    (128, 64, 128, 2, 4, 4, False),
]
"""(tokens, outputs, columns, splits of K, warps, stages, swap) of `fp8_cuda.token_scaled`
tried by `--fp8-gemm`."""


class Rotating:
    """Calls `product(weight)` with the next of several copies of a weight at each call, so
    that a graph of 20 calls reads ~256 MiB of weights and none comes from L2 (the H200's
    50 MB would hold a qkv or o weight of the 8B between calls, unlike a model's forward)."""

    def __init__(self, weights: list[torch.Tensor], product: Callable[[torch.Tensor], object]):
        self.weights, self.product, self.calls = weights, product, 0

    def __call__(self) -> object:
        self.calls += 1
        return self.product(self.weights[self.calls % len(self.weights)])


def fp8_one_row_sweep(shapes: list[str]) -> None:
    """The one-row FP8 GEMV (a decode step at batch 1) in the engine's setting and in
    `ONE_ROW_SWEEP`'s, the weights rotating past L2 (`Rotating`) and the 20 calls of a
    graph chained by PDL as a decode step chains them; then gate|up with SiLU's kernel
    (`fp8_silu_gemv`) for shapes of at least `FP8_WORDS_MIN_ROWS` rows."""
    from aserve.layers.gemv import FP8_WORDS_MIN_ROWS, fp8_silu_gemv
    from aserve.quant.fp8 import Fp8Weight, quantize_rows

    print(f"{torch.cuda.get_device_name()}; us a one-row product with FP8 weights")
    print("shape           engine  settings from the fastest (rows, columns, warps, stages)")
    for shape in shapes:
        out, cols = (int(v) for v in shape.split("x"))
        weight = Fp8Weight(quantize_rows(torch.randn(out, cols) * 0.02), torch.device("cuda"))
        copies = [weight.values] + [
            weight.values.clone() for _ in range(max(1, 2**28 // weight.values.nbytes))
        ]
        x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
        engine = us_per_cuda_call(Rotating(copies, partial(_one_row_with, x, weight.scales, None)))
        timed = sorted(
            (us_per_cuda_call(Rotating(copies, partial(_one_row_with, x, weight.scales, c))), c)
            for c in ONE_ROW_SWEEP
            if cols % c[1] == 0
        )
        cells = ", ".join(f"{c}: {us:.2f}" for us, c in timed)
        print(f"{shape:<14}{engine:>8.2f}  {cells}", flush=True)
        if out >= FP8_WORDS_MIN_ROWS and out % 2 == 0:
            silu = us_per_cuda_call(
                Rotating(copies, partial(fp8_silu_gemv, x, scales=weight.scales))
            )
            print(f"{shape:<14}{silu:>8.2f}  (gate|up with SiLU, `fp8_silu_gemv`)", flush=True)


def _one_row_with(
    x: torch.Tensor,
    scales: torch.Tensor,
    config: tuple[int, int, int, int] | None,
    values: torch.Tensor,
) -> torch.Tensor:
    from aserve.layers.gemv import gemv

    return gemv(x, values, None, scales=scales, config=config)


def fp8_gemm_sweep(shapes: list[str], row_counts: list[int], chosen: bool = False) -> None:
    """Products of activations already in FP8 (a scale per token): `torch._scaled_mm` (its
    float32 promotion every few products, then with the tensor cores' own accumulation, "fast
    accum") against the Triton kernel's settings, or with `chosen` only the one the engine
    takes (`token_scaled_config`), with the quantization kernel's own time beside them; the
    weights rotate (`Rotating`)."""
    from aserve.quant.fp8 import quantize_rows
    from aserve.quant.fp8_cuda import quantize_tokens, token_scaled, token_scaled_config

    print(f"{torch.cuda.get_device_name()}; us a product with FP8 weights and activations")
    print(
        "shape        rows  quantize  _scaled_mm  fast (rel. err)  "
        "best Triton (config)  rel. err  next best"
    )
    for shape in shapes:
        out, cols = (int(v) for v in shape.split("x"))
        weight = quantize_rows(torch.randn(out, cols, device="cuda") * 0.02)
        values, weight_scales = weight.values.cuda(), weight.scales.cuda().float()
        copies = [values] + [values.clone() for _ in range(max(1, 2**28 // values.nbytes))]
        for rows in row_counts:
            x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
            x_values, x_scales = quantize_tokens(x)
            quantize_us = us_per_cuda_call(partial(quantize_tokens, x))

            reference = _scaled_mm_with(x_values, x_scales, weight_scales, values).float()
            fast = _scaled_mm_with(x_values, x_scales, weight_scales, values, fast_accum=True)
            fast_error = float((fast.float() - reference).abs().max() / reference.abs().max())
            fast_us = us_per_cuda_call(
                Rotating(
                    copies,
                    partial(_scaled_mm_with, x_values, x_scales, weight_scales, fast_accum=True),
                )
            )
            configs = TOKEN_SCALED_CONFIGS
            if chosen:
                config = token_scaled_config(rows, out, cols)
                configs = [] if config is None else [config]
            timed = []
            for config in configs:
                run = partial(
                    token_scaled, x_values, x_scales, values, weight_scales, None, x.dtype, config
                )
                rotating = Rotating(
                    copies,
                    partial(_token_scaled_with, x_values, x_scales, weight_scales, x.dtype, config),
                )
                try:
                    error = (run().float() - reference).abs().max() / reference.abs().max()
                    timed.append((us_per_cuda_call(rotating), config, float(error)))
                except Exception as failure:  # a setting that does not compile here
                    print(f"  {config}: {type(failure).__name__}: {str(failure)[:80]}")
            timed.sort()
            triton = "-"
            if timed:
                best_us, best, error = timed[0]
                rest = ", ".join(f"{c}: {u:.1f}" for u, c, _ in timed[1:4])
                triton = f"{best_us:>9.1f} {best}  {error:.1e}  {rest}"
            cublas_us = us_per_cuda_call(
                Rotating(copies, partial(_scaled_mm_with, x_values, x_scales, weight_scales))
            )
            print(
                f"{shape:<12}{rows:>6}{quantize_us:>10.1f}{cublas_us:>12.1f}"
                f"{fast_us:>7.1f} ({fast_error:.1e}){triton}",
                flush=True,
            )


def _token_scaled_with(
    x_values: torch.Tensor,
    x_scales: torch.Tensor,
    weight_scales: torch.Tensor,
    dtype: torch.dtype,
    config: tuple[int, int, int, int, int, int, bool],
    weight: torch.Tensor,
) -> torch.Tensor:
    from aserve.quant.fp8_cuda import token_scaled

    return token_scaled(x_values, x_scales, weight, weight_scales, None, dtype, config)


def _scaled_mm_with(
    x_values: torch.Tensor,
    x_scales: torch.Tensor,
    weight_scales: torch.Tensor,
    weight: torch.Tensor,
    fast_accum: bool = False,
) -> torch.Tensor:
    return torch._scaled_mm(
        x_values,
        weight.t(),
        scale_a=x_scales,
        scale_b=weight_scales[None, :],
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )


def fp8_feeds(row_counts: list[int], hidden: int = 4096, inter: int = 14336) -> None:
    """What feeds an FP8 product (us a call): the norm then the quantization kernel against
    the fused norm, the gated activation then the quantization against `silu_fp8`, and the
    quantization alone of an attention output (Llama-3.1-8B's widths by default)."""
    from aserve.layers.cuda_ops import CudaKernels
    from aserve.quant.fp8_cuda import norm_fp8, quantize_tokens, silu_fp8

    ops = CudaKernels()
    print(f"{torch.cuda.get_device_name()}; us a call, hidden {hidden}, intermediate {inter}")
    print("rows   norm+quantize      norm_fp8 silu+quantize      silu_fp8  quantize (hidden)")
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    for rows in row_counts:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        gate_up = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)

        def norm_then_quantize(x: torch.Tensor, residual: torch.Tensor) -> object:
            ops.fused_add_rmsnorm(x, residual, weight, 1e-6)
            return quantize_tokens(x)

        def silu_then_quantize(gate_up: torch.Tensor) -> object:
            return quantize_tokens(ops.silu_and_mul(gate_up))

        figures = [
            us_per_cuda_call(partial(norm_then_quantize, x, residual)),
            us_per_cuda_call(partial(norm_fp8, x, residual, weight, 1e-6)),
            us_per_cuda_call(partial(silu_then_quantize, gate_up)),
            us_per_cuda_call(partial(silu_fp8, gate_up)),
            us_per_cuda_call(partial(quantize_tokens, x)),
        ]
        print(f"{rows:<6}" + "".join(f"{f:>14.1f}" for f in figures), flush=True)


def fp8_few_rows(shapes: list[str], row_counts: list[int]) -> None:
    print(f"{torch.cuda.get_device_name()}; us a product with FP8 weights")
    print(
        "shape        rows    default  _scaled_mm  bf16 gemv  cuBLAS bf16  "
        "sweep of the GEMV (1 row) and of few_rows (config: us)"
    )
    for shape in shapes:
        for rows in row_counts:
            print(fp8_product(shape, rows), flush=True)


def fp8_product(shape: str, rows: int) -> str:
    from aserve.layers.gemv import gemv
    from aserve.quant.fp8 import Fp8Weight, quantize_rows
    from aserve.quant.fp8_cuda import few_rows

    out, cols = (int(v) for v in shape.split("x"))
    dense = torch.randn(out, cols, device="cuda") * 0.02
    weight = quantize_rows(dense)
    fp8, scaled_mm = (
        Fp8Weight(weight, torch.device("cuda")),
        Fp8Weight(weight, torch.device("cuda")),
    )
    scaled_mm._one_row = scaled_mm._few_rows = None
    dense = dense.to(torch.bfloat16)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    figures = [
        us_per_cuda_call(lambda: fp8.linear(x, None)),
        us_per_cuda_call(lambda: scaled_mm.linear(x, None)),
        us_per_cuda_call(lambda: gemv(x, dense, None)) if rows == 1 else float("nan"),
        us_per_cuda_call(lambda: torch.nn.functional.linear(x, dense)),
    ]
    scales = fp8.scales.reshape(-1)
    swept = [
        (f"gemv {c}", partial(gemv, x, fp8.values, None, scales=fp8.scales, config=c))
        for c in (FP8_CONFIGS if rows == 1 else [])
    ] + [(str(c), partial(few_rows, x, fp8.values, scales, None, c)) for c in FEW_ROWS_CONFIGS]
    sweep = [f"{name}: {us_per_cuda_call(run):.1f}" for name, run in swept]
    return (
        f"{shape:<12}{rows:>5}" + "".join(f"{f:>11.1f}" for f in figures) + "  " + ", ".join(sweep)
    )


def gguf_products(qtypes: list[str], shapes: list[str], row_counts: list[int]) -> None:
    """`--qtypes`: each format's product against its 4-bit codes and cuBLAS (CUDA)."""
    import gguf
    import numpy as np

    from aserve.quant.cuda import CudaWeight
    from aserve.quant.gguf import decode
    from bench.gguf_files import random_blocks

    print(f"{torch.cuda.get_device_name()}; us a product: engine (bits a weight) / 4-bit codes")
    print("/ cuBLAS bfloat16, weights rotating past L2")
    print("shape        qtype   " + "".join(f"{m:>24}" for m in row_counts))
    device, rng = torch.device("cuda"), np.random.default_rng(0)
    for shape in shapes:
        out, cols = (int(v) for v in shape.split("x"))
        for name in qtypes:
            kind = gguf.GGMLQuantizationType[name]
            raw = random_blocks(kind, out, cols, 0.02, rng)
            codes = decode(torch.from_numpy(raw), kind, cols)
            ours = CudaWeight(codes, device, torch.bfloat16)
            plain = CudaWeight(codes._replace(runs=None), device, torch.bfloat16)
            dense = codes.dequantize().to(device, torch.bfloat16)
            copies = max(2, 2**28 // ours.nbytes)
            engine = [ours] + [CudaWeight(codes, device, torch.bfloat16) for _ in range(copies)]
            nibbles = [plain] + [
                CudaWeight(codes._replace(runs=None), device, torch.bfloat16)
                for _ in range(max(2, 2**28 // plain.nbytes))
            ]
            floats = [dense] + [dense.clone() for _ in range(max(2, 2**28 // dense.nbytes))]
            cells = []
            for rows in row_counts:
                x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
                times = [
                    us_per_cuda_call(Rotating(ws, lambda w, x=x: w.linear(x, None)))
                    for ws in (engine, nibbles)
                ]
                times.append(
                    us_per_cuda_call(Rotating(floats, partial(torch.nn.functional.linear, x)))
                )
                cells.append(" / ".join(f"{t:.1f}" for t in times))
            bits = 8 * ours.nbytes / (out * cols)
            print(f"{shape:<12} {name:<7} ({bits:.2f})" + "".join(f"{c:>24}" for c in cells))
            del engine, nibbles, floats
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", nargs="+", default=SMOLLM2, help="OUTxIN weight shapes")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128, 2048])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    p.add_argument("--group", type=int, default=32, help="inputs a scale (16: the K-quants')")
    p.add_argument(
        "--levels", action="store_true", help="also 4-bit codes standing for IQ4's 16 levels"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--fp8", action="store_true", help="FP8 products of --rows rows (CUDA)")
    p.add_argument("--qtypes", nargs="+", help="random weights of these GGUF formats (CUDA)")
    p.add_argument(
        "--fp8-gemm", action="store_true", help="FP8 x FP8 products: Triton settings (CUDA)"
    )
    p.add_argument(
        "--chosen", action="store_true", help="--fp8-gemm: only the engine's Triton setting"
    )
    p.add_argument(
        "--fp8-feeds", action="store_true", help="FP8 norm/activation/quantization (CUDA)"
    )
    p.add_argument(
        "--fp8-one-row", action="store_true", help="the one-row FP8 GEMV's settings (CUDA)"
    )
    args = p.parse_args()
    if args.qtypes:
        if not torch.cuda.is_available():
            raise SystemExit("--qtypes times CUDA products: this machine has no CUDA device")
        gguf_products(args.qtypes, args.shapes, args.rows)
        return
    if args.fp8_feeds:
        fp8_feeds(args.rows)
        return
    if args.fp8_gemm:
        fp8_gemm_sweep(args.shapes, args.rows, args.chosen)
        return
    if args.fp8_one_row:
        fp8_one_row_sweep(args.shapes)
        return
    if args.fp8:
        fp8_few_rows(args.shapes, args.rows)
        return
    if args.device == "cpu" and not native_kernels():
        raise SystemExit("aserve's CPU kernels did not build here")
    timed = us_per_cuda_call if args.device == "cuda" else us_per_call
    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()}; us a product, aserve / cuBLAS bfloat16")
    else:
        print(f"threads {torch.get_num_threads()}; us a product, aserve / MKL float32")
    print("shape        bits " + "".join(f"{m:>18}" for m in args.rows))
    for shape in args.shapes:
        out, cols = (int(v) for v in shape.split("x"))
        kinds = [(bits, None) for bits in args.bits]
        if args.levels:
            kinds.append((4, IQ4_LEVELS))
        for bits, levels in kinds:
            codes = Codes(
                torch.randint(0, 2**bits, (out, cols), dtype=torch.uint8),
                torch.rand(out, cols // args.group),
                torch.rand(out, cols // args.group),
                args.group,
                bits,
                levels,
            )
            ours, reference, activations = products(codes, args.device)
            cells = []
            for rows in args.rows:
                x = activations(rows)
                a = timed(lambda x=x, f=ours: f(x, None))
                b = timed(lambda x=x, f=reference: f(x, None))
                cells.append(f"{a:>8.0f} / {b:<7.0f}")
            name = f"{bits}L" if levels is not None else str(bits)
            print(f"{shape:<12} {name:>4} " + "".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
