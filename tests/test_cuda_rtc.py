"""The run-time CUDA kernels' host side, on any machine: the driver structures' layouts and,
where NVRTC is installed, the resident FP8 GEMV's source compiled for Hopper."""

from __future__ import annotations

import ctypes

import pytest

from aserve.layers import cuda_rtc


def test_launch_structures_have_the_driver_layout() -> None:
    """`CUlaunchAttribute` is an int id padded to 8 bytes and a 64-byte union;
    `CUlaunchConfig` six grid and block sizes, the shared bytes, then (8-byte aligned) the
    stream, the attribute pointer and their count."""
    assert ctypes.sizeof(cuda_rtc._LaunchAttribute) == 72
    assert cuda_rtc._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(cuda_rtc._LaunchConfig) == 56
    assert cuda_rtc._LaunchConfig.stream.offset == 32
    assert cuda_rtc._LaunchConfig.attributes.offset == 40
    assert cuda_rtc._LaunchConfig.attribute_count.offset == 48


@pytest.mark.parametrize("k", [512, 2048, 4096])
def test_resident_gemv_source_compiles_for_hopper(k: int) -> None:
    """NVRTC compiles the kernel for every input width it takes (no GPU needed)."""
    from aserve.layers import resident_gemv

    try:
        cuda_rtc._library("nvrtc")
    except RuntimeError:
        pytest.skip("NVRTC is not installed (it comes with PyTorch's CUDA wheels)")
    defines = {"K": k, "WARPS": resident_gemv.WARPS, "ROW_PAD": resident_gemv.ROW_PAD}
    cubin = cuda_rtc.compile_cubin(resident_gemv._SOURCE, "resident_fp8_gemv", "sm_90", defines)
    assert cubin[:4] == b"\x7fELF"
