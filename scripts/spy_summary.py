"""Where a process spent its time, from a py-spy raw profile (`py-spy record -f raw`).

    python scripts/spy_summary.py spy.txt [rows]

Prints the functions with the most samples of their own (self) and with the most samples
anywhere on the stack (inclusive), as percentages of all samples. scripts/device-run.sh runs
it on the GPU machine after profiling the single-stream benchmark.
"""

from __future__ import annotations

import sys
from collections import Counter


def main(path: str, rows: int) -> None:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            samples = int(count)
            total += samples
            frames = stack.split(";")
            own[frames[-1]] += samples
            for frame in set(frames):
                inclusive[frame] += samples
    print(f"{total} samples")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"--- {title}")
        for frame, samples in counter.most_common(rows):
            print(f"{100 * samples / total:6.1f}% {frame[:140]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
