"""The KV pool: per layer, one tensor indexed by KV slot that holds K and V side by side."""

from __future__ import annotations

import math
import mmap

import torch


def zeros_on(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU backed by anonymous memory that the OS commits page by page when it is
    first written, so a large, mostly idle KV pool does not count in the resident memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVPool:
    """K/V storage of `num_pages * page_size` slots per layer, `[slots, 2, kv_heads, head_dim]`.

    A slot's K and V sit side by side, as they come out of the fused QKV projection, so one
    indexed write stores both (`store`); `k[layer]` and `v[layer]` are the two strided halves
    `[slots, kv_heads, head_dim]` that backends read (FlashInfer through their strides).
    Attention backends write the new tokens' K/V at their slots and read a request's context
    through the page table; nothing else touches these tensors.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_pages * page_size, 2, num_kv_heads, head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv = [zeros_on(shape, dtype, device) for _ in range(num_layers)]
        self.k = [layer[:, 0] for layer in self.kv]
        self.v = [layer[:, 1] for layer in self.kv]

    def store(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write `kv` `[tokens, 2, kv_heads, head_dim]` (K then V of each token) at `slots`."""
        self.kv[layer].index_copy_(0, slots, kv)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element
