"""A linear attention layer's decode step (models/gated_deltanet.py) in three Triton kernels.

In torch ops the step gathers every row's convolution window and delta-rule state,
computes in a dozen small kernels, and scatters both back: two copies of 64 KiB a head of
float32 state each way. Here `conv_step` convolves each row's window and shifts it in
place, and `delta_rule_step` reads a row's state once, decays and corrects it, writes it
back where it lives and gives the output: the queries' and keys' L2 norms, the gate's
decay and beta are computed in the same program; `gated_norm` norms and gates each head's
output (ten small kernels in torch ops). Imported only on CUDA and under Triton's
interpreter (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHANNEL_BLOCK = 128
VALUE_BLOCK = 32


@triton.jit
def _conv_step_kernel(
    x_ptr,
    x_stride,
    states_ptr,
    rows_ptr,
    weight_ptr,
    out_ptr,
    channels,
    KERNEL: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row `b`'s channels of one block: the window (its stored `KERNEL - 1` inputs, then
    this token's) convolved, SiLU'd; the window's last `KERNEL - 1` stored back."""
    b = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = channel < channels
    row = tl.load(rows_ptr + b).to(tl.int64)
    tap = tl.arange(0, TAPS)
    stored = tap < KERNEL - 1
    state_at = states_ptr + row * channels * (KERNEL - 1) + channel * (KERNEL - 1)
    window = tl.load(
        state_at[:, None] + tap[None, :], mask=ok[:, None] & stored[None, :], other=0.0
    )
    x = tl.load(x_ptr + b * x_stride + channel, mask=ok, other=0.0)
    window = tl.where(tap[None, :] == KERNEL - 1, x[:, None], window)
    weight = tl.load(
        weight_ptr + channel[:, None] * KERNEL + tap[None, :],
        mask=ok[:, None] & (tap[None, :] < KERNEL),
        other=0.0,
    )
    total = tl.sum(window.to(tl.float32) * weight.to(tl.float32), axis=1)
    tl.store(out_ptr + b * channels + channel, total / (1.0 + tl.exp(-total)), mask=ok)
    # the window moved one to the left: tap i takes tap i + 1
    for i in tl.static_range(KERNEL - 1):
        shifted = tl.sum(tl.where(tap[None, :] == i + 1, window, 0.0), axis=1)
        tl.store(state_at + i, shifted.to(states_ptr.dtype.element_ty), mask=ok)


