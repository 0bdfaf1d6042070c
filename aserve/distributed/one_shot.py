"""A one-shot all-reduce over NVLink for small tensors, through torch symmetric memory.

Each rank owns a buffer that every other rank of the host has mapped (torch's symmetric
memory). One kernel copies a rank's input into its buffer, waits at a barrier for every
rank to have done the same, and sums all buffers in place of the input's copy. A decode
step's all-reduce is a few kilobytes a layer; NCCL's ring spends more time on its steps
than on the bytes (bench/all_reduce.py measures both). Larger tensors (prefill) go to NCCL.
`--disable-pynccl` keeps every collective on NCCL.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from aserve.distributed.fused_norm import AllReduceAddNorm, workspace_bytes

logger = logging.getLogger(__name__)

MAX_BYTES = 2 * 1024 * 1024
"""The largest input taken here; bigger ones go to NCCL. On two H200s (bench/all_reduce.py,
bf16, in a CUDA graph) the one-shot kernel took 6.6 against NCCL's 22.8 us at 8 KiB and
21.6 against 33.4 us at 2 MiB, which covers a decode step of 256 requests of the 8B shape."""

_opened_in_this_process = False
"""torch's symmetric-memory rendezvous numbers its exchanges per process: a process that
opened the path once (rank 0 of an earlier engine) and fresh worker processes disagree on
the numbers, and a second rendezvous hangs (seen on two H200s). A server opens one engine,
so only a second engine in one process (tests, a re-created offline LLM) stays on NCCL."""


def opened_in_this_process() -> bool:
    return _opened_in_this_process


class OneShotAllReduce:
    def __init__(
        self, group_name: str, buffer: torch.Tensor, addresses: list[int], rank: int, max_bytes: int
    ) -> None:
        self.group_name = group_name
        self.buffer = buffer  # the one-shot staging area, then fused_norm.py's workspace
        self.addresses = addresses  # where each rank's buffer is mapped in this process
        self.rank = rank
        self.max_bytes = max_bytes

    @classmethod
    def open(
        cls,
        store: Any,
        device_group: Any,
        rank: int,
        size: int,
        device: torch.device,
        max_bytes: int = MAX_BYTES,
    ) -> OneShotAllReduce:
        """Allocate and map every rank's buffer; a collective call (every rank, same
        arguments). Symmetric memory finds its group by name in torch's process-group
        registry, so the NCCL backend `device_group` is registered there under a name taken
        from the rendezvous `store`'s port (the same on every rank, unique on the host)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

        global _opened_in_this_process
        _opened_in_this_process = True
        group_name = f"aserve-tp-{store.port}"
        prefix = dist.PrefixStore("one-shot", store)
        group = dist.ProcessGroup(prefix, rank, size)
        nccl = dist.ProcessGroup.BackendType.NCCL
        group._set_default_backend(nccl)
        group._register_backend(device, nccl, device_group)
        group._set_group_name(group_name)
        _register_process_group(group_name, group)
        _SymmetricMemory.set_group_info(group_name, rank, size, prefix)
        total = max_bytes + workspace_bytes(size, max_bytes)
        buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group_name)
        return cls(group_name, buffer, list(handle.buffer_ptrs), rank, max_bytes)

    def open_add_norm(self) -> AllReduceAddNorm:
        """The fused all-reduce + add + RMSNorm over the rest of the buffer (fused_norm.py)."""
        regions = [address + self.max_bytes for address in self.addresses]
        local = self.buffer[self.max_bytes :]
        return AllReduceAddNorm.open(regions, local, self.rank, self.max_bytes)

    def close(self) -> None:
        """Drop the registry entry `open` made (the buffer goes with this object)."""
        from torch._C._distributed_c10d import _unregister_process_group

        _unregister_process_group(self.group_name)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of `x` over ranks as a new tensor, or None when `x` is too large or not
        contiguous for this path. Every rank must call it with the same shape."""
        nbytes = x.numel() * x.element_size()
        # the kernel moves 16-byte vectors
        if nbytes > self.max_bytes or nbytes % 16 or not x.is_contiguous():
            return None
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)
        return out


def can_use_one_shot(size: int, device: torch.device) -> bool:
    """Every pair of this host's GPUs in the group reaches the other's memory directly, and
    this process has not opened the path before."""
    if device.type != "cuda" or size < 2 or torch.cuda.device_count() < size:
        return False
    if _opened_in_this_process:
        logger.info("an earlier engine in this process used the one-shot all-reduce: NCCL now")
        return False
    return all(
        torch.cuda.can_device_access_peer(a, b) for a in range(size) for b in range(size) if a != b
    )
