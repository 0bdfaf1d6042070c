"""How many KV pages fit: what is left after the weights, within the memory ratio."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from aserve.config import EngineConfig, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.engine.graph import graph_batch_limit, graph_page_ids
from aserve.kvcache.pages import PageTable
from aserve.kvcache.pool import KVPool
from aserve.kvcache.states import RecurrentStates
from aserve.models.gated_deltanet import CHUNK

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_KV_BUDGET_BYTES = 2 * GiB
CPU_KV_SHARE_OF_AVAILABLE = 0.25
MIN_PREFILL_LENGTH = 256  # the smallest prefill chunk that shrinking goes down to


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo; total physical memory where that file is missing."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


def sliding_window_pool(model: ModelConfig, max_seq_len: int) -> int:
    """The window after which the sliding-window layers drop their KV, where they keep it in
    pages of their own (0: they do not): the widest of their windows, where it is shorter
    than the context (else they would hold as much as the other layers)."""
    window = max(model.layer_windows, default=0)
    return window if 0 < window < max_seq_len else 0


def kv_bytes_per_token(
    model: ModelConfig, tp: TPGroup, dtype: torch.dtype, window_share: float = 1.0
) -> int:
    """Bytes of K/V a token of the pool takes over all layers; with `window_share` < 1
    (sliding-window layers in their own pages, that many of theirs a token of the others'),
    those layers count that share."""
    local_kv_heads = max(1, model.num_kv_heads // tp.size)
    parts = 1 if model.latent else 2  # latent attention's values are its keys' first columns
    per_layer = KVPool.bytes_per_token(1, local_kv_heads, model.head_dim, dtype, parts)
    windowed = sum(1 for window in model.layer_windows if window) if window_share < 1 else 0
    return int(per_layer * (model.kv_layers - windowed + window_share * windowed))


def plan_window_pages(
    num_pages: int, model: ModelConfig, config: EngineConfig, window: int, max_seq_len: int
) -> tuple[int, int]:
    """Pages of the other layers' pool and of the sliding-window layers' (dummy pages
    included): the latter `--swa-full-tokens-ratio` of the former (SGLang's option), and at
    least what one request needs at once, its window and a whole prefill chunk, so that one
    always fits. Where that least is more than the ratio gives, a pool sized from memory
    gives the other layers' pool up as many bytes."""
    one_request = min(max_seq_len + 1, window + config.max_prefill_length + config.page_size)
    least = -(-one_request // config.page_size) + 1
    planned = int(config.swa_full_tokens_ratio * (num_pages - 1)) + 1
    window_pages = min(num_pages, max(least, planned))
    if config.num_pages is None and window_pages > planned:
        windowed = sum(1 for layer_window in model.layer_windows if layer_window)
        whole = max(1, model.num_layers - windowed)
        excess = (window_pages - planned) * windowed
        num_pages = max(2, num_pages + (-excess // whole))
    return num_pages, window_pages


def window_share(config: EngineConfig, model: ModelConfig, max_seq_len: int) -> float:
    """What a token of the sliding-window layers' pool counts for in sizing (1: they keep
    no pool of their own)."""
    return config.swa_full_tokens_ratio if sliding_window_pool(model, max_seq_len) else 1.0


def working_memory_bytes(
    config: EngineConfig, model: ModelConfig, tp: TPGroup, dtype: torch.dtype
) -> int:
    """What a step needs besides weights and KV, kept out of the pool on CUDA: the largest
    prefill chunk's activations (residual, normed input, Q/K/V, attention output, and the
    MLP's gate/up and product, all alive at once at worst; linear attention's chunk
    matrices, models/gated_deltanet.py), the sampler's float32 [B, vocab]
    tensors (logits, probabilities, filtered copies: four at once), and the decode CUDA
    graphs' own pool, which holds one such activation set at the largest captured batch."""
    size = torch.finfo(dtype).bits // 8
    local_q = model.num_heads // tp.size
    local_kv = max(1, model.num_kv_heads // tp.size)
    inter = max(model.intermediate_size, model.moe_intermediate_size * model.num_experts_per_tok)
    attention = (2 * local_q + 2 * local_kv) * model.head_dim
    width = 3 * model.hidden_size + attention + 3 * inter // tp.size
    prefill = config.max_prefill_length * width * size
    if model.linear_attention is not None:  # the delta rule's chunk matrices, three alive at
        # once, for every place of a prefill's grid of sequences (at most twice its tokens)
        value_heads = model.linear_attention.value_heads // tp.size
        prefill += config.max_prefill_length * 2 * value_heads * 3 * CHUNK * 4
    graphs = config.max_running_requests * (width * size + model.vocab_size * size)
    sampling = 4 * config.max_running_requests * model.vocab_size * 4
    return prefill + graphs + sampling


def step_bytes(
    config: EngineConfig, model: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_seq_len: int
) -> int:
    """What the KV pool must leave on CUDA: a step's working memory, the page table (and
    a hybrid model's recurrent states, a row each) and the decode graphs' page ids
    (int32)."""
    rows = config.max_running_requests + 1
    windowed = sliding_window_pool(model, max_seq_len) > 0
    table = rows * PageTable.bytes_per_row(max_seq_len, config.page_size, windowed)
    if model.linear_attention is not None:
        table += rows * RecurrentStates.bytes_per_row(model.linear_attention, tp.size, dtype)
    graph_pages = graph_page_ids(graph_batch_limit(config), max_seq_len, config.page_size) * 4
    graph_pages *= 1 + windowed  # the windowed layers' plans have their own buffer
    return working_memory_bytes(config, model, tp, dtype) + table + graph_pages


def within_ratio_bytes(config: EngineConfig, device: torch.device) -> int:
    """Free device memory that --memory-ratio lets the pool and a step's working memory use:
    that share of the total may be in use, and what is in use now stays."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free - total * (1.0 - config.memory_ratio))


def fit_step_to_memory(
    config: EngineConfig,
    model: ModelConfig,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    max_seq_len: int,
    kv_dtype: torch.dtype,
) -> EngineConfig:
    """`config` with the running-request cap (the CUDA graphs' largest batch and the
    sampler's rows follow it) and the prefill chunk halved, the larger memory user first,
    until a step's working memory leaves the KV pool room for one request at full context.
    A small GPU (an edge box, or a large one shared) then starts with smaller batches, said
    in one line, instead of a pool too small to serve a context, or none at all. Unchanged
    where it already fits, on CPU, and with --num-pages."""
    if device.type != "cuda" or config.num_pages is not None:
        return config
    available = within_ratio_bytes(config, device)
    share = window_share(config, model, max_seq_len)
    wanted_kv = max_seq_len * kv_bytes_per_token(model, tp, kv_dtype, share)
    fitted = config

    def working(c: EngineConfig) -> int:
        return step_bytes(c, model, tp, dtype, max_seq_len)

    while working(fitted) + wanted_kv > available:
        running, chunk = fitted.max_running_requests, fitted.max_prefill_length
        halve_running = running > 1 and (
            chunk <= MIN_PREFILL_LENGTH
            or working(dataclasses.replace(fitted, max_prefill_length=chunk // 2))
            > working(dataclasses.replace(fitted, max_running_requests=running // 2))
        )
        if halve_running:
            fitted = dataclasses.replace(fitted, max_running_requests=running // 2)
        elif chunk > MIN_PREFILL_LENGTH:
            fitted = dataclasses.replace(
                fitted, max_prefill_length=max(MIN_PREFILL_LENGTH, chunk // 2)
            )
        else:
            break
    fitted = dataclasses.replace(
        fitted,
        max_running_requests=tp.agree_min(fitted.max_running_requests),
        max_prefill_length=tp.agree_min(fitted.max_prefill_length),
    )
    changes = []
    if fitted.max_running_requests != config.max_running_requests:
        changes.append(
            f"running requests (and CUDA graph batches) are capped at "
            f"{fitted.max_running_requests} instead of {config.max_running_requests}"
        )
    if fitted.max_prefill_length != config.max_prefill_length:
        changes.append(
            f"prefill chunks at {fitted.max_prefill_length} tokens instead of "
            f"{config.max_prefill_length}"
        )
    if changes:
        logger.warning(
            "little GPU memory: %.2f GiB for the KV cache and a step's working memory, so %s",
            max(0.0, available) / GiB,
            " and ".join(changes),
        )
    return fitted


def plan_num_pages(
    config: EngineConfig,
    model: ModelConfig,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    max_seq_len: int,
    kv_dtype: torch.dtype,
) -> int:
    """Pages for the KV pool (including the dummy page 0).

    On CUDA, as mini-SGLang defines `--memory-ratio`: that share of the device's total memory
    may be in use once the pool exists, so the pool gets it minus what is already used
    (weights, CUDA context) and minus the working memory of a step (activations, sampler,
    CUDA graphs: `working_memory_bytes`; the page table), so no admitted batch runs out of
    memory. On CPU a laptop must stay usable: the pool takes at most a quarter of available
    RAM and 2 GiB.
    Never more than every running request at full context could use. Tensor-parallel
    ranks take the smallest count of them all, so every rank's pool has the same pages.
    Sliding-window layers with a pool of their own count `--swa-full-tokens-ratio` of a
    token each (`plan_window_pages` sizes that pool).
    """
    if config.num_pages is not None:
        return config.num_pages
    share = window_share(config, model, max_seq_len)
    per_token = kv_bytes_per_token(model, tp, kv_dtype, share)
    if device.type == "cuda":
        budget = within_ratio_bytes(config, device) - step_bytes(
            config, model, tp, dtype, max_seq_len
        )
    else:
        budget = int(min(CPU_KV_BUDGET_BYTES, available_host_memory() * CPU_KV_SHARE_OF_AVAILABLE))
    tokens = min(budget // per_token, config.max_running_requests * max_seq_len)
    pages = tp.agree_min(tokens // config.page_size + 1)
    if pages < 2:
        raise MemoryError(
            f"no room for a KV cache: {budget / GiB:.2f} GiB left for it, one token needs "
            f"{per_token} bytes; lower the model size or raise --memory-ratio"
        )
    return pages
