"""One server against `--dp N` replicas behind SGLang's router, on the same serving workload,
in one command: `bench/serving.py` runs against each in turn (one server, then the fleet,
`--repeat` times), each run recorded with a label that says which.

    python -m bench.replicas --dp 2 --server-args "--model M" -- --api chat --tokenizer T ...

The router takes text prompts only (its completions schema has no token-id prompts), so the
serving arguments should send text (`--api chat --tokenizer ...`). Server output goes to
files under --log-dir; the label of each run is the server's name.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from aserve.replicas import free_port, http_status
from bench import serving


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "aserve", *args], stdout=out, stderr=subprocess.STDOUT
        )


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while http_status(url) != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"the server did not get ready; its log:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(
    name: str,
    server_args: list[str],
    serving_args: list[str],
    log_dir: Path,
    timeout_s: float,
    warmup_runs: int,
) -> None:
    port = free_port()
    log = log_dir / f"{name.replace(' ', '_')}.log"
    proc = start([*server_args, "--port", str(port)], log)
    try:
        ready = "/readiness" if "--dp" in server_args else "/health"
        wait_ready(proc, f"http://127.0.0.1:{port}{ready}", log, timeout_s)
        url = ["--base-url", f"http://127.0.0.1:{port}"]
        for _ in range(warmup_runs):
            print(f"\n### {name} (warm-up, not recorded)", flush=True)
            serving.main([*serving_args, *url, "--no-record"])
        print(f"\n### {name}", flush=True)
        serving.main([*serving_args, *url, "--label", name])
    finally:
        stop(proc)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, serving_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="replicas of the fleet")
    p.add_argument("--server-args", default="", help="aserve options of both, as one string")
    p.add_argument("--router-policy", default="cache_aware")
    p.add_argument("--repeat", type=int, default=1, help="pairs of runs, one server first")
    p.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="unrecorded runs of the workload on each fresh server first: a new server's "
        "first burst runs at about half speed on a GPU (bench/NOTES.md)",
    )
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    p.add_argument("--ready-timeout", type=float, default=900.0)
    args = p.parse_args(ours)
    server = shlex.split(args.server_args)
    fleet = [*server, "--dp", str(args.dp), "--router-policy", args.router_policy]
    for _ in range(args.repeat):
        timing = (args.log_dir, args.ready_timeout, args.warmup_runs)
        measure("one server", server, serving_args, *timing)
        measure(f"dp{args.dp} {args.router_policy}", fleet, serving_args, *timing)


if __name__ == "__main__":
    main()
