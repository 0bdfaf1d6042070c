"""Programmatic dependent launch (PDL) of aserve's Triton kernels on Hopper and newer GPUs.

A decode step is a chain of a few hundred kernels, each needing the one before it: the GPU
lets a kernel drain before it launches the next, about a microsecond of ramp and tail at
each link. Launched with PDL, a kernel starts while the one before it still runs and waits
(`griddepcontrol.wait`) until that one has finished and its writes are visible, so its
launch and start overlap the other's tail. Such a kernel must call `wait_for_previous` before
it reads or writes any memory that another kernel touches. What only the host writes (the
weights; a step's positions, slots and attention page layout, copied in before its kernels)
it may read first, off the chain of dependent loads. A kernel
launched without PDL (cuBLAS's, FlashInfer's, PyTorch's) waits for the one before it as
usual, so the two kinds mix safely in a stream and in a CUDA graph.

A kernel that calls `wait_only` and `launch_next` in place of `wait_for_previous` lets the
next one launch only once each of its programs reaches `launch_next`. That matters after a
large product followed by another: the next kernel's programs, launched early, take the room
each SM has left beside the running ones, and (as far as measured) an uneven share of them
makes the second product's tail long (the FP8 gate|up product that ends with SiLU,
quant/fp8_cuda.py).

Only launches over a few rows take it (`PDL_MAX_ROWS`). On the H200 a single 8B FP8 stream
decoded in 2.85 ms/token with every kernel launched so, against 2.97 without; but the
offline workload of Qwen3-0.6B with an FP8 cache, whose steps are mostly large batches' decode
attention, lost 2.3% (34,082 -> 33,297 tok/s, three runs each alternating) and the 8B's did
not move. Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from aserve.engine.gpu import gpu_capability


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability 9.0 or newer
    (as `gpu_capability` gives it, so a GPU pretending to be older has none)."""
    capability = gpu_capability(device)
    return capability is not None and capability >= (9, 0)


PDL_MAX_ROWS = 16
"""Launches over up to this many rows (tokens, requests) take PDL."""


def pdl_options(device: torch.device, rows: int) -> dict[str, bool]:
    """A launch's options for a kernel that calls `wait_for_previous`, over `rows` rows: the
    kernel's `PDL` and Triton's `launch_pdl`."""
    on = rows <= PDL_MAX_ROWS and pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """With PDL, wait for the kernel before this one, then let the next one launch; with
    `EARLY`, let it launch first. A one-row norm (and then the attention merge kernel), which
    reads little memory, so launches the GEMV after it (which loads weights before its own
    wait) while the kernel before the norm still runs: a single 8B FP8 stream 2.536 -> 2.523
    ms/token (H200, alternating; bf16 4.001 -> 3.998). The next kernel's wait still waits
    for this one to end, and this one for the one before."""
    if PDL:
        if EARLY:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()


@triton.jit
def wait_only(PDL: tl.constexpr):
    """With PDL, wait for the kernel before this one; the next one launches when this
    kernel calls `launch_next` (or ends)."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_next(PDL: tl.constexpr):
    """With PDL, let the next kernel launch (after `wait_only`)."""
    if PDL:
        gdc_launch_dependents()