def conv_step(
    x: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """SiLU of the causal convolution at each row's new input `x` `[B, channels]` (rows of
    a wider tensor), over its window in `states` `[rows, channels, kernel - 1]` (shifted in
    place at `rows`), by `weight` `[channels, kernel]`: float32 `[B, channels]`."""
    batch, channels = x.shape
    kernel = weight.shape[1]
    out = torch.empty(batch, channels, dtype=torch.float32, device=x.device)
    grid = (batch, triton.cdiv(channels, CHANNEL_BLOCK))
    _conv_step_kernel[grid](
        x,
        x.stride(0),
        states,
        rows,
        weight,
        out,
        channels,
        KERNEL=kernel,
        TAPS=triton.next_power_of_2(kernel),
        BLOCK=CHANNEL_BLOCK,
    )
    return out


@triton.jit
def _delta_rule_step_kernel(
    qkv_ptr,
    gates_ptr,
    gates_stride,
    states_ptr,
    rows_ptr,
    a_log_ptr,
    dt_bias_ptr,
    out_ptr,
    key_width,
    value_heads,
    SHARED: tl.constexpr,
    TILED: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Row `b`, value head `h`, one block of its value dimensions: the state's columns
    decayed, corrected toward the value, and read by the query."""
    b = tl.program_id(0) // value_heads
    h = tl.program_id(0) % value_heads
    column = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_value = column < VALUE_DIM
    dim = tl.arange(0, BLOCK_K)
    in_key = dim < KEY_DIM
    row = tl.load(rows_ptr + b).to(tl.int64)
    width = 2 * key_width + value_heads * VALUE_DIM
    key_head = h % (value_heads // SHARED) if TILED else h // SHARED
    q = tl.load(qkv_ptr + b * width + key_head * KEY_DIM + dim, mask=in_key, other=0.0)
    k = tl.load(qkv_ptr + b * width + key_width + key_head * KEY_DIM + dim, mask=in_key, other=0.0)
    v_at = qkv_ptr + b * width + 2 * key_width + h * VALUE_DIM + column
    v = tl.load(v_at, mask=in_value, other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(KEY_DIM * 1.0))
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)  # models/gated_deltanet.py's L2_EPS
    # the gates: beta's logit, then the decay's (`b` and `a` of the projection)
    beta_logit = tl.load(gates_ptr + b * gates_stride + h).to(tl.float32)
    decay_logit = tl.load(gates_ptr + b * gates_stride + value_heads + h).to(tl.float32)
    shifted = decay_logit + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(shifted > 20.0, shifted, tl.log(1.0 + tl.exp(shifted)))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus)
    beta = 1.0 / (1.0 + tl.exp(-beta_logit))
    state_at = (
        states_ptr
        + (row * value_heads + h) * KEY_DIM * VALUE_DIM
        + dim[:, None] * VALUE_DIM
        + column[None, :]
    )
    both = in_key[:, None] & in_value[None, :]
    state = tl.load(state_at, mask=both, other=0.0) * decay
    correction = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state += k[:, None] * correction[None, :]
    tl.store(state_at, state, mask=both)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (b * value_heads + h) * VALUE_DIM + column, out, mask=in_value)


def delta_rule_step(
    convolved: torch.Tensor,
    gates: torch.Tensor,
    states: torch.Tensor,
    rows: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    key_heads: int,
    tiled: bool = False,
) -> torch.Tensor:
    """One token a row of the gated delta rule (value heads in llama.cpp's order where
    `tiled`: models/gated_deltanet.py). `convolved` `[B, 2 * key_width +
    value_width]` float32 (queries, keys, values of `key_heads` and the value heads),
    `gates` `[B, 2 * value_heads]` (beta's logits, then the decay's; rows of a wider
    tensor), `states` `[rows, value_heads, key_dim, value_dim]` float32, updated in place
    at `rows`. Returns the outputs `[B, value_heads, value_dim]` in float32."""
    batch = convolved.shape[0]
    value_heads, key_dim, value_dim = states.shape[1:]
    out = torch.empty(batch, value_heads, value_dim, dtype=torch.float32, device=states.device)
    grid = (batch * value_heads, triton.cdiv(value_dim, VALUE_BLOCK))
    _delta_rule_step_kernel[grid](
        convolved,
        gates,
        gates.stride(0),
        states,
        rows,
        a_log,
        dt_bias,
        out,
        key_heads * key_dim,
        value_heads,
        SHARED=value_heads // key_heads,
        TILED=tiled,
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=VALUE_BLOCK,
    )
    return out


@triton.jit
def _gated_norm_kernel(
    x_ptr,
    gate_ptr,
    gate_stride,
    weight_ptr,
    out_ptr,
    value_heads,
    eps,
    VALUE_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row `b`, head `h`: RMS-normed, rounded to the output's dtype, weighed, gated by
    SiLU(z), rounded again (where transformers rounds)."""
    b = tl.program_id(0) // value_heads
    h = tl.program_id(0) % value_heads
    dim = tl.arange(0, BLOCK)
    ok = dim < VALUE_DIM
    x = tl.load(x_ptr + (b * value_heads + h) * VALUE_DIM + dim, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / VALUE_DIM + eps)).to(dtype)
    weight = tl.load(weight_ptr + dim, mask=ok, other=0.0)
    weighed = (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype).to(tl.float32)
    z = tl.load(gate_ptr + b * gate_stride + h * VALUE_DIM + dim, mask=ok, other=0.0)
    z = z.to(tl.float32)
    gated = weighed * z / (1.0 + tl.exp(-z))
    tl.store(out_ptr + (b * value_heads + h) * VALUE_DIM + dim, gated.to(dtype), mask=ok)


def gated_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """models/gated_deltanet.py's `GatedNorm` in one kernel: `x` `[B, heads, value_dim]`
    float32, `gate` `[B, heads * value_dim]` (rows of a wider tensor), `weight`
    `[value_dim]`; `[B, heads * value_dim]` in the gate's dtype."""
    batch, heads, value_dim = x.shape
    out = torch.empty(batch, heads * value_dim, dtype=gate.dtype, device=x.device)
    _gated_norm_kernel[(batch * heads,)](
        x,
        gate,
        gate.stride(0),
        weight,
        out,
        heads,
        eps,
        VALUE_DIM=value_dim,
        BLOCK=triton.next_power_of_2(value_dim),
    )
    return out
