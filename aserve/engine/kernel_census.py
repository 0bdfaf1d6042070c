"""A pass's Triton kernels compiled side by side in threads, not one by one as it meets them.

A first start compiles some thirty Triton kernels in its warm-up, each at its first launch:
~15 s of the embedded model's cold start on an H200, one kernel after another. Triton's
compiler releases the GIL through its passes and ptxas, so kernels compile in parallel in
threads, but only from their exact signatures (dtypes, each pointer's alignment, the
constexprs), which only a launch produces. So the warm-up's forwards first run under a
census: each Triton launch that would compile is noted (Triton's `jit_cache_hook`) and
skipped (a stand-in takes its place in the kernel's cache while the census lasts, so that
its later launches skip at once rather than through the hook's signature serialization, which
had made the pass ~1.7 s long); torch's own operations run as usual on whatever values they
get. The noted kernels then compile in a thread pool through `JITFunction.preload`
(Triton's compile from a noted signature, into the same in-memory cache a launch looks in),
and the warm-up proper finds them there.

Outputs of skipped kernels are garbage, and kernels compiled before the census (an earlier
engine of the process) run on them, so a pass under a census must neither read device values
back to the host nor read memory at an address a kernel computed. A forward that CUDA graphs
can capture reads nothing back; a dense decoder's addresses are the host's (pages, slots,
token ids) or torch's own (top-k), valid whatever the values; a fused MoE layer's are not
(its experts read the block layout a kernel computes), so MoE models compile as they go.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from aserve.replicas import usable_cpus

logger = logging.getLogger(__name__)


class _SkippedLaunch:
    """What a noted kernel's cache entry holds during the census: Triton launches it as a
    compiled kernel, and nothing runs."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args: object) -> None:
        return None

    def run(self, *args: object) -> None:
        return None


class KernelCensus:
    """While entered, Triton launches that would compile are noted instead, not launched."""

    def __init__(self) -> None:
        # (kernel, Triton's cache key) -> (device index, Triton's serialized signature)
        self.noted: dict[tuple[JITFunction, str], tuple[int, str]] = {}
        self._hook_before: Any = None

    def __enter__(self) -> KernelCensus:
        self._hook_before = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._note
        return self

    def __exit__(self, *exc_info: object) -> None:
        knobs.runtime.jit_cache_hook = self._hook_before
        for (kernel, key), (device, _) in self.noted.items():
            cache = kernel.device_caches[device][0]
            if isinstance(cache.get(key), _SkippedLaunch):
                del cache[key]

    def _note(self, *, key: str, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        """Triton's hook before a compile: True skips the compile and the launch."""
        kernel, device = fn.jit_function, compile["device"]
        self.noted[kernel, key] = (device, compile["specialization_data"])
        kernel.device_caches[device][0][key] = _SkippedLaunch()
        return True

    def compile_all(self, threads: int | None = None) -> None:
        """Compile every noted kernel, `threads` at a time (default: one per core this
        process may use), each for the device its launch was on."""
        if not self.noted:
            return
        started = time.perf_counter()
        workers = min(threads or len(usable_cpus()), len(self.noted))
        with ThreadPoolExecutor(workers, "triton-compile") as pool:
            jobs = [
                pool.submit(_compile_on, device, kernel, signature)
                for (kernel, _), (device, signature) in self.noted.items()
            ]
            for job in jobs:
                job.result()
        logger.info(
            "%d Triton kernels compiled or loaded in %.1f s, %d at a time",
            len(self.noted),
            time.perf_counter() - started,
            workers,
        )


def _compile_on(device: int, kernel: JITFunction, signature: str) -> None:
    """Triton compiles for, and caches under, the thread's current device."""
    torch.cuda.set_device(device)
    kernel.preload(signature)
