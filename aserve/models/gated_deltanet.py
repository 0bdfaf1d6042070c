"""Qwen3.5's linear attention (Gated DeltaNet): a layer that keeps, a request, a fixed-size
state in place of a KV cache (kvcache/states.py).

Each token's queries, keys and values come through a causal depthwise convolution (its
window reaches `conv_kernel - 1` tokens back: those inputs are part of the state) and SiLU;
queries and keys are L2-normalised. The state S, a `[key_head_dim, value_head_dim]` matrix
a value head, decays by exp(g) and is corrected toward the token's value: with
u = beta (v - S^T k), S becomes S + k u^T (the delta rule), and the output is S^T q, then
RMS-normed and gated by SiLU(z) a head.

A decode step runs that recurrence once for every row at once. A prefill runs it in chunks
of `CHUNK` tokens, every sequence's together, where the corrections of a chunk's tokens are
a triangular system (each u_t subtracts what the earlier u_j of the chunk already wrote):
solved once, what is left a chunk is two products with the state it starts from. Prefixes
of 0 tokens start from a zero state; others from the state their last step stored.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aserve.attention.base import AttentionBackend
from aserve.config import ConfigError, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.forward import ForwardBatch
from aserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from aserve.layers.weight import WeightSource

CHUNK = 64
"""Tokens a prefill solves together: the triangular solve grows with its square, the
sequential loop over chunks with its inverse."""
L2_EPS = 1e-6


class DepthwiseConv(nn.Module):
    """The convolution's weight `[channels, kernel]` of this rank's queries, keys and values
    (`parts` channels each, whole in the checkpoint's `[channels, 1, kernel]`)."""

    def __init__(self, parts: list[int], kernel: int, tp: TPGroup) -> None:
        super().__init__()
        self.parts, self.tp = parts, tp
        self.weight = nn.Parameter(torch.empty(sum(parts) // tp.size, kernel), False)

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        whole = tensor[:].reshape(sum(self.parts), -1)
        pieces, start = [], 0
        for size in self.parts:
            local = size // self.tp.size
            pieces.append(whole[start + self.tp.rank * local : start + (self.tp.rank + 1) * local])
            start += size
        self.weight.data.copy_(torch.cat(pieces))


class GatedNorm(nn.Module):
    """RMSNorm over each head's output (weighing by w, not 1 + w), then gated by SiLU(z)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width), False)

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        self.weight.data.copy_(tensor[:])

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear attention layer on this rank's heads: tensor parallelism splits the key
    heads, the value heads they serve with them, and the convolution's channels alike."""

    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        linear = config.linear_attention
        assert linear is not None
        for heads in (linear.key_heads, linear.value_heads):
            tp.shard(heads)
        if linear.tiled and tp.size > 1 and linear.value_heads != linear.key_heads:
            raise ConfigError(
                "a GGUF file's linear attention heads (llama.cpp's order) do not split over "
                "tensor-parallel ranks; run it with --tp 1 or from its safetensors checkpoint"
            )
        self.tiled = linear.tiled
        self.layer = layer
        self.key_heads = linear.key_heads // tp.size
        self.value_heads = linear.value_heads // tp.size
        self.key_dim, self.value_dim = linear.key_head_dim, linear.value_head_dim
        self.kernel = linear.conv_kernel
        key_width, value_width = linear.key_width, linear.value_width
        parts = [key_width, key_width, value_width]
        heads = linear.value_heads
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, [*parts, value_width, heads, heads], False, tp, config.quantization
        )
        self.conv1d = DepthwiseConv(parts, self.kernel, tp)
        self.A_log = nn.Parameter(torch.zeros(self.value_heads), False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads), False)
        self.norm = GatedNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(
            value_width,
            config.hidden_size,
            False,
            tp,
            reduce_results=False,
            quantization=config.quantization,
        )
        self.head_range = tp.shard(heads)

    def load_weight(self, name: str, tensor: WeightSource, shard: int = 0) -> None:
        """`A_log` and `dt_bias`: one value a value head."""
        if name not in ("A_log", "dt_bias"):
            raise ValueError(f"checkpoint tensor linear_attn.{name} has no place in this model")
        start, end = self.head_range
        getattr(self, name).data.copy_(tensor[start:end].float())

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        projected = self.in_proj(hidden)
        conv_width = self.conv1d.weight.shape[0]
        value_width = self.value_heads * self.value_dim
        mixed, z, gates = projected.split([conv_width, value_width, 2 * self.value_heads], -1)
        states = attn.pool.states
        assert states is not None, "a hybrid model's pool holds recurrent states"
        conv_states, delta_states = states.of(self.layer)
        if batch.is_decode and hidden.is_cuda:
            out = self._decode_kernels(mixed, z, gates, conv_states, delta_states, batch.rows)
            return self.out_proj(out)
        b, a = gates.float().split(self.value_heads, -1)
        beta = b.sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        if batch.is_decode:
            rows = batch.rows
            out = self._decode(mixed, beta, decay, conv_states, delta_states, rows, batch.row_ids)
        else:
            out = self._prefill(mixed, beta, decay, conv_states, delta_states, batch)
        tokens = hidden.shape[0]
        out = self.norm(out.to(hidden.dtype), z.reshape(tokens, self.value_heads, self.value_dim))
        return self.out_proj(out.reshape(tokens, value_width))

    def _heads(self, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys `[tokens, value_heads, key_dim]` (normalised, each key head
        repeated for the value heads it serves, queries scaled) and values, in float32."""
        key_width = self.key_heads * self.key_dim
        value_width = convolved.shape[-1] - 2 * key_width
        q, k, v = convolved.float().split([key_width, key_width, value_width], -1)
        tokens, shared = q.shape[0], self.value_heads // self.key_heads
        q = _l2_normalised(q.view(tokens, self.key_heads, self.key_dim)) * self.key_dim**-0.5
        k = _l2_normalised(k.view(tokens, self.key_heads, self.key_dim))
        if shared > 1 and self.tiled:
            q, k = q.repeat(1, shared, 1), k.repeat(1, shared, 1)
        elif shared > 1:
            q, k = q.repeat_interleave(shared, 1), k.repeat_interleave(shared, 1)
        return q, k, v.reshape(tokens, self.value_heads, self.value_dim)

    def _decode_kernels(
        self,
        mixed: torch.Tensor,
        z: torch.Tensor,
        gates: torch.Tensor,
        conv_states: torch.Tensor,
        delta_states: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """`_decode` and the gated norm in three Triton kernels that update the states
        where they live: the normed, gated output `[B, value_width]`."""
        from aserve.layers.delta_rule_triton import conv_step, delta_rule_step, gated_norm

        convolved = conv_step(mixed, conv_states, rows, self.conv1d.weight)
        out = delta_rule_step(
            convolved,
            gates,
            delta_states,
            rows,
            self.A_log,
            self.dt_bias,
            self.key_heads,
            self.tiled,
        )
        return gated_norm(out, z, self.norm.weight, self.norm.eps)

    def _decode(
        self,
        mixed: torch.Tensor,
        beta: torch.Tensor,
        decay: torch.Tensor,
        conv_states: torch.Tensor,
        delta_states: torch.Tensor,
        rows: torch.Tensor,
        row_ids: list[int],
    ) -> torch.Tensor:
        """One token a row: the convolution over its stored window, one step of the rule.
        One row's states are worked on where they live; several rows' are gathered and
        written back (a copy of 64 KiB a head each way)."""
        alone = len(row_ids) == 1
        if alone:
            conv = conv_states[row_ids[0]][None]
            state = delta_states[row_ids[0]][None]
        else:
            conv = conv_states.index_select(0, rows)
            state = delta_states.index_select(0, rows)
        window = torch.cat([conv, mixed.unsqueeze(-1)], -1)
        convolved = F.silu((window.float() * self.conv1d.weight.float()).sum(-1))
        q, k, v = self._heads(convolved)
        state.mul_(decay.exp()[..., None, None])
        flat = state.view(-1, self.key_dim, self.value_dim)
        remembered = torch.bmm(k.reshape(-1, 1, self.key_dim), flat).view_as(v)
        correction = (v - remembered) * beta[..., None]
        flat.baddbmm_(k.reshape(-1, self.key_dim, 1), correction.reshape(-1, 1, self.value_dim))
        if alone:
            conv.copy_(window[..., 1:])
        else:
            conv_states.index_copy_(0, rows, window[..., 1:])
            delta_states.index_copy_(0, rows, state)
        return torch.bmm(q.reshape(-1, 1, self.key_dim), flat).view_as(v)

    def _prefill(
        self,
        mixed: torch.Tensor,
        beta: torch.Tensor,
        decay: torch.Tensor,
        conv_states: torch.Tensor,
        delta_states: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Every sequence at once, each from its stored states (zeros for a first step), its
        tokens laid out in a row of a `[sequences, longest]` grid: the places after a
        sequence's end hold tokens that neither decay nor write (beta and decay 0), so the
        states each row ends with are its sequence's."""
        lengths = batch.extend_lens
        count, longest, channels = len(lengths), max(lengths), mixed.shape[-1]
        starts = np.arange(count) * longest
        places = np.concatenate([start + np.arange(n) for start, n in zip(starts, lengths)])
        places_t = torch.from_numpy(places).to(mixed.device)
        carried = torch.tensor([prefix > 0 for prefix in batch.prefix_lens], device=mixed.device)
        rows = batch.rows

        def gridded(values: torch.Tensor) -> torch.Tensor:
            grid = values.new_zeros(count * longest, *values.shape[1:])
            return grid.index_copy_(0, places_t, values).view(count, longest, *values.shape[1:])

        earlier = conv_states.index_select(0, rows) * carried[:, None, None]
        window = torch.cat([earlier.transpose(1, 2), gridded(mixed)], 1)
        tail = torch.tensor(lengths, device=mixed.device)[:, None] + torch.arange(
            self.kernel - 1, device=mixed.device
        )
        last_inputs = window.gather(1, tail[..., None].expand(-1, -1, channels))
        conv_states.index_copy_(0, rows, last_inputs.transpose(1, 2))
        weight = self.conv1d.weight.float()
        convolved = F.conv1d(window.transpose(1, 2).float(), weight[:, None, :], groups=channels)
        q, k, v = self._heads(F.silu(convolved).transpose(1, 2).reshape(count * longest, -1))
        states = delta_states.index_select(0, rows) * carried[:, None, None, None]
        out, states = chunked_delta_rule(
            *(x.view(count, longest, *x.shape[1:]) for x in (q, k, v)),
            gridded(decay),
            gridded(beta),
            states,
        )
        delta_states.index_copy_(0, rows, states)
        return out.reshape(count * longest, *out.shape[2:]).index_select(0, places_t)


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over `n` tokens of each of `b` sequences, float32 throughout.

    `q`, `k` `[b, n, heads, key_dim]`, `v` `[b, n, heads, value_dim]`, `decay` (log space)
    and `beta` `[b, n, heads]`, `state` `[b, heads, key_dim, value_dim]`. Returns the outputs
    `[b, n, heads, value_dim]` and the states after the last token.

    Within a chunk, with G the running sum of the decays, token t's correction is
    u_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{j<t} e^{G_t - G_j} (k_j . k_t) u_j), a unit
    lower-triangular system (I + A) U = beta V - (beta e^G K) S0; its output is
    e^{G_t} S0^T q_t + sum_{j<=t} e^{G_t - G_j} (q_t . k_j) u_j, and the state it leaves
    e^{G_L} S0 + sum_j e^{G_L - G_j} k_j u_j^T.
    """
    b, n, heads = q.shape[:3]
    pad = -n % CHUNK
    chunks, streams = (n + pad) // CHUNK, b * heads

    def by_stream(x: torch.Tensor) -> torch.Tensor:
        """`[b, n, heads, ...]` as `[b * heads, chunks, CHUNK, ...]`, padded with tokens
        that neither decay nor write."""
        moved = x.transpose(1, 2)
        widths = (0, 0) * (moved.dim() - 3) + (0, pad)
        return F.pad(moved, widths).reshape(streams, chunks, CHUNK, *moved.shape[3:])

    q, k, v, decay, beta = (by_stream(x) for x in (q, k, v, decay, beta))
    running = decay.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    between = (running[..., :, None] - running[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * between).tril_(-1)
    system.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    written = torch.linalg.solve_triangular(
        system, beta[..., None] * v, upper=False, unitriangular=True
    )
    read_back = torch.linalg.solve_triangular(
        system, (beta * running.exp())[..., None] * k, upper=False, unitriangular=True
    )
    del system
    scores = (q @ k.transpose(-1, -2)).mul_(between)
    del between
    q_from_start = running.exp()[..., None] * q
    k_to_end = (running[..., -1:] - running).exp()[..., None] * k
    chunk_decay = running[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    state = state.reshape(streams, *state.shape[2:])
    for c in range(chunks):
        corrections = written[:, c] - read_back[:, c] @ state
        out[:, c] = q_from_start[:, c] @ state + scores[:, c] @ corrections
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ corrections
    out = out.reshape(b, heads, chunks * CHUNK, -1)[:, :, :n].transpose(1, 2)
    return out, state.reshape(b, heads, *state.shape[1:])
