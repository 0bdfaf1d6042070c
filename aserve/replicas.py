"""`aserve --dp N`: N replicas of the server behind SGLang's router, started and stopped as one.

Each replica is a plain `aserve` process (with its own tensor-parallel ranks) on a loopback
port of its own, with its own GPUs (CUDA_VISIBLE_DEVICES) or its own share of the CPU cores.
SGLang's router (`python -m sglang_router.launch_router`, installed by
`pip install "aserve[router]"`) listens on --host/--port and spreads requests over them by
--router-policy. This process only starts, watches and stops processes; it holds no model:
- every replica's /health must answer 200 before the router starts, so the first request
  finds them all;
- a replica that exits once it has been ready is started again on the same port: the router's
  health check takes it out meanwhile and back in when it answers;
- SIGINT / SIGTERM stop the replicas first (each drains: its /health turns 503, it takes
  requests for a few seconds more while the router notices, then finishes what it runs), and
  the router last, so nothing in flight is cut off.
More GPUs than replicas need are left idle; fewer make replicas share a GPU, each with its
part of --memory-ratio (they start one after another, since each sizes its KV cache by
what the GPU has free).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import logging
import os
import re
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import IO

from aserve.config import ServerConfig

logger = logging.getLogger("aserve.replicas")

# How the router watches the replicas: a dead one is out after about HEALTH_INTERVAL_S x
# HEALTH_FAILURES (a refused connection fails at once), a restarted one is back after one
# good answer. The router's circuit breaker, which takes a replica out after 10 failed
# requests (a killed replica's broken streams), lets requests try it again after the same
# time instead of its 60 s default: with that, a restarted replica sat idle for a minute
# while the router called it healthy. A replica told to stop keeps taking requests for
# DRAIN_DELAY_S, longer than the router needs to see its 503.
HEALTH_INTERVAL_S = 2
HEALTH_FAILURES = 2
HEALTH_TIMEOUT_S = 10  # a CPU replica's loop can be inside one long prefill step
DRAIN_DELAY_S = HEALTH_INTERVAL_S * (HEALTH_FAILURES + 1)
READY_TIMEOUT_S = 1800.0  # large checkpoints on slow disks
POLL_S = 0.5
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, most; doubled while a replica keeps crashing
ANSI_ESCAPE = re.compile(rb"\x1b\[[0-9;]*m")  # the router colours its log even into a pipe


class LaunchError(Exception):
    """Replicas or router could not start; the message is the one line the user sees."""


@dataclass(frozen=True)
class Placement:
    """Where one replica runs. `memory_ratio` overrides --memory-ratio for its first start
    on a shared GPU (the share of the GPU in use once its KV cache exists: the k-th of n
    replicas there takes k/n of it); `wave` orders starts on shared GPUs."""

    env: dict[str, str]
    cpus: tuple[int, ...] = ()
    memory_ratio: float | None = None
    wave: int = 0


def place_on_gpus(dp: int, tp: int, gpus: Sequence[str], memory_ratio: float) -> list[Placement]:
    """Replica i takes the GPU group i mod (GPUs // tp); a group several replicas share is
    split by memory and filled one replica after another."""
    groups = len(gpus) // tp
    if groups == 0:
        raise LaunchError(f"--tp {tp} needs {tp} GPUs for each replica; {len(gpus)} visible")
    placements = []
    for i in range(dp):
        group, wave = i % groups, i // groups
        sharing = len(range(group, dp, groups))
        devices = ",".join(gpus[group * tp : (group + 1) * tp])
        ratio = memory_ratio * (wave + 1) / sharing if sharing > 1 else None
        placements.append(Placement({"CUDA_VISIBLE_DEVICES": devices}, (), ratio, wave))
    return placements


def place_on_cpus(dp: int, cpus: Sequence[int]) -> list[Placement]:
    """Replica i gets its own slice of the cores, or all of them with one thread if there are
    fewer cores than replicas."""
    per = len(cpus) // dp
    placements = []
    for i in range(dp):
        mine = tuple(cpus[i * per : (i + 1) * per]) if per else tuple(cpus)
        threads = str(max(per, 1))
        placements.append(Placement({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}, mine))
    return placements


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def visible_gpus(device: str) -> list[str]:
    """The GPUs replicas may take (names as CUDA_VISIBLE_DEVICES gives them); none for CPU.
    Counted in a child process, so this one never loads torch or a CUDA context."""
    if device.startswith("cpu"):
        return []
    if device.startswith("cuda:"):
        raise LaunchError("--dp gives each replica its GPUs: use --device cuda or auto")
    probe = "import torch; print(torch.cuda.device_count())"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    count = int(done.stdout.strip() or 0) if done.returncode == 0 else 0
    if count == 0 and device == "cuda":
        raise LaunchError("--device cuda asked for, but torch sees no CUDA device")
    named = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return named[:count] if named else [str(i) for i in range(count)]


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port nothing listens on now, other than those in `avoid`: ports handed out for
    processes not yet started (the router's own, the replicas') are free until they bind,
    and the system may hand the same one out again (a router once failed to start so)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


def http_status(url: str, timeout_s: float = 2.0) -> int:
    """The status a GET of `url` gets, 0 if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return 0


def _linux_child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    """Runs in the child before exec: pin its cores, and ask for SIGTERM should this launcher
    die (even by SIGKILL), so no replica outlives it."""
    parent = os.getpid()

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return setup


class OutputPump:
    """Copies the children's output to ours, each line tagged with its child's name. One
    thread, driven by the supervising loop (a reader thread would make fork unsafe)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._partial: dict[int, bytes] = {}

    def add(self, stream: IO[bytes], tag: str) -> None:
        os.set_blocking(stream.fileno(), False)
        self._selector.register(stream, selectors.EVENT_READ, tag.encode() + b" | ")
        self._partial[stream.fileno()] = b""

    def pump(self, timeout_s: float) -> None:
        if not self._selector.get_map():
            time.sleep(timeout_s)
            return
        for key, _ in self._selector.select(timeout_s):
            fd, prefix = key.fd, key.data
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not data:  # the child is gone: what it left unterminated, then close
                self._selector.unregister(key.fileobj)
                self._emit(prefix, [self._partial.pop(fd)])
                key.fileobj.close()  # type: ignore[union-attr]
                continue
            *lines, self._partial[fd] = (self._partial[fd] + data).split(b"\n")
            self._emit(prefix, lines)

    def _emit(self, prefix: bytes, lines: list[bytes]) -> None:
        lines = [ANSI_ESCAPE.sub(b"", line) for line in lines if line]
        if lines:
            self._write(b"".join(prefix + line + b"\n" for line in lines))

    @staticmethod
    def _write(data: bytes) -> None:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            pass


@dataclass
class Child:
    """One process this launcher keeps running: a replica or the router."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()
    port: int = 0
    first_args: tuple[str, ...] = ()  # options of the first start only (a shared GPU's share)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    backoff_s: float = RESTART_BACKOFF_S[0]

    def start(self, pump: OutputPump, command: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(
            command or self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            start_new_session=True,  # a replica's tensor-parallel ranks go with its group
            preexec_fn=_linux_child_setup(self.cpus) if sys.platform == "linux" else None,
        )
        self.started_at = time.monotonic()
        self.restart_at = None
        assert self.proc.stdout is not None
        pump.add(self.proc.stdout, self.name)
        logger.info("started %s (pid %d)", self.name, self.proc.pid)

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def schedule_restart(self, now: float) -> float:
        """When to start it again: soon after a long run, later while it keeps crashing."""
        first, most = RESTART_BACKOFF_S
        ran_long = now - self.started_at > 60.0
        self.backoff_s = first if ran_long else min(self.backoff_s * 2, most)
        self.restart_at = now + self.backoff_s
        return self.backoff_s


class StopSignals:
    """SIGINT / SIGTERM counted instead of raised: the loops look at `count` between polls."""

    def __init__(self) -> None:
        self.count = 0

    def install(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        self.count += 1


def _connect_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url(host: str, port: int) -> str:
    host = _connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Launcher:
    def __init__(
        self,
        config: ServerConfig,
        args: argparse.Namespace,
        argv: list[str],
        signals: StopSignals | None = None,
    ) -> None:
        self.config = config
        self.args = args
        self.pump = OutputPump()
        self.signals = signals or StopSignals()
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.argv = argv

    def plan(self) -> list[list[Child]]:
        """The replicas, in waves: a wave starts once the one before it is ready."""
        dp, tp = self.args.dp_size, self.config.engine.tensor_parallel_size
        gpus = visible_gpus(self.config.engine.device)
        if gpus:
            placements = place_on_gpus(dp, tp, gpus, self.config.engine.memory_ratio)
            if len(gpus) < dp * tp:
                logger.info(
                    "%d replicas of %d GPUs each on %d GPUs: replicas share GPUs, each with its "
                    "part of --memory-ratio, started one after another",
                    dp,
                    tp,
                    len(gpus),
                )
        else:
            placements = place_on_cpus(dp, usable_cpus())
        waves: list[list[Child]] = [[] for _ in range(max(p.wave for p in placements) + 1)]
        for index, placement in enumerate(placements):
            port = self._unused_port()
            command = [
                *(sys.executable, "-m", "aserve", *self.argv),
                *("--dp", "1", "--host", "127.0.0.1", "--port", str(port)),
                *("--drain-delay", str(DRAIN_DELAY_S)),
            ]
            ratio = placement.memory_ratio
            first = () if ratio is None else ("--memory-ratio", f"{ratio:.4f}")
            replica = Child(f"replica{index}", command, placement.env, placement.cpus, port, first)
            self.replicas.append(replica)
            waves[placement.wave].append(replica)
            where = placement.env.get("CUDA_VISIBLE_DEVICES")
            cores = f"cores {list(placement.cpus)}" if placement.cpus else "all cores"
            logger.info(
                "replica %d: http://127.0.0.1:%d on %s",
                index,
                port,
                f"GPU {where}" if where is not None else cores,
            )
        return waves

    def replica_url(self, replica: Child) -> str:
        return f"http://127.0.0.1:{replica.port}"

    def _unused_port(self) -> int:
        """A free port that is neither the router's nor a replica's already."""
        return free_port(avoid={self.config.port, *(r.port for r in self.replicas)})

    def router_command(self) -> list[str]:
        urls = [self.replica_url(r) for r in self.replicas]
        return [
            *(sys.executable, "-m", "sglang_router.launch_router"),
            *("--host", self.config.host, "--port", str(self.config.port)),
            *("--worker-urls", *urls, "--policy", self.args.router_policy),
            *("--health-check-interval-secs", str(HEALTH_INTERVAL_S)),
            *("--health-failure-threshold", str(HEALTH_FAILURES)),
            *("--health-success-threshold", "1"),
            *("--health-check-timeout-secs", str(HEALTH_TIMEOUT_S)),
            *("--cb-timeout-duration-secs", str(HEALTH_INTERVAL_S * HEALTH_FAILURES)),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(self._unused_port())),
            *("--shutdown-grace-period-secs", "10", "--log-level", "warn"),
            *shlex.split(self.args.router_args),
        ]

    def wait_until(self, ready: Callable[[], bool], children: list[Child], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            if self.signals.count:
                raise LaunchError(f"stopped by a signal while waiting for {what}")
            for child in children:
                if child.exited:
                    assert child.proc is not None
                    raise LaunchError(
                        f"{child.name} exited with code {child.proc.returncode} before it was "
                        "ready (its output is above)"
                    )
            if time.monotonic() > deadline:
                raise LaunchError(f"{what} not ready within {READY_TIMEOUT_S:.0f} s")
            self.pump.pump(POLL_S)

    def start(self) -> None:
        for wave in self.plan():
            for replica in wave:
                replica.start(self.pump, [*replica.command, *replica.first_args])
            self.wait_until(
                lambda wave=wave: all(
                    http_status(self.replica_url(r) + "/health") == 200 for r in wave
                ),
                wave,
                "the replicas",
            )
        self.router = Child("router", self.router_command())
        self.router.start(self.pump)
        router_url = _url(self.config.host, self.config.port)
        self.wait_until(
            lambda: http_status(router_url + "/readiness") == 200, [self.router], "the router"
        )
        logger.info(
            "ready: %d replicas behind SGLang's router (%s) on %s",
            len(self.replicas),
            self.args.router_policy,
            router_url,
        )

    def supervise(self) -> None:
        """Until a signal: start again whatever exits (the router too)."""
        assert self.router is not None
        while not self.signals.count:
            self.pump.pump(POLL_S)
            now = time.monotonic()
            for child in [*self.replicas, self.router]:
                if child.exited and child.restart_at is None:
                    assert child.proc is not None
                    delay = child.schedule_restart(now)
                    logger.warning(
                        "%s (pid %d) exited with code %d; starting it again in %.0f s",
                        child.name,
                        child.proc.pid,
                        child.proc.returncode,
                        delay,
                    )
                elif child.restart_at is not None and now >= child.restart_at:
                    child.start(self.pump)

    def stop(self) -> None:
        """Replicas drain first, under the router; then the router goes. A second signal
        (or a replica past its drain) is killed."""
        drain = DRAIN_DELAY_S + self.args.drain_timeout + 15.0
        first_signals = self.signals.count
        for replica in self.replicas:
            replica.signal_group(signal.SIGTERM)
        self._wait_for(self.replicas, drain, first_signals)
        if self.router is not None:
            self.router.signal_group(signal.SIGTERM)
            self._wait_for([self.router], 15.0, self.signals.count)

    def _wait_for(self, children: list[Child], timeout_s: float, signals_before: int) -> None:
        deadline = time.monotonic() + timeout_s
        running = [c for c in children if c.proc is not None]
        while any(c.proc.poll() is None for c in running):  # type: ignore[union-attr]
            if time.monotonic() > deadline or self.signals.count > signals_before:
                for child in running:
                    child.signal_group(signal.SIGKILL)
            self.pump.pump(0.1)
        self.pump.pump(0.0)


def run_replicas(config: ServerConfig, args: argparse.Namespace, argv: list[str]) -> int:
    if importlib.util.find_spec("sglang_router") is None:
        print(
            "aserve: error: --dp runs the replicas behind SGLang's router, which is not "
            'installed: pip install "aserve[router]"',
            file=sys.stderr,
        )
        return 2
    launcher = Launcher(config, args, argv, StopSignals().install())
    failure = None
    try:
        launcher.start()
        launcher.supervise()
    except LaunchError as error:
        failure = None if launcher.signals.count else str(error)
    finally:
        logger.info("stopping: replicas drain first, then the router")
        launcher.stop()
        logger.info("stopped")
    if failure is not None:
        print(f"aserve: error: {failure}", file=sys.stderr)
        return 1
    return 0
