"""Where a process's threads spent a stretch of wall time, from Linux's per-thread counters.

    python scripts/thread_times.py snap PID > before.json
    ... run the load ...
    python scripts/thread_times.py snap PID > after.json
    python scripts/thread_times.py diff before.json after.json

Per thread: CPU seconds (user, system), seconds runnable but waiting for a core (schedstat:
contention or a cgroup quota), and voluntary / involuntary context switches; then the
cgroup's throttling counters. A thread that is neither on a core nor waiting for one was
blocked (a lock such as the GIL, a syscall, a driver call). scripts/device-run.sh uses it to
find where the server's event loop goes when it is not running.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def thread_counters(task: Path) -> dict[str, float | str]:
    stat = (task / "stat").read_text()
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
    status = dict(
        line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line
    )
    return {
        "name": name,
        "user_s": int(fields[11]) / TICKS,
        "system_s": int(fields[12]) / TICKS,
        "on_cpu_s": run_ns / 1e9,
        "runnable_waiting_s": wait_ns / 1e9,
        "voluntary": int(status["voluntary_ctxt_switches"]),
        "involuntary": int(status["nonvoluntary_ctxt_switches"]),
    }


def cgroup_cpu() -> dict[str, int]:
    path = Path("/sys/fs/cgroup/cpu.stat")
    if not path.exists():
        return {}
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def snap(pid: int) -> dict[str, object]:
    tasks = Path(f"/proc/{pid}/task")
    threads = {}
    for task in tasks.iterdir():
        try:
            threads[task.name] = thread_counters(task)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return {"time": time.time(), "threads": threads, "cgroup": cgroup_cpu()}


def diff(before: dict, after: dict) -> None:
    wall = after["time"] - before["time"]
    print(f"{wall:.2f} s of wall time")
    print(
        f"{'thread':<24}{'on cpu':>9}{'user':>8}{'sys':>8}{'runq wait':>11}{'vol':>8}{'invol':>8}"
    )
    rows = []
    for tid, now in after["threads"].items():
        then = before["threads"].get(tid)
        if then is None:
            continue
        delta = {k: now[k] - then[k] for k in now if k != "name"}
        rows.append((delta["on_cpu_s"], now["name"], tid, delta))
    for on_cpu, name, tid, d in sorted(rows, reverse=True)[:12]:
        print(
            f"{name[:15] + ' ' + tid:<24}{100 * on_cpu / wall:8.1f}%{d['user_s']:9.2f}"
            f"{d['system_s']:9.2f}{100 * d['runnable_waiting_s'] / wall:8.1f}%"
            f"{d['voluntary']:9d}{d['involuntary']:9d}"
        )
    for key in after["cgroup"]:
        moved = after["cgroup"][key] - before["cgroup"].get(key, 0)
        print(f"cgroup {key}: +{moved}")


def main() -> None:
    if sys.argv[1] == "snap":
        print(json.dumps(snap(int(sys.argv[2]))))
    else:
        diff(*(json.loads(Path(p).read_text()) for p in sys.argv[2:4]))


if __name__ == "__main__":
    main()
