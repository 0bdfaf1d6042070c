"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of rows."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.group import TPGroup
from aserve.layers.cpu_gemm import PackedWeight
from aserve.layers.weight import WeightSource
from aserve.quant.method import TABLE_QUANTIZATIONS, QuantizedTable, Shard, load_table_rows
from aserve.quant.native import Scratch


class VocabParallelEmbedding(nn.Module):
    """Ranks look up the ids in their slice, zero the rest, and all-reduce the rows."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TPGroup, quantization: str | None = None
    ) -> None:
        """`quantization`: the model's; under a `TABLE_QUANTIZATIONS` one the table loads in
        its own form (`load_table_rows`), else in the model's dtype."""
        super().__init__()
        quantized = quantization in TABLE_QUANTIZATIONS
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.local_vocab
        if quantized:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size), False)
        self.quantized = quantized
        self.quantization = quantization
        self.loaded: Shard | None = None
        self.table: QuantizedTable | None = None
        self.packed: PackedWeight | None = None
        self.lookup_table: torch.Tensor | None = None
        self.one_row: Callable[..., torch.Tensor] | None = None  # see layers/linear.py

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup_table is not None:
            return F.embedding(ids, self.lookup_table).to(self.dtype)
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        rows = self._rows(local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.rows(ids)
        return F.embedding(ids, self.weight)

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        rows = tensor[self.vocab_start : self.vocab_start + self.local_vocab]
        if self.quantized:
            assert self.quantization is not None
            self.loaded = load_table_rows(rows, self.local_vocab, self.quantization)
            return
        self.weight.data[: rows.shape[0]].copy_(rows)
        self.weight.data[rows.shape[0] :].zero_()

    def finalize_quantized(
        self, device: torch.device, dtype: torch.dtype, lookups: bool, head: bool, scratch: Scratch
    ) -> None:
        """Pack a table that arrived quantized: for row lookups, for the logits, or both."""
        assert self.loaded is not None, "the table was never loaded"
        self.table = QuantizedTable(self.loaded, device, dtype, lookups, head, scratch)
        self.loaded = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Score `hidden` against every vocabulary row (the tied LM head uses this too)."""
        if self.table is not None:
            local = self.table.logits(hidden)
            return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]
        if self.packed is not None:
            return self.packed.linear(hidden, None)[:, : self.vocab_size]
        if self.one_row is not None and hidden.shape[0] == 1:
            local = self.one_row(hidden, self.weight, None)
        else:
            local = F.linear(hidden, self.weight)
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]

    def pack(self, lookup_table: torch.Tensor | None = None) -> None:
        """CPU, one rank: pack the weight for `logits` as the linear layers are (at 16 rows a
        step's logits took 12 ms plain, 9 packed) and drop the plain one. A packed matrix
        serves no row lookups: a table that is also the embedding reads its rows from
        `lookup_table`, the checkpoint's through a memory map: clean file pages that the OS
        can drop, not a second copy in the process's own memory."""
        self.packed = PackedWeight(self.weight.detach())
        self.lookup_table = lookup_table
        self.dtype = self.weight.dtype
        del self.weight


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output projection: the same sharding as the embedding, its own weight."""
