"""llama.cpp as the CPU peer of bench/embed.py: the same GGUF file and inputs, each pooled at
its last token and made unit length, as aserve's `--is-embedding` does; a file that names
its pooling (`{arch}.pooling_type`: a BERT's [CLS] or mean) pooled as it says, by both.

Through llama-cpp-python's low-level API, as bench/llamacpp_peer.py runs generation: up to
`max_seqs` inputs share one `llama_decode` (llama.cpp's server batches embedding requests
so), every token marked as an output, as llama.cpp asks in embedding mode. Installed for the
benchmark only, never a dependency of aserve.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.llamacpp_peer import LlamaCppModel


class LlamaCppEmbedder(LlamaCppModel):
    def __init__(
        self, gguf: Path, threads: int, max_seqs: int, batch_tokens: int, file_pools: bool
    ) -> None:
        super().__init__(gguf)
        llama_cpp = self.lib
        self.width = llama_cpp.llama_model_n_embd(self.model)
        self.max_seqs, self.batch_tokens = max_seqs, batch_tokens
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = batch_tokens
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        params.embeddings = True
        params.pooling_type = (
            llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED  # the file's own
            if file_pools
            else llama_cpp.LLAMA_POOLING_TYPE_LAST
        )
        self._open(params, batch_tokens)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Each input's embedding, unit length, `[inputs, width]`."""
        out = np.zeros((len(inputs), self.width), np.float32)
        start = 0
        while start < len(inputs):
            self.batch.n_tokens = 0
            end = start
            while end < len(inputs) and end - start < self.max_seqs:
                if self.batch.n_tokens + len(inputs[end]) > self.batch_tokens:
                    break
                for position, token in enumerate(inputs[end]):
                    self._add(token, position, end - start, True)
                end += 1
            if end == start:
                raise ValueError(f"input {start} is longer than {self.batch_tokens} tokens")
            if self.lib.llama_decode(self.context, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i in range(start, end):
                row = self.lib.llama_get_embeddings_seq(self.context, i - start)
                out[i] = np.ctypeslib.as_array(row, shape=(self.width,))
            if self.memory:  # encoders (BERT) keep no cache
                self.lib.llama_memory_clear(self.memory, True)
            start = end
        return out / np.linalg.norm(out, axis=1, keepdims=True)
