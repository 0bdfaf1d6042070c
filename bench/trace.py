"""Does the GPU idle between decode steps? A torch profiler trace of steady decode, summarised.

    python bench/trace.py --model bench/models/qwen3-0.6b --dummy-weight --batch 64

Runs `--batch` requests to the end of their prefill, then profiles `--steps` decode steps of
the whole batch and reads the kernels' timeline from the trace: busy time, the gaps between
one kernel's end and the next one's start, and where the host spends its time. With overlap
scheduling the next step's kernels are queued before the previous step ends, so the gaps
should be launch-latency sized (a few microseconds), never a host-sized hole.

The profiler slows the host (each CUDA-graph launch takes ~0.5 ms under it against ~10 us
without), so a first pass over the same batch runs without it: CUDA events recorded on the
stream before and after every decode step time the stream's idle span between one step's
end and the next one's start, which is only idle if the host had not queued that step yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve import LLM, SamplingParams  # noqa: E402
from aserve.forward import ForwardMode  # noqa: E402
from aserve.scheduler.plan import ScheduledBatch  # noqa: E402
from bench.common import StepTimer, new_run_id, random_workload, record  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="profile steady decode and report GPU idle gaps")
    p.add_argument("--model", default=None)
    p.add_argument("--dummy-weight", action="store_true")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--trace-out", default=None, help="also keep the Chrome trace here")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    return p.parse_args()


class DecodeWindow:
    """Once armed, starts the profiler after `warmup` decode steps and stops it `steps` later."""

    def __init__(self, prof: profile, warmup: int, steps: int) -> None:
        self.prof, self.warmup, self.steps = prof, warmup, steps
        self.armed = False
        self.decode_steps = 0
        self.started_at = self.stopped_at = 0.0

    def __call__(self, planned: ScheduledBatch, seconds: float) -> None:
        if not self.armed or planned.mode is not ForwardMode.DECODE:
            return
        self.decode_steps += 1
        if self.decode_steps == self.warmup:
            self.prof.start()
            self.started_at = time.perf_counter()
        elif self.decode_steps == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.stopped_at = time.perf_counter()
            self.prof.stop()


class StepEvents(StepTimer):
    """CUDA events around each full-batch decode step (after `warmup` of them, for
    `steps`), with no profiler running."""

    def __init__(self, engine: Any, batch: int, warmup: int, steps: int) -> None:
        super().__init__(engine, self.window_step)
        self.batch, self.warmup, self.steps = batch, warmup, steps
        self.seen = 0

    def window_step(self, batch: Any) -> bool | None:
        counted = batch.is_decode and batch.batch_size == self.batch
        self.seen += counted
        return True if counted and self.warmup < self.seen <= self.warmup + self.steps else None

    def stats(self) -> dict[str, float]:
        """Restore the engine; per-step time and the idle spans between steps, in us."""
        self.detach()
        torch.cuda.synchronize()
        idle = [
            end.elapsed_time(start) * 1e3 for (_, end, _), (start, _, _) in pairwise(self.marks)
        ]
        first, last = self.marks[0][0], self.marks[-1][1]
        window_us = first.elapsed_time(last) * 1e3
        return {
            "unprofiled_step_ms": window_us / len(self.marks) / 1e3,
            "unprofiled_idle_pct": 100.0 * sum(idle) / window_us,
            "unprofiled_idle_median_us": statistics.median(idle),
            "unprofiled_idle_max_us": max(idle),
            "unprofiled_idle_over_50us": sum(i > 50.0 for i in idle),
        }


def gpu_events(trace_file: Path) -> list[dict[str, Any]]:
    """Every kernel, copy and memset of the trace, by start time."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    return sorted(gpu, key=lambda e: float(e["ts"]))


def kernel_table(events: list[dict[str, Any]], steps: int, rows: int = 12) -> str:
    """The kernels that take the GPU's time, per decode step."""
    totals: dict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    for e in events:
        totals[e["name"]] += float(e.get("dur", 0.0))
        counts[e["name"]] += 1
    lines = [f"{'us/step':>9} {'calls/step':>10}  kernel"]
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"{total / steps:9.1f} {counts[name] / steps:10.1f}  {name[:90]}")
    return "\n".join(lines)


def summarise(events: list[dict[str, Any]]) -> dict[str, float]:
    """Busy time as the union of the events' spans; gaps where no GPU work runs at all."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events]
    busy, gaps = 0.0, []
    current_start, current_end = spans[0]
    for start, end in spans[1:]:
        if start > current_end:
            busy += current_end - current_start
            gaps.append(start - current_end)
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    busy += current_end - current_start
    window = spans[-1][1] - spans[0][0]
    gaps.sort()
    return {
        "window_ms": window / 1e3,
        "busy_ms": busy / 1e3,
        "gpu_busy_pct": 100.0 * busy / window,
        "gaps": len(gaps),
        "gap_median_us": statistics.median(gaps) if gaps else 0.0,
        "gap_p99_us": gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "gap_max_us": gaps[-1] if gaps else 0.0,
        "gaps_over_50us": sum(g > 50.0 for g in gaps),
        "idle_ms": sum(gaps) / 1e3,
    }


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/trace.py needs a CUDA device (it reads GPU kernel timelines)")
    llm = LLM(
        args.model,
        dummy_weight=args.dummy_weight,
        page_size=args.page_size,
        max_running_requests=max(args.batch, 1),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    workload = random_workload(args.batch, (args.input_len,) * 2, (1, 1), seed=0)
    prompts = [p for p, _ in workload]
    total_steps = args.warmup_steps + args.steps + 4
    params = SamplingParams(temperature=args.temperature, max_tokens=total_steps, ignore_eos=True)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    window = DecodeWindow(prof, args.warmup_steps, args.steps)
    llm.start_scheduler(on_step=window)
    unprofiled = StepEvents(llm.runtime.engine, args.batch, args.warmup_steps, args.steps)
    llm.generate(prompts, params)
    plain = unprofiled.stats()
    window.armed = True
    llm.generate(prompts, params)  # the prompts come from the prefix cache; decode is the same
    llm.close()

    trace_path = Path(args.trace_out or tempfile.mkstemp(suffix=".json")[1])
    prof.export_chrome_trace(str(trace_path))
    events = gpu_events(trace_path)
    stats = summarise(events)
    host_ms = (window.stopped_at - window.started_at) * 1e3 / args.steps
    stats["step_ms"] = host_ms
    stats.update(plain)
    print(f"decode, batch {args.batch}, {args.steps} steps profiled after {args.warmup_steps}")
    for key, value in stats.items():
        print(f"  {key:<16} {value:10.2f}")
    print(kernel_table(events, args.steps))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if not args.no_record:
        model = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
        settings = {k: getattr(args, k) for k in ("batch", "input_len", "steps", "temperature")}
        tokens = args.batch * args.steps
        record(
            "trace",
            "aserve",
            model,
            settings,
            tokens,
            host_ms * args.steps / 1e3,
            new_run_id(),
            **{k: round(v, 2) for k, v in stats.items()},
        )


if __name__ == "__main__":
    main()
