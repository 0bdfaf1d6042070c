"""Where a burst's first moments go: run aserve with timestamps around each request, then
print them per burst.

    python scripts/request_timeline.py serve OUT.json -- --model M --port 1919 ...
    ... send bursts (bench/serving.py) ...; stop the server with SIGINT (OUT.json is written)
    python scripts/request_timeline.py report OUT.json

Recorded (perf_counter seconds): each request's entry into the handlers, the tokenizer's
batches (size, time on the loop) and hand-outs, each `Scheduler.submit`, each stream's first
text delta, every scheduler call (plan, launches, result handling) that took over 2 ms, garbage
collections over 2 ms, and late ticks of a 1 ms timer on the loop (the loop was busy that
long). The report prints, per burst of 16 or more requests, percentiles from the burst's first
request and the events of its first 600 ms. It wraps aserve's own functions from outside, so
it is a diagnostic that follows their names, not part of the server (issue 21 used it on the
H200: bench/NOTES.md, "Where a burst's first 150 ms went").
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SLOW_S = 0.002
LATE_S = 0.005
now = time.perf_counter


def record_into(events: dict[str, list[Any]]) -> None:
    """Wrap the server's functions so that each appends to `events`."""
    from aiohttp import web

    import aserve.tokenizer as tokenizer
    from aserve.scheduler.plan import Planner
    from aserve.scheduler.scheduler import Scheduler
    from aserve.server.app import Server
    from aserve.server.generation import Choice

    guard = Server.guard

    @web.middleware
    async def timed_guard(self: Server, request: web.Request, handler: Any) -> Any:
        events["entry"].append(now())
        return await guard(self, request, handler)

    def timed(owner: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = now()
            result = original(*args, **kwargs)
            if now() - started > SLOW_S:
                events["slow"].append((started, now() - started, name))
            return result

        setattr(owner, name, wrapper)

    submit = Scheduler.submit

    def timed_submit(self: Scheduler, req: Any) -> None:
        events["submit"].append(now())
        submit(self, req)

    send_batch = tokenizer.Tokenizer._send_batch

    def timed_send(self: Any, special: bool) -> None:
        size, started = len(self._batches[special]), now()
        send_batch(self, special)
        events["batch"].append((started, now() - started, size))

    hand_out = tokenizer._hand_out

    def timed_hand_out(job: Any, futures: list[Any]) -> None:
        events["handout"].append((now(), len(futures)))
        hand_out(job, futures)

    run = Choice.run

    async def timed_run(self: Choice) -> Any:
        first = True
        async for delta in run(self):
            if first and delta.text:
                events["first"].append(now())
                first = False
            yield delta

    scheduler_run = Scheduler.run

    async def ticking_run(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        async def ticker() -> None:
            while True:
                started = now()
                await asyncio.sleep(0.001)
                if now() - started > LATE_S:
                    events["late"].append((started, now() - started))

        task = asyncio.get_running_loop().create_task(ticker())
        try:
            await scheduler_run(self, *args, **kwargs)
        finally:
            task.cancel()

    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = now()
        elif now() - gc_started[0] > SLOW_S:
            events["gc"].append((gc_started[0], now() - gc_started[0], info["generation"]))

    Server.guard = timed_guard  # type: ignore[method-assign]
    tokenizer.Tokenizer._send_batch = timed_send  # type: ignore[method-assign]
    tokenizer._hand_out = timed_hand_out
    Choice.run = timed_run  # type: ignore[method-assign]
    Scheduler.run = ticking_run  # type: ignore[method-assign]
    Scheduler.submit = timed_submit  # type: ignore[method-assign]
    for name in ("_launch_forward", "_launch_sampling", "_process_results"):
        timed(Scheduler, name)
    timed(Planner, "schedule")
    gc.callbacks.append(on_gc)


def serve(out: Path, server_args: list[str]) -> int:
    events: dict[str, list[Any]] = {
        k: [] for k in ("entry", "batch", "handout", "submit", "first", "slow", "gc", "late")
    }
    record_into(events)
    atexit.register(lambda: out.write_text(json.dumps(events)))
    from aserve.cli import main

    return main(server_args)


def bursts(entries: list[float]) -> list[tuple[float, float]]:
    """(first, last) entry times of each run of 16+ requests arriving within 50 ms, extended
    while the next arrives within 0.5 s."""
    found, i = [], 0
    while i < len(entries):
        if i + 16 < len(entries) and entries[i + 16] - entries[i] < 0.05:
            j = i
            while j + 1 < len(entries) and entries[j + 1] - entries[j] < 0.5:
                j += 1
            found.append((entries[i], entries[j]))
            i = j + 1
        else:
            i += 1
    return found


def report(path: Path) -> None:
    events = json.loads(path.read_text())

    def percentiles(times: list[float]) -> str:
        if not times:
            return "none"
        times = sorted(times)
        picks = [times[min(len(times) - 1, int(q * len(times)))] for q in (0, 0.1, 0.5, 0.9)]
        return " ".join(f"p{int(q * 100)}={t:.1f}" for q, t in zip((0, 0.1, 0.5, 0.9), picks))

    for start, last in bursts(sorted(events["entry"])):
        end = last + 2.0
        print(f"== burst at {start:.3f} s (ms from its first request)")
        for key in ("entry", "submit", "first"):
            times = [(t - start) * 1e3 for t in events[key] if start <= t <= end]
            print(f"  {key:7s} n={len(times)} {percentiles(times)}")
        for key in ("batch", "handout", "slow", "gc", "late"):
            shown = [
                (
                    round((e[0] - start) * 1e3, 1),
                    *[round(x * 1e3, 1) if isinstance(x, float) else x for x in e[1:]],
                )
                for e in events[key]
                if start - 0.05 <= e[0] <= start + 0.6
            ]
            print(f"  {key}: {shown[:40]}")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        rest = argv[2:]
        return serve(Path(argv[1]), rest[1:] if rest[:1] == ["--"] else rest)
    if len(argv) == 2 and argv[0] == "report":
        report(Path(argv[1]))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
