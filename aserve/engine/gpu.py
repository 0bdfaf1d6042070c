"""What the GPU can do, as aserve chooses kernels by it: the compute capability, which
`ASERVE_GPU_CAPABILITY=8.6` (say) lowers for the process. That runs the choices an Ampere or
Ada card gets (no FA3, no FP8, Triton configurations within its shared memory) on a Hopper
box, where they are tested (tests/test_gpu.py); it cannot raise what the device has."""

from __future__ import annotations

import os
import threading

import torch

from aserve.config import ConfigError

CAPABILITY_ENV = "ASERVE_GPU_CAPABILITY"

# Shared memory one thread block may use (bytes) by compute capability: what a Triton
# configuration must fit. Ampere consumer cards (8.6) and Ada (8.9) have the least.
SHARED_MEMORY = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024}
HOPPER_SHARED_MEMORY = 227 * 1024


def gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, lowered by ASERVE_GPU_CAPABILITY; None on CPU."""
    if device.type != "cuda":
        return None
    real = torch.cuda.get_device_capability(device)
    pretended = os.environ.get(CAPABILITY_ENV)
    return min(real, parse_capability(pretended)) if pretended else real


def parse_capability(text: str) -> tuple[int, int]:
    """MAJOR.MINOR text, such as 8.6, as (8, 6); anything else is a one-line error."""
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise ConfigError(f"{CAPABILITY_ENV} takes MAJOR.MINOR such as 8.6, not {text!r}")
    return int(major), int(minor)


def shared_memory_limit(capability: tuple[int, int]) -> int:
    """Bytes of shared memory a kernel's block may take on a GPU of this capability."""
    if capability >= (9, 0):
        return HOPPER_SHARED_MEMORY
    return SHARED_MEMORY.get(capability, 99 * 1024)


def start_triton_hash() -> threading.Thread:
    """Triton keys its on-disk kernel cache by a hash of its own install (libtriton's hundreds
    of MB included), computed once a process at the first kernel launch: 0.45 s of a warm
    start on the H200. Hashing releases the GIL, so a thread started with the engine takes
    it off the path while the weights load."""
    thread = threading.Thread(target=_hash_triton, name="triton-hash", daemon=True)
    thread.start()
    return thread


def _hash_triton() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # no Triton, or a version that keeps its key elsewhere
        return
    triton_key()  # kept by Triton (functools.lru_cache) for the launches
