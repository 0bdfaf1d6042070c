"""The tensor-parallel group that layers reduce and gather over.

At world size 1 every collective is the identity, so the same layers run unsharded on a
laptop. Larger groups hold two torch.distributed backends of their own, built from a TCP
store rather than through `init_process_group`: torch's default group is process-wide state,
and owning the groups lets a process open and close engines one after another (tests, the
offline LLM) without touching a user's own torch.distributed setup.

- the device group runs the model's collectives: NCCL on CUDA, gloo on CPU;
- the host group (always gloo) agrees on host-side numbers, such as the KV pool size;
- on GPUs that reach each other's memory, small all-reduces take a one-shot kernel over
  symmetric memory instead of NCCL (`one_shot.py`), unless `--disable-pynccl` says not to.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch

from aserve.distributed.fused_norm import AllReduceAddNorm
from aserve.distributed.one_shot import OneShotAllReduce, can_use_one_shot

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = field(default=None, compare=False, repr=False)
    host_group: Any = field(default=None, compare=False, repr=False)
    one_shot: OneShotAllReduce | None = field(default=None, compare=False, repr=False)
    add_norm: AllReduceAddNorm | None = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks: a new tensor from the one-shot path, else `x` summed in place."""
        if self.size == 1:
            return x
        if self.one_shot is not None:
            summed = self.one_shot.all_reduce(x)
            if summed is not None:
                return summed
        self.device_group.allreduce([x]).wait()
        return x

    def all_reduce_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`residual += sum of x over ranks`, then RMSNorm, in one kernel (fused_norm.py):
        (normalised, residual), or None where that kernel does not apply."""
        if self.add_norm is None:
            return None
        return self.add_norm(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (a device tensor: NCCL on CUDA)."""
        if self.size == 1:
            return x
        self.device_group.broadcast([x], _broadcast_options()).wait()
        return x

    def agree_min(self, value: int) -> int:
        """The smallest `value` of all ranks (e.g. the KV pages that fit on every GPU)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        tensor = torch.tensor([value], dtype=torch.int64)
        self.host_group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def close(self) -> None:
        """Release the backends by aborting them, which never waits on a peer that may be
        gone (a graceful NCCL shutdown could wait on a dead rank). Seen on two H200s: an
        NCCL abort after CUDA graphs had captured its collectives did not return, so each
        abort gets ABORT_TIMEOUT_S on a daemon thread and is otherwise left to process exit."""
        if self.one_shot is not None:
            self.one_shot.close()
        for group in (self.device_group, self.host_group):
            release = getattr(group, "abort", None)
            if release is None:
                continue
            aborting = threading.Thread(target=release, name="tp-abort", daemon=True)
            aborting.start()
            aborting.join(ABORT_TIMEOUT_S)
            if aborting.is_alive():
                logger.warning(
                    "a tensor-parallel process group did not close in %d s; it goes with the "
                    "process",
                    ABORT_TIMEOUT_S,
                )

    def shard(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of a dimension of size `total` that divides evenly."""
        if total % self.size:
            raise ValueError(f"size {total} does not split over {self.size} ranks")
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part


