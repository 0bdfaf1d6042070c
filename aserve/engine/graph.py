"""CUDA graphs of the decode forward, one per captured batch size.

A decode step of a small model is hundreds of tiny kernels; replaying a captured graph
launches them all at once. The per-token inputs (ids, KV slots, positions) live in one static
`[3, max_batch]` buffer that each step fills with one copy; a batch is padded up to the next
captured size, pad rows (zeros) reading and writing only the dummy page 0. Attention
metadata is planned into a FlashInfer wrapper with static buffers per size. Sampling stays
outside the graph.

With LoRA adapters each size has a second graph whose layers add the adapters' products
(aserve/lora/), reading the rows' adapter ids from a static buffer (pad rows 0: no adapter);
steps with adapter rows replay it, the others the plain one, which costs them nothing for
the adapters. Adapters loaded at run time are copied into the tensors both read.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from aserve.attention.flashinfer import FlashInferBackend
from aserve.attention.flashinfer_mla import FlashInferMLABackend
from aserve.config import EngineConfig
from aserve.forward import ForwardBatch, ForwardMode
from aserve.kvcache.pages import PageTable, pages_needed
from aserve.lora.layers import LoraRows

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to the maximum (which is always included): a batch runs
    padded to the next size, and at large batches the padded rows cost GEMM time."""
    sizes = {s for s in (1, 2, 4) if s <= max_batch_size}
    sizes.update(range(8, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def graph_batch_limit(config: EngineConfig) -> int:
    """The largest batch the decode graphs capture: `--cuda-graph-max-bs`, unset meaning
    256, never above the running-request cap; 0 turns graphs off."""
    chosen = 256 if config.cuda_graph_max_bs is None else config.cuda_graph_max_bs
    return min(chosen, config.max_running_requests)


def graph_page_ids(max_batch_size: int, max_seq_len: int, page_size: int) -> int:
    """Entries of the graphs' shared page-id buffer: every row at full context."""
    return max_batch_size * pages_needed(max_seq_len + 1, page_size)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        attn: FlashInferBackend | FlashInferMLABackend,
        page_table: PageTable,
        max_batch_size: int,
        max_seq_len: int,
        adapters: LoraRows | None = None,
    ) -> None:
        self.model = model
        self.copies_rows = bool(getattr(model, "reads_rows", False))
        self.adapters = adapters
        self.attn = attn
        self.page_table = page_table
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        device = page_table.slots.device
        n = self.max_batch_size
        windowed = page_table.window_slots is not None
        self.token_inputs = torch.zeros(3 + windowed, n, dtype=torch.int64, device=device)
        self.rows = torch.full((n,), page_table.dummy_row, dtype=torch.int64, device=device)
        self.logit_indices = torch.arange(n, device=device)
        # One page-id buffer for every size, as large as the largest batch at full context.
        entries = graph_page_ids(n, max_seq_len, attn.page_size)
        self.page_ids = torch.zeros(entries, dtype=torch.int32, device=device)
        # The sliding-window layers' plans list their own pages where they have them.
        window_entries = entries if windowed else 0
        self.window_page_ids = torch.zeros(window_entries, dtype=torch.int32, device=device)
        self.wrappers = {
            bs: attn.graph_decode_wrapper(bs, self.page_ids, self.window_page_ids)
            for bs in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.adapter_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.adapter_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.adapter_outputs: dict[int, torch.Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def sizes_without_flashinfer(self) -> list[int]:
        """The sizes whose decode runs aserve's Triton attention: their capture needs none of
        FlashInfer's modules, so it can go on while those build (a first start)."""
        return [size for size in self.sizes if self.attn.uses_triton(size)]

    def _static_batch(self, size: int, seq_lens: list[int], row_ids: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            token_inputs=self.token_inputs[:, :size],
            rows=self.rows[:size],
            row_ids=row_ids,
            prefix_lens=[n - 1 for n in seq_lens],
            extend_lens=[1] * size,
            seq_lens=seq_lens,
            logit_indices=self.logit_indices[:size],
            record_index=self.logit_indices[:size],  # unused: tokens are recorded outside
            page_table=self.page_table.slots,
            window_page_table=self.page_table.window_slots,
        )

    @torch.inference_mode()
    def forward_each_size(self) -> None:
        """One eager forward at each size not captured yet, attention through aserve's
        Triton kernels: under the warm-up's kernel census (engine/kernel_census.py) it notes
        the kernels every size runs (products and norms by row count), so that they compile
        in parallel, before any capture and while FlashInfer's modules build."""
        wrapper = self.attn.triton_wrapper
        if wrapper is None:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in sorted(set(self.sizes) - self.graphs.keys(), reverse=True):
                batch = self._static_batch(size, [1] * size, [self.page_table.dummy_row] * size)
                self.attn.plan_decode(wrapper, batch)
                self.model(batch, self.attn)
        torch.cuda.current_stream().wait_stream(side)

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture `sizes` (by default every size not captured yet), largest first."""
        sizes = sorted(set(self.sizes) - self.graphs.keys() if sizes is None else set(sizes))
        if not sizes:
            return
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        # One eager forward, before the first capture, on a side stream: the libraries'
        # one-time set-ups (cuBLAS handles and workspaces, NCCL's first collective) happen
        # outside a graph. The sizes are captured without one of their own: what a size
        # meets for the first time (a Triton kernel of another setting, loaded or
        # compiled; a cuBLAS kernel loaded lazily) is a host-side call that relaxed capture
        # lets through, not stream work. Warm H200 starts: capture 1.0-1.3 s against
        # 1.1-2.5 with a forward before every size (bench/NOTES.md).
        for size in reversed(sizes):
            batch = self._static_batch(size, [1] * size, [self.page_table.dummy_row] * size)
            self.attn.plan_decode(self.wrappers[size], batch)
            if not self.graphs:
                warm_up = torch.cuda.Stream()
                warm_up.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm_up):
                    self.model(batch, self.attn)
                torch.cuda.current_stream().wait_stream(warm_up)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="relaxed"):
                self.outputs[size] = self.model(batch, self.attn)
            if self.adapters is not None:
                self._capture_adapted(size, batch)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s, using %.2f GiB",
            sizes,
            time.perf_counter() - started,
            used / (1 << 30),
        )

    def _capture_adapted(self, size: int, batch: ForwardBatch) -> None:
        """The graph of `size` with the adapters' products."""
        assert self.adapters is not None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="relaxed"):
                self.adapters.begin(self.adapter_ids[:size])
                self.adapter_outputs[size] = self.model(batch, self.attn)
        finally:
            self.adapters.end()
        self.adapter_graphs[size] = graph

    def size_for(self, count: int) -> int | None:
        """The captured size that a decode batch of `count` requests replays, padded: the
        next size up once every size is captured; before (FlashInfer's modules still
        building), the next one captured."""
        return next((s for s in self.sizes if s >= count and s in self.graphs), None)

    def run(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """Logits of a decode batch by replay of the graph of `size` (`size_for`)."""
        count = batch.batch_size
        self.token_inputs[:, :count].copy_(batch.token_inputs)
        if size > count:
            self.token_inputs[:, count:size].zero_()
        if self.copies_rows:  # padded entries take the dummy row, whatever ran there before
            self.rows[:count].copy_(batch.rows)
            self.rows[count:size].fill_(self.page_table.dummy_row)
        padding = size - count
        padded = self._static_batch(
            size,
            batch.seq_lens + [1] * padding,
            batch.row_ids + [self.page_table.dummy_row] * padding,
        )
        self.attn.plan_decode(self.wrappers[size], padded)
        if batch.adapter_ids is None:
            self.graphs[size].replay()
            return self.outputs[size][:count]
        self.adapter_ids[:count].copy_(batch.adapter_ids)
        self.adapter_ids[count:size].zero_()
        self.adapter_graphs[size].replay()
        return self.adapter_outputs[size][:count]
