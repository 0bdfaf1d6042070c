"""What edge users care about: time from `aserve` to a ready /health (cold: GGUF conversion
included; warm: conversion cached), resident memory after start-up and under N concurrent
streams, and the number of processes.

    python bench/footprint.py --streams 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import new_run_id, record  # noqa: E402
from tests.server_utils import free_port  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_count(pid: int) -> int:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return 1 + len(children.stdout.split())


def start_and_wait(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, float, str]:
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--port", str(port), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as response:
                if response.status == 200:
                    return proc, time.perf_counter() - started, base
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            raise RuntimeError("aserve exited before it was ready")
        time.sleep(0.05)


async def streams(base: str, count: int, max_tokens: int, pid: int) -> float:
    """Run `count` concurrent streams; returns the peak RSS seen while they ran."""
    peak = rss_mib(pid)
    body = {
        "prompt": "Tell me a story about a lighthouse.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }

    async def one(session: aiohttp.ClientSession) -> None:
        async with session.post(base + "/v1/completions", json=body) as response:
            async for _ in response.content:
                pass

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(count)]
        while not all(t.done() for t in tasks):
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-record", action="store_true")
    args, server_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "ASERVE_CACHE_DIR": cache}
        cold_proc, cold_s, _ = start_and_wait(server_args, env)
        cold_proc.terminate()
        cold_proc.wait()
        proc, warm_s, base = start_and_wait(server_args, env)
        try:
            idle_rss = rss_mib(proc.pid)
            processes = process_count(proc.pid)
            started = time.perf_counter()
            peak_rss = asyncio.run(streams(base, args.streams, args.max_tokens, proc.pid))
            seconds = time.perf_counter() - started
        finally:
            proc.terminate()
            proc.wait()
    print(
        f"ready cold {cold_s:.1f} s, warm {warm_s:.1f} s; RSS idle {idle_rss:.0f} MiB, "
        f"under {args.streams} streams {peak_rss:.0f} MiB; processes {processes}"
    )
    if not args.no_record:
        settings = {
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "server_args": server_args,
        }
        record(
            "footprint",
            "aserve",
            "SmolLM2-135M-Instruct",
            settings,
            args.streams * args.max_tokens,
            seconds,
            new_run_id(),
            ready_cold_s=round(cold_s, 2),
            ready_warm_s=round(warm_s, 2),
            rss_idle_mib=round(idle_rss),
            rss_streams_mib=round(peak_rss),
            processes=processes,
        )


if __name__ == "__main__":
    main()
