"""Whether the GPU waits on the event loop: `ASERVE_STEP_TIMING=<seconds>` brackets every step
with timing CUDA events and logs, every that many seconds (1 s for any value that is not a
number), how much of the window the GPU was busy, the idle gaps between steps, and where the
loop thread's time went.

A gap between one step's end and the next step's start on the GPU is time the host took to
plan and launch that step while nothing else was queued: with overlap there is none unless
the loop (handlers, streaming, the scheduler's own bookkeeping) is the bound. That is the
question issue 21 asks of 256 streams, and the one a user asks when HTTP is slower than
offline. Off by default: an event pair per step costs a few microseconds.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


def step_timing_window(device: torch.device) -> float | None:
    """The window of `ASERVE_STEP_TIMING` in seconds, or None where it is off (or no GPU)."""
    value = os.environ.get("ASERVE_STEP_TIMING", "")
    if device.type != "cuda" or value in ("", "0"):
        return None
    try:
        return max(0.05, float(value))
    except ValueError:
        return 1.0


class StepTimer:
    """Collects one window of steps; `finished` logs and restarts it every `interval_s`."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last_done: torch.cuda.Event | None = None
        self._gc_started = 0.0
        self._idle = False
        self._reset(time.perf_counter())
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """Collector pauses stall the loop like any other work: count them apart."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_started
            self._gc_full += info["generation"] == 2

    def _reset(self, now: float) -> None:
        self._window_start = now
        self._thread_cpu_start = time.thread_time()
        self._steps = 0
        self._gpu_busy_ms = 0.0
        self._gaps: list[float] = []
        self._launch_s = 0.0
        self._launch_cpu_s = 0.0
        self._results_s = 0.0
        self._wait_s = 0.0
        self._gc_s = 0.0
        self._gc_full = 0

    @staticmethod
    def mark() -> torch.cuda.Event:
        """A timing event recorded now on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finished(
        self,
        start: torch.cuda.Event,
        done: torch.cuda.Event,
        launch_s: float,
        launch_cpu_s: float,
        wait_s: float,
        results_s: float,
    ) -> None:
        """A step whose `done` event has completed: `launch_s` the host time to plan and
        launch it (`launch_cpu_s` of it on the CPU), `wait_s` the time the loop then polled
        for it (handlers ran meanwhile), `results_s` the time to hand out its tokens."""
        self._steps += 1
        self._gpu_busy_ms += start.elapsed_time(done)
        if self._last_done is not None:
            self._gaps.append(max(0.0, self._last_done.elapsed_time(start)))
        self._last_done = done
        self._launch_s += launch_s
        self._launch_cpu_s += launch_cpu_s
        self._wait_s += wait_s
        self._results_s += results_s
        now = time.perf_counter()
        if now - self._window_start >= self.interval_s:
            self._log(now)
            self._reset(now)

    def idle(self) -> None:
        """No step is queued: the window ends here (idle time is not the host's), and the
        next step's gap is waiting for work, not for the host."""
        self._last_done = None
        if self._steps:
            now = time.perf_counter()
            self._log(now)
            self._reset(now)
        self._idle = True

    def resume(self, now: float) -> None:
        """Work again after `idle`: the next window opens now, when planning starts."""
        if self._idle:
            self._idle = False
            self._reset(now)

    def _log(self, now: float) -> None:
        wall_ms = (now - self._window_start) * 1e3
        loop_cpu_ms = (time.thread_time() - self._thread_cpu_start) * 1e3
        steps = max(self._steps, 1)
        gaps = self._gaps or [0.0]
        launch_ms, results_ms = self._launch_s * 1e3, self._results_s * 1e3
        rest_ms = wall_ms - launch_ms - results_ms
        rest_cpu_ms = loop_cpu_ms - self._launch_cpu_s * 1e3 - results_ms
        logger.info(
            "step timing: %d steps in %.0f ms, GPU busy %.1f%%, idle gaps mean %.3f / max %.2f "
            "ms; loop thread CPU %.1f%%; per step: plan+launch %.2f ms (CPU %.2f), results "
            "%.2f, outside the scheduler %.2f (CPU %.2f; polling for the GPU %.2f); garbage "
            "collector %.0f ms (%d full)",
            self._steps,
            wall_ms,
            100 * self._gpu_busy_ms / wall_ms,
            sum(gaps) / len(gaps),
            max(gaps),
            100 * loop_cpu_ms / wall_ms,
            launch_ms / steps,
            self._launch_cpu_s * 1e3 / steps,
            results_ms / steps,
            max(0.0, rest_ms) / steps,
            max(0.0, rest_cpu_ms) / steps,
            self._wait_s * 1e3 / steps,
            self._gc_s * 1e3,
            self._gc_full,
        )
