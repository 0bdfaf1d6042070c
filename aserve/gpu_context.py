"""The GPU's primary context, created through the CUDA driver in a thread while the `aserve`
command imports torch.

Creating a context is driver work (device set-up, the memory map of a large GPU) that does
not need torch, and torch's own start-up is mostly Python that holds the GIL; a ctypes call
releases it, so the two overlap. torch's runtime then finds the primary context made and
retains it at no cost. Nothing here imports torch; where the driver or a GPU is missing the
thread ends and torch starts as usual.
"""

from __future__ import annotations

import ctypes
import threading


def _retain_primary_context(ordinal: int) -> None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    device, context = ctypes.c_int(), ctypes.c_void_p()
    if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return
    driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)


def start_gpu_context(device: str) -> threading.Thread | None:
    """Start creating the context of the GPU that `--device` names (`auto` and `cuda` mean
    the first one); None for the CPU."""
    if device == "auto" or device == "cuda":
        ordinal = 0
    elif device.startswith("cuda:") and device[5:].isdigit():
        ordinal = int(device[5:])
    else:
        return None
    thread = threading.Thread(
        target=_retain_primary_context, args=(ordinal,), name="gpu-context", daemon=True
    )
    thread.start()
    return thread
