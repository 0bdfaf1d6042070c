"""A quantized decoder's decode step on CPU with its layers walked in C++
(quant/csrc/cpu_decode.cpp), not through the modules.

At batch 1 a decode step of a small model is mostly Python: on the embedded 135M model the
kernels took 3.1 ms of a 5.6 ms step, the module calls and wrappers around them the rest. The
stack holds each layer's weights once and calls the same ops in the same order, so the
outputs are the same bits as the modules' (tests/test_cpu_decode.py). It is built where
every layer takes aserve's CPU kernels whole (`build_decode_stack`) and runs for decode
batches the kernels take (`DecodeStack.takes`); anything else runs the modules.
"""

from __future__ import annotations

import torch

from aserve.attention.base import AttentionBackend
from aserve.attention.torch_native import TorchNativeBackend
from aserve.config import PLAIN_EXPERTS, ModelConfig
from aserve.forward import ForwardBatch
from aserve.layers.cpu_ops import CpuKernels
from aserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aserve.layers.moe import QuantizedExperts, SparseMoE, bias_rows
from aserve.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderMLP,
    DecoderModel,
)
from aserve.quant.native import KernelTensors, NativeWeight


class DecodeStack:
    """The C++ stack of a model's layers, and when it may run them: batches of fewer rows
    than any of its weights sends to BLAS (`blas_from`)."""

    def __init__(self, stack: torch.ScriptObject, blas_from: int) -> None:
        self.stack = stack
        self.blas_from = blas_from

    def takes(self, batch: ForwardBatch, attn: AttentionBackend) -> bool:
        """Decode batches that the modules too would run on the kernels whole: attention
        from the pool (`native_decode`) and fewer rows than go to BLAS."""
        return (
            batch.is_decode
            and isinstance(attn, TorchNativeBackend)
            and attn.native_decode
            and batch.batch_size < self.blas_from
        )

    def run(
        self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the step's embeddings: (last layer's output, residual)."""
        windowed = any(attn.pool.windowed)
        return self.stack.run(
            hidden,
            batch.positions,
            batch.out_slots,
            batch.slots_of(windowed),
            attn.pool.kv,
            batch.page_table,
            batch.table_of(windowed),
            batch.rows,
            batch.attn_metadata.seq_lens,
        )


def build_decode_stack(model: DecoderModel, config: ModelConfig) -> DecodeStack | None:
    """The stack of `model`'s layers, or None where a layer is not the kernels' whole:
    tensor parallelism, float or padded weights, a fused projection of mixed formats, a
    float32 model that does not run the CPU kernels. Gemma's layers come with their windows
    (`config.layer_windows`), their scores' scale and Gemma 2's soft cap, gpt-oss's with their
    sinks, biases and clamped experts, OLMo 2's and EXAONE 4's with norms after attention and
    the MLP alone (`post_norms`; OLMo 2's Q/K norms across heads)."""
    layers = list(model.layers)
    # no latent attention, linear attention or gated attention in C++
    if not layers or model.tp.size != 1 or config.latent or config.linear_attention:
        return None
    attention = layers[0].self_attn
    assert isinstance(attention, DecoderAttention)
    if not isinstance(layers[0].post_attention_layernorm.ops, CpuKernels):
        return None
    scale = config.attention_scale
    stack = torch.classes.aserve_cpu.DecodeStack(
        attention.q_size,
        attention.kv_size,
        attention.head_dim,
        attention.eps,
        attention.head_dim**-0.5 if scale is None else scale,
        config.attention_softcap,
        config.residual_multiplier,
        config.post_norms,
        config.qk_norm_across_heads,
    )
    blas_from: list[int] = []
    for i, layer in enumerate(layers):
        if not _add_layer(stack, layer, config.layer_window(i), blas_from):
            return None
    return DecodeStack(stack, min(blas_from))


def _add_layer(
    stack: torch.ScriptObject, layer: DecoderLayer, window: int, blas_from: list[int]
) -> bool:
    """Add `layer`'s weights and its own parts to `stack`, and each weight's `blas_from` to
    `blas_from`; False where a part is not the kernels' whole."""

    def add(weight: KernelTensors) -> int:
        blas_from.append(weight.blas_from)
        return stack.add_weight(*weight.kernel_args())

    attention, mlp = layer.self_attn, layer.mlp
    assert isinstance(attention, DecoderAttention)
    shared: tuple[int, int, int, torch.Tensor | None] = (-1, -1, 0, None)  # no shared expert
    qkv = _products(attention.qkv_proj)
    o = _products(attention.o_proj)
    if qkv is None or o is None or len(o) != 1:
        return False
    if isinstance(mlp, DecoderMLP):
        gate_up, down = _products(mlp.gate_up_proj), _products(mlp.down_proj)
        if gate_up is None or down is None or len(gate_up) != 1 or len(down) != 1:
            return False
        inter = gate_up[0].shape[0] // 2
        if 2 * inter != gate_up[0].shape[0]:
            return False
        up_id, down_id = add(gate_up[0]), add(down[0])
        router, top_k, renormalize = None, 0, False
        router_bias, expert_biases, style = None, (None, None), PLAIN_EXPERTS
        choice_bias, routed_scaling = None, 1.0
    elif isinstance(mlp, SparseMoE) and isinstance(mlp.experts, QuantizedExperts):
        stacks = mlp.experts.cpu_stacks
        if stacks is None or not mlp.gate.cpu_kernels_route:
            return False
        if mlp.shared_expert is not None:  # Qwen2-MoE's and GLM-4.5's, a dense MLP
            shared_up, shared_down = (
                _products(mlp.shared_expert.gate_up_proj),
                _products(mlp.shared_expert.down_proj),
            )
            if shared_up is None or shared_down is None or len(shared_up) + len(shared_down) != 2:
                return False
            gate = mlp.shared_expert_gate
            shared = (
                add(shared_up[0]),
                add(shared_down[0]),
                shared_up[0].shape[0] // 2,
                None if gate is None else gate.weight,
            )
        up_id, down_id = add(stacks[0]), add(stacks[1])
        inter = mlp.experts.gate_up.weights[0].shard_rows[0]
        router, top_k, renormalize = mlp.gate.weight, mlp.top_k, mlp.renormalize
        router_bias, expert_biases = mlp.gate.bias, bias_rows(mlp.experts.biases)
        style = mlp.style
        choice_bias, routed_scaling = mlp.gate.e_score_correction_bias, mlp.gate.style.scaling
    else:
        return False
    sandwich = layer.sandwich  # Gemma: the norm before the MLP is another, with two after
    after = sandwich or layer.post_norms  # norms of attention's and the MLP's outputs
    if layer.post_norms:  # no norm before attention or the MLP: the stack reads none
        input_norm = mlp_norm = attention.rotary.cos_sin[:0]
    else:
        input_norm = layer.input_layernorm.weight
        before_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        mlp_norm = before_mlp.weight
    stack.add_layer(
        input_norm,
        mlp_norm,
        [add(part) for part in qkv],
        attention.qkv_proj.bias,
        None if attention.q_norm is None else attention.q_norm.weight,
        None if attention.k_norm is None else attention.k_norm.weight,
        add(o[0]),
        up_id,
        down_id,
        inter,
        router,
        top_k,
        renormalize,
        layer.post_attention_layernorm.weight if after else None,
        layer.post_feedforward_layernorm.weight if after else None,
        attention.rotary.cos_sin,
        window,
        isinstance(mlp, DecoderMLP) and mlp.gelu,
        attention.sinks,
        attention.o_proj.bias,
        router_bias,
        *expert_biases,
        style.swiglu_alpha,
        style.swiglu_limit or 0.0,
        *shared,
        choice_bias,
        routed_scaling,
    )
    return True


def _products(
    linear: QKVParallelLinear | ColumnParallelLinear | RowParallelLinear,
) -> list[NativeWeight] | None:
    """A linear layer's kernel weights, or None where one is not the kernels' or has padded
    rows (whose outputs the module slices)."""
    quantized = linear.quantized
    if quantized is None:
        return None
    products = quantized.products
    if not all(isinstance(p, NativeWeight) and p.padded == p.shape[0] for p in products):
        return None
    return products  # type: ignore[return-value]


def use_decode_stacks(model: DecoderForCausalLM) -> None:
    """Give `model`'s decoder its stack where it can have one (CPU kernels, after packing)."""
    decoder = model.model
    if isinstance(decoder, DecoderModel):
        decoder.decode_stack = build_decode_stack(decoder, model.config)
