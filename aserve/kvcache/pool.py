"""The KV pool: per layer, one K and one V tensor indexed by KV slot."""

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
    """K/V storage of `num_pages * page_size` slots per layer, `[slots, kv_heads, head_dim]`.

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
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        self.k = [zeros_on(shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeros_on(shape, dtype, device) for _ in range(num_layers)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element
