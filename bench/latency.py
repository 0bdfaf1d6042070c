"""Single-stream decode latency: one request, a long prompt, milliseconds per new token.

    python bench/latency.py --model bench/models/llama-3.1-8b --dummy-weight

Times each step as the scheduler finishes it: the prefill step gives the time to the first
token, the decode steps after it give the per-token latency. Beside it stands the
weight-bandwidth bound, the time to read every weight once at the GPU's peak memory
bandwidth, which no batch-1 decode step can beat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve import LLM, SamplingParams  # noqa: E402
from aserve.engine.engine import weight_bytes  # noqa: E402
from aserve.forward import ForwardMode  # noqa: E402
from aserve.scheduler.plan import ScheduledBatch  # noqa: E402
from bench.common import new_run_id, random_workload, record  # noqa: E402

PEAK_BANDWIDTH_TB_S = {"H200": 4.8, "H100": 3.35}
"""Data-sheet HBM bandwidth (H100 SXM and H200 SXM)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="single-stream decode latency")
    p.add_argument("--model", default=None)
    p.add_argument("--dummy-weight", action="store_true")
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    p.add_argument("--moe-backend", default="auto", help="MoE models: auto, torch or fused")
    p.add_argument("--quantization", default="auto", help="auto, none, int8, int4 or fp8")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8_e4m3")
    p.add_argument("--attention-backend", default="auto", help="auto, fi, fa, torch or a,b")
    p.add_argument("--no-record", action="store_true")
    return p.parse_args()


class StepClock:
    """Finish times of every step, split into the prefill and the decode steps."""

    def __init__(self) -> None:
        self.prefill_done: list[float] = []
        self.decode_done: list[float] = []

    def __call__(self, planned: ScheduledBatch, seconds: float) -> None:
        now = time.perf_counter()
        if planned.mode is ForwardMode.DECODE:
            self.decode_done.append(now)
        else:
            self.prefill_done.append(now)


def bandwidth_bound_ms(llm: LLM) -> float | None:
    """Weight bytes a decode step reads over the GPU's peak bandwidth, or None off the GPUs
    in the table. Under tensor parallelism these are rank 0's shards: each GPU reads its own
    at the same time. Quantized weights count in the bytes they are kept in. Of a
    mixture-of-experts layer one token reads only the experts it is routed to, so expert
    weights count at num_experts_per_tok / num_experts. An input embedding that the LM head
    does not share is left out: a step reads one row of it. (Rows recorded before 2026-11-25
    counted it: 3.346 ms for the 8B shape in bf16, now 3.127; 1.893 in FP8, now 1.674.)"""
    engine = llm.runtime.engine
    if engine.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(engine.device)
    peak = next((tb for key, tb in PEAK_BANDWIDTH_TB_S.items() if key in name), None)
    if peak is None:
        return None
    config = engine.model_config
    routed = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
    expert_bytes = sum(
        p.numel() * p.element_size()
        for name, p in engine.model.named_parameters()
        if ".experts." in name
    )
    read = engine.weight_bytes - expert_bytes * (1.0 - routed)
    embedding = engine.model.model.embed_tokens
    if engine.model.lm_head is not embedding:
        read -= weight_bytes(embedding)
    return read / (peak * 1e12) * 1e3


def main() -> None:
    args = parse_args()
    llm = LLM(
        args.model,
        dummy_weight=args.dummy_weight,
        page_size=args.page_size,
        tensor_parallel_size=args.tp,
        moe_backend=args.moe_backend,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
    )
    clock = StepClock()
    llm.start_scheduler(on_step=clock)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    per_token, ttfts = [], []
    for run in range(args.repeat + 1):
        prompt = random_workload(1, (args.input_len,) * 2, (1, 1), seed=run)[0][0]
        clock.prefill_done.clear()
        clock.decode_done.clear()
        sent = time.perf_counter()
        llm.generate([prompt], params)
        if run == 0:
            continue
        first = clock.prefill_done[-1]
        ttfts.append((first - sent) * 1e3)
        per_token.append((clock.decode_done[-1] - first) * 1e3 / len(clock.decode_done))
    bound = bandwidth_bound_ms(llm)
    llm.close()
    ms = statistics.median(per_token)
    ttft = statistics.median(ttfts)
    ratio = f" = {ms / bound:.2f}x the bound of {bound:.2f} ms" if bound else ""
    print(f"decode {ms:.3f} ms/token (runs: {', '.join(f'{t:.3f}' for t in per_token)}){ratio}")
    print(f"time to first token {ttft:.1f} ms for a {args.input_len}-token prompt")
    if not args.no_record:
        model = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
        keys = ("input_len", "output_len", "repeat", "tp", "moe_backend")
        keys += ("quantization", "kv_cache_dtype", "attention_backend")
        settings = {k: getattr(args, k) for k in keys}
        record(
            "latency",
            "aserve",
            model,
            settings,
            args.output_len - 1,
            ms * (args.output_len - 1) / 1e3,
            new_run_id(),
            ms_per_token=round(ms, 3),
            ttft_ms=round(ttft, 1),
            bound_ms=round(bound, 3) if bound else None,
        )


if __name__ == "__main__":
    main()
