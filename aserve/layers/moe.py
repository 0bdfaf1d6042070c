"""A sparse mixture-of-experts MLP: a router picks `top_k` experts per token, each a SiLU-gated
MLP, and the token's output is their routing-weighted sum.

The experts run behind `MoEBackend`. `torch` sorts the (token, expert) pairs by expert and runs
one matmul pair per expert that has tokens; it reads the group sizes on the host, so it cannot
be captured in a CUDA graph. `fused` (aserve/layers/moe_triton.py, CUDA) runs Triton
grouped-GEMM kernels over the block layout of `moe_layout.align_blocks`, built on the device
with no host sync.

Tensor parallelism splits every expert along its intermediate dimension: each rank holds the
rows of gate and up and the columns of down that belong to it, computes a partial sum for
every token, and one all-reduce of the layer output completes it. The router is replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from aserve.config import PLAIN_EXPERTS, SOFTMAX_ROUTER, ConfigError, ExpertStyle, RouterStyle
from aserve.distributed.group import TPGroup
from aserve.layers.moe_layout import group_by_expert
from aserve.layers.weight import WeightSource, read_whole
from aserve.quant.codes import Codes
from aserve.quant.fp8 import FP8, Fp8Tensor, quantize_rows
from aserve.quant.gguf import QuantizedTensor, decode
from aserve.quant.int_checkpoints import CodesTensor
from aserve.quant.method import ProductGroup
from aserve.quant.native import ExpertStack, Scratch, moe_layer

if TYPE_CHECKING:
    from aserve.layers.moe_codes_triton import StackedCodes

ExpertsFn = Callable[..., torch.Tensor]
STACKED_PARTS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
"""Names of every expert's tensors in one, as transformers' modules hold them."""


@dataclass(frozen=True)
class MoEBackend:
    """`experts(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None,
    w13_bias=None, w2_bias=None, style=PLAIN_EXPERTS)` returns `[tokens, hidden]`: each
    token's routing-weighted sum over its experts (this rank's partial sum under tensor
    parallelism). `w13` is `[experts, 2 * inter, hidden]` (gate rows, then up rows), `w2` is
    `[experts, hidden, inter]`; FP8 weights come with one float32 scale per expert row
    (`[experts, rows]`); biases (gpt-oss) are `[experts, rows]` too, added before the
    activation or the routing weight, and `style` says how the experts gate. `host_sync`
    backends cannot run inside a CUDA graph."""

    name: str
    experts: ExpertsFn
    host_sync: bool


ExpertMLP = Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]]
"""The experts' MLPs on their rows: (expert ids, each one's rows) -> each one's outputs."""


def grouped_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    mlp: ExpertMLP,
) -> torch.Tensor:
    """Grouped dispatch: gather the pairs expert by expert, run `mlp` on the experts that have
    tokens, each on its contiguous slice, then scatter-add the weighted rows back."""
    top_k = topk_ids.shape[1]
    order, counts = group_by_expert(topk_ids, num_experts)
    tokens = order // top_k
    sizes = counts.tolist()
    experts = [expert for expert, size in enumerate(sizes) if size]
    parts = x[tokens].split([size for size in sizes if size])
    out = torch.cat(mlp(experts, list(parts)))
    out *= topk_weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, out)


def activate(gate_up: torch.Tensor, style: ExpertStyle) -> torch.Tensor:
    """An expert's gated activation from its gate | up outputs (`ExpertStyle`), in their
    dtype, op for op as transformers computes it."""
    gate, up = gate_up.chunk(2, -1)
    limit = style.swiglu_limit
    if limit is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * style.swiglu_alpha))


