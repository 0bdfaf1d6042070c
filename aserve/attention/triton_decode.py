"""Decode attention in Triton kernels, for the batch sizes where they beat FlashInfer's
(CUDA only).

One program reads a (request, KV head) pair's context, or a split of it, in blocks of
tokens for all query heads of the KV head at once (padded to 16 rows for the tensor cores),
with KV heads varying fastest over the launch so neighbouring programs read neighbouring
heads of the same slots. Two regimes:

- Small batches (1-2 requests): each pair's context is cut into a fixed number of splits,
  enough programs to fill the GPU, and the last program of a pair to finish merges the
  splits by their log-sum-exp (layers/tickets.py: no second kernel). At batch 1
  FlashInfer's decode took 13 us a layer on the H200 for Llama-3.1-8B's shape at a context
  of 1,000 (its tensor-core kernel and the merge of its splits), where reading that layer's
  K and V takes about 1 us; these took 6.5 us with a merge kernel.
- Large batches (at least `WHOLE_MIN_PROGRAMS` pairs): one program a pair walks the whole
  context and writes the output itself. Blocks of 128 tokens that lie in one page need one
  page-id lookup each, and two pipeline stages keep the loads streaming; on the H200 this
  reads the KV cache at 4.1-4.6 TB/s where FlashInfer's tensor-core decode reads it at
  3.4-4.3 (8-24% faster at 40-256 requests of mixed contexts).

Programs take requests longest first (`plan` sorts them on the host): with contexts of mixed
lengths a long one left for last would run alone at the end of the launch. On the H200,
48-256 requests of 100-600, 100-1,100 or 100-2,048 tokens: 5% faster than in batch order
over those 15 cases, 13% faster than FlashInfer.

`TritonDecodeWrapper` takes the paged layout FlashInfer's decode wrappers take (page index
pointers, page ids, last-page lengths; all three on the host) through the same `plan` / `run`
calls, so the FlashInfer backend hands it the batches `takes_batch` names, in CUDA graphs
too (static buffers, a grid fixed at capture). Imported only on CUDA (it imports Triton).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from aserve.layers.pdl import pdl_options, wait_for_previous
from aserve.layers.tickets import TICKET_SLOTS, last_of_splits, split_tickets

SPLIT_MAX_BATCH = 2
"""Batches up to this size take the split kernels. bench/decode_kernels.py on the H200 (us a
layer, Llama-3.1-8B shape, contexts of 1,000 / 2,000): batch 1 6.2 / 7.4 against
FlashInfer's 11.0 / 11.5, batch 2 7.6 / 10.2 against 11.6 / 11.9, batch 4 10.0 / 14.0
against 12.2 / 13.0, batch 8 14.7 / 29.3 against 13.4 / 25.1 (each program then walks a
long split alone)."""

WHOLE_MIN_PROGRAMS = 320
"""Batches with at least this many (request, KV head) pairs take the whole-context kernel.
Measured on the H200 against FlashInfer's tensor-core decode (8 KV heads, 32 or 16 query
heads, contexts of 1,000, 2,000, or mixed in 100-1,100 / 100-2,048): from 40 requests (320
pairs) it was faster in 52 of 56 cases and at most 4% slower (64 and 128 requests of exactly
2,000 tokens); at 24-32 requests it lost 3-15% in 7 of 16 cases, so those stay with
FlashInfer."""

SPLIT_BLOCK_TOKENS = 64
PROGRAMS = 264
"""Programs a batch's splits aim at: the H100/H200's 132 SMs twice. Blocks of 16 to 64
tokens and 132 to 528 programs all gave the 8B single-stream step 4.33-4.36 ms with a merge
kernel after the splits. Merged by their last program, splits of 32 tokens made 32 parts to
read at a context of 1,000 (two goes of `MERGE_SPLITS`): 5.8 -> 7.3 us a layer at batch 1
(bench/decode_kernels.py, H200); 64 tokens make 16."""

WHOLE_BLOCK_TOKENS = 128
WHOLE_STAGES = 2
WHOLE_WARPS = 4
"""The whole-context kernel's settings: of blocks of 64 or 128 tokens, 2 or 3 stages and 4 or
8 warps, these were fastest on average over the cases above (0.93 of FlashInfer's time)."""


FP8_DOT_F16 = True
FP8_WHOLE_SETTINGS = ((0, 32, 1, 6),)
FP8_SPLIT_SETTINGS = ((13, 64, 2, 6), (0, 64, 4, 2))
FP8_SPLIT_PROGRAMS = 512
"""Over an FP8 cache: products in float16 (FP8 widens to it in one instruction per two values;
to bfloat16 it takes more; FP8 tensor-core products, queries and softmax weights rounded to
FP8, were no faster: 173 / 184 us at 256 requests against 170). Whole contexts take
(pairs from, block tokens, warps, stages), splits (requests from, block tokens, warps,
stages) and enough splits for `FP8_SPLIT_PROGRAMS` programs: one warp with deep pipelines of
small blocks keeps the most bytes moving, except over a few requests, where a program reads
one or two blocks and four warps finish them sooner.

On the H200 (bench/decode_kernels.py --fp8-settings, 8B shape, contexts of 1,000, us a
layer), batch 8 / 16 / 32 / 48 / 64 / 96 / 128 / 256: 10.5 / 15.7 / 26.3 / 39.4 / 40.9 /
64.3 / 76.7 / 153.4 with these settings for 13 requests and more, against 12 / 20 / 36.4 /
39.4 / 42.1 / 69.0 / 87.9 / 164.2 with the settings before (splits for 264 programs in blocks
of 32 with 4 warps and 3 stages; whole contexts in blocks of 64 with 2 warps and 6 stages,
then 1 warp and 4 stages from 1,024 pairs); with whole blocks read without masks, 32 / 64 /
96 / 128 / 256: 27.4 / 38.6 / 60.1 / 65.7 / 127.7 (4.1 TB/s of FP8 at 256, where the bf16
kernel reads 4.3). A whole-context program of one warp takes 255 registers a thread
(ptxas for sm_90a: 16 padded query rows), so 8 fit an SM and a launch of more than ~1,056
programs runs in two waves: with 16-token blocks the kernel took 68 us at 128 requests and
113-129 us at every batch from 144 to 224. Blocks of 32 tokens in 6 stages (5 alike; 7 or 8
lose from 96 requests) take 35 / 39 / 56 / 71 / 118 / 119 / 135 us at 40 / 64 / 96 / 128 /
160 / 192 / 256 requests, against 35 / 39 / 61 / 68 / 125 / 126 / 133 with the two settings
before (16 tokens in 8 stages from 1,024 pairs, 32 in 8 below; one command, 2026-11-25).
Over mini-SGLang's offline workload, whose contexts are mixed, the one setting beat the two:
8B FP8 + FP8 KV 15,039 / 15,037 -> 15,272 / 15,305 tok/s, Qwen3-0.6B FP8 KV 34,721 ->
35,565 (alternating in one command). The split kernel alone in a CUDA graph, 1 / 2 / 4 / 6 /
8 / 12 / 16 / 32 requests: 5.6 / 6.5 / 9.5 / 9.8 / 13.3 / 15.2 / 21.7 / 40.0 with four
warps and two stages, 8.3 / 9.5 / 12.5 / 14.5 / 14.5 / 15.4 / 18.9 / 26.1 with two warps and
six (blocks of 64); the single 8B FP8 stream 2.74 -> 2.67 ms/token in the same command
(bench/latency.py). Rescaling the running sums only when a row's max rose by more than 8 (a
branch in the loop) was 3-15% slower."""


def takes_batch(batch_size: int, num_kv_heads: int) -> bool:
    """Whether these kernels beat FlashInfer's for a decode batch of this size."""
    return batch_size <= SPLIT_MAX_BATCH or batch_size * num_kv_heads >= WHOLE_MIN_PROGRAMS


@triton.jit
def _head_mask(row_ok, dims, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The rows-by-dims mask of a tile of heads whose size is padded to a power of two
    (Phi-3's 96 to 128): the rows' alone where nothing is padded, as before."""
    if HEAD_PAD == HEAD_DIM:
        return row_ok[:, None]
    else:
        return row_ok[:, None] & (dims < HEAD_DIM)[None, :]


@triton.jit
def _attend_block(
    query,
    best,
    total,
    acc,
    scale,
    block,
    end,
    lo,
    k_cache,
    v_cache,
    request_pages,
    page_stride,
    token_stride,
    head_at,
    softcap,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One block of tokens into the running softmax (`best` the rows' max score in log2
    units, `total` their weights' sum, `acc` the weighted values); `MASKED` for a block that
    runs past `end` or (`WINDOWED`) starts before `lo`, the window's first position. With
    `SOFTCAP` (Gemma 2) the scores are capped by `softcap` (in log2 units too) * tanh(score /
    softcap), tanh as 2 sigmoid(2x) - 1."""
    tokens = block + tl.arange(0, BLOCK_T)
    token_ok = tokens < end
    if WINDOWED:
        token_ok = token_ok & (tokens >= lo)
    dims = tl.arange(0, HEAD_PAD)
    if PAGE_SIZE % BLOCK_T == 0:  # the block lies in one page: one page id to look up
        page = tl.load(request_pages + block // PAGE_SIZE)
        token_at = page.to(tl.int64) * page_stride + (block % PAGE_SIZE) * token_stride
        token_at += tl.arange(0, BLOCK_T) * token_stride
    elif MASKED:
        page = tl.load(request_pages + tokens // PAGE_SIZE, mask=token_ok, other=0)
        token_at = page.to(tl.int64) * page_stride + (tokens % PAGE_SIZE) * token_stride
    else:
        page = tl.load(request_pages + tokens // PAGE_SIZE)
        token_at = page.to(tl.int64) * page_stride + (tokens % PAGE_SIZE) * token_stride
    offsets = token_at[:, None] + head_at + dims[None, :]
    # V is asked for with K, not after the scores: a split of one block then waits for
    # memory once.
    if MASKED:
        kv_ok = _head_mask(token_ok, dims, HEAD_DIM, HEAD_PAD)
        keys = tl.load(k_cache + offsets, mask=kv_ok, other=0.0)
        values = tl.load(v_cache + offsets, mask=kv_ok, other=0.0)
    elif HEAD_PAD == HEAD_DIM:
        keys = tl.load(k_cache + offsets)
        values = tl.load(v_cache + offsets)
    else:
        keys = tl.load(k_cache + offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        values = tl.load(v_cache + offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    scores = tl.dot(query, tl.trans(keys.to(query.dtype))) * scale
    if SOFTCAP:
        scores = softcap * (2.0 * tl.sigmoid(scores * (2.0 / softcap)) - 1.0)
    if MASKED:
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    weights = tl.exp2(scores - new_best[:, None])
    rescale = tl.exp2(best - new_best)
    total = total * rescale + tl.sum(weights, axis=1)
    acc = acc * rescale[:, None] + tl.dot(weights.to(query.dtype), values.to(query.dtype))
    return new_best, total, acc


# One compile for every split count: each captured batch size would otherwise
# add variants (Triton specializes integers equal to 1 and multiples of 16).
@triton.jit(do_not_specialize=["num_splits", "window", "softcap"])
def _attend_kernel(
    q,
    q_stride,
    k_cache,
    v_cache,
    page_stride,
    token_stride,
    head_stride,
    order,
    indptr,
    page_ids,
    last_page_len,
    out,
    out_stride,
    partial_out,
    partial_lse,
    tickets,
    sinks,
    sm_scale,
    v_scale,
    num_splits,
    window,
    softcap,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DIRECT: tl.constexpr,
    F16: tl.constexpr,
    UNMASKED_BLOCKS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
):
    # KV heads vary fastest over the launch, so programs running side by side read
    # neighbouring heads of the same tokens (one slot's K or V row is all heads together).
    kv_head, split = tl.program_id(0), tl.program_id(2)
    # Longest first; a split batch (1-2 requests) skips that extra dependent load. The
    # layout comes from the plan's copy, which no kernel writes: read before the wait.
    request = tl.load(order + tl.program_id(1)) if DIRECT else tl.program_id(1)
    first_page = tl.load(indptr + request)
    pages = tl.load(indptr + request + 1) - first_page
    seq_len = (pages - 1) * PAGE_SIZE + tl.load(last_page_len + request)  # a decode row has >= 1
    # With a sliding window (Gemma 3) the splits share the last `window` positions, from the
    # block that holds the first of them.
    lo = tl.maximum(seq_len - window, 0) if WINDOWED else 0
    base = lo // BLOCK_T * BLOCK_T
    chunk = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_T) * BLOCK_T  # blocks aligned
    start = base + split * chunk
    # Splits past a short context have nothing to read: they end here, and the context's
    # `used` splits are the ones that merge.
    if start < seq_len:
        wait_for_previous(PDL)
        end = tl.minimum(start + chunk, seq_len)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_PAD)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        head_ok = _head_mask(row_ok, dims, HEAD_DIM, HEAD_PAD)
        query_at = q + request * q_stride + heads[:, None] * HEAD_DIM + dims[None, :]
        query = tl.load(query_at, mask=head_ok, other=0.0)
        scale = sm_scale * 1.4426950408889634  # exp2 of scores in log2 units
        softcap = softcap * 1.4426950408889634
        # An FP8 cache is widened as it is read, to the queries' dtype or (F16) to float16,
        # the queries then scaled first so that they cannot overflow it; its K scale is
        # folded into `sm_scale`, its V scale multiplies the result.
        if F16:
            query = (query.to(tl.float32) * scale).to(tl.float16)
            scale = 1.0

        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        if SINKS and DIRECT:  # each head's sink: a first score of weight one on no value
            best, total = _sink_start(sinks, heads, row_ok)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        pages_of_request = page_ids + first_page
        head_at = kv_head * head_stride
        if UNMASKED_BLOCKS:
            # Whole blocks without masks, then the last, partial block with them: over an
            # FP8 cache at 256 requests the masks cost 17% (bench/decode_kernels.py: 153.4
            # -> 127.7 us a layer). Not for the splits' few blocks (2-5% slower at 1-32
            # requests) nor the bf16 kernel (4% slower at 128-256 requests, 17% at 48).
            full_end = start + (end - start) // BLOCK_T * BLOCK_T
            for block in range(start, full_end, BLOCK_T):
                best, total, acc = _attend_block(
                    query, best, total, acc, scale, block, end, lo, k_cache, v_cache,
                    pages_of_request, page_stride, token_stride, head_at, softcap, PAGE_SIZE,
                    HEAD_DIM, HEAD_PAD, BLOCK_T, False, False, SOFTCAP,
                )  # fmt: skip
            if full_end < end:
                best, total, acc = _attend_block(
                    query, best, total, acc, scale, full_end, end, lo, k_cache, v_cache,
                    pages_of_request, page_stride, token_stride, head_at, softcap, PAGE_SIZE,
                    HEAD_DIM, HEAD_PAD, BLOCK_T, True, False, SOFTCAP,
                )  # fmt: skip
        else:
            for block in range(start, end, BLOCK_T):
                best, total, acc = _attend_block(
                    query, best, total, acc, scale, block, end, lo, k_cache, v_cache,
                    pages_of_request, page_stride, token_stride, head_at, softcap, PAGE_SIZE,
                    HEAD_DIM, HEAD_PAD, BLOCK_T, True, WINDOWED, SOFTCAP,
                )  # fmt: skip

        acc = acc * v_scale
        if DIRECT:  # one split: the whole context, finished here
            result = acc / total[:, None]
            out_at = out + request * out_stride + heads[:, None] * HEAD_DIM + dims[None, :]
            tl.store(out_at, result.to(out.dtype.element_ty), mask=head_ok)
        else:
            # A used split has at least one token: its sum of weights is not 0.
            lse = best + tl.log2(total)
            slot = (request * tl.num_programs(0) * GROUP + heads) * num_splits + split
            part_at = partial_out + slot[:, None] * HEAD_DIM + dims[None, :]
            tl.store(part_at, acc / total[:, None], mask=head_ok)
            tl.store(partial_lse + slot, lse, mask=row_ok)
            pair = request * tl.num_programs(0) + kv_head
            used = tl.cdiv(seq_len - base, chunk)
            if last_of_splits(tickets, pair, used):
                _merge_splits(
                    partial_out, partial_lse, out + request * out_stride, pair * GROUP,
                    kv_head * GROUP, num_splits, used, sinks, GROUP, MERGE_ROWS, HEAD_DIM,
                    HEAD_PAD, SINKS,
                )  # fmt: skip


MERGE_SPLITS = tl.constexpr(16)
"""Splits the merging program reads at a time."""


@triton.jit
def _sink_start(sinks, heads, row_ok):
    """A running softmax's start with attention sinks (gpt-oss): each head's sink logit as
    its maximum (in log2 units, as the scores) and a sum of weights of one, e^0."""
    sink = tl.load(sinks + heads, mask=row_ok, other=0.0) * 1.4426950408889634
    return sink, tl.full(sink.shape, 1.0, tl.float32)


@triton.jit
def _merge_splits(
    partial_out,
    partial_lse,
    out_row,
    first_row,
    first_head,
    num_splits,
    used,
    sinks,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    """A KV head's query heads merged over their `used` splits by log-sum-exp, in split order
    whichever program runs it, `MERGE_SPLITS` at a time under a running maximum; the parts are
    read from L2 (`.cg`: other SMs wrote them). With SINKS each head's sink joins first, as
    a split of weight e^sink and no value."""
    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_PAD)
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    if SINKS:
        best, total = _sink_start(sinks, first_head + rows, row_ok)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for first in range(0, used, MERGE_SPLITS):
        splits = first + tl.arange(0, MERGE_SPLITS)
        ok = row_ok[:, None] & (splits < used)[None, :]
        slot = (first_row + rows)[:, None] * num_splits + splits[None, :]
        lse = tl.load(partial_lse + slot, mask=ok, other=float("-inf"), cache_modifier=".cg")
        if HEAD_PAD == HEAD_DIM:
            part_ok = ok[:, :, None]
        else:
            part_ok = ok[:, :, None] & (dims < HEAD_DIM)[None, None, :]
        parts = tl.load(
            partial_out + slot[:, :, None] * HEAD_DIM + dims[None, None, :],
            mask=part_ok,
            other=0.0,
            cache_modifier=".cg",
        )
        # Padding rows (ROWS > GROUP) see only -inf and give NaN, never stored.
        new_best = tl.maximum(best, tl.max(lse, axis=1))
        weights = tl.exp2(lse - new_best[:, None])
        rescale = tl.exp2(best - new_best)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(parts * weights[:, :, None], axis=1)
        best = new_best
    heads = first_head + rows
    merged = acc / total[:, None]
    out_at = out_row + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(
        out_at,
        merged.to(out_row.dtype.element_ty),
        mask=_head_mask(row_ok, dims, HEAD_DIM, HEAD_PAD),
    )


class TritonDecodeWrapper:
    """FlashInfer's decode-wrapper calls (`plan`, then `run` per layer) over the kernels
    above, with the paged layout on the host: `plan` sends it to the device in one copy,
    with the order the programs take the requests in. With `static_batch` it lands in one
    buffer sized for a CUDA graph of that many requests and up to `page_capacity` pages."""

    def __init__(
        self,
        device: torch.device,
        static_batch: int | None = None,
        page_capacity: int = 0,
    ) -> None:
        self.device = device
        self.static_batch = static_batch
        if static_batch is not None:
            # [indptr (B + 1) | order (B) | last page lengths (B) | page ids]
            self.meta = torch.zeros(
                3 * static_batch + 1 + page_capacity, dtype=torch.int32, device=device
            )
            self._view_meta(static_batch)
        self.partial: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tickets = split_tickets(device)

    def _view_meta(self, batch: int) -> None:
        sizes = [batch + 1, batch, batch, len(self.meta) - 3 * batch - 1]
        self.indptr, self.order, self.last_page_len, self.page_ids = self.meta.split(sizes)

    def plan(
        self,
        indptr: torch.Tensor | np.ndarray,
        indices: torch.Tensor | np.ndarray,
        last_page_len: torch.Tensor | np.ndarray,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
    ) -> None:
        """FlashInfer's layout, all three on the host (int32): page index pointers, page ids
        and last-page lengths. One host-to-device copy a plan, where FlashInfer's signature
        with page ids already on the device took four (on a slow host core, ~0.15 ms of the
        event loop's time a decode step at 256 requests)."""
        pointers = np.asarray(indptr, dtype=np.int32)
        last = np.asarray(last_page_len, dtype=np.int32)
        batch = len(pointers) - 1
        lengths = (pointers[1:] - pointers[:-1] - 1) * page_size + last
        order = np.argsort(-lengths, kind="stable").astype(np.int32)
        meta = torch.from_numpy(
            np.concatenate([pointers, order, last, np.asarray(indices, dtype=np.int32)])
        )
        if self.static_batch is not None:
            assert batch == self.static_batch, "a graph's batch is padded to its size"
            self.meta[: len(meta)].copy_(meta, non_blocking=True)
        else:
            self.meta = meta.to(self.device, non_blocking=True)
            self._view_meta(batch)
        self.batch = batch
        self.num_kv_heads = num_kv_heads
        self.group = num_qo_heads // num_kv_heads
        self.page_size = page_size
        pairs = batch * num_kv_heads
        whole = pairs >= WHOLE_MIN_PROGRAMS
        programs = FP8_SPLIT_PROGRAMS if kv_data_type == torch.float8_e4m3fn else PROGRAMS
        self.num_splits = 1 if whole else min(64, max(1, math.ceil(programs / pairs)))
        if self.num_splits == 1:
            return
        assert pairs <= TICKET_SLOTS, f"{pairs} (request, KV head) pairs to merge"
        shape = (batch * num_qo_heads * self.num_splits,)
        if self.partial is None or self.partial[1].shape != shape:
            self.partial = (
                torch.empty(shape + (head_dim,), dtype=torch.float32, device=self.device),
                torch.empty(shape, dtype=torch.float32, device=self.device),
            )

    def run(
        self,
        q: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        window: int = 0,
        sm_scale: float | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """`q` `[batch, heads, head_dim]` (rows may be strided); `cache` the K and V views
        `[pages, page_size, kv_heads, head_dim]` of one layer's pool, in `q`'s dtype or in
        FP8 with the layer's scales. `window`: the layer's sliding window (0: none);
        `sm_scale` the scores' scale (default 1 / sqrt(head_dim)); `sinks` float32
        `[heads]`, each head's sink logit (gpt-oss), or None; `softcap` the scaled scores'
        soft cap (Gemma 2; 0: none)."""
        k_cache, v_cache = cache
        batch, heads, head_dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == head_dim and k_cache.stride(3) == 1
        assert k_cache.stride() == v_cache.stride()
        direct = self.num_splits == 1
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)
        partial_out, partial_lse = (out, out) if direct else self.partial
        if not direct and fp8:
            _, block_tokens, warps, stages = next(s for s in FP8_SPLIT_SETTINGS if batch >= s[0])
        elif not direct:
            block_tokens, warps, stages = SPLIT_BLOCK_TOKENS, 4, 3
        elif fp8:
            pairs = batch * self.num_kv_heads
            _, block_tokens, warps, stages = next(s for s in FP8_WHOLE_SETTINGS if pairs >= s[0])
        else:
            block_tokens, warps, stages = WHOLE_BLOCK_TOKENS, WHOLE_WARPS, WHOLE_STAGES
        _attend_kernel[(self.num_kv_heads, batch, self.num_splits)](
            q,
            q.stride(0),
            k_cache,
            v_cache,
            *k_cache.stride()[:3],  # page, token in a page, head: any layout with these strides
            self.order,
            self.indptr,
            self.page_ids,
            self.last_page_len,
            out,
            out.stride(0),
            partial_out,
            partial_lse,
            self.tickets,
            self.tickets if sinks is None else sinks,
            (head_dim**-0.5 if sm_scale is None else sm_scale) * k_scale,
            v_scale,
            self.num_splits,
            window,
            softcap,
            PAGE_SIZE=self.page_size,
            GROUP=self.group,
            GROUP_PAD=max(16, triton.next_power_of_2(self.group)),
            MERGE_ROWS=triton.next_power_of_2(self.group),
            HEAD_DIM=head_dim,
            HEAD_PAD=triton.next_power_of_2(head_dim),
            BLOCK_T=block_tokens,
            DIRECT=direct,
            F16=fp8 and FP8_DOT_F16,
            UNMASKED_BLOCKS=fp8 and direct and not window,
            WINDOWED=window > 0,
            SINKS=sinks is not None,
            SOFTCAP=softcap > 0,
            num_warps=warps,
            num_stages=stages,
            **pdl_options(q.device, batch),
        )
        return out