def _broadcast_options() -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def create_store(size: int, timeout: timedelta) -> Any:
    """Rank 0's rendezvous store on a port the OS picks, so a busy port never stops start-up;
    `store.port` is the port to hand to the other ranks."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
    )


def connect_store(port: int, size: int, timeout: timedelta) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)


def join_group(
    store: Any,
    rank: int,
    size: int,
    device: torch.device,
    timeout: timedelta,
    one_shot: bool = True,
) -> TPGroup:
    """Build this rank's backends; blocks until every rank has called it (or `timeout`).
    `one_shot` False keeps every device collective on NCCL (`--disable-pynccl`)."""
    import torch.distributed as dist

    host = dist.ProcessGroupGloo(dist.PrefixStore("host", store), rank, size, timeout=timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        prefix = dist.PrefixStore("device", store)
        device_group = dist.ProcessGroupNCCL(prefix, rank, size, options)
    else:
        prefix = dist.PrefixStore("device", store)
        device_group = dist.ProcessGroupGloo(prefix, rank, size, timeout=timeout)
    group = TPGroup(rank, size, device_group, host)
    if one_shot and group.agree_min(int(can_use_one_shot(size, device))):
        group = _with_one_shot(group, store, device)
    return group


def _with_one_shot(group: TPGroup, store: Any, device: torch.device) -> TPGroup:
    """`group` with the one-shot all-reduce if every rank opens it and it sums a test tensor
    as NCCL does, else `group` as it was. Every rank makes the same collective calls whatever
    happens on it (agree on opening, probe, agree on the probe), so no rank is left waiting."""
    fast: OneShotAllReduce | None = None
    try:
        fast = OneShotAllReduce.open(store, group.device_group, group.rank, group.size, device)
    except Exception as error:  # any failure here means: stay on NCCL
        logger.warning("the one-shot all-reduce is unavailable (%s); using NCCL", error)
    if not group.agree_min(int(fast is not None)) or fast is None:
        return _without(fast, group)
    try:
        probe = torch.arange(4096, dtype=torch.bfloat16, device=device) * (group.rank + 1)
        summed = fast.all_reduce(probe)
        works = summed is not None and torch.equal(summed, group.all_reduce(probe.clone()))
    except Exception as error:
        logger.warning("the one-shot all-reduce failed its check (%s); using NCCL", error)
        works = False
    if not group.agree_min(int(works)):
        return _without(fast, group)
    logger.info(
        "tensor-parallel all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above",
        fast.max_bytes // 1024,
    )
    return _with_add_norm(replace(group, one_shot=fast), fast)


def _with_add_norm(group: TPGroup, fast: OneShotAllReduce) -> TPGroup:
    """`group` with the fused all-reduce + add + RMSNorm if every rank opens it and it
    matches the separate steps on a test input, else `group` as it was (collective calls in
    the same order on every rank, as `_with_one_shot`)."""
    fused: AllReduceAddNorm | None = None
    logger.info("loading the fused all-reduce + RMSNorm kernel (a first start compiles it)")
    try:
        fused = fast.open_add_norm()
        torch.cuda.synchronize()  # every rank's markers are written before any rank sends
    except Exception as error:  # FlashInfer missing or its kernel not built for this GPU
        logger.info("the fused all-reduce + RMSNorm is unavailable (%s)", error)
    if not group.agree_min(int(fused is not None)) or fused is None:
        return group
    try:
        works = _add_norm_matches(group, fused, fast.buffer.device)
    except Exception as error:
        logger.warning("the fused all-reduce + RMSNorm failed its check (%s)", error)
        works = False
    if not group.agree_min(int(works)):
        return group
    logger.info(
        "tensor-parallel add + RMSNorm: fused with the all-reduce up to %d KiB",
        fused.max_bytes // 1024,
    )
    return replace(group, add_norm=fused)


def _add_norm_matches(group: TPGroup, fused: AllReduceAddNorm, device: torch.device) -> bool:
    """One fused call against the sum, add and norm done one by one in float32."""
    shape = (3, 1024)
    base = (torch.arange(3 * 1024, device=device).view(shape) % 7 - 3).float()
    residual = (torch.arange(3 * 1024, device=device).view(shape) % 5).float()
    weight = torch.linspace(0.5, 1.5, 1024, device=device)
    expected = residual + base * (group.size * (group.size + 1) // 2)
    normed = expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    half = torch.bfloat16
    x = base * (group.rank + 1)
    out = fused(x.to(half), residual.to(half), weight.to(half), 1e-6)
    if out is None:
        return False
    close = torch.allclose(out[1].float(), expected, rtol=0.01, atol=0.01)
    return close and torch.allclose(out[0].float(), normed, rtol=0.02, atol=0.02)


def _without(fast: OneShotAllReduce | None, group: TPGroup) -> TPGroup:
    if fast is not None:
        fast.close()
    logger.info("tensor-parallel all-reduce: NCCL")
    return group
