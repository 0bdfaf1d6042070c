"""FlashInfer's fused kernels for layers that run on CUDA in half precision.

The model is built with `ops` from `fused_ops(device, dtype)`: the `flashinfer` module where
its kernels apply, otherwise None, and the layers then use their plain PyTorch code (CPU,
float32, or no FlashInfer installed).
"""

from __future__ import annotations

from types import ModuleType

import torch


def fused_ops(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer
