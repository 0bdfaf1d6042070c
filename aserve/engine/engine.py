"""The engine of one rank: model, KV pool, page table, attention backend and sampler.

`Engine.forward_logits(batch)` runs one forward and `Engine.sample(...)` picks the next token
of every request in the batch (two calls, so the scheduler can read the previous step
between them when a grammar or penalties need its tokens). It knows nothing about requests
or queues: the scheduler plans, the engine computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from aserve.attention.base import AttentionBackend, SplitBackend
from aserve.attention.flashinfer import FLASHINFER_HEAD_DIMS, triton_decodes
from aserve.attention.flashinfer_mla import LATENT_WIDTHS, FlashInferMLABackend, runs_latent
from aserve.config import ENCODER_ARCHITECTURES, ConfigError, EngineConfig, ModelConfig
from aserve.constrained.masks import StepMasks
from aserve.distributed.group import TPGroup
from aserve.engine.gpu import gpu_capability, start_triton_hash
from aserve.engine.graph import DecodeGraphs, graph_batch_limit
from aserve.engine.memory import (
    GiB,
    fit_step_to_memory,
    free_device_memory,
    plan_num_pages,
    plan_window_pages,
    sliding_window_pool,
)
from aserve.engine.sampler import (
    PromptScoring,
    SampleOutput,
    Sampler,
    SamplingBatch,
    race_kernel,
    score_prompt,
)
from aserve.engine.step import StepSpec, forward_batch
from aserve.forward import ForwardBatch, ForwardMode
from aserve.kvcache.pages import PageTable
from aserve.kvcache.pool import KVPool, kv_storage_dtype
from aserve.kvcache.scales import KVScales
from aserve.kvcache.states import RecurrentStates
from aserve.layers.cpu_gemm import keep_activations_in_heap, return_freed_memory
from aserve.layers.fused import fused_ops
from aserve.layers.linear import pack_linear_weights, use_one_row_kernel
from aserve.layers.moe import QuantizedExperts
from aserve.lora.adapter import read_adapter
from aserve.lora.layers import AdapterSlots, make_adapter_slots
from aserve.models.cpu_decode import use_decode_stacks
from aserve.models.decoder import use_fp8_activations
from aserve.models.multimodal import decoder_weights, language_model_weights
from aserve.models.pooling import Pooler, Pooling, read_pooling
from aserve.models.registry import build_model
from aserve.models.vision import (
    ImageEncoder,
    ImagePiece,
    ImageSpan,
    expand_images,
    image_support,
)
from aserve.models.weights import fill_dummy_weights, iter_weights, load_hf_config, torch_dtype
from aserve.quant.cpu import FLOAT_ON_KERNELS, float_weights_on_kernels
from aserve.quant.fp8 import pair_scales
from aserve.quant.int_checkpoints import pair_int_weights
from aserve.quant.mxfp4 import mxfp4_experts
from aserve.sampling_params import SamplingParams

# Attention backends that are FlashInfer's, and the prefill kernels each asks it for.
FLASHINFER_KERNELS = {"fi": "fa2", "fa": "fa3"}

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    """What `--device auto` runs on: the GPU when torch sees one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return default_device()
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
    return device


@contextlib.contextmanager
def _construct_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New parameters are created directly on `device` in `dtype` (no float32 detour)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


class StepLogits(NamedTuple):
    """A step's logits: `sampled` rows (each request's last token) and `every_row` computed
    (more than those only with prompt logprobs; otherwise the same tensor)."""

    sampled: torch.Tensor
    every_row: torch.Tensor


