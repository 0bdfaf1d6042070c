"""CPU kernel weights on transparent huge pages.

A one-row decode step streams every weight once, and on 4 KB pages that stream needs a new
address translation every 4 KB: ~170,000 a step of a 1B Q4_K_M file, each a page walk the
TLB cannot hide. On 2 MB pages it needs ~340. Linux gives a process huge pages for memory it
advises (`MADV_HUGEPAGE`) where transparent huge pages are "madvise" (the common default) or
"always", at the memory's first touch. So the weights are copied, once at load, into large
fresh blocks advised before anything is written to them: the one-row products of that 1B
file's weights took 0.91-0.92x the time on a 2-core AMD EPYC (bench/NOTES.md). Where the system
gives no huge pages (THP "never", another OS) the blocks are plain memory and nothing else
changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
BLOCK_BYTES = 64 << 20
"""A block's size, unless a tensor needs more: few blocks, so few partly used huge pages."""
MADV_HUGEPAGE = 14  # Linux's value on every architecture


def advise_huge_pages(memory: torch.Tensor) -> None:
    """Ask Linux for huge pages under `memory` (before its first touch, for them to be
    given then); elsewhere, or where the call fails, nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise(memory.data_ptr(), memory.nbytes, MADV_HUGEPAGE)


class WeightBlocks:
    """Weight tensors copied one after another into blocks of memory that start on a huge
    page and are advised for huge pages before they are written."""

    def __init__(self) -> None:
        self.block = torch.empty(0, dtype=torch.uint8)
        self.used = 0

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in the blocks (the same shape, dtype and values); empty,
        non-contiguous or non-CPU tensors as they are."""
        if tensor.device.type != "cpu" or not tensor.numel() or not tensor.is_contiguous():
            return tensor
        nbytes = tensor.nbytes
        if self.used + nbytes > self.block.numel():
            self.block = _advised_block(max(BLOCK_BYTES, nbytes))
            self.used = 0
        start = self.used
        self.used = -(-(start + nbytes) // 64) * 64  # the next tensor on a cache line
        copy = self.block[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        return copy


def _advised_block(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh memory (rounded up to huge pages) from a huge page boundary, advised
    for huge pages. The tensors placed in it keep it alive."""
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    raw = torch.empty(size + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    block = raw[start : start + size]
    advise_huge_pages(block)
    return block
