"""aserve's CPU products for quantized weights against MKL's float32 product of the same
weight de-quantized, per shape and row count (microseconds a product; prints a table).

    python bench/quant_kernels.py                      # SmolLM2-135M's shapes
    python bench/quant_kernels.py --shapes 4096x4096 --rows 1 16 512
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve.layers.cpu_gemm import PackedWeight  # noqa: E402
from aserve.quant.codes import Codes  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", nargs="+", default=SMOLLM2, help="OUTxIN weight shapes")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128, 2048])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    args = p.parse_args()
    if not native_kernels():
        raise SystemExit("aserve's CPU kernels did not build here")
    print(f"threads {torch.get_num_threads()}; us a product, aserve / MKL float32")
    print("shape        bits " + "".join(f"{m:>18}" for m in args.rows))
    for shape in args.shapes:
        out, cols = (int(v) for v in shape.split("x"))
        for bits in args.bits:
            codes = Codes(
                torch.randint(0, 2**bits, (out, cols), dtype=torch.uint8),
                torch.rand(out, cols // 32),
                torch.rand(out, cols // 32),
                32,
                bits,
            )
            ours, mkl = NativeWeight(codes), PackedWeight(codes.dequantize())
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, cols)
                a = us_per_call(lambda x=x, w=ours: w.linear(x, None))
                b = us_per_call(lambda x=x, w=mkl: w.linear(x, None))
                cells.append(f"{a:>8.0f} / {b:<7.0f}")
            print(f"{shape:<12} {bits:>4} " + "".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
