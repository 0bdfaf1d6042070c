"""Qwen-VL's rotary positions (M-RoPE) for a prompt with images.

The language model rotates each pair of a head by one of three position coordinates (time,
height, width; `ModelConfig.mrope_section` says which pairs take which). A text token's
three are equal, one more than the position before. An image's features all take the time
of the image's first position and, at row r and column c of its grid of features, height
first + r and width first + c; the text after it goes on from first + max(rows, columns),
so a prompt's positions run behind its indices by what its images save (`shift`), and the
generated tokens keep that shift. Each token's coordinates are worked out here on the host,
for the steps that reach it (engine/step.py carries them); the rotary tables are looked up
per coordinate (layers/rotary.py)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from aserve.models.vision import ImageSpan


@dataclass(frozen=True)
class ImageRun:
    """One image's positions: prompt indices [start, end) and its grid of features."""

    start: int
    end: int
    first: int  # the rotary position of the image's first feature
    rows: int
    columns: int


@dataclass(frozen=True)
class MropePositions:
    """A prompt's M-RoPE positions: its images' runs, and each run's end with the shift the
    text after it takes (`ends`, `shifts`; the last shift is the generated tokens')."""

    runs: tuple[ImageRun, ...]
    ends: tuple[int, ...]
    shifts: tuple[int, ...]

    @classmethod
    def of(cls, spans: list[ImageSpan]) -> MropePositions:
        runs, ends, shifts = [], [], []
        shift = 0
        for span in spans:
            assert span.grid is not None
            _, rows, columns = span.grid
            first = span.start + shift
            runs.append(ImageRun(span.start, span.end, first, rows, columns))
            shift = first + max(rows, columns) - span.end
            ends.append(span.end)
            shifts.append(shift)
        return cls(tuple(runs), tuple(ends), tuple(shifts))

    @property
    def shift(self) -> int:
        """What the positions after the last image (the generated tokens') run behind their
        indices."""
        return self.shifts[-1] if self.shifts else 0

    def text_position(self, index: int) -> int:
        """The rotary position of a text token at prompt or output index `index`."""
        before = bisect.bisect_right(self.ends, index)
        return index + (self.shifts[before - 1] if before else 0)

    def coordinates(self, start: int, count: int) -> tuple[list[int], list[int], list[int]]:
        """Time, height and width positions of indices [start, start + count)."""
        times, heights, widths = [], [], []
        for index in range(start, start + count):
            run = next((r for r in self.runs if r.start <= index < r.end), None)
            if run is None:
                position = self.text_position(index)
                times.append(position)
                heights.append(position)
                widths.append(position)
                continue
            row, column = divmod(index - run.start, run.columns)
            times.append(run.first)
            heights.append(run.first + row)
            widths.append(run.first + column)
        return times, heights, widths
