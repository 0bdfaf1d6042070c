"""Qwen3-MoE (Qwen3-VL-MoE's language model too), Qwen2-MoE, Mixtral, OLMoE, GraniteMoe,
gpt-oss, GLM-4.5 and dots.llm1: the dense decoder of models/decoder.py with sparse expert MLPs
(Qwen2-MoE's, GLM-4.5's and dots.llm1's with a shared expert beside them; the last two routed
by DeepSeek-V3's sigmoid scores, `RouterStyle`).

Attention, norms, embedding and LM head are the dense decoder's (Qwen3's per-head Q/K norm,
gpt-oss's biases, sinks and windows included). Layers that `ModelConfig.is_moe_layer` picks
get a `SparseMoE` (router + experts, aserve/layers/moe.py); the others, e.g. those in
`mlp_only_layers`, keep a dense MLP of `intermediate_size`. A quantized GGUF file's experts
stay in their blocks (`QuantizedExperts`). gpt-oss names its router `mlp.router`, read here as
`mlp.gate`; Mixtral's checkpoints name the block `block_sparse_moe` and an expert's gate, down
and up `w1`, `w2` and `w3` (`MIXTRAL_NAMES`); GraniteMoe's name its router `router.layer` and
hold its experts stacked, `input_linear` and `output_linear` (`GRANITE_NAMES`).
"""

from __future__ import annotations

from torch import nn

from aserve.config import ModelConfig
from aserve.distributed.group import TPGroup
from aserve.layers.fused import FusedOps
from aserve.layers.moe import (
    TORCH_BACKEND,
    ExpertWeights,
    MoEBackend,
    QuantizedExperts,
    SparseMoE,
)
from aserve.layers.weight import WeightSource
from aserve.models.decoder import DecoderForCausalLM, DecoderMLP

EXPERTS = ".mlp.experts."
MIXTRAL_NAMES = {"w1.": "gate_proj.", "w2.": "down_proj.", "w3.": "up_proj."}
# GraniteMoe's checkpoints: its router, and its experts stacked (gate rows, then up rows)
GRANITE_NAMES = {
    ".mlp.router.layer.": ".mlp.gate.",
    ".mlp.input_linear.weight": EXPERTS + "gate_up_proj",
    ".mlp.output_linear.weight": EXPERTS + "down_proj",
}


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        tp: TPGroup,
        ops: FusedOps | None = None,
        backend: MoEBackend = TORCH_BACKEND,
    ) -> None:
        shared = config.shared_expert_intermediate_size  # Qwen2-MoE's shared expert

        def make_mlp(layer: int) -> nn.Module:
            if not config.is_moe_layer(layer):
                return DecoderMLP(config, tp, ops)
            return SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                tp,
                backend,
                fp8=config.quantization == "fp8",
                gguf=config.quantization == "gguf",
                style=config.expert_style,
                shared=DecoderMLP(config, tp, ops, shared) if shared else None,
                shared_gated=config.shared_expert_gated,
                router=config.router,
            )

        super().__init__(config, max_positions, tp, ops, make_mlp)
        self.backend = backend

    addresses_from_host = False  # the fused experts read the block layout a kernel computes

    @property
    def graph_capturable(self) -> bool:  # type: ignore[override]
        """Decode captures where no expert reads the host: the fused backend, with GGUF
        experts stacked for it (known once they are finalized)."""
        quantized = [m for m in self.modules() if isinstance(m, QuantizedExperts)]
        return not self.backend.host_sync and all(m.stacked is not None for m in quantized)

    def load_tensor(
        self, modules: dict[str, nn.Module], name: str, tensor: WeightSource
    ) -> list[str]:
        """Expert tensors go into their layer's stacked weights; the rest as in the dense model."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for granite, ours in GRANITE_NAMES.items():
            name = name.replace(granite, ours)
        name = name.replace(".mlp.router.", ".mlp.gate.")
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        if self._in_mtp_layer(name):
            return []
        layer, found, part = name.partition(EXPERTS)
        if not found:
            return super().load_tensor(modules, name, tensor)
        expert, _, rest = part.partition(".")
        for mixtral, ours in MIXTRAL_NAMES.items():
            if rest.startswith(mixtral):
                part = f"{expert}.{ours}{rest.removeprefix(mixtral)}"
        prefix = layer + EXPERTS.rstrip(".")
        experts = modules.get(prefix)
        if not isinstance(experts, (ExpertWeights, QuantizedExperts)):
            raise ValueError(f"checkpoint tensor {name} has no place in {self.config.architecture}")
        return [f"{prefix}.{filled}" for filled in experts.load_tensor(part, tensor)]

    def _in_mtp_layer(self, name: str) -> bool:
        """Whether `name` is of a next-token prediction layer after the last (GLM-4.5's
        `model.layers.{num_layers}`, with its own embedding and head): speculative decoding
        that aserve does not run, so it is not loaded."""
        if not self.config.mtp_layers or not name.startswith("model.layers."):
            return False
        layer = name.removeprefix("model.layers.").partition(".")[0]
        return layer.isdigit() and int(layer) >= self.config.num_layers

    def expected_tensors(self) -> set[str]:
        """Every expert's gate, up and down in place of the stacked parameters they fill."""
        expected = super().expected_tensors()
        for name, module in self.named_modules():
            if isinstance(module, (ExpertWeights, QuantizedExperts)):
                expected -= {f"{name}.{p}" for p in ("w13", "w2", "biases.w13", "biases.w2")}
                expected |= {f"{name}.{part}" for part in module.parts()}
        return expected
