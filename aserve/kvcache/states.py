"""Recurrent states: what linear attention layers keep a request in place of a KV cache.

A request's state lives in the row of its page-table slot (`Req.slot`; the dummy row takes
what padded CUDA-graph entries write), one tensor a layer: the convolution's last inputs
in the model's dtype and the delta rule's matrices in float32, whose rounding would add
up over thousands of tokens. A state is the whole prefix in a fixed size, so nothing of it
can be shared or cut back: a request's first step starts from zeros (the model resets the
row where `prefix_lens` is 0) and the prefix cache never supplies a hybrid model's prompt.
"""

from __future__ import annotations

import torch

from aserve.config import LinearAttention
from aserve.kvcache.pool import zeros_on


class RecurrentStates:
    """`conv[i]` `[rows, channels, conv_kernel - 1]` and `delta[i]` `[rows, value_heads,
    key_head_dim, value_head_dim]` of the i-th linear attention layer (`index[layer]`), for
    this rank's heads (`tp_size` ranks split them)."""

    def __init__(
        self,
        linear: LinearAttention,
        rows: int,
        tp_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.index = {layer: i for i, layer in enumerate(linear.layers)}
        channels = linear.conv_width // tp_size
        heads = linear.value_heads // tp_size
        self.conv = [
            zeros_on((rows, channels, linear.conv_kernel - 1), dtype, device) for _ in linear.layers
        ]
        shape = (rows, heads, linear.key_head_dim, linear.value_head_dim)
        self.delta = [zeros_on(shape, torch.float32, device) for _ in linear.layers]

    def of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s convolution inputs and delta-rule states, every row."""
        i = self.index[layer]
        return self.conv[i], self.delta[i]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.conv, *self.delta))

    @staticmethod
    def bytes_per_row(linear: LinearAttention, tp_size: int, dtype: torch.dtype) -> int:
        """Bytes one request's states take over all linear attention layers."""
        element = torch.empty((), dtype=dtype).element_size()
        conv = linear.conv_width // tp_size * (linear.conv_kernel - 1) * element
        heads = linear.value_heads // tp_size
        delta = heads * linear.key_head_dim * linear.value_head_dim * 4
        return len(linear.layers) * (conv + delta)
