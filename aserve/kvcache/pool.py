"""The KV pool: per layer, one tensor indexed by KV slot that holds K and V side by side (or,
for latent attention, one row whose first columns are the values too), in the model's
dtype, in FP8 (`--kv-cache-dtype fp8_e4m3`, half a 16-bit model's bytes a token) or in
float16 (`--kv-cache-dtype float16`, half a float32 model's: on CPU)."""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from aserve.kvcache.states import RecurrentStates

KV_CACHE_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "float16": torch.float16,
    "float32": torch.float32,
}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def kv_storage_dtype(
    kv_cache_dtype: str, dtype: torch.dtype, quantized_on_cpu: bool
) -> torch.dtype:
    """What the pool stores for `--kv-cache-dtype`. `auto` keeps the model's dtype, except
    for quantized weights on CPU, which compute in float32 and keep the cache in float16, as
    llama.cpp does with GGUF files: half the bytes to hold and to read a decode step (at a
    context of 1,100 the embedded model decodes ~10% faster), the same perplexity to three
    decimals (bench/perplexity.py)."""
    if kv_cache_dtype != "auto":
        return KV_CACHE_DTYPES[kv_cache_dtype]
    return torch.float16 if quantized_on_cpu and dtype == torch.float32 else dtype


def zeros_on(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU backed by anonymous memory that the OS commits page by page when it is
    first written, so a large, mostly idle KV pool does not count in the resident memory."""
    if device.type != "cpu" or not math.prod(shape):
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

    Stored in another dtype than the model's (`quantized`), values are cast on the way in
    and out. In FP8 (`storage_dtype` float8_e4m3fn, `scaled`) a stored value is
    `k / k_scale` (or `v / v_scale`), saturated at +-448, and reads multiply back:
    `scales[layer]` holds (k_scale, v_scale) in float32 on the device, `scale_pairs[layer]`
    the same as host floats for the kernels that take them as arguments (FlashInfer's, the
    Triton ones). They are 1.0 (vLLM's default where no calibrated scales are given) unless
    `set_scales` says otherwise: the engine sets a checkpoint's own (kvcache/scales.py).
    `dtype` is what backends compute in; `gather` gives them a context in it.

    With `window_pages`, the layers `windowed[layer]` says (Gemma 3's and gpt-oss's
    sliding-window ones) hold that many pages of their own, indexed by the page table's
    window slots (kvcache/pages.py: `SlidingWindow`).

    The layers that `stateful` marks (Qwen3.5's linear attention layers) hold no slots:
    they keep a recurrent state a request instead, in `states` (kvcache/states.py).

    With a `value_dim` (DeepSeek's latent attention) a slot holds one part, `[slots, 1,
    kv_heads, head_dim]`: the keys, whose first `value_dim` columns are the values as well
    (`v[layer]` is that view), so a token costs half the bytes; `parts` is 1 (else 2), and
    the tensors that `store` takes and `gather` gives have one part too.
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
        storage_dtype: torch.dtype | None = None,
        windowed: tuple[bool, ...] = (),
        window_pages: int = 0,
        value_dim: int | None = None,
        stateful: tuple[bool, ...] = (),
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.storage_dtype = storage_dtype or dtype
        self.quantized = self.storage_dtype != dtype
        self.scaled = self.storage_dtype == torch.float8_e4m3fn
        self.windowed = windowed if window_pages else (False,) * num_layers
        self.parts = 1 if value_dim is not None else 2
        self.value_dim = head_dim if value_dim is None else value_dim

        stateful = stateful or (False,) * num_layers

        def layer_tensor(layer: int) -> torch.Tensor:
            pages = window_pages if self.windowed[layer] else num_pages
            slots = 0 if stateful[layer] else pages * page_size
            shape = (slots, self.parts, num_kv_heads, head_dim)
            return zeros_on(shape, self.storage_dtype, device)

        self.kv = [layer_tensor(layer) for layer in range(num_layers)]
        self.k = [layer[:, 0] for layer in self.kv]
        self.v = [layer[:, -1, :, : self.value_dim] for layer in self.kv]
        self.scales = torch.ones(num_layers, 2, dtype=torch.float32, device=device)
        self.scale_pairs = [(1.0, 1.0)] * num_layers
        self.states: RecurrentStates | None = None  # a hybrid model's (the engine sets them)

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Set a layer's FP8 scales (before anything is stored with the old ones)."""
        self.scales[layer] = torch.tensor([k_scale, v_scale])
        self.scale_pairs[layer] = (k_scale, v_scale)

    def store(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write `kv` `[tokens, parts, kv_heads, head_dim]` (K then V of each token) at
        `slots`."""
        if self.scaled:
            scaled = kv.float() / self.scales[layer][: self.parts, None, None]
            fp8 = scaled.clamp_(-FP8_MAX, FP8_MAX).to(self.storage_dtype)
            # as bytes: indexed copies of float8 tensors are not implemented on every device
            self.kv[layer].view(torch.uint8).index_copy_(0, slots, fp8.view(torch.uint8))
        else:
            self.kv[layer].index_copy_(0, slots, kv.to(self.storage_dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The K/V at `slots`, `[len(slots), parts, kv_heads, head_dim]`, in `dtype`."""
        if not self.scaled:
            return self.kv[layer].index_select(0, slots).to(self.dtype)
        stored = self.kv[layer].view(torch.uint8).index_select(0, slots).view(self.storage_dtype)
        return (stored.float() * self.scales[layer][: self.parts, None, None]).to(self.dtype)

    def split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of gathered or staged slots (`[..., parts, kv_heads, positions or head_dim]`
        with the part at dimension 1): the values of one-part slots are the keys' first
        `value_dim` columns."""
        return kv[:, 0], kv[:, -1, ..., : self.value_dim]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, parts: int = 2
    ) -> int:
        """Bytes of K and V (`parts` 2; one part for latent attention) a token takes over
        all layers, stored as `dtype`."""
        element = torch.empty((), dtype=dtype).element_size()
        return parts * num_layers * num_kv_heads * head_dim * element
