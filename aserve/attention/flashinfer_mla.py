"""Latent attention (models/mla.py) through FlashInfer's MLA kernels (CUDA, 16-bit cache).

The pool's one-part slots `[pages * page_size, 1, 1, kv_lora_rank + rope]` are FlashInfer's
MLA page layout once viewed as `[pages, page_size, width]`: the latent columns are its
`ckv` cache and the rest its `kpe` cache, two strided views the kernels read in place.
One wrapper runs both phases: a prefill's queries causally after their request's cached
prefix, a decode step's one query a request. Plans come from host data only (the page
table's host mirror), as attention/flashinfer.py's do. Decode graphs (engine/graph.py) take
a wrapper of their own a captured size, whose index buffers stay put: `plan_decode` fills
them before each replay.
"""

from __future__ import annotations

from typing import Any

import torch

from aserve.forward import ForwardBatch
from aserve.kvcache.pages import PageTable
from aserve.kvcache.pool import KVPool

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace for MLA
LATENT_WIDTHS = (512, 64)
"""The (latent, rotating key part) widths FlashInfer's MLA kernels are built for: DeepSeek-V2's
and V3's (and so Kimi K2's and Moonlight's)."""


def runs_latent(pool_dtype: torch.dtype, latent: int, rope: int) -> bool:
    """Whether FlashInfer's MLA kernels take this cache: 16-bit, of the published widths."""
    return pool_dtype in (torch.float16, torch.bfloat16) and (latent, rope) == LATENT_WIDTHS


class FlashInferMLABackend:
    """`scale`: the scores' scale of a whole query head (`ModelConfig.attention_scale`).
    A `LatentBackend` (attention/base.py), with the decode graphs' side of FlashInferBackend's
    interface: `graph_decode_wrapper`, `plan_decode`, and no Triton kernels (`uses_triton`,
    `triton_wrapper`)."""

    triton_wrapper = None

    def __init__(
        self, pool: KVPool, page_table: PageTable, num_heads: int, scale: float, dtype: torch.dtype
    ) -> None:
        import flashinfer

        self.pool = pool
        self.page_table = page_table
        self.num_heads = num_heads
        self.scale = scale
        self.dtype = dtype
        self.latent = pool.value_dim
        self.width = pool.kv[0].shape[-1]
        device = pool.kv[0].device
        self.page_size = pool.page_size
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper: Any = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace)

    def uses_triton(self, batch_size: int) -> bool:
        return False

    def prepare(self, batch: ForwardBatch) -> None:
        self.plan_decode(self.wrapper, batch)

    def graph_decode_wrapper(
        self, batch_size: int, page_ids: torch.Tensor, window_page_ids: torch.Tensor
    ) -> Any:
        """A wrapper whose index arrays are static buffers, for one captured size; `page_ids`
        is the page-id buffer every size shares (no windows here: `window_page_ids` unused)."""
        import flashinfer

        device = self.workspace.device

        def index_buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        return flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self.workspace,
            use_cuda_graph=True,
            qo_indptr=index_buffer(batch_size + 1),
            kv_indptr=index_buffer(batch_size + 1),
            kv_indices=page_ids,
            kv_len_arr=index_buffer(batch_size),
        )

    def plan_decode(self, wrapper: Any, batch: ForwardBatch) -> None:
        """Plan `batch` (a prefill too, despite the name the graphs call it by) into
        `wrapper`."""
        lens = torch.tensor(batch.extend_lens, dtype=torch.int32)
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=qo_indptr[1:])
        indptr, _, pages = self.page_table.page_layout(batch.row_ids, batch.seq_lens)
        device = self.workspace.device
        wrapper.plan(
            qo_indptr,
            torch.from_numpy(indptr),
            torch.from_numpy(pages).to(device, non_blocking=True),
            torch.tensor(batch.seq_lens, dtype=torch.int32),
            self.num_heads,
            self.latent,
            self.width - self.latent,
            self.page_size,
            True,  # bottom-right aligned: each query sees its prefix and itself
            self.scale,
            self.dtype,
            self.pool.storage_dtype,
        )
        batch.attn_metadata = wrapper

    def forward_latent(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """`LatentBackend`'s. The kernels take every operand with its strides: the queries
        as the layer left them, the cache's two parts in place, and an output whose heads
        are the outer dimension, as the layer's product with the value rows reads it."""
        self.pool.store(layer, batch.slots_of(False), kv)
        pages = self.pool.kv[layer].view(-1, self.page_size, self.width)
        latent = self.latent
        tokens = q_latent.shape[0]
        out = q_latent.new_empty(self.num_heads, tokens, latent).transpose(0, 1)
        batch.attn_metadata.run(q_latent, q_rope, pages[..., :latent], pages[..., latent:], out=out)
        return out
