"""Linear weights packed once into MKL's GEMM layout, for float32 on CPU.

MKL's sgemm copies the weight into its blocked layout on every call. With the few rows of a
decode step that copy costs about as much as the product: on the 2-core box the layers of
SmolLM2-135M take 38 ms a step at 16 rows with plain weights and 28-30 ms packed (18 against
16 ms at one row, 1.43 against 1.39 s at 2,048). Packing takes a row count; the layout it
picks for 256 rows was the best at every row count measured (1 to 2,048), so that is used.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

PACKED_FOR_ROWS = 256


def can_pack(weight: torch.Tensor) -> bool:
    """Float32 on a CPU build of torch with MKL (the x86 wheels; not Apple silicon)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


class PackedWeight:
    """`linear(x, bias)` = `x W^T + bias` with W held packed (the op torch.compile's CPU
    weight freezing uses). The op falls back to the plain weight for row counts other than the
    one it was packed for, but the packed matrix is valid for any (tests check this against
    `F.linear`), so each call passes its own and a zero-stride stand-in of W's shape
    replaces the plain weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)
        self.stand_in = weight.new_zeros(()).expand(weight.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(rows, self.packed, self.stand_in, bias, rows.shape[0])
        return out.view(*x.shape[:-1], out.shape[-1])


def return_freed_memory() -> None:
    """Hand the heap's free memory back to the OS. After packing, glibc keeps the freed plain
    weights in its heap, which counted as ~100 MiB of resident memory for the 135M model;
    elsewhere (no glibc) this does nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


ACTIVATIONS_IN_HEAP_BYTES = 32 << 20
"""glibc's largest mmap threshold: buffers up to this size come from the heap."""
HEAP_KEPT_BYTES = 128 << 20
"""Freed heap memory glibc keeps (rather than hands back) for the next step's buffers."""


def keep_activations_in_heap() -> bool:
    """Have glibc serve a step's large temporaries (a prefill's activations, tens of MB)
    from its heap and keep them there when freed, where by default each comes from a fresh
    mmap that the next step faults in page by page again: 11% of the embedded model's
    prefill of 4 x 1,024 tokens on the 2-core Xeon (5.2 -> 4.6 s), 14% of a
    nomic-embed-text-shaped encoder's at 2,048-token steps. Fixed thresholds also stop
    glibc's own adjustment. False where the C library is not glibc (nothing changes)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        kept = libc.mallopt(m_trim_threshold, HEAP_KEPT_BYTES)
        return bool(kept and libc.mallopt(m_mmap_threshold, ACTIVATIONS_IN_HEAP_BYTES))
    except (OSError, AttributeError):
        return False