def torch_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    style: ExpertStyle = PLAIN_EXPERTS,
) -> torch.Tensor:
    """One gate_up and one down matmul per expert with tokens (`grouped_experts`). FP8
    experts are de-quantized one at a time, as they are used."""

    def mlp(experts: list[int], parts: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = []
        for expert, rows in zip(experts, parts):
            gate_up = _expert_weight(w13, w13_scale, expert, x.dtype)
            down = _expert_weight(w2, w2_scale, expert, x.dtype)
            gate_up_bias = None if w13_bias is None else w13_bias[expert]
            activation = activate(F.linear(rows, gate_up, gate_up_bias), style)
            outs.append(F.linear(activation, down, None if w2_bias is None else w2_bias[expert]))
        return outs

    return grouped_experts(x, topk_weights, topk_ids, w13.shape[0], mlp)


def _expert_weight(
    weight: torch.Tensor, scale: torch.Tensor | None, expert: int, dtype: torch.dtype
) -> torch.Tensor:
    if scale is None:
        return weight[expert]
    return (weight[expert].float() * scale[expert, :, None]).to(dtype)


TORCH_BACKEND = MoEBackend("torch", torch_experts, host_sync=True)
ROUTE_KERNEL_TOKENS = 64
"""Batches of up to this many tokens route in one kernel on CUDA (decode)."""


def moe_backend(name: str, device: torch.device) -> MoEBackend:
    """`auto` is `fused` on CUDA when Triton imports, `torch` otherwise. Triton is imported
    here, not at module level, so `import aserve` works where it is absent."""
    if name == "torch":
        return TORCH_BACKEND
    if device.type != "cuda":
        if name == "fused":
            raise ConfigError(
                f"--moe-backend fused needs a CUDA device (this engine runs on {device.type}); "
                "use auto or torch"
            )
        return TORCH_BACKEND
    try:
        from aserve.layers.moe_triton import fused_experts
    except ImportError as error:
        if name == "fused":
            raise ConfigError(
                f"--moe-backend fused needs Triton ({error}); install the triton that matches "
                "your torch, or use --moe-backend torch"
            ) from error
        return TORCH_BACKEND
    return MoEBackend("fused", fused_experts, host_sync=False)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token and their weights, as transformers computes them: softmax in
    float32, optionally renormalised over the chosen k, weights cast back to the model dtype.
    A decode batch on CUDA takes one kernel for it (layers/moe_route_triton.py)."""
    if logits.is_cuda and logits.shape[0] <= ROUTE_KERNEL_TOKENS:
        try:
            from aserve.layers.moe_route_triton import route_kernel
        except ImportError:  # no Triton: the torch ops below
            pass
        else:
            return route_kernel(logits, top_k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_deepseek(
    logits: torch.Tensor,
    correction: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    style: RouterStyle,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RouterStyle`'s top-k, as transformers' DeepSeek-V2, DeepSeek-V3 and GLM-4.5 routers
    compute it from float32 `logits`: sigmoid (V3) or softmax (V2) scores, the choice by
    scores plus `correction` (V3's; None: V2's, none) within the best groups, the weights
    from the scores alone, in `dtype`. One group on CUDA in decode takes one kernel
    (layers/moe_route_triton.py)."""
    one_kernel = style.groups == 1 and style.sigmoid == (correction is not None)
    if logits.is_cuda and logits.shape[0] <= ROUTE_KERNEL_TOKENS and one_kernel:
        try:
            from aserve.layers.moe_route_triton import route_kernel
        except ImportError:  # no Triton: the torch ops below
            pass
        else:
            return route_kernel(logits, top_k, renormalize, correction, style.scaling, dtype)
    scores = logits.sigmoid() if style.sigmoid else logits.softmax(-1)
    choice = scores if correction is None else scores + correction
    if style.groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, style.groups, experts // style.groups)
        best = min(style.group_best, grouped.shape[-1])
        ranks = grouped.topk(best, dim=-1).values.sum(dim=-1)
        kept = ranks.topk(style.top_groups, dim=-1).indices
        keep = torch.zeros_like(ranks, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * style.scaling).to(dtype), ids


class Router(nn.Module):
    """The gate: one score per expert (plus a bias of its own with gpt-oss). Replicated on
    every rank, so all ranks route alike. DeepSeek's routers (`RouterStyle.in_float32`) keep
    their weight (and a sigmoid router its experts' `e_score_correction_bias`) in float32
    and score float32 rows, as transformers keeps them."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        bias: bool = False,
        style: RouterStyle = SOFTMAX_ROUTER,
    ) -> None:
        super().__init__()
        self.style = style
        wide = torch.float32 if style.in_float32 else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=wide), False)
        self.bias = nn.Parameter(torch.zeros(num_experts), False) if bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), False)
            if style.sigmoid
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style.in_float32:
            return F.linear(x.float(), self.weight)
        return F.linear(x, self.weight, self.bias)

    @property
    def cpu_kernels_route(self) -> bool:
        """Whether the CPU kernels' one-call MoE layer (`moe_layer`) routes as this router
        does: a softmax, or sigmoid scores in one group (no groups there); scaled weights
        only with sigmoid scores."""
        style = self.style
        return style.groups == 1 and (style.sigmoid or style.scaling == 1.0)

    def choose(
        self, x: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's `top_k` experts and their weights, in `x`'s dtype."""
        if not self.style.in_float32:
            return route(self(x), top_k, renormalize)
        return route_deepseek(
            self(x), self.e_score_correction_bias, top_k, renormalize, self.style, x.dtype
        )

    def load_weight(
        self, name: str, tensor: WeightSource | QuantizedTensor, shard: int = 0
    ) -> None:
        """GGUF files keep the router in float32; one that quantized it is widened here."""
        param = {
            "bias": self.bias,
            "weight": self.weight,
            "e_score_correction_bias": self.e_score_correction_bias,
        }.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor mlp.gate.{name} has no place in this model")
        if isinstance(tensor, QuantizedTensor):
            param.data.copy_(tensor.decode().dequantize(torch.float32))
        else:
            param.data.copy_(tensor[:])


EXPERT_PARTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
BIAS_PARTS = ("gate_proj.bias", "up_proj.bias", "down_proj.bias")


def expert_parts(num_experts: int, biases: bool = False) -> list[str]:
    """The per-expert tensor names a checkpoint fills, as transformers saves them (and,
    where the experts have biases, as GGUF files split gpt-oss's)."""
    parts = EXPERT_PARTS + BIAS_PARTS if biases else EXPERT_PARTS
    return [f"{e}.{part}" for e in range(num_experts) for part in parts]


def expert_part(name: str, num_experts: int, biases: bool = False) -> tuple[int, str]:
    """`"{e}.gate_proj.weight"` -> (e, "gate_proj.weight"); anything else is refused."""
    expert, _, part = name.partition(".")
    known = EXPERT_PARTS + BIAS_PARTS if biases else EXPERT_PARTS
    if not expert.isdigit() or part not in known or int(expert) >= num_experts:
        raise ValueError(f"unknown expert tensor {name!r}")
    return int(expert), part


class ExpertBiases(nn.Module):
    """gpt-oss's expert biases, this rank's: `w13` `[E, 2 * I / tp]` (gate's, then up's,
    on this rank's slice of the intermediate dimension) and `w2` `[E, H]`, which only rank 0
    adds: each rank's down output is a partial sum that the all-reduce adds up."""

    def __init__(self, num_experts: int, hidden_size: int, shard: slice, tp: TPGroup) -> None:
        super().__init__()
        self.shard = shard
        self.local = shard.stop - shard.start
        self.w13 = nn.Parameter(torch.zeros(num_experts, 2 * self.local), False)
        self.w2 = nn.Parameter(torch.zeros(num_experts, hidden_size), False)
        self.adds_down = tp.rank == 0

    @property
    def down(self) -> torch.Tensor | None:
        """The down biases where this rank adds them (rank 0), else None."""
        return self.w2 if self.adds_down else None

    def load(self, where: int | slice, part: str, tensor: torch.Tensor) -> None:
        """Part `part` (of `BIAS_PARTS`) of the experts at `where`, the whole rows of it."""
        local = self.local
        if part == "gate_proj.bias":
            self.w13.data[where, :local] = tensor[..., self.shard]
        elif part == "up_proj.bias":
            self.w13.data[where, local:] = tensor[..., self.shard]
        else:
            self.w2.data[where] = tensor


def bias_rows(biases: ExpertBiases | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gate|up and down bias rows the expert kernels take (None where there are none, or
    for the down biases on ranks after the first)."""
    return (None, None) if biases is None else (biases.w13, biases.down)


class ExpertWeights(nn.Module):
    """Every expert's weights stacked: `w13` `[E, 2 * I / tp, H]` (gate rows, then up rows)
    and `w2` `[E, H, I / tp]`, this rank's slice of the intermediate dimension `I`.

    Checkpoints name experts one by one (`E.gate_proj.weight`, ...), as transformers saves
    them, or stacked (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`), as its modules
    hold them, or stacked with each expert's product transposed, as Qwen3-VL-MoE publishes
    them (`held_layout`). `load_tensor` returns the per-expert parts a tensor filled, so the
    model can tell a checkpoint that misses one expert.

    With `fp8` each expert row is kept in FP8 with a float32 scale of its own (`w13_scale`
    `[E, 2 * I / tp]`, `w2_scale` `[E, H]`), quantized as its part arrives: a float
    checkpoint's (`--quantization fp8`, on the weights' device) or a published FP8
    checkpoint's (block scales applied, then the rows quantized again, as linear layers do).
    The float experts are never held whole, so loading needs no more memory than the model."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        inter_size: int,
        tp: TPGroup,
        fp8: bool = False,
        biases: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size, self.inter_size = hidden_size, inter_size
        start, end = tp.shard(inter_size)
        self.inter_start, self.local_inter = start, end - start
        self.biases = (
            ExpertBiases(num_experts, hidden_size, slice(start, end), tp) if biases else None
        )
        dtype = FP8 if fp8 else None
        w13 = torch.empty(num_experts, 2 * self.local_inter, hidden_size, dtype=dtype)
        w2 = torch.empty(num_experts, hidden_size, self.local_inter, dtype=dtype)
        self.w13, self.w2 = nn.Parameter(w13, False), nn.Parameter(w2, False)
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        if fp8:
            self.w13_scale = torch.zeros(w13.shape[:2], dtype=torch.float32, device=w13.device)
            self.w2_scale = torch.zeros(w2.shape[:2], dtype=torch.float32, device=w2.device)

    @property
    def fp8(self) -> bool:
        """Whether the experts are held in FP8, with their row scales."""
        return self.w13_scale is not None

    def parts(self) -> list[str]:
        return expert_parts(self.num_experts, self.biases is not None)

    def load_tensor(self, name: str, tensor: WeightSource | Fp8Tensor) -> list[str]:
        """Per-expert tensors read only this rank's slice of the intermediate dimension;
        the stacked gate_up layout joins gate and up, so it is read whole."""
        local = self.local_inter
        shard = slice(self.inter_start, self.inter_start + local)
        every, gate_rows, up_rows = slice(None), slice(0, local), slice(local, 2 * local)
        if name in STACKED_PARTS and isinstance(tensor, Fp8Tensor):
            raise ValueError(f"stacked FP8 experts ({name}) are not supported")
        if self.biases is not None and name in STACKED_PARTS:
            return self._load_gpt_oss(name, read_whole(tensor))
        if name in STACKED_PARTS:
            tensor = self.held_layout(name, read_whole(tensor))
        if name == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            self._fill("w13", (every, gate_rows), gate[:, shard])
            self._fill("w13", (every, up_rows), up[:, shard])
            return [p for p in self.parts() if not p.endswith("down_proj.weight")]
        if name == "down_proj":
            self._fill("w2", (every,), tensor[:, :, shard])
            return [p for p in self.parts() if p.endswith("down_proj.weight")]
        index, part = expert_part(name, self.num_experts, self.biases is not None)
        if part in BIAS_PARTS:
            assert self.biases is not None
            self.biases.load(index, part, read_whole(tensor))
        elif part == "gate_proj.weight":
            self._fill("w13", (index, gate_rows), tensor[shard])
        elif part == "up_proj.weight":
            self._fill("w13", (index, up_rows), tensor[shard])
        else:
            self._fill("w2", (index,), tensor[:, shard])
        return [name]

    def held_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Stacked experts `[E, 2I, H]` / `[E, H, I]` from either orientation of each
        expert's product, told apart by shape as transformers does (where 2I = H, the
        modules' own is taken)."""
        inter, hidden = self.inter_size, self.hidden_size
        held = (2 * inter, hidden) if name == "gate_up_proj" else (hidden, inter)
        shape = tuple(tensor.shape)
        if shape == (self.num_experts, *held):
            return tensor
        if shape == (self.num_experts, *held[::-1]):
            return tensor.transpose(1, 2)
        raise ValueError(f"stacked experts {name} of shape {list(shape)}: expected {list(held)}")

    def _load_gpt_oss(self, name: str, tensor: torch.Tensor) -> list[str]:
        """gpt-oss's stacked experts as transformers holds them: each expert's products
        transposed (`gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`), gate and up
        interleaved column by column, biases `[E, 2I]` (interleaved too) and `[E, H]`."""
        local = self.local_inter
        shard = slice(self.inter_start, self.inter_start + local)
        every = slice(None)
        assert self.biases is not None
        if name == "gate_up_proj":
            gate, up = tensor[..., 0::2].transpose(1, 2), tensor[..., 1::2].transpose(1, 2)
            self._fill("w13", (every, slice(0, local)), gate[:, shard])
            self._fill("w13", (every, slice(local, 2 * local)), up[:, shard])
            parts = EXPERT_PARTS[:2]
        elif name == "gate_up_proj_bias":
            self.biases.load(every, "gate_proj.bias", tensor[:, 0::2])
            self.biases.load(every, "up_proj.bias", tensor[:, 1::2])
            parts = BIAS_PARTS[:2]
        elif name == "down_proj":
            self._fill("w2", (every,), tensor.transpose(1, 2)[:, :, shard])
            parts = EXPERT_PARTS[2:]
        else:
            self.biases.load(every, "down_proj.bias", tensor)
            parts = BIAS_PARTS[2:]
        return [f"{e}.{part}" for e in range(self.num_experts) for part in parts]

    def fill_random(self, std: float, generator: torch.Generator) -> None:
        """Random experts (dummy weights) from normal floats, quantized one at a time."""
        for index in range(self.num_experts):
            for name in ("w13", "w2"):
                weight = getattr(self, name)
                part = torch.empty(weight.shape[1:], device=weight.device)
                self._fill(name, (index,), part.normal_(0.0, std, generator=generator))

    def _fill(
        self, name: str, where: tuple[int | slice, ...], value: torch.Tensor | Fp8Tensor
    ) -> None:
        """Copy `value` into `where` of weight `name` ("w13" or "w2": rows of one expert, or
        of all); into FP8 rows and their scales (the same `where` of `{name}_scale`) where
        the experts are FP8."""
        target = getattr(self, name).data[where]
        scales = getattr(self, f"{name}_scale")
        if scales is None:
            target.copy_(value)
            return
        if isinstance(value, Fp8Tensor):
            rows = value.rows()
        elif value.dtype == FP8:  # FP8 values whose scale the checkpoint does not name
            raise ValueError("an FP8 expert tensor without its scale is not supported")
        else:
            value = value.to(target.device)
            rows = quantize_rows(value.reshape(-1, value.shape[-1]))
        target.copy_(rows.values.view(target.shape))
        scales[where].copy_(rows.scales.view(scales[where].shape))


class QuantizedExperts(nn.Module):
    """The experts of a quantized GGUF file, each expert's gate|up and down kept in its
    blocks (a `ProductGroup` of gate|ups and one of downs): a Qwen3-MoE GGUF takes about its
    file's bytes, not float's. On CUDA with `fused` (the fused MoE backend) a layer whose
    experts share one format per part is stacked at load and runs in two fused launches
    (layers/moe_codes_triton.py, CUDA graphs allowed); otherwise the quantized products of
    its device run grouped (`grouped_experts`); on CPU each part is also stacked
    (`ExpertStack`), and a decode step runs the whole layer, router included, in one call of
    the kernels (`whole_layer`). Names and tensor-parallel slices as `ExpertWeights`."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        inter_size: int,
        tp: TPGroup,
        fused: bool,
        style: ExpertStyle = PLAIN_EXPERTS,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.fused = fused
        self.style = style
        start, end = tp.shard(inter_size)
        self.shard = slice(start, end)
        self.biases = (
            ExpertBiases(num_experts, hidden_size, self.shard, tp) if style.biases else None
        )
        local = end - start
        self.gate_up = ProductGroup(num_experts, [local, local], hidden_size, "gguf")
        self.down = ProductGroup(num_experts, [hidden_size], local, "gguf")
        self.stacked: tuple[StackedCodes, StackedCodes] | None = None
        self.cpu_stacks: tuple[ExpertStack, ExpertStack] | None = None
        # each part's tensors as they arrive, decoded at `finalize` for every expert at once
        self.arrived: dict[str, list[QuantizedTensor | torch.Tensor | None]] = {
            part: [None] * num_experts for part in EXPERT_PARTS
        }

    def parts(self) -> list[str]:
        return expert_parts(self.num_experts, self.biases is not None)

    def load_tensor(self, name: str, tensor: WeightSource | QuantizedTensor) -> list[str]:
        index, part = expert_part(name, self.num_experts, self.biases is not None)
        if part in BIAS_PARTS:
            assert self.biases is not None and not isinstance(tensor, QuantizedTensor)
            self.biases.load(index, part, read_whole(tensor).float())
            return [name]
        sliced = tensor[:, self.shard] if part == "down_proj.weight" else tensor[self.shard]
        self.arrived[part][index] = sliced
        return [name]

    def finalize(self, device: torch.device, dtype: torch.dtype, scratch: Scratch) -> None:
        """Each part decoded for every expert at once; on CUDA with `fused`, packed whole
        for the fused kernels (gate and up rows joined expert by expert), else into each
        expert's products."""
        gate, up, down = (_decode_experts(self.arrived[part]) for part in EXPERT_PARTS)
        self.arrived = {}
        if self.biases is not None:
            self.biases.to(device=device, dtype=dtype)
        joinable = isinstance(gate, Codes) and isinstance(up, Codes) and gate.packs_with(up)
        if self.fused and device.type == "cuda" and joinable and isinstance(down, Codes):
            from aserve.layers.moe_codes_triton import stack_experts

            count = self.num_experts
            gate_up = stack_experts(gate.interleave_blocks(up, count), count, device, dtype)
            stacked_down = stack_experts(down, count, device, dtype)
            if gate_up is not None and stacked_down is not None:
                self.stacked = (gate_up, stacked_down)
                return
        for group, parts in ((self.gate_up, (gate, up)), (self.down, (down,))):
            for shard, part in enumerate(parts):
                pieces = part.split_rows(self.num_experts) if isinstance(part, Codes) else part
                for weight, piece in zip(group.weights, pieces, strict=True):
                    weight.load(shard, piece)
            group.finalize(device, dtype, scratch)
        if self.gate_up.native is not None and self.down.native is not None:
            self.cpu_stacks = (ExpertStack(self.gate_up.native), ExpertStack(self.down.native))

    @property
    def nbytes(self) -> int:
        if self.stacked is not None:
            return sum(part.nbytes for part in self.stacked)
        return self.gate_up.nbytes + self.down.nbytes

    def takes_whole_layer(self, x: torch.Tensor) -> bool:
        """Whether `whole_layer` runs these tokens: stacked CPU experts, float32 rows, fewer
        than go to BLAS (decode; on CPUs where BLAS is the slower, every batch)."""
        stacks = self.cpu_stacks
        return (
            stacks is not None
            and x.dtype == torch.float32
            and x.shape[0] < min(stack.blas_from for stack in stacks)
        )

    def whole_layer(
        self, x: torch.Tensor, router: Router, top_k: int, renormalize: bool
    ) -> torch.Tensor:
        """Routing and experts in one call of the CPU kernels (`takes_whole_layer`; a
        sigmoid router's in one group)."""
        assert self.cpu_stacks is not None
        inter = self.gate_up.weights[0].shard_rows[0]
        return moe_layer(
            x.contiguous(),
            router.weight,
            top_k,
            renormalize,
            *self.cpu_stacks,
            inter,
            router.bias,
            *bias_rows(self.biases),
            self.style,
            router.e_score_correction_bias,
            router.style.scaling,
        )

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Stacked experts on CUDA: the fused launches. Else grouped in Python around the
        products."""
        if self.stacked is not None:
            from aserve.layers.moe_codes_triton import fused_code_experts

            return fused_code_experts(
                x, *self.stacked, topk_weights, topk_ids, *bias_rows(self.biases), self.style
            )
        return grouped_experts(x, topk_weights, topk_ids, self.num_experts, self._mlp)

    def _mlp(self, experts: list[int], parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The chosen experts' gate|up products together, then their downs (`ProductGroup`:
        on CPU in decode one call of the kernels each)."""
        gate_up = self.gate_up.linear(experts, parts)
        up_bias, down_bias = bias_rows(self.biases)
        if up_bias is not None:
            gate_up = [out + up_bias[expert] for expert, out in zip(experts, gate_up)]
        acts = activate(torch.cat(gate_up), self.style).split([p.shape[0] for p in parts])
        outs = self.down.linear(experts, list(acts))
        if down_bias is None:
            return outs
        return [out + down_bias[expert] for expert, out in zip(experts, outs)]


def _decode_experts(
    tensors: list[QuantizedTensor | CodesTensor | torch.Tensor | None],
) -> Codes | list[Codes | torch.Tensor]:
    """One part of every expert: where all are blocks of one format and shape, decoded in
    one go into one `Codes` of all their rows, expert after expert (an integer checkpoint's
    codes of one format joined likewise); else each on its own (a float tensor stays
    float)."""
    present = [t for t in tensors if t is not None]
    if len(present) < len(tensors):
        raise ValueError(f"{len(tensors) - len(present)} experts' tensors are missing")
    if any(isinstance(t, CodesTensor) and t.order is not None for t in present):
        raise ConfigError(
            "act-order experts (desc_act) are not supported: their inputs would be gathered "
            "in another order for each expert"
        )
    first = present[0]
    if isinstance(first, QuantizedTensor) and all(
        isinstance(t, QuantizedTensor) and (t.qtype, t.raw.shape) == (first.qtype, first.raw.shape)
        for t in present
    ):
        return decode(torch.cat([t.raw for t in present]), first.qtype, first.cols)
    pieces = [t.decode() if isinstance(t, (QuantizedTensor, CodesTensor)) else t for t in present]
    codes = [p for p in pieces if isinstance(p, Codes)]
    if len(codes) == len(pieces) and all(codes[0].packs_with(c) for c in codes):
        return Codes.concat_rows(codes)
    return pieces


class SparseMoE(nn.Module):
    """Router plus experts, named as in Hugging Face checkpoints (`gate`, `experts`), and
    Qwen2-MoE's `shared_expert`, a dense MLP every token takes, weighed by the sigmoid of
    `shared_expert_gate` (GLM-4.5's shared experts, `shared_gated` False, are not weighed).
    Under tensor parallelism the output is this rank's partial sum, as
    the dense MLP's (the shared expert's too: its gate is a replicated scale): the decoder's
    next norm reduces it."""

    def __init__(
        self,
        hidden_size: int,
        inter_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TPGroup,
        backend: MoEBackend,
        fp8: bool = False,
        gguf: bool = False,
        style: ExpertStyle = PLAIN_EXPERTS,
        shared: nn.Module | None = None,
        shared_gated: bool = True,
        router: RouterStyle = SOFTMAX_ROUTER,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.backend = backend
        self.style = style
        self.gate = Router(num_experts, hidden_size, style.biases, router)
        self.shared_expert = shared
        gated = shared is not None and shared_gated
        self.shared_expert_gate = Router(1, hidden_size) if gated else None
        fused = backend.name == "fused"
        self.experts: ExpertWeights | QuantizedExperts = (
            QuantizedExperts(num_experts, hidden_size, inter_size, tp, fused, style)
            if gguf
            else ExpertWeights(num_experts, hidden_size, inter_size, tp, fp8, style.biases)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self._routed(x)
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(self.shared_expert_gate(x))
        return routed + shared

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        whole = isinstance(experts, QuantizedExperts) and self.gate.cpu_kernels_route
        if whole and experts.takes_whole_layer(x):
            return experts.whole_layer(x, self.gate, self.top_k, self.renormalize)
        weights, ids = self.gate.choose(x, self.top_k, self.renormalize)
        if isinstance(experts, QuantizedExperts):
            return experts(x, weights, ids)
        return self.backend.experts(
            x,
            experts.w13,
            experts.w2,
            weights,
            ids,
            experts.w13_scale,
            experts.w2_scale,
            *bias_rows(experts.biases),
            self.style,
        )
