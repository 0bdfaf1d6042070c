"""Where an offline run's GPU time goes, step by step: prefill against decode, and decode by
batch size and context.

    python bench/step_census.py --model bench/models/llama-3.1-8b --dummy-weight \\
        --quantization fp8 --kv-cache-dtype fp8_e4m3

Runs mini-SGLang's offline workload (as bench/offline.py draws it) with the next seed to
warm up, then with `--seed` and a CUDA event pair around every step (forward and sampling),
and prints the GPU time of the steps by kind, batch size and mean context length, with the
run's wall time.
The events are recorded on the stream between the steps, so they cost the run a few
microseconds a step and change nothing else; the figure to improve is the largest row.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import StepTimer, random_workload  # noqa: E402
from bench.offline import build_llm, run_aserve  # noqa: E402

BATCH_BUCKETS = (1, 16, 64, 128, 192, 256, 1 << 30)


class StepCensus(StepTimer):
    """Every step's GPU time with its shape: (is decode, requests, new tokens, mean KV
    length)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, self.shape)

    @staticmethod
    def shape(batch: Any) -> tuple[bool, int, int, float]:
        return (
            batch.is_decode,
            batch.batch_size,
            sum(batch.extend_lens),
            sum(batch.seq_lens) / batch.batch_size,
        )

    def table(self, wall_s: float) -> str:
        torch.cuda.synchronize()
        groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])
        busy_ms = 0.0
        for start, end, (decode, requests, tokens, context) in self.marks:
            ms = start.elapsed_time(end)
            busy_ms += ms
            if decode:
                low = max(b for b in BATCH_BUCKETS if b <= requests)
                high = min(b for b in BATCH_BUCKETS if b > requests) - 1
                key = f"decode {low}-{min(high, 256)}"
            else:
                key = "prefill"
            g = groups[key]
            g[0] += 1
            g[1] += ms
            g[2] += tokens
            g[3] += context
        first, last = self.marks[0][0], self.marks[-1][1]
        span_ms = first.elapsed_time(last)
        lines = [
            f"wall {wall_s:.3f} s, first step start to last step end {span_ms / 1e3:.3f} s, "
            f"GPU inside steps {busy_ms / 1e3:.3f} s ({100 * busy_ms / span_ms:.1f}%)",
            "| steps | count | GPU s | share | ms/step | tokens | us/token | mean context |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        order = ["prefill"] + sorted((k for k in groups if k != "prefill"), key=_bucket_start)
        for key in order:
            if key not in groups:
                continue
            count, ms, tokens, context = groups[key]
            lines.append(
                f"| {key} | {count} | {ms / 1e3:.3f} | {100 * ms / busy_ms:.1f}% | "
                f"{ms / count:.2f} | {tokens} | {1e3 * ms / tokens:.1f} | {context / count:.0f} |"
            )
        return "\n".join(lines)


def _bucket_start(key: str) -> int:
    return int(key.split()[1].split("-")[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dummy-weight", action="store_true")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=(100, 1024))
    p.add_argument("--output-len", type=int, nargs=2, default=(100, 1024))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    args = p.parse_args()
    # build_llm reads bench/offline.py's options: the benchmark's settings, as device-run.sh's $W
    options = argparse.Namespace(
        model=args.model,
        dummy_weight=args.dummy_weight,
        constrained=0,
        max_seq_len=4096,
        max_prefill_length=16384,
        max_running_requests=256,
        page_size=256,
        num_pages=None,
        memory_ratio=0.9,
        cuda_graph_max_bs=256,
        attention_backend=args.attention_backend,
        moe_backend="auto",
        dtype="auto",
        tp=1,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    llm = build_llm(options)
    draw = (args.num_seqs, tuple(args.input_len), tuple(args.output_len))
    # The warm-up draws with the next seed: the same prompts would hit the prefix cache.
    tokens, seconds = run_aserve(
        llm, random_workload(*draw, args.seed + 1), args.temperature, seeded=False
    )
    print(f"warm-up run {tokens / seconds:.1f} tok/s")
    workload = random_workload(*draw, args.seed)
    census = StepCensus(llm.runtime.engine)
    started = time.perf_counter()
    tokens, _ = run_aserve(llm, workload, args.temperature, seeded=False)
    wall_s = time.perf_counter() - started
    print(f"census run {tokens / wall_s:.1f} tok/s")
    print(census.table(wall_s))
    llm.close()


if __name__ == "__main__":
    main()
