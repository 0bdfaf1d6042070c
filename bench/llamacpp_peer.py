"""llama.cpp as the CPU peer of bench/offline.py, on the same GGUF file and workload.

It runs through llama-cpp-python's low-level API rather than its `Llama` class, which serves
one sequence at a time: here up to `max_running` sequences share one unified KV cache and
every step is one `llama_decode` over a token per running sequence plus the whole prompts of
sequences that join, as llama.cpp's own server batches. Decoding is greedy (argmax of the
logits in numpy), and every sequence makes exactly its requested tokens, like aserve's
`ignore_eos` requests. llama-cpp-python is installed for the benchmark only
(`pip install llama-cpp-python`, a source build), never as a dependency of aserve.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

Workload = list[tuple[list[int], int]]


@dataclass
class Sequence:
    order: int  # its place in the workload
    slot: int
    prompt: list[int]
    wanted: int
    produced: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:
        return len(self.prompt) + len(self.produced) - 1


class LlamaCppModel:
    """llama-cpp-python's library and a GGUF file's model in it, its log lines silenced
    (they would interleave with the benchmark's table)."""

    def __init__(self, gguf: Path) -> None:
        try:
            import llama_cpp
        except ImportError as error:
            raise SystemExit(
                f"--peer llamacpp needs llama-cpp-python ({error}): pip install llama-cpp-python"
            ) from error
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(self.quiet, ctypes.c_void_p())
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        self.context: Any = None  # `_open`'s
        self.memory: Any = None
        self.batch: Any = None

    def _open(self, params: Any, batch_tokens: int) -> None:
        """A context of `params` (one KV cache for all sequences) and a batch of
        `batch_tokens` tokens."""
        params.kv_unified = True
        params.no_perf = True
        self.context = self.lib.llama_init_from_model(self.model, params)
        if not self.context:
            raise SystemExit("llama.cpp could not create a context")
        self.memory = self.lib.llama_get_memory(self.context)
        self.batch = self.lib.llama_batch_init(batch_tokens, 0, 1)

    def _add(self, token: int, position: int, seq: int, wants_logits: bool) -> None:
        """One token of sequence `seq` into the batch."""
        i = self.batch.n_tokens
        self.batch.token[i] = token
        self.batch.pos[i] = position
        self.batch.n_seq_id[i] = 1
        self.batch.seq_id[i][0] = seq
        self.batch.logits[i] = wants_logits
        self.batch.n_tokens = i + 1

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.context)
        self.lib.llama_model_free(self.model)


class LlamaCppPeer(LlamaCppModel):
    def __init__(self, gguf: Path, threads: int, max_running: int, max_seq_len: int) -> None:
        super().__init__(gguf)
        llama_cpp = self.lib
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
        self.max_running = max_running
        self.batch_tokens = max(2048, max_seq_len + max_running)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_running * max_seq_len
        params.n_batch = self.batch_tokens
        params.n_seq_max = max_running
        params.n_threads = params.n_threads_batch = threads
        self._open(params, self.batch_tokens)

    def run(self, workload: Workload) -> tuple[int, float]:
        """Greedy decode of every (prompt, length) pair; returns (tokens made, seconds)."""
        outputs, seconds = self.generate(workload)
        return sum(map(len, outputs)), seconds

    def generate(self, workload: Workload) -> tuple[list[list[int]], float]:
        """Greedy decode of every (prompt, length) pair; returns each pair's new tokens, in
        the workload's order, and the seconds it took."""
        lib = self.lib
        waiting = list(workload)
        waiting.reverse()
        free_slots = list(range(self.max_running))
        running: list[Sequence] = []
        finished: list[Sequence] = []
        started = time.perf_counter()
        while waiting or running:
            self._clear_batch()
            for seq in running:
                self._add(seq.produced[-1], seq.position, seq.slot, wants_logits=True)
            joined = []
            while waiting and free_slots:
                prompt, wanted = waiting[-1]
                if self.batch.n_tokens + len(prompt) > self.batch_tokens:
                    break
                waiting.pop()
                seq = Sequence(
                    len(finished) + len(running) + len(joined), free_slots.pop(), prompt, wanted
                )
                for position, token in enumerate(prompt):
                    self._add(token, position, seq.slot, position == len(prompt) - 1)
                joined.append(seq)
            running.extend(joined)
            if lib.llama_decode(self.context, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            logits = np.ctypeslib.as_array(
                lib.llama_get_logits(self.context), shape=(len(running), self.vocab_size)
            )
            for seq, token in zip(running, logits.argmax(axis=1).tolist()):
                seq.produced.append(token)
            done = [s for s in running if len(s.produced) == s.wanted]
            for seq in done:
                lib.llama_memory_seq_rm(self.memory, seq.slot, -1, -1)
                free_slots.append(seq.slot)
            finished.extend(done)
            running = [s for s in running if len(s.produced) < s.wanted]
        seconds = time.perf_counter() - started
        return [s.produced for s in sorted(finished, key=lambda s: s.order)], seconds

    def _clear_batch(self) -> None:
        self.batch.n_tokens = 0
