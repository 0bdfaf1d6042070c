"""Which model class serves which Hugging Face architecture."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from aserve.config import ModelConfig
from aserve.distributed.group import TPGroup
from aserve.models.decoder import DecoderForCausalLM


def build_model(
    config: ModelConfig, max_positions: int, tp: TPGroup, ops: ModuleType | None = None
) -> nn.Module:
    """Construct (uninitialised) the model for `config`; dense families share one class.
    `ops` selects FlashInfer's fused kernels (see aserve/layers/fused.py)."""
    return DecoderForCausalLM(config, max_positions, tp, ops)
