"""What every benchmark shares: the seeded workload, the machine description and the record
that each run appends to bench/results.jsonl (bench/RESULTS.md is rendered from it)."""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_JSONL = BENCH_DIR / "results.jsonl"


def random_workload(
    num_seqs: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
    vocab_limit: int = 10000,
) -> list[tuple[list[int], int]]:
    """mini-SGLang's offline draw exactly (its benchmark/offline/bench.py), so that both
    engines run the same work: one generator seeded with `seed`, every prompt first (its
    length, then its ids, uniform in [0, vocab_limit] inclusive), then every output length.
    Lengths are uniform in the inclusive ranges. Returns (prompt ids, output length) pairs;
    with mini-SGLang's settings (256, 100-1024, 100-1024, seed 0) the totals are 142,827
    prompt and 133,966 output tokens."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, vocab_limit) for _ in range(rng.randint(*input_range))]
        for _ in range(num_seqs)
    ]
    output_lens = [rng.randint(*output_range) for _ in range(num_seqs)]
    return list(zip(prompts, output_lens))


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"CPU {cpu} x{torch.get_num_threads()} threads"


def git_commit() -> str:
    """The checkout's short commit. ASERVE_COMMIT wins when set: the GPU machine's copy of
    the tree may carry a stale .git, so the caller names the commit it copied."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=False
        ).stdout.strip()

    if os.environ.get("ASERVE_COMMIT"):
        return os.environ["ASERVE_COMMIT"]
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # The figures this writes do not make the tree dirty: runs in a row keep the commit.
    records = (f":(top,exclude)bench/{name}" for name in ("results.jsonl", "RESULTS.md"))
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/", *records)
    return commit + ("-dirty" if changed else "")


def record(
    bench: str,
    engine: str,
    model: str,
    settings: dict[str, Any],
    output_tokens: int,
    seconds: float,
    run_id: str,
    **figures: Any,
) -> dict[str, Any]:
    """Append one result line; `run_id` ties ours and the peer's figures of one run."""
    line = {
        "bench": bench,
        "engine": engine,
        "run_id": run_id,
        "date": time.strftime("%Y-%m-%d"),
        "model": model,
        "device": device_name(),
        "commit": git_commit(),
        "settings": settings,
        "output_tokens": output_tokens,
        "seconds": round(seconds, 3),
        "tok_s": round(output_tokens / seconds, 1),
        **figures,
    }
    with RESULTS_JSONL.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def us_per_call_in_graph(run: Callable[[], object], calls: int = 20) -> float:
    """Microseconds per call of `run()` on CUDA, timed as serving runs it: `calls` calls
    captured in one CUDA graph (after one eager call that warms them up), replayed 10 times
    between two events."""
    import torch

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (10 * calls)


class StepTimer:
    """Wraps an engine's `forward_logits` and `sample` to record a CUDA event before a step's
    forward and after its sampling, with no profiler running: `marks` holds (start, end,
    tag) for each step that `tag_of` (the step's batch -> a tag, or None to skip it) tags.
    `detach` gives the engine its own methods back."""

    def __init__(self, engine: Any, tag_of: Callable[[Any], Any]) -> None:
        self.engine, self.tag_of = engine, tag_of
        self.inner_forward, self.inner_sample = engine.forward_logits, engine.sample
        self.open: tuple[Any, Any] | None = None
        self.marks: list[tuple[Any, Any, Any]] = []
        engine.forward_logits, engine.sample = self.forward_logits, self.sample

    def forward_logits(self, batch: Any) -> Any:
        import torch

        tag = self.tag_of(batch)
        if tag is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.open = (start, tag)
        return self.inner_forward(batch)

    def sample(self, *args: Any) -> Any:
        import torch

        out = self.inner_sample(*args)
        if self.open is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((self.open[0], end, self.open[1]))
            self.open = None
        return out

    def detach(self) -> None:
        self.engine.forward_logits, self.engine.sample = self.inner_forward, self.inner_sample
