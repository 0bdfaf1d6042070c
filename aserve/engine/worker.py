"""The loop a tensor-parallel rank > 0 runs around its own Engine.

A worker is a spawned process. It joins the group, builds the same Engine as rank 0 (same
model class, its weight shards, its own KV pool and page table; warm-up, the KV-size
agreement and CUDA-graph capture run in lockstep with rank 0 because they run collectives),
then follows: for every step rank 0 sends a packed `StepSpec` down a pipe; the worker
replays the page-table writes, builds the same ForwardBatch, runs the forward (taking part
in every all-reduce and all-gather), receives the sampled ids that rank 0 broadcasts and
writes them into its token table. An empty message means stop. A pipe that closes (rank 0
died) ends the worker too, so no worker outlives the server.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from aserve.config import EngineConfig, ModelConfig
from aserve.distributed.group import connect_store, join_group
from aserve.engine.engine import Engine, resolve_device
from aserve.engine.step import StepSpec, forward_batch

logger = logging.getLogger(__name__)

READY = b"ready"


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker needs, picklable: it crosses the spawn boundary."""

    rank: int
    size: int
    port: int
    timeout_s: float
    config: EngineConfig
    model_config: ModelConfig
    model_dir: Path | None
    log_level: int
    num_threads: int


def run_worker(args: WorkerArgs, conn: Connection) -> None:
    """Spawn target: set up, build the engine, report ready, follow until told to stop.
    A follower has nothing to flush, so it leaves with os._exit: on two H200s, NCCL's
    teardown at interpreter exit did not return once CUDA graphs had captured collectives."""
    threading.Thread(target=_exit_with_parent, name="aserve-tp-parent", daemon=True).start()
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s"
    )
    torch.set_num_threads(args.num_threads)
    device = resolve_device(args.config.device)
    if device.type == "cuda":
        torch.cuda.set_device(args.rank)
    timeout = timedelta(seconds=args.timeout_s)
    store = connect_store(args.port, args.size, timeout)
    store.set(f"joining/{args.rank}", "1")
    group = join_group(
        store, args.rank, args.size, device, timeout, one_shot=not args.config.disable_pynccl
    )
    engine = Engine(args.config, args.model_config, args.model_dir, group)
    conn.send_bytes(READY)
    try:
        follow(engine, conn)
    except EOFError:
        logger.error(
            "rank 0 went away; tensor-parallel worker %d (pid %d) exits", args.rank, os.getpid()
        )
    logging.shutdown()
    os._exit(0)


def _exit_with_parent() -> None:
    """Rank 0 died (even by SIGKILL, which spares daemonic children): exit at once, in
    whatever phase this worker is, rather than wait on a rendezvous or collective."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(1)


@torch.inference_mode()
def follow(engine: Engine, conn: Connection) -> None:
    """Run every step rank 0 sends until the empty stop message."""
    while message := conn.recv_bytes():
        spec = StepSpec.unpack(message)
        for write in spec.page_writes:
            engine.page_table.write_pages(*write)
        batch = forward_batch(spec, engine.page_table, engine.device)
        engine.forward(batch)
        next_ids = torch.empty(batch.batch_size, dtype=torch.int64, device=engine.device)
        engine.record_tokens(batch, engine.tp.broadcast(next_ids))
