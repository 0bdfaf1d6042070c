"""Rank 0's side of tensor parallelism: start ranks 1..N-1, send them each step, watch them,
stop them.

Start-up: rank 0 opens a rendezvous store on a port the OS picks, spawns one worker process
per extra rank (daemonic, so none outlives the server), waits until each has reached the
store, then every rank joins the group and builds its Engine; rank 0 finally waits for every
worker's ready message. A worker that dies meanwhile ends start-up with a one-line error.

Steps go down one pipe per worker as a packed `StepSpec` (a few hundred bytes; cheaper than a
gloo broadcast, and a pipe needs no timeout while the server idles). A watcher thread waits
on the workers' process sentinels and reports a death through `on_failure` at once, so a
crash never turns into a hang; `close()` sends the stop message, joins the workers and
terminates any that do not exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from aserve.config import ConfigError, EngineConfig, ModelConfig
from aserve.distributed.group import TPGroup, create_store, join_group
from aserve.engine.engine import Engine, resolve_device
from aserve.engine.step import StepSpec
from aserve.engine.worker import READY, WorkerArgs, run_worker
from aserve.replicas import usable_cpus

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or a step failed part-way: the ranks are no longer in
    lockstep and the engine cannot run another step."""


class Followers:
    """The processes of ranks 1..N-1 and the pipes that carry each step to them."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: Path | None,
        timeout_s: float = GROUP_TIMEOUT_S,
    ) -> None:
        size = config.tensor_parallel_size
        device = resolve_device(config.device)
        self.on_failure: Callable[[WorkerFailure], None] | None = None
        self.failure: WorkerFailure | None = None
        self._closing = False
        self.group = TPGroup()
        self._timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        self._store = create_store(size, timeout)
        self._threads_before = torch.get_num_threads()
        threads = 1 if device.type == "cuda" else max(1, len(usable_cpus()) // size)
        if device.type != "cuda":
            torch.set_num_threads(threads)
        context = torch.multiprocessing.get_context("spawn")
        self.processes: list[Any] = []
        self.pipes: list[Connection] = []
        for rank in range(1, size):
            args = WorkerArgs(
                rank=rank,
                size=size,
                port=self._store.port,
                timeout_s=timeout_s,
                config=replace(config, device=device.type),  # where rank 0 runs
                model_config=model_config,
                model_dir=model_dir,
                log_level=logging.getLogger("aserve").getEffectiveLevel(),
                num_threads=threads,
            )
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_worker, args=(args, theirs), name=f"aserve-tp{rank}", daemon=True
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        try:
            joined = [f"joining/{r}" for r in range(1, size)]
            self._wait_for(lambda: self._store.check(joined), "reach the rendezvous")
            self.group = join_group(
                self._store, 0, size, device, timeout, one_shot=not config.disable_pynccl
            )
        except BaseException:
            self.close()
            raise

    def _describe_death(self) -> WorkerFailure | None:
        for rank, process in enumerate(self.processes, start=1):
            code = process.exitcode
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return WorkerFailure(f"tensor-parallel rank {rank} (pid {process.pid}) {how}")
        return None

    def _wait_for(self, done: Callable[[], bool], what: str) -> None:
        """Poll `done` while every worker lives; a dead worker or the start-up timeout
        raises WorkerFailure."""
        deadline = time.monotonic() + self._timeout_s
        while not done():
            failure = self._describe_death()
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                raise WorkerFailure(
                    f"tensor-parallel workers did not {what} in {self._timeout_s:.0f} s"
                )
            time.sleep(POLL_S)

    def wait_ready(self) -> None:
        """After rank 0 built its engine: wait for every worker's, then start watching."""
        for pipe in self.pipes:
            self._wait_for(pipe.poll, "build their engines")
            if pipe.recv_bytes() != READY:
                raise WorkerFailure("a tensor-parallel worker sent an unexpected message")
        threading.Thread(target=self._watch, name="aserve-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        wait([p.sentinel for p in self.processes])
        if self._closing:
            return
        self.failure = self.dead_rank()
        if self.failure is None:
            return
        logger.error("%s", self.failure)
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def send(self, spec: StepSpec) -> None:
        """Hand one step to every worker (before rank 0 runs it itself)."""
        if self.failure is not None:
            raise self.failure
        message = spec.pack()
        for pipe in self.pipes:
            pipe.send_bytes(message)

    def dead_rank(self, grace_s: float = 2.0) -> WorkerFailure | None:
        """The failure of a rank that died, waiting up to `grace_s` for its exit to show (it
        can trail the broken pipe or collective that revealed it by a moment)."""
        deadline = time.monotonic() + grace_s
        while (failure := self._describe_death()) is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return failure

    def explain(self, error: BaseException) -> WorkerFailure:
        """What to report when a launched step raised: once any rank may have run part of
        the step, the ranks' collectives no longer line up, so the engine is done."""
        return self.dead_rank() or WorkerFailure(
            f"a tensor-parallel step failed part-way and the ranks left lockstep: {error!r}"
        )

    def close(self) -> None:
        """Stop every worker: the stop message, then terminate those that do not exit."""
        if self._closing:
            return
        self._closing = True
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send_bytes(b"")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        self.group.close()
        torch.set_num_threads(self._threads_before)


def check_shardable(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse a `--tp` that the model's shapes or the machine's GPUs cannot take."""
    size = config.tensor_parallel_size
    uneven = [
        name
        for name, count in (
            ("attention heads", model.num_heads),
            ("intermediate size", model.intermediate_size),
        )
        if count % size
    ]
    if model.num_kv_heads % size and size % model.num_kv_heads:
        uneven.append("KV heads")
    if uneven:
        raise ConfigError(f"--tp {size} does not evenly split the model's {', '.join(uneven)}")
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is not None:
        raise ConfigError(
            f"with --tp, rank r runs on GPU r: choose the GPUs with CUDA_VISIBLE_DEVICES, "
            f"not --device {config.device}"
        )
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(f"--tp {size} needs {size} GPUs; torch sees {torch.cuda.device_count()}")


def start_engine(
    config: EngineConfig, model_config: ModelConfig, model_dir: Path | None
) -> tuple[Engine, Followers | None]:
    """Rank 0's engine, and with `--tp` above 1 the running workers of the other ranks."""
    if config.tensor_parallel_size == 1:
        return Engine(config, model_config, model_dir), None
    check_shardable(config, model_config)
    followers = Followers(config, model_config, model_dir)
    try:
        engine = Engine(config, model_config, model_dir, followers.group)
        followers.wait_ready()
    except BaseException as error:
        own = isinstance(error, (ConfigError, MemoryError, WorkerFailure))
        failure = None if own else followers.dead_rank()
        followers.close()
        if failure is None:
            raise
        raise failure from error
    engine.page_table.record_writes()
    return engine, followers
