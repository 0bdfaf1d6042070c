"""All-reduce, residual add and RMSNorm in one kernel, for decode-sized batches under TP.

A row-parallel projection (attention's output, the MLP's down projection) leaves partial sums
that the next RMSNorm needs summed: unfused, that is an all-reduce kernel and then the fused
add+RMSNorm, two launches twice a layer. FlashInfer's port of TensorRT-LLM's fused
all-reduce does all three in one kernel, without a barrier round trip: each rank writes its
partial sums straight into every peer's buffer, and a reader knows a value has landed
because the buffer held -0.0 until then (writers send +0.0 instead of -0.0). Three such
buffers rotate, so one is cleared while another fills ("Lamport" buffers).

Its workspace lives in the symmetric memory that one_shot.py maps on every rank; this module
lays FlashInfer's pointer table over it. Only 16-bit models use it (the -0.0 marker is set
for 16-bit values) and only inputs up to `max_bytes`: larger ones (prefill) keep the
separate all-reduce and norm.
"""

from __future__ import annotations

from typing import Any

import torch

BARRIER_FLAGS = 256
"""FlashInfer's flag slots per rank for its two-shot variant (part of the workspace layout)."""

ALIGN = 2 * 1024 * 1024

NEGATIVE_ZERO_16 = -32768
"""0x8000 as int16: -0.0 in both float16 and bfloat16, the marker of an empty slot."""

RESIDUAL_RMS_NORM = 1
"""FlashInfer's `AllReduceFusionPattern.kARResidualRMSNorm`."""

WORLD_SIZES = (2, 4, 8)


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _regions(size: int, max_bytes: int) -> tuple[int, int, int, int]:
    """Offsets of the data, flag and Lamport regions, and the workspace's total bytes, laid
    out as FlashInfer's own workspace: a data buffer of `size * max_bytes`, barrier flags,
    then three Lamport buffers of `size * max_bytes` each."""
    comm = size * max_bytes
    flags = _align(comm)
    lamport = flags + _align(size * BARRIER_FLAGS * 4)
    return 0, flags, lamport, lamport + _align(3 * comm)


def workspace_bytes(size: int, max_bytes: int) -> int:
    return _regions(size, max_bytes)[3]


class AllReduceAddNorm:
    def __init__(
        self,
        kernels: Any,
        table: torch.Tensor,
        state: torch.Tensor,
        rank: int,
        size: int,
        max_bytes: int,
    ) -> None:
        self.kernels = kernels
        self.table = table  # pointers: data, flags, Lamport (one per rank each), then `state`
        self.state = state  # this rank's counters for the rotation; kept alive with the table
        self.rank = rank
        self.size = size
        self.max_bytes = max_bytes

    @classmethod
    def open(
        cls, region_addresses: list[int], local: torch.Tensor, rank: int, max_bytes: int
    ) -> AllReduceAddNorm:
        """Prepare this rank's part: `local` is its uint8 region of `workspace_bytes`, at
        address `region_addresses[rank]`; the others are the peers' regions, mapped here.
        Every rank must finish this before any rank calls the kernel (a later write of the
        -0.0 markers would erase a peer's data): the caller synchronises and agrees first."""
        from flashinfer.jit.comm import gen_trtllm_comm_module

        size = len(region_addresses)
        if size not in WORLD_SIZES:
            raise ValueError(f"the fused all-reduce takes {WORLD_SIZES} ranks, not {size}")
        kernels = gen_trtllm_comm_module().build_and_load()
        data, flags, lamport, end = _regions(size, max_bytes)
        local[flags:lamport].zero_()
        local[lamport:end].view(torch.int16).fill_(NEGATIVE_ZERO_16)
        # read counter, two-shot flag, Lamport flag, bytes per Lamport buffer, bytes to clear
        state = torch.tensor([0, 0, 0, size * max_bytes, 0], dtype=torch.int32, device=local.device)
        pointers = [base + offset for offset in (data, flags, lamport) for base in region_addresses]
        table = torch.tensor([*pointers, state.data_ptr()], dtype=torch.int64, device=local.device)
        return cls(kernels, table, state, rank, size, max_bytes)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`residual += sum of x over ranks`, then RMSNorm of it: (normalised, residual), the
        residual updated in place. None when `x` is not for this path (the caller then
        reduces and normalises separately); every rank must call it with the same shape."""
        tokens, hidden = x.shape
        if (
            x.dtype not in (torch.float16, torch.bfloat16)
            or x.numel() * x.element_size() > self.max_bytes
            or hidden % 8  # the kernel moves 16-byte vectors, one token a thread cluster
            or not (x.is_contiguous() and residual.is_contiguous())
        ):
            return None
        normed = torch.empty_like(x)
        self.kernels.trtllm_allreduce_fusion(
            x,
            self.size,
            self.rank,
            tokens,
            hidden,
            self.table,
            False,  # launch with programmatic dependent launch
            True,  # one-shot (Lamport); the two-shot variant is for large inputs
            False,  # trigger completion at the end (only matters with PDL)
            True,  # accumulate in float32
            RESIDUAL_RMS_NORM,
            None,  # all-reduce output: not needed, the residual holds the sum
            residual,
            residual,
            normed,
            None,  # quantised output
            None,  # quantisation scales
            weight,
            eps,
            None,  # quantisation scale factor
            None,  # scale-factor layout
        )
        return normed, residual
