"""Paged attention through FlashInfer kernels (CUDA only; `--attention-backend fi` or `fa`).

The KV pool's per-layer K and V halves `[pages * page_size, kv_heads, head_dim]` are
FlashInfer's NHD paged layout once viewed as `[pages, page_size, kv_heads, head_dim]`; the
kernels take their strides (K and V of a slot sit side by side), so they read the pool in
place. `prepare` plans once per batch, from host data only: lengths, index pointers and
page ids come from the batch's host-side lists and the page table's host mirror
(FlashInfer's planner reads them on the host anyway), so nothing waits for the device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from aserve.attention.base import visible_keys
from aserve.config import ConfigError
from aserve.forward import ForwardBatch
from aserve.kvcache.pages import PageTable, first_read_page
from aserve.kvcache.pool import KVPool

WORKSPACE_BYTES = 256 * 1024 * 1024
BUILD_WORKSPACE_BYTES = 16 * 1024 * 1024
BUILD_NICENESS = 10  # of the threads (and so the nvcc processes) that build FlashInfer's modules

WIDEN_SLOTS_PER_PREFILL_TOKEN = 2
"""A prefill step over an FP8 pool widens its pages to 16 bits when they hold at most this
many slots per token of the largest prefill chunk (see `WidenedPrefill`)..."""

WIDEN_MIN_HEAD_SLOTS = 8192
"""...and when query heads times the slots of a request, on average, come to at least this
much: the copy costs a pass over the pages, the kernel's saving grows with the queries that
read each page (bench/prefill_kernels.py on the H200, us a layer, FP8 against widened: 16
heads, 64 prompts of 256 tokens 216 against 240, 16 of 512 175 against 156; 32 heads, 64 of
256 396 against 346)."""

logger = logging.getLogger("aserve.engine")


class FlashInferBackend:
    """`prefill_backend` "fa2" (FlashInfer's own kernels, `fi`) or "fa3" (FlashAttention-3
    kernels on Hopper, `fa`). Decode uses the Triton kernels of attention/triton_decode.py for
    the batch sizes they were measured faster at (1-2 requests, and from about 40 up), and
    FlashInfer's decode kernels for the rest, with or without tensor cores as
    `use_tensor_cores` says for the batch.

    With an FP8 pool (`--kv-cache-dtype fp8_e4m3`) prefill widens the step's pages to 16 bits
    and runs the 16-bit kernels (`WidenedPrefill`), or over more pages than that allows plans
    FlashInfer's kernels for 16-bit queries over FP8 pages; either way the layer's K scale is
    folded into the softmax scale and the V scale applied to the output. Every decode batch
    takes the Triton kernels, which read FP8 the same way: it spares a start-up compile of
    FlashInfer's FP8 decode variants, and at 3-39 requests, where FlashInfer's own were
    faster in 16 bits, FP8 halves the bytes both read anyway.

    `windows` (Gemma 3: a sliding window on some layers) and `scale` (the scores' scale,
    default 1 / sqrt(head_dim)): FlashInfer fixes a plan's window, so such a model plans
    each batch twice for FlashInfer's kernels, for its whole-context layers and its windowed
    ones (`ByWindow`); the Triton kernels take the window and the scale at each layer's run.
    Where the windowed layers keep their own pages (`pool.windowed`), their plans list those
    pages, from the first one the batch's queries read (kvcache/pages.py: `SlidingWindow`),
    and the Triton kernels too are planned twice.

    `sinks` (gpt-oss: each head's softmax also sums e^sink, a weight on no value): every
    decode batch takes the Triton kernels, which start each head's running softmax at its
    sink; a prefill's output is scaled by Z / (Z + e^sink) from the log-sum-exp of the scores
    that FlashInfer's kernels return beside it (`_weigh_sinks`).

    `softcap` (Gemma 2: the scaled scores soft-capped, 0 for none): prefill plans take it
    (FlashInfer's soft-cap variant), and every decode batch takes the Triton kernels, which
    cap each block's scores.

    A prefill whose chunks hold Gemma 3 images (`batch.both_ways`: features that attend to
    each other both ways) is planned with a mask of each query's visible keys
    (`visible_keys`), on wrappers of FlashInfer's own kernels (FlashAttention-3's take no
    mask), without widening an FP8 pool's pages (`masked_prefill`)."""

    def __init__(
        self,
        pool: KVPool,
        page_table: PageTable,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        prefill_backend: str = "fa2",
        max_prefill_length: int = 0,
        windows: tuple[int, ...] = (),
        scale: float | None = None,
        sinks: bool = False,
        softcap: float = 0.0,
    ) -> None:
        try:
            import flashinfer
        except ImportError as error:
            raise ImportError(
                "--attention-backend fi needs FlashInfer: pip install 'aserve[gpu]'"
            ) from error
        self.pool = pool
        self.page_table = page_table
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = pool.storage_dtype
        self.page_size = pool.page_size
        self.widen_max_slots = WIDEN_SLOTS_PER_PREFILL_TOKEN * max_prefill_length
        self.layer_windows = windows or (0,) * len(pool.kv)
        self.window = window_of(self.layer_windows)
        self.scale = scale
        self.sinks = sinks
        self.softcap = softcap
        device = pool.k[0].device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

        def prefill() -> Any:
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=prefill_backend
            )

        def decode(tensor_cores: bool) -> Any:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores
            )

        self.prefill_wrapper = ByWindow(prefill(), prefill()) if self.window else prefill()
        self.masked_prefill: Any = None  # made at the first prefill with Gemma 3 images
        self.decode_wrappers = {
            tensor_cores: ByWindow(decode(tensor_cores), decode(tensor_cores))
            if self.window
            else decode(tensor_cores)
            for tensor_cores in (False, True)
        }
        self.split_pool = any(pool.windowed)
        self.triton_decode = _triton_decode(head_dim)
        if head_dim not in FLASHINFER_HEAD_DIMS and self.triton_decode is None:
            raise ConfigError(
                f"heads of {head_dim} decode through the Triton kernels: pip install triton"
            )
        if softcap and self.triton_decode is None:
            raise ConfigError(
                f"soft-capped scores decode through Triton kernels, for head dims of 64, 128 "
                f"or 256 (this model's: {head_dim})"
            )
        self.triton_wrapper: Any = None
        if self.triton_decode is not None:
            triton_wrapper = self.triton_decode.TritonDecodeWrapper
            self.triton_wrapper = (
                ByWindow(triton_wrapper(device), triton_wrapper(device))
                if self.split_pool
                else triton_wrapper(device)
            )

    def use_tensor_cores(self, batch_size: int) -> bool:
        return use_tensor_cores(self.num_heads, self.num_kv_heads, batch_size)

    def _host_layout(
        self, batch: ForwardBatch, windowed: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch's paged layout on the host, over the sliding-window layers' own pages
        from the first one its queries read where `windowed` (and the pool has them)."""
        if not (windowed and self.split_pool):
            return self.page_table.page_layout(batch.row_ids, batch.seq_lens)
        first_query = np.asarray(batch.prefix_lens, dtype=np.int64)
        first_pages = first_read_page(first_query, self.window, self.page_size)
        return self.page_table.page_layout(batch.row_ids, batch.seq_lens, True, first_pages)

    def _page_layout(
        self, batch: ForwardBatch, windowed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """kv index pointers and last-page lengths (host) and page ids (copied to the device
        behind the queued work), from the page table's host mirror: no device work to queue
        and nothing that waits for the device."""
        indptr, last, pages = self._host_layout(batch, windowed)
        device = self.workspace.device
        indices = torch.from_numpy(pages).to(device, non_blocking=True)
        return torch.from_numpy(indptr), torch.from_numpy(last), indices

    def uses_triton(self, batch_size: int) -> bool:
        """Decode batches the Triton kernels of attention/triton_decode.py are faster for."""
        kernels = self.triton_decode
        if kernels is None:
            return False
        return (
            self.pool.quantized
            or self.sinks
            or self.softcap > 0
            or self.head_dim not in FLASHINFER_HEAD_DIMS
            or kernels.takes_batch(batch_size, self.num_kv_heads)
        )

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            if self.uses_triton(batch.batch_size):
                wrapper = self.triton_wrapper
            else:
                wrapper = self.decode_wrappers[self.use_tensor_cores(batch.batch_size)]
            self.plan_decode(wrapper, batch)
            return
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(batch.extend_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
        # by whether a plan reads the sliding-window layers' own pages
        layouts = {False: self._page_layout(batch)}
        if self.split_pool:
            layouts[True] = self._page_layout(batch, windowed=True)
        if batch.both_ways is not None:
            self._plan_masked_prefill(batch, qo_indptr, layouts)
            return
        slots = len(layouts[False][2]) * self.page_size
        widen = (
            self.pool.quantized
            and slots <= self.widen_max_slots
            and self.num_heads * slots >= WIDEN_MIN_HEAD_SLOTS * batch.batch_size
        )
        kv_data_type = self.dtype if widen else self.kv_dtype
        for wrapper, window_left in self._by_window(self.prefill_wrapper):
            indptr, last, indices = layouts[window_left >= 0 and self.split_pool]
            wrapper.plan(
                qo_indptr,
                indptr,
                torch.arange(len(indices), dtype=torch.int32, device=indices.device)
                if widen
                else indices,
                last,
                num_qo_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim_qk=self.head_dim,
                page_size=self.page_size,
                causal=True,
                q_data_type=self.dtype,
                kv_data_type=kv_data_type,
                window_left=window_left,
                sm_scale=self.scale,
                logits_soft_cap=self.softcap,
            )
        batch.attn_metadata = self.prefill_wrapper
        if widen:
            window_ids = layouts[True][2] if self.split_pool else None
            widened = WidenedPrefill(self.prefill_wrapper, layouts[False][2], window_ids)
            batch.attn_metadata = widened

    def _plan_masked_prefill(
        self,
        batch: ForwardBatch,
        qo_indptr: torch.Tensor,
        layouts: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        """Plan a prefill with Gemma 3 images: each query's visible keys as a mask over the
        positions its plan's pages hold (the windowed layers' own pages may start later)."""
        import flashinfer

        if self.masked_prefill is None:  # each wrapper holds buffers: made where needed

            def masked() -> Any:
                return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", backend="fa2"
                )

            self.masked_prefill = ByWindow(masked(), masked()) if self.window else masked()
        blocks = batch.both_ways or []
        for wrapper, window_left in self._by_window(self.masked_prefill):
            indptr, last, indices = layouts[window_left >= 0 and self.split_pool]
            window = window_left + 1 if window_left >= 0 else 0
            pages = (indptr[1:] - indptr[:-1]).tolist()
            masks = []
            for i, (prefix, total) in enumerate(zip(batch.prefix_lens, batch.seq_lens)):
                held = (pages[i] - 1) * self.page_size + int(last[i])
                visible = visible_keys(prefix, total, window, torch.device("cpu"), blocks[i])
                masks.append(visible[:, total - held :].flatten())
            device = self.workspace.device  # FlashInfer packs the mask on the device
            wrapper.plan(
                qo_indptr.to(device),
                indptr.to(device),
                indices,
                last.to(device),
                num_qo_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim_qk=self.head_dim,
                page_size=self.page_size,
                custom_mask=torch.cat(masks).to(device),
                q_data_type=self.dtype,
                kv_data_type=self.kv_dtype,
                window_left=window_left,
                sm_scale=self.scale,
                logits_soft_cap=self.softcap,
            )
        batch.attn_metadata = self.masked_prefill

    def _by_window(self, wrapper: Any) -> list[tuple[Any, int]]:
        """A plan's wrappers with the `window_left` each is planned for: FlashInfer reads the
        last window_left + 1 positions, or all of them at -1."""
        if isinstance(wrapper, ByWindow):
            return [(wrapper.whole, -1), (wrapper.windowed, self.window - 1)]
        return [(wrapper, -1)]

    def _is_triton(self, wrapper: Any) -> bool:
        """Whether `wrapper` (or each part of a `ByWindow`) is attention/triton_decode.py's,
        not FlashInfer's."""
        if isinstance(wrapper, ByWindow):
            wrapper = wrapper.whole
        kernels = self.triton_decode
        return kernels is not None and isinstance(wrapper, kernels.TritonDecodeWrapper)

    def plan_decode(self, wrapper: Any, batch: ForwardBatch) -> None:
        """Plan a decode batch into `wrapper` (ours, or a CUDA-graph one with static buffers).
        Triton's wrapper takes the page ids on the host, with the rest in one copy; it takes
        the window and scale at each layer's run."""
        triton = self._is_triton(wrapper)
        for part, window_left in self._by_window(wrapper):
            windowed = window_left >= 0
            if triton:
                indptr, last, indices = self._host_layout(batch, windowed)
                options: dict[str, Any] = {}
            else:
                indptr, last, indices = self._page_layout(batch, windowed)
                options = {"window_left": window_left, "sm_scale": self.scale}
            part.plan(
                indptr,
                indices,
                last,
                num_qo_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                page_size=self.page_size,
                q_data_type=self.dtype,
                kv_data_type=self.kv_dtype,
                **options,
            )
        batch.attn_metadata = wrapper

    def graph_decode_wrapper(
        self, batch_size: int, page_ids: torch.Tensor, window_page_ids: torch.Tensor
    ) -> Any:
        """A decode wrapper whose metadata lives in static buffers, for one captured size;
        `page_ids` (int32) is the page-id buffer that FlashInfer's wrappers of every size
        share, `window_page_ids` the windowed plans' where those layers keep their own pages
        (Triton's keeps its own of that size, beside the rest of its plan)."""
        import flashinfer

        device = self.workspace.device
        if self.uses_triton(batch_size):
            assert self.triton_decode is not None

            def triton() -> Any:
                return self.triton_decode.TritonDecodeWrapper(device, batch_size, len(page_ids))

            return ByWindow(triton(), triton()) if self.split_pool else triton()

        def captured(page_ids: torch.Tensor) -> Any:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores(batch_size),
                paged_kv_indptr_buffer=torch.zeros(
                    batch_size + 1, dtype=torch.int32, device=device
                ),
                paged_kv_indices_buffer=page_ids,
                paged_kv_last_page_len_buffer=torch.zeros(
                    batch_size, dtype=torch.int32, device=device
                ),
            )

        if not self.window:
            return captured(page_ids)
        return ByWindow(
            captured(page_ids), captured(window_page_ids if self.split_pool else page_ids)
        )

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor | None,
        layer: int,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernels read Q with its strides (Q is a slice of the fused QKV output), which
        saves a copy a layer (176 us of a 16k-token prefill's layer of the 8B shape on the
        H200), and write into an output left unfilled (FlashInfer's prefill zeroes its own
        first, and every row is written)."""
        if kv is not None:
            self.pool.store(layer, batch.slots_of(self.pool.windowed[layer]), kv)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        cache = (self.pool.k[layer].view(shape), self.pool.v[layer].view(shape))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k_scale, v_scale = self.pool.scale_pairs[layer]
        metadata = batch.attn_metadata
        window = self.layer_windows[layer]
        if isinstance(metadata, WidenedPrefill):
            windowed = self.pool.windowed[layer]
            cache = metadata.widen(self.pool.kv[layer], self.page_size, self.dtype, windowed)
            metadata = metadata.wrapper
        if isinstance(metadata, ByWindow):
            metadata = metadata.windowed if window else metadata.whole
        if batch.is_decode:
            if self._is_triton(metadata):
                out = metadata.run(
                    q, cache, k_scale, v_scale, window, self.scale, sinks, self.softcap
                )
            else:
                out = metadata.run(q, cache, k_scale=k_scale, v_scale=v_scale)
            return out.reshape(-1, self.num_heads * self.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if sinks is None:
            metadata.run(q, cache, out=out, k_scale=k_scale, v_scale=v_scale)
        else:
            _, lse = metadata.run(
                q, cache, out=out, k_scale=k_scale, v_scale=v_scale, return_lse=True
            )
            _weigh_sinks(out, lse, sinks)
        return out.reshape(-1, self.num_heads * self.head_dim)


LN2 = math.log(2.0)


def _weigh_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Attention output `[tokens, heads, dim]` normalised over the scores alone, rescaled in
    place as if each head's softmax had also summed e^sink: by Z / (Z + e^sink) =
    sigmoid(ln Z - sink), with ln Z from FlashInfer's log-sum-exp `[tokens, heads]`, which
    its kernels keep in base 2."""
    weights = torch.sigmoid(lse * LN2 - sinks)
    out.mul_(weights.unsqueeze(-1).to(out.dtype))


