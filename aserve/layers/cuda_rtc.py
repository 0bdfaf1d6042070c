"""CUDA C++ kernels compiled at run time by NVRTC and launched through the driver API.

Triton cannot keep bytes in shared memory across `griddepcontrol.wait` (layers/pdl.py), and
that is what a kernel needs to copy its whole weight in while the kernel before it still
runs (layers/resident_gemv.py). NVRTC ships with PyTorch's CUDA wheels and compiles a small
kernel in about a second, so no nvcc and no build step are needed; a compiled kernel is kept
for the process. Launches take PDL's attribute, so such a kernel chains with the Triton ones.
Imported only on CUDA.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from dataclasses import dataclass

import torch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attributes", ctypes.POINTER(_LaunchAttribute)),
        ("attribute_count", ctypes.c_uint),
    ]


def _load_nvrtc() -> ctypes.CDLL:
    """NVRTC of PyTorch's CUDA major version: by name, then from the `nvidia` wheels on
    sys.path, then from CUDA_HOME."""
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for entry in sys.path:
        names += sorted(
            glob.glob(os.path.join(entry, "nvidia", "**", f"libnvrtc.so.{major}*"), recursive=True)
        )
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    names += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"NVRTC (libnvrtc.so.{major}) was not found")


_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}


def _library(name: str) -> ctypes.CDLL:
    with _lock:
        if name not in _libraries:
            _libraries[name] = _load_nvrtc() if name == "nvrtc" else ctypes.CDLL("libcuda.so.1")
        return _libraries[name]


def _check_driver(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _library("cuda").cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: {(text.value or b'').decode()} ({result})")


def compile_cubin(source: str, name: str, arch: str, defines: dict[str, int]) -> bytes:
    """`source` compiled for `arch` (e.g. "sm_90") with `defines`, as a cubin."""
    nvrtc = _library("nvrtc")
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(
        ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None
    ):
        raise RuntimeError(f"NVRTC could not create {name}")
    options = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device"]
    options += [f"-D{key}={value}" for key, value in defines.items()]
    encoded = (ctypes.c_char_p * len(options))(*(option.encode() for option in options))
    try:
        if nvrtc.nvrtcCompileProgram(program, len(options), encoded):
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC failed on {name}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


@dataclass
class Kernel:
    """One kernel of a loaded cubin, launched with PDL's attribute when `pdl`."""

    function: ctypes.c_void_p
    module: ctypes.c_void_p  # kept: the function lives as long as its module
    shared_bytes: int
    pdl: bool

    def launch(self, grid: int, threads: int, args: list[ctypes._SimpleCData], stream: int) -> None:
        """Launch over `grid` blocks of `threads` on the stream handle `stream`; `args` are
        the kernel's parameters as ctypes values, in order."""
        attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attribute.value[0] = 1
        config = _LaunchConfig(
            grid=(ctypes.c_uint * 3)(grid, 1, 1),
            block=(ctypes.c_uint * 3)(threads, 1, 1),
            shared_bytes=self.shared_bytes,
            stream=stream,
            attributes=ctypes.pointer(attribute),
            attribute_count=1 if self.pdl else 0,
        )
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(arg) for arg in args))
        _check_driver(
            _library("cuda").cuLaunchKernelEx(ctypes.byref(config), self.function, params, None),
            "cuLaunchKernelEx",
        )


def load_kernel(
    cubin: bytes, name: str, device: torch.device, shared_bytes: int, pdl: bool
) -> Kernel:
    """Kernel `name` of `cubin` on `device` (in PyTorch's context for it), allowed
    `shared_bytes` of dynamic shared memory."""
    cuda = _library("cuda")
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # makes PyTorch's context current on this thread
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check_driver(cuda.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        _check_driver(
            cuda.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
            "cuModuleGetFunction",
        )
        _check_driver(
            cuda.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
            "cuFuncSetAttribute",
        )
    return Kernel(function, module, shared_bytes, pdl)
