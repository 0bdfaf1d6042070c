"""Which model class serves which Hugging Face architecture."""

from __future__ import annotations

import torch

from aserve.config import ENCODER_ARCHITECTURES, MODERN_BERT, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.layers.fused import FusedOps
from aserve.layers.moe import moe_backend as select_moe_backend
from aserve.models.decoder import DecoderForCausalLM
from aserve.models.encoder import EncoderModel
from aserve.models.modernbert import ModernBertModel
from aserve.models.moe import Qwen3MoeForCausalLM


def build_model(
    config: ModelConfig,
    max_positions: int,
    tp: TPGroup,
    ops: FusedOps | None = None,
    moe_backend: str = "auto",
    device: torch.device | None = None,
) -> DecoderForCausalLM | EncoderModel:
    """Construct (uninitialised) the model for `config`; dense families share one class.
    `ops` selects FlashInfer's fused kernels (see aserve/layers/fused.py); `moe_backend`
    (--moe-backend) the expert kernels of MoE families for `device` (default: CPU)."""
    if config.architecture == MODERN_BERT:
        return ModernBertModel(config, tp)
    if config.architecture in ENCODER_ARCHITECTURES:
        return EncoderModel(config, tp)
    if config.num_experts:
        backend = select_moe_backend(moe_backend, device or torch.device("cpu"))
        return Qwen3MoeForCausalLM(config, max_positions, tp, ops, backend)
    return DecoderForCausalLM(config, max_positions, tp, ops)