def require_fp8_gpu(device: torch.device, option: str) -> None:
    """FP8 weights and KV need FP8 hardware: compute capability 8.9 (Ada) or newer."""
    capability = gpu_capability(device)
    if capability is None or capability < (8, 9):
        where = (
            "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        )
        raise ConfigError(
            f"{option} needs a GPU with FP8 (compute capability 8.9 or newer), not {where}"
        )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: Path | None,
        tp: TPGroup | None = None,
    ) -> None:
        if config.is_embedding or model_config.classifies:
            # An embedding server pools the last layer's output (`DecoderForCausalLM.embed`)
            # and never runs the LM head: tied to the embedding, an untied checkpoint's head
            # is neither read nor held. Nothing decodes, so no decode graph is captured.
            config = dataclasses.replace(config, cuda_graph_max_bs=0)
            model_config = dataclasses.replace(model_config, tie_word_embeddings=True)
        # A classifier (reranker, reward model) pools its last token too, into its labels.
        self.pooling = config.is_embedding or model_config.classifies
        self.config = config
        self.tp = tp or TPGroup()
        # This rank's query and KV heads (a KV head is replicated when there are fewer than ranks).
        self.local_heads = model_config.num_heads // self.tp.size
        self.local_kv_heads = max(1, model_config.num_kv_heads // self.tp.size)
        self.device = resolve_device(config.device)
        self.dtype = torch_dtype(config.dtype, self.device, model_config.torch_dtype)
        on_kernels = float_weights_on_kernels(config, model_config, self.device, self.dtype)
        if on_kernels is not None:
            model_config = dataclasses.replace(model_config, quantization=on_kernels)
            if on_kernels == "half":
                logger.info(
                    "%s weights stay in 16 bits on CPU, multiplied in float32 (--quantization "
                    "none widens them at load)",
                    model_config.torch_dtype,
                )
        self.model_config = model_config
        self.max_seq_len = model_config.max_position_embeddings
        if model_config.architecture in ENCODER_ARCHITECTURES:
            # A pooled request records one placeholder token after its prompt, which never
            # runs: an input may fill every learned position (512 for BERT), none beyond.
            self.max_seq_len += 1
            override = config.max_seq_len_override
            if override is not None and override > self.max_seq_len:
                raise ConfigError(
                    f"--context-length {override}: this encoder learned positions for inputs "
                    f"of up to {self.max_seq_len - 1} tokens"
                )
        if config.max_seq_len_override is not None:
            self.max_seq_len = config.max_seq_len_override

        if model_config.quantization is not None and self.device.type not in ("cpu", "cuda"):
            raise ConfigError(
                "quantized weights run on CPU and CUDA: pass --quantization none to run "
                f"the model in --dtype on {self.device.type}"
            )
        float_weights = model_config.quantization in (None, *FLOAT_ON_KERNELS)
        quantized_on_cpu = self.device.type == "cpu" and not float_weights
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype, quantized_on_cpu)
        if self.kv_dtype in (torch.float16, torch.float32) and self.kv_dtype != self.dtype:
            if self.device.type != "cpu" or self.dtype != torch.float32:
                others = "auto" if self.device.type == "cpu" else "auto or fp8_e4m3"
                raise ConfigError(
                    f"--kv-cache-dtype {config.kv_cache_dtype} is for a float32 model's cache "
                    f"on CPU; for a {str(self.dtype).removeprefix('torch.')} model on "
                    f"{self.device.type} take {others}"
                )
        elif self.kv_dtype != self.dtype:
            require_fp8_gpu(self.device, f"--kv-cache-dtype {config.kv_cache_dtype}")
            if "fa" in config.attention_backend.split(","):
                raise ConfigError(
                    f"--kv-cache-dtype {config.kv_cache_dtype} takes --attention-backend fi or "
                    "torch: FA3 prefill reads an FP8 cache only with FP8 queries"
                )
        if model_config.quantization == "fp8":
            require_fp8_gpu(self.device, "--quantization fp8")
        capability = gpu_capability(self.device)
        if "fa" in config.attention_backend.split(",") and capability and capability < (9, 0):
            raise ConfigError(
                "--attention-backend fa (FlashAttention-3) needs a Hopper GPU (compute "
                "capability 9.0); fi runs on every GPU aserve supports"
            )
        self._triton_hash = start_triton_hash() if self.device.type == "cuda" else None
        self.free_memory_before_load = free_device_memory(self.device)
        self._kernel_builds = self._start_kernel_builds()
        started = time.perf_counter()
        ops = fused_ops(self.device, self.dtype, model_config.quantization is not None)
        self.cpu_kernels = ops is not None and self.device.type == "cpu"
        with _construct_on(self.device, self.dtype):
            self.model = build_model(
                model_config, self.max_seq_len, self.tp, ops, config.moe_backend, self.device
            )
        kv_scales = KVScales()
        if config.dummy_weight:
            fill_dummy_weights(self.model, config.seed)
        else:
            assert model_dir is not None
            dequantize = model_config.quantization != "gguf"
            weights = iter_weights(model_dir, self.tp.rank == 0, lazy=True, dequantize=dequantize)
            if model_config.language_model_of is not None:
                weights = language_model_weights(weights)
            weights = decoder_weights(weights)
            weights = kv_scales.take(weights)
            if model_config.fp8_checkpoint:
                float_weights = model_config.quantization != "fp8"
                weights = pair_scales(weights, model_config.fp8_block, float_weights)
            if model_config.mxfp4_checkpoint:
                weights = mxfp4_experts(weights, dequantize)
            if model_config.int_scheme is not None:
                as_float = model_config.quantization != "gguf"  # none, or fp8 on a GPU
                weights = pair_int_weights(weights, model_config.int_scheme, as_float)
            self.model.load_weights(weights)
        self.model.finalize_quantized(self.device, self.dtype)
        self.adapters: AdapterSlots | None = None  # LoRA adapters, and each step's rows
        if config.lora_modules or config.enable_lora:
            adapters = [read_adapter(*pair, config.max_lora_rank) for pair in config.lora_modules]
            self.adapters = make_adapter_slots(
                self.model,
                adapters,
                self.device,
                self.dtype,
                config.lora_slots,
                config.max_lora_rank,
                every_layer=config.enable_lora,
            )
            for adapter in adapters:
                logger.info(
                    "LoRA adapter %s: rank %d on %d layers, from %s",
                    adapter.name,
                    adapter.rank,
                    len(adapter.pairs),
                    adapter.path,
                )
        self.images = self._image_encoder(model_config, model_dir)
        pooling = read_pooling(model_dir) if config.is_embedding and model_dir else Pooling()
        if pooling != Pooling():
            self.model.pooler = Pooler(pooling, self.device)
        # Prompts whose every position a step must hold, never taken from the prefix cache:
        # attention both ways, pooling by the mean or the first token.
        self.whole_prompts = model_config.bidirectional or (
            config.is_embedding and pooling.whole_prompt
        )
        if self.device.type == "cuda":
            _warn_of_unfused_experts(self.model)
        self.model.eval()
        if ops is not None and self.device.type == "cuda":
            use_one_row_kernel(self.model)
            if model_config.quantization == "fp8":
                rows = None if self.adapters is None else self.adapters.rows
                use_fp8_activations(self.model, rows)
        if self.device.type == "cpu":
            pack_linear_weights(self.model)
            self.model.pack_lm_head(None if config.dummy_weight else model_dir)
            if self.cpu_kernels:
                use_decode_stacks(self.model)
            return_freed_memory()
            keep_activations_in_heap()
        self.load_seconds = time.perf_counter() - started
        self.weight_bytes = weight_bytes(self.model)
        self.free_memory_after_load = free_device_memory(self.device)
        logger.info(
            "weights: %.0f MiB on %s in %.1f s",
            self.weight_bytes / 2**20,
            self.device,
            self.load_seconds,
        )

        config = self.config = fit_step_to_memory(
            config,
            model_config,
            self.tp,
            self.dtype,
            self.device,
            self.max_seq_len,
            self.kv_dtype,
        )
        self.num_pages = plan_num_pages(
            config,
            model_config,
            self.tp,
            self.dtype,
            self.device,
            self.max_seq_len,
            self.kv_dtype,
        )
        self.kv_window = sliding_window_pool(model_config, self.max_seq_len)
        self.window_pages = 0
        if self.kv_window:
            self.num_pages, self.window_pages = plan_window_pages(
                self.num_pages, model_config, config, self.kv_window, self.max_seq_len
            )
        pool_tokens = (self.num_pages - 1) * config.page_size
        if pool_tokens < self.max_seq_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than the context of %d: serving a "
                "context of %d",
                pool_tokens,
                self.max_seq_len,
                pool_tokens,
            )
            self.max_seq_len = pool_tokens
        pool_started = time.perf_counter()
        self.pool = KVPool(
            model_config.num_layers,
            self.num_pages,
            config.page_size,
            self.local_kv_heads,
            model_config.head_dim,
            self.dtype,
            self.device,
            self.kv_dtype,
            tuple(window > 0 for window in model_config.layer_windows),
            self.window_pages,
            None if model_config.latent is None else model_config.latent.kv_lora_rank,
            tuple(not model_config.keeps_kv(layer) for layer in range(model_config.num_layers)),
        )
        kv_scales.apply(self.pool)
        self.kv_cache_bytes = sum(layer.nbytes for layer in self.pool.kv)
        if model_config.linear_attention is not None:
            rows = config.max_running_requests + 1  # the page table's, its dummy row too
            states = RecurrentStates(
                model_config.linear_attention, rows, self.tp.size, self.dtype, self.device
            )
            self.pool.states = states
            logger.info(
                "recurrent states: %d rows of %.1f MiB (%d linear attention layers), %.2f GiB",
                rows,
                states.nbytes / rows / 2**20,
                len(model_config.linear_attention.layers),
                states.nbytes / GiB,
            )
        self.page_table = PageTable(
            config.max_running_requests,
            self.max_seq_len,
            config.page_size,
            self.device,
            windowed=self.window_pages > 0,
        )
        window_tokens = ""
        if self.window_pages:
            window_tokens = (
                f" ({(self.window_pages - 1) * config.page_size} in the sliding-window "
                f"layers, which keep the last {self.kv_window} positions)"
            )
        logger.info(
            "KV cache: %d tokens%s, %.2f GiB of %s, allocated in %.1f s",
            pool_tokens,
            window_tokens,
            self.kv_cache_bytes / GiB,
            str(self.kv_dtype).removeprefix("torch."),
            time.perf_counter() - pool_started,
        )
        self.attn = self._create_attention_backend(config.attention_backend)
        latent = model_config.latent is not None
        if latent and self._half_on_cuda and not self._flashinfer_runs_latent():
            logger.warning(
                "latent attention with a %s KV cache runs on the torch backend, without CUDA "
                "graphs (FlashInfer's MLA kernels read 16-bit caches of widths %s): "
                "--kv-cache-dtype auto is faster",
                str(self.kv_dtype).removeprefix("torch."),
                LATENT_WIDTHS,
            )
        self.sampler = Sampler(race_kernel(self.device))
        self.graphs = self._make_graphs()
        # Attention for what FlashInfer's modules would run while they still build: set by
        # the warm-up of a first start, cleared by `finish_kernel_builds`.
        self._stand_in: AttentionBackend | None = None
        self._stand_in_since = 0.0
        self._warm_up()

    def _image_encoder(
        self, model_config: ModelConfig, model_dir: Path | None
    ) -> ImageEncoder | None:
        """The checkpoint's image encoder where its images run (models/vision.py) on one
        rank of a generating engine with real weights; else None, and prompts take text."""
        owner = model_config.language_model_of
        self.no_images_because = "it is a text model"
        if owner is None or model_dir is None or self.config.dummy_weight or self.pooling:
            return None
        hf_config, _ = load_hf_config(model_dir)
        why_not = image_support(hf_config, owner)
        if why_not is None and self.tp.rank != 0:
            return None  # rank 0 encodes the images and shares their features (`share_images`)
        if why_not is not None:
            logger.info("prompts take text alone: %s", why_not)
            self.no_images_because = why_not
            return None
        started = time.perf_counter()
        encoder = ImageEncoder(hf_config, owner, model_dir, self.device, self.dtype)
        logger.info(
            "image encoder ready in %.1f s: %s",
            time.perf_counter() - started,
            encoder.describe(),
        )
        return encoder

    def expand_images(
        self, prompt: list[int], images: list[torch.Tensor]
    ) -> tuple[list[int], list[ImageSpan]]:
        """`prompt` with each image token made its image's positions (`expand_images`);
        a ValueError where this engine takes no images or they do not pair up."""
        image_token = self.model_config.image_token_id
        if self.images is None or image_token is None:
            raise ValueError(f"this model takes no images here: {self.no_images_because}")
        vocab = self.model_config.vocab_size
        return expand_images(prompt, images, image_token, self.images, vocab)

    def attach_images(self, batch: ForwardBatch, pieces: list[ImagePiece]) -> None:
        """Give a prefill batch the features of the image positions its chunks compute
        (`pieces`, in the order of `batch.image_rows`: scheduler/batch.py's `step_images`),
        each image encoded the first time a chunk reaches it (kept on its span until the
        request ends)."""
        assert self.images is not None
        features: list[torch.Tensor] = []
        layer_features: list[torch.Tensor] = []
        for piece in pieces:
            span = piece.span
            if span.features is None:
                span.features, span.layer_features = self.images.encode(span.pixels[None])[0]
            chosen = piece.chosen.to(span.features.device)
            features.append(span.features[chosen])
            if span.layer_features is not None:
                layer_features.append(span.layer_features[:, chosen])
        if features:
            batch.image_embeds = torch.cat(features).to(self.dtype)
        if layer_features:  # Qwen3-VL: every image has them
            batch.image_layer_embeds = torch.cat(layer_features, dim=1).to(self.dtype)

    def share_images(self, batch: ForwardBatch) -> None:
        """Under tensor parallelism, rank 0's image features (its encoder's) on every rank,
        into tensors of the shapes the step's spec gives the followers."""
        if self.tp.size == 1 or batch.image_rows is None:
            return
        rows, hidden = len(batch.image_rows), self.model_config.hidden_size
        if self.tp.rank != 0:
            like = {"dtype": self.dtype, "device": self.device}
            batch.image_embeds = torch.empty(rows, hidden, **like)
            if batch.image_levels > 1:
                inner = (batch.image_levels - 1, rows, hidden)
                batch.image_layer_embeds = torch.empty(inner, **like)
        assert batch.image_embeds is not None
        self.tp.broadcast(batch.image_embeds)
        if batch.image_layer_embeds is not None:
            self.tp.broadcast(batch.image_layer_embeds)

    def _create_attention_backend(self, name: str) -> AttentionBackend:
        names = self._backend_names(name)
        if len(names) == 2:
            return SplitBackend(self._single_backend(names[0]), self._single_backend(names[1]))
        return self._single_backend(names[0])

    def _backend_names(self, name: str) -> list[str]:
        """The backends of `--attention-backend`: one, or prefill's and decode's. FlashInfer's
        kernels take heads of 64, 128 and 256 only; other sizes the Triton decode kernels
        take (Phi-3-mini's 96) prefill through torch and decode through them, in CUDA
        graphs (`auto` picks that split)."""
        names = name.split(",")
        if len(names) > 2:
            raise ConfigError("--attention-backend takes one backend or two as prefill,decode")
        head_dim = self.model_config.head_dim
        if self.device.type != "cuda" or head_dim in FLASHINFER_HEAD_DIMS:
            return names
        if self.model_config.latent is not None:  # one backend runs both phases of MLA
            return names
        if names == ["auto"]:
            return ["torch", "fi"] if self._half_on_cuda and triton_decodes(head_dim) else names
        prefill, decode = self._resolved_backend(names[0]), self._resolved_backend(names[-1])
        if prefill in FLASHINFER_KERNELS or (
            decode in FLASHINFER_KERNELS and not triton_decodes(head_dim)
        ):
            raise ConfigError(
                f"FlashInfer's kernels take heads of 64, 128 or 256, not {head_dim}: "
                "--attention-backend torch,fi prefills through torch and decodes through the "
                "Triton kernels (what auto picks)"
            )
        return names

    @property
    def _half_on_cuda(self) -> bool:
        return self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)

    def _resolved_backend(self, name: str) -> str:
        """`auto` is FlashInfer on CUDA in half precision with a head size its kernels
        support (they have no float32), plain torch otherwise. FA3 prefill (`fa`) was
        measured no faster than FlashInfer's own on the H200 (bench/NOTES.md), so auto uses
        `fi` for both phases."""
        if name != "auto":
            return name
        supported = self.model_config.head_dim in FLASHINFER_HEAD_DIMS
        if self.model_config.latent is not None:
            supported = self._flashinfer_runs_latent()
        return "fi" if self._half_on_cuda and supported else "torch"

    def _flashinfer_runs_latent(self) -> bool:
        latent = self.model_config.latent
        assert latent is not None
        return runs_latent(self.kv_dtype, latent.kv_lora_rank, latent.qk_rope_head_dim)

    def _start_kernel_builds(self) -> list[threading.Thread]:
        """FlashInfer's modules compile (or load) in threads while the weights load."""
        prefill = self._resolved_backend(self.config.attention_backend.split(",")[0])
        if self.device.type != "cuda" or prefill not in FLASHINFER_KERNELS:
            return []
        if self.model_config.latent is not None:  # the MLA module builds at its first plan
            return []
        from aserve.attention.flashinfer import build_kernels

        return build_kernels(
            self.device,
            self.local_heads,
            self.local_kv_heads,
            self.model_config.head_dim,
            self.dtype,
            self.kv_dtype,
            self.config.page_size,
            FLASHINFER_KERNELS[prefill],
            self.config.max_running_requests,
            windowed=bool(self.model_config.layer_windows),
            softcap=self.model_config.attention_softcap,
        )

    def _single_backend(self, name: str) -> AttentionBackend:
        name = self._resolved_backend(name)
        head_dim = self.model_config.head_dim
        if name == "torch":
            from aserve.attention.torch_native import TorchNativeBackend

            return TorchNativeBackend(
                self.pool,
                self.page_table,
                self.local_heads,
                head_dim,
                self.cpu_kernels,
                self.model_config.layer_windows,
                self.model_config.attention_scale,
                self.model_config.attention_softcap,
            )
        latent = self.model_config.latent
        if name in FLASHINFER_KERNELS and self.device.type == "cuda" and latent is not None:
            if name != "fi" or not self._flashinfer_runs_latent():
                raise ConfigError(
                    f"latent attention runs on --attention-backend fi with a 16-bit KV cache "
                    f"and latent widths {LATENT_WIDTHS}, else on torch"
                )
            scale = self.model_config.attention_scale
            assert scale is not None
            return FlashInferMLABackend(
                self.pool, self.page_table, self.local_heads, scale, self.dtype
            )
        if name in FLASHINFER_KERNELS and self.device.type == "cuda":
            from aserve.attention.flashinfer import FlashInferBackend

            model = self.model_config
            windows = model.layer_windows
            fi_only = {
                "attention sinks": model.attention_sinks,
                "soft-capped scores": bool(model.attention_softcap),
                "sliding windows": bool(windows),
            }
            used = [feature for feature, present in fi_only.items() if present]
            if used and name != "fi":
                raise ConfigError(
                    f"{model.architecture}'s {used[0]} run on --attention-backend fi or torch"
                )
            return FlashInferBackend(
                self.pool,
                self.page_table,
                self.local_heads,
                self.local_kv_heads,
                head_dim,
                self.dtype,
                FLASHINFER_KERNELS[name],
                self.config.max_prefill_length,
                windows,
                self.model_config.attention_scale,
                self.model_config.attention_sinks,
                self.model_config.attention_softcap,
            )
        raise ConfigError(
            f"attention backend {name!r} is not available on {self.device.type}; "
            "choose torch, or fi / fa on CUDA"
        )

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One-token decode, sampling and prefill on the dummy page, so that every kernel
        compiles (first start) or loads now rather than inside the first request. Decode,
        sampling and the decode graphs of the sizes that use Triton attention first: their
        kernels are Triton's, and compile while FlashInfer's modules build in their
        threads, which the prefill then waits for."""
        if self.device.type != "cuda":
            return
        logger.info("warming up GPU kernels (the first start compiles them)")
        started = time.perf_counter()
        if self._triton_hash is not None:
            self._triton_hash.join()
        self._compile_triton_kernels()
        if not self.pooling:  # a pooling model's requests are prompts alone: nothing decodes
            self._sample_each_way(self._dummy_forward(ForwardMode.DECODE, self.attn))
        if self.graphs is not None and self._kernel_builds:
            self.graphs.capture(self.graphs.sizes_without_flashinfer())
        # A first start: the builds go on. Not under TP, where every rank must run the same
        # forwards (their all-reduces pair up) and each rank's builds end apart.
        if self._still_building() and self.tp.size == 1:
            self._serve_before_flashinfer(started)
            return
        self._take_flashinfer()
        logger.info("GPU kernels ready in %.1f s", time.perf_counter() - started)

    def _sample_each_way(self, logits: torch.Tensor) -> None:
        """The three races: greedy (no noise), over the logits (temperature only) and over
        filtered probabilities."""
        for params in (
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=1.0, top_k=2, top_p=0.9, min_p=0.01),
        ):
            sampling = SamplingBatch.build(
                [params], [0], [0], [[]], [[]], logits.shape[-1], self.device
            )
            self.sampler.sample(logits, sampling)

    def _compile_triton_kernels(self) -> None:
        """Compile the Triton kernels of the warm-up's forwards in threads before it runs
        them (one after another they bound a first start: 31 kernels, 15 s of the embedded
        model's on an H200). The forwards run once under a `KernelCensus`, which notes each
        kernel's signature and launches none: the decode, the sampler's races, an eager
        decode at each graph size with Triton attention, and a prefill through torch's
        SDPA. Only where that is safe (a forward graphs can capture reads nothing back to
        the host; a dense one's kernels read addresses only the host gives) and on one GPU
        (ranks' forwards run in step)."""
        model = self.model
        if self.tp.size > 1 or not (model.graph_capturable and model.addresses_from_host):
            return
        try:
            from aserve.engine.kernel_census import KernelCensus
        except ImportError:  # a Triton before 3.4 has no `knobs`: kernels compile as met
            return
        stand_in = self._single_backend("torch")
        with KernelCensus() as census:
            if not self.pooling:
                self._sample_each_way(self._dummy_forward(ForwardMode.DECODE, self.attn))
            if self.graphs is not None:
                self.graphs.forward_each_size()
            self._dummy_forward(ForwardMode.PREFILL, stand_in)
        census.compile_all()

    def _still_building(self) -> bool:
        return any(thread.is_alive() for thread in self._kernel_builds)

    def _serve_before_flashinfer(self, warm_up_started: float) -> None:
        """Be ready now rather than when FlashInfer's modules are (their nvcc builds had
        bound a first start: 34-37 s of the embedded model's 43 on an H200). Until they are,
        prefills and the decode batches that no captured graph takes run through torch's
        SDPA; the idle scheduler, or the first step after the builds end, takes FlashInfer
        (`take_built_kernels`)."""
        self._stand_in = self._single_backend("torch")
        self._dummy_forward(ForwardMode.PREFILL, self._stand_in)
        torch.cuda.synchronize(self.device)
        self._stand_in_since = time.perf_counter()
        logger.info(
            "GPU kernels ready in %.1f s but FlashInfer's, which build on: until they are, "
            "prefills run through torch's SDPA",
            self._stand_in_since - warm_up_started,
        )

    @property
    def context_length(self) -> int:
        """The context a client is told (`max_model_len`): `max_seq_len`, less an encoder's
        placeholder slot after its input (an input fills its learned positions, no more)."""
        encoder = self.model_config.architecture in ENCODER_ARCHITECTURES
        return self.max_seq_len - 1 if encoder else self.max_seq_len

    @property
    def awaits_kernels(self) -> bool:
        """True while the engine serves without FlashInfer's modules, which still build."""
        return self._stand_in is not None

    def take_built_kernels(self) -> None:
        """Take FlashInfer's modules if their builds have ended (the scheduler asks while
        idle; a step asks first thing)."""
        if self._stand_in is not None and not self._still_building():
            self.finish_kernel_builds()

    @torch.inference_mode()
    def finish_kernel_builds(self) -> None:
        """Wait for FlashInfer's modules if the engine was made ready before them, and take
        them: the offline `LLM` calls this so that its batches run at full speed."""
        if self._stand_in is None:
            return
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)  # steps in flight read the stand-in's metadata
        self._take_flashinfer()
        self._stand_in = None
        logger.info(
            "FlashInfer's kernels built %.1f s after the engine was ready; taken in %.1f s",
            started - self._stand_in_since,
            time.perf_counter() - started,
        )

    def _take_flashinfer(self) -> None:
        """Join FlashInfer's builds, load the prefill module by a one-token prefill and
        capture the decode graphs not captured yet."""
        for thread in self._kernel_builds:
            thread.join()
        self._dummy_forward(ForwardMode.PREFILL, self.attn)
        torch.cuda.synchronize(self.device)
        if self.graphs is not None:
            self.graphs.capture()

    def _dummy_forward(self, mode: ForwardMode, attn: AttentionBackend) -> torch.Tensor:
        """One token of one request on the dummy page."""
        prefill_ids = [0] if mode is ForwardMode.PREFILL else []
        spec = StepSpec(mode, [self.page_table.dummy_row], [0], [1], [0], prefill_ids, [])
        batch = forward_batch(spec, self.page_table, self.device)
        attn.prepare(batch)
        return self._run_model(batch, attn)

    def _make_graphs(self) -> DecodeGraphs | None:
        """Decode graphs on CUDA when the decode backend is FlashInfer (the torch backend
        plans with host-side shapes), not captured yet, up to `graph_batch_limit`."""
        decode = self.attn.decode if isinstance(self.attn, SplitBackend) else self.attn
        max_bs = graph_batch_limit(self.config)
        if self.device.type != "cuda" or max_bs == 0 or not self.model.graph_capturable:
            return None
        from aserve.attention.flashinfer import FlashInferBackend

        if not isinstance(decode, (FlashInferBackend, FlashInferMLABackend)):
            logger.info("CUDA graphs are off: they need the FlashInfer decode backend")
            return None
        rows = None if self.adapters is None else self.adapters.rows
        return DecodeGraphs(self.model, decode, self.page_table, max_bs, self.max_seq_len, rows)

    def describe(self) -> str:
        """The start-up summary users look for: model, dtype, device, KV size and memory."""
        tokens = (self.num_pages - 1) * self.config.page_size
        return (
            f"{self.model_config.architecture} dtype={str(self.dtype).removeprefix('torch.')} "
            f"device={self.device} tp={self.tp.size} max_total_num_tokens={tokens} "
            f"pages={self.num_pages - 1}x{self.config.page_size} "
            f"kv_cache={self.kv_cache_bytes / GiB:.2f} GiB "
            f"kv_dtype={str(self.kv_dtype).removeprefix('torch.')} context_len={self.max_seq_len} "
            f"free_mem_before_load={self.free_memory_before_load / GiB:.2f} GiB "
            f"free_mem_after_load={self.free_memory_after_load / GiB:.2f} GiB "
            f"weights={self.weight_bytes / 2**20:.0f} MiB load_time={self.load_seconds:.1f}s "
            f"cuda_graph={self.graphs is not None}"
        )

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> StepLogits:
        """The step's logits: each request's last row to sample, and every row computed (an
        embedding server's: the embeddings, one a request)."""
        every_row = self.forward(batch)
        if batch.sample_rows is None:
            return StepLogits(every_row, every_row)
        return StepLogits(every_row.index_select(0, batch.sample_rows), every_row)

    @torch.inference_mode()
    def sample(
        self,
        batch: ForwardBatch,
        logits: StepLogits,
        sampling: SamplingBatch,
        scoring: PromptScoring | None = None,
        token_masks: StepMasks | None = None,
    ) -> SampleOutput:
        """Sample one token per request and record it in the token table at the position
        after the request's context, where the next decode step reads it. Under tensor
        parallelism rank 0 samples and broadcasts the ids to the other ranks. With
        `scoring`, every logits row is scored too (prompt logprobs); with `token_masks`
        constrained rows sample only the tokens allowed. An embedding server samples
        nothing: each request's token is 0 (its one token, which ends it) and the step's
        embeddings go out with them."""
        if self.pooling:
            next_ids = torch.zeros(logits.sampled.shape[0], dtype=torch.long, device=self.device)
            self.record_tokens(batch, self.tp.broadcast(next_ids))
            return SampleOutput(next_ids, None, None, None, pooled=logits.sampled)
        out = self.sampler.sample(logits.sampled, sampling, token_masks)
        self.record_tokens(batch, self.tp.broadcast(out.next_ids))
        if scoring is not None:
            out = out._replace(**score_prompt(logits.every_row, scoring))
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of `batch` (an embedding server's embeddings); decode batches that fit a
        captured graph replay it."""
        self.take_built_kernels()
        if batch.is_decode and self.graphs is not None:
            size = self.graphs.size_for(batch.batch_size)
            if size is not None:  # with adapter rows, the graph that adds their products
                return self.graphs.run(batch, size)
        attn = self.attn if self._stand_in is None else self._stand_in
        self.share_images(batch)
        attn.prepare(batch)
        if batch.adapter_ids is None:
            return self._run_model(batch, attn)
        assert self.adapters is not None and batch.adapter_ids is not None
        self.adapters.rows.begin(batch.adapter_ids)
        try:
            return self._run_model(batch, attn)
        finally:
            self.adapters.rows.end()

    def _run_model(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """A classifier's logits, an embedding server's embeddings, else the LM's logits
        (an encoder has only the first two)."""
        if self.model_config.classifies:
            return self.model.classify(batch, attn)
        if self.pooling:
            return self.model.embed(batch, attn)
        return self.model(batch, attn)

    def record_tokens(self, batch: ForwardBatch, next_ids: torch.Tensor) -> None:
        self.page_table.tokens.view(-1).index_copy_(0, batch.record_index, next_ids)


def _warn_of_unfused_experts(model: torch.nn.Module) -> None:
    """GGUF experts that run on CUDA one expert at a time, without CUDA graphs: under
    --moe-backend torch, or where a layer's experts differ in format."""
    loose = [m for m in model.modules() if isinstance(m, QuantizedExperts) and m.stacked is None]
    if loose:
        logger.warning(
            "%d layers of this GGUF file's experts run on CUDA one expert at a time, without "
            "CUDA graphs (a small MoE decoded 24x slower than in the fused kernels): "
            "--moe-backend torch, or experts of one layer in different formats",
            len(loose),
        )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights in whatever form the layers keep them (plain, MKL-packed, quantized),
    a tensor that tied layers share counted once."""
    storages: dict[int, int] = {}
    for tensor in model.parameters():
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    extra = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None:  # MKL's packed copy is opaque: counted as the plain matrix
            extra += packed.stand_in.numel() * packed.stand_in.element_size()
        lookup = getattr(module, "lookup_table", None)
        if lookup is not None:
            storages[lookup.untyped_storage().data_ptr()] = lookup.nbytes
        for held in (getattr(module, "quantized", None), getattr(module, "table", None)):
            if held is not None and not isinstance(held, bool):
                extra += held.nbytes
        if isinstance(module, QuantizedExperts):
            extra += module.nbytes
    return sum(storages.values()) + extra
