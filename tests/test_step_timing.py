"""ASERVE_STEP_TIMING's arithmetic, with stand-in events that carry GPU times: the idle gaps
between steps, the window ended when the scheduler idles, and the switch itself (CUDA only)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import pytest
import torch

from aserve.scheduler.timing import StepTimer, step_timing_window


@dataclass
class GpuMark:
    """A stand-in for a completed timing CUDA event, recorded at `ms` on the GPU's clock."""

    ms: float

    def elapsed_time(self, later: GpuMark) -> float:
        return later.ms - self.ms


def test_switched_on_only_for_cuda_with_its_window_in_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASERVE_STEP_TIMING", "1")
    assert step_timing_window(torch.device("cuda")) == 1.0
    assert step_timing_window(torch.device("cpu")) is None
    monkeypatch.setenv("ASERVE_STEP_TIMING", "0.25")
    assert step_timing_window(torch.device("cuda")) == 0.25
    monkeypatch.setenv("ASERVE_STEP_TIMING", "yes")
    assert step_timing_window(torch.device("cuda")) == 1.0
    monkeypatch.setenv("ASERVE_STEP_TIMING", "0")
    assert step_timing_window(torch.device("cuda")) is None


def test_a_busy_stretch_logs_its_steps_and_the_gaps_between_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timer = StepTimer(interval_s=3600.0)
    timer.idle()
    timer.resume(time.perf_counter())
    # GPU spans: [0, 4], [5, 9], [11, 15] ms: gaps of 1 and 2 ms between the steps
    for start, done in ((0, 4), (5, 9), (11, 15)):
        timer.finished(GpuMark(start), GpuMark(done), 0.002, 0.001, wait_s=0.0005, results_s=0.0003)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="aserve.scheduler.timing"):
        timer.idle()
        timer.idle()  # nothing ran since: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("step timing: 3 steps in ")
    assert "idle gaps mean 1.500 / max 2.00 ms" in line
    assert "plan+launch 2.00 ms (CPU 1.00), results 0.30" in line
    assert "polling for the GPU 0.50" in line
    busy = float(re.search(r"GPU busy ([\d.]+)%", line).group(1))  # type: ignore[union-attr]
    assert busy > 0


def test_the_first_step_after_idle_has_no_gap(caplog: pytest.LogCaptureFixture) -> None:
    """Time the GPU waited for work is not a gap the host caused."""
    timer = StepTimer(interval_s=3600.0)
    timer.finished(GpuMark(0), GpuMark(1), 0.0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]
    timer.idle()
    caplog.clear()
    timer.resume(time.perf_counter())
    timer.finished(GpuMark(500), GpuMark(501), 0.0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="aserve.scheduler.timing"):
        timer.idle()
    assert "idle gaps mean 0.000 / max 0.00 ms" in caplog.records[-1].getMessage()
