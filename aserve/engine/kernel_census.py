"""A pass's Triton kernels compiled side by side in threads, not one by one as it meets them.

A first start compiles some thirty Triton kernels in its warm-up, each at its first launch:
~15 s of the embedded model's cold start on an H200, one kernel after another. Triton's
compiler releases the GIL through its passes and ptxas, so kernels compile in parallel in
threads, but only from their exact signatures (dtypes, each pointer's alignment, the
constexprs), which only a launch produces. So the warm-up's forwards first run under a
census: each Triton launch that would compile is noted (Triton's `jit_cache_hook`) and
skipped; torch's own operations run as usual on whatever values they get. The noted kernels
then compile in a thread pool through `JITFunction.preload` (Triton's compile from a noted
signature, into the same in-memory cache a launch looks in), and the warm-up proper finds
them there.

Outputs of skipped kernels are garbage, so a pass under a census must neither read device
values back to the host nor let torch index memory by what a Triton kernel computed. A
forward that CUDA graphs can capture reads nothing back; its only indices on device are
the host's (pages, slots) and torch's own (top-k), which hold whatever the values are.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

logger = logging.getLogger(__name__)


class KernelCensus:
    """While entered, Triton launches that would compile are noted instead, not launched."""

    def __init__(self) -> None:
        self.noted: dict[tuple[JITFunction, str], str] = {}
        self._hook_before: Any = None

    def __enter__(self) -> KernelCensus:
        self._hook_before = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._note
        return self

    def __exit__(self, *exc_info: object) -> None:
        knobs.runtime.jit_cache_hook = self._hook_before

    def _note(self, *, key: str, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        """Triton's hook before a compile: True skips the compile and the launch."""
        self.noted.setdefault((fn.jit_function, key), compile["specialization_data"])
        return True

    def compile_all(self, device: torch.device, threads: int | None = None) -> None:
        """Compile every noted kernel for `device`, `threads` at a time (default: one per
        core this process may use)."""
        if not self.noted:
            return
        started = time.perf_counter()
        if threads is None:
            has_affinity = hasattr(os, "sched_getaffinity")
            threads = len(os.sched_getaffinity(0)) if has_affinity else os.cpu_count() or 1
        workers = min(threads, len(self.noted))
        index = torch.cuda.current_device() if device.index is None else device.index
        pool = ThreadPoolExecutor(workers, "triton-compile", torch.cuda.set_device, (index,))
        with pool:
            jobs = [pool.submit(kernel.preload, data) for (kernel, _), data in self.noted.items()]
            for job in jobs:
                job.result()
        logger.info(
            "%d Triton kernels compiled or loaded in %.1f s, %d at a time",
            len(self.noted),
            time.perf_counter() - started,
            workers,
        )