@dataclass
class ByWindow:
    """A batch's two FlashInfer plans where some layers have a sliding window (Gemma 3):
    one for the layers that read the whole context, one for the windowed ones."""

    whole: Any
    windowed: Any


def window_of(windows: tuple[int, ...]) -> int:
    """The one window of a model's windowed layers (0: none); FlashInfer plans take one."""
    sizes = set(windows) - {0}
    if len(sizes) > 1:
        raise ConfigError(f"layers with windows of {sorted(sizes)}: FlashInfer plans take one")
    return sizes.pop() if sizes else 0


@dataclass
class WidenedPrefill:
    """A prefill step over an FP8 pool, planned for 16-bit pages: each layer copies the
    step's pages out of the pool widened to the model dtype (exact: every e4m3 value is a
    bfloat16 and a float16 value) and FlashInfer's 16-bit kernel reads the copy. Its FP8
    kernel read the same values at about half the speed (bench/prefill_kernels.py --long on
    the H200, 8B shape, us a layer: 16 prompts of 1,024 tokens 997 against 629 with the
    copy, one of 32,768 47,482 against 24,013) and gave the same bits in every case measured.

    The copy lives while the layer's attention runs, when the MLP's activations, which the
    prefill's working memory counts (engine/memory.py), do not; `WIDEN_SLOTS_PER_PREFILL_TOKEN`
    keeps it a small share of them (6 KiB a slot for the 8B shape, the gathered FP8 bytes and
    their bf16 copy, against ~130 KiB of activations a token). A step over more pages (long
    cached prefixes), or of many short prompts (`WIDEN_MIN_HEAD_SLOTS`), reads FP8."""

    wrapper: Any
    page_ids: torch.Tensor
    """The step's pages in the pool (int32, on the device), in the plan's order."""
    window_page_ids: torch.Tensor | None = None
    """The same in the sliding-window layers' own pages, where they have them."""

    def widen(
        self, kv: torch.Tensor, page_size: int, dtype: torch.dtype, windowed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages `[pages, page_size, kv_heads, head_dim]` of one layer's pool `kv`
        `[slots, 2, kv_heads, head_dim]` (the sliding-window layers' own where `windowed`),
        widened to `dtype`, in the plan's page order."""
        page_ids = self.page_ids
        if windowed:
            assert self.window_page_ids is not None
            page_ids = self.window_page_ids
        pages = kv.view(torch.uint8).unflatten(0, (-1, page_size))  # index_select takes bytes
        picked = pages.index_select(0, page_ids).view(kv.dtype)
        wide = picked.to(dtype)
        return wide[:, :, 0], wide[:, :, 1]


FLASHINFER_HEAD_DIMS = (64, 128, 256)
"""Head sizes FlashInfer's kernels run (0.6.8's prefill faults on 96, Phi-3-mini's)."""


def triton_decodes(head_dim: int) -> bool:
    """Whether attention/triton_decode.py's kernels take this head size: any multiple of 16
    up to 256, those that are no power of two padded to the next one as they are read."""
    return head_dim % 16 == 0 and 32 <= head_dim <= 256


def _triton_decode(head_dim: int) -> ModuleType | None:
    """attention/triton_decode.py where Triton is installed and the head size is one its
    kernels take, else None."""
    if not triton_decodes(head_dim):
        return None
    try:
        from aserve.attention import triton_decode
    except ImportError:
        return None
    return triton_decode


def use_tensor_cores(num_heads: int, num_kv_heads: int, batch_size: int) -> bool:
    """FlashInfer's tensor-core decode kernel, or its CUDA-core one. With 4 or more query
    heads per KV head tensor cores win at every batch (bench/decode_kernels.py on the
    H200, Llama-3.1-8B shape: 11 against 29 us a layer at batch 1, 75 against 104 at 64).
    With 2 (Qwen3-0.6B) they win at batch 64 in real decode (trace at batch 64, mixed
    contexts of 530-850: 1.37 against 1.92 ms a step; a micro-benchmark with equal
    contexts of 1000 ties at 74 against 72 us a layer) and lose slightly at 256 (152
    against 143 us a layer)."""
    return num_heads // num_kv_heads >= 4 or batch_size <= 64


def decode_modules(num_heads: int, num_kv_heads: int, head_dim: int, max_batch: int) -> list[str]:
    """FlashInfer's decode modules ("decode" on tensor cores, "CUDA-core decode") that
    batches of 1 to `max_batch` requests of a 16-bit pool plan: those the Triton kernels do
    not take, by `use_tensor_cores`."""
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return []
    triton = _triton_decode(head_dim)
    tensor_cores = {
        use_tensor_cores(num_heads, num_kv_heads, batch)
        for batch in range(1, max_batch + 1)
        if triton is None or not triton.takes_batch(batch, num_kv_heads)
    }
    return ["decode"] * (True in tensor_cores) + ["CUDA-core decode"] * (False in tensor_cores)


def build_kernels(
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    page_size: int,
    prefill_backend: str,
    max_batch: int,
    windowed: bool = False,
    softcap: float = 0.0,
) -> list[threading.Thread]:
    """Start compiling (first start) or loading FlashInfer's prefill module and the decode
    modules that batches of up to `max_batch` requests use (tensor-core, CUDA-core: by
    `use_tensor_cores`, where the Triton kernels do not take the batch), each in a thread of
    its own, and return the threads. An FP8 pool decodes with the Triton kernels only, so it
    needs no decode module, and prefills with both the 16-bit and the FP8 prefill modules.

    FlashInfer compiles a module when a wrapper first plans for it, one module after
    another and each in minutes' share of the first start. Planning a one-token batch here
    while the weights load and the Triton kernels compile overlaps all of it (the builds
    are nvcc processes, so the threads hold no lock). The warm-up joins them before its
    first prefill. A `windowed` model (sliding-window layers) also needs each module's
    sliding-window variant; soft-capped scores (`softcap`) the prefill's soft-cap variant,
    and no decode module (the Triton kernels take every batch)."""

    def plan(kind: str) -> None:
        import flashinfer

        started = time.perf_counter()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            plan_one_token(flashinfer, kind.removeprefix("windowed "), window_left(kind))
        # This stream only: the engine thread may be capturing decode graphs meanwhile, and
        # a device-wide synchronize invalidates a capture under way.
        stream.synchronize()
        logger.info("FlashInfer %s kernels ready in %.1f s", kind, time.perf_counter() - started)

    def plan_one_token(flashinfer: Any, kind: str, window_left: int) -> None:
        workspace = torch.empty(BUILD_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        one = torch.tensor([0, 1], dtype=torch.int32)
        page = torch.zeros(1, dtype=torch.int32, device=device)
        last = torch.ones(1, dtype=torch.int32)
        if kind in ("prefill", "widened prefill"):
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", backend=prefill_backend
            )
            wrapper.plan(
                one, one, page, last, num_heads, num_kv_heads, head_dim, page_size,
                causal=True, q_data_type=dtype,
                kv_data_type=dtype if kind == "widened prefill" else kv_dtype,
                window_left=window_left, logits_soft_cap=softcap,
            )  # fmt: skip
        else:
            decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(  # "CUDA-core decode" or not
                workspace, "NHD", use_tensor_cores=kind == "decode"
            )
            decode.plan(
                one, page, last, num_heads, num_kv_heads, head_dim, page_size,
                q_data_type=dtype, kv_data_type=kv_dtype, window_left=window_left,
            )  # fmt: skip

    def window_left(kind: str) -> int:
        return 1 if kind.startswith("windowed ") else -1  # any window selects the variant

    def guarded(kind: str) -> None:
        # Linux keeps a niceness per thread, and the nvcc processes this thread starts
        # inherit it: at 10 they leave the cores to what readiness waits for (the weights'
        # loading, Triton's compiles, the tokenizer's process); the engine serves before
        # these builds end.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BUILD_NICENESS)
        try:
            plan(kind)
        except Exception as error:  # the warm-up's own prefill then raises it in full
            logger.debug("building FlashInfer's %s kernels ahead failed: %s", kind, error)

    kinds = ["prefill"]
    if kv_dtype != dtype:  # most prefill steps read the FP8 pool widened (`WidenedPrefill`)
        kinds.append("widened prefill")
    elif not softcap:
        kinds += decode_modules(num_heads, num_kv_heads, head_dim, max_batch)
    if windowed:
        kinds += [f"windowed {kind}" for kind in kinds]
    threads = [
        threading.Thread(target=guarded, args=(kind,), name=f"flashinfer-{kind}", daemon=True)
        for kind in kinds
    ]
    for thread in threads:
        thread.start()
    return threads
