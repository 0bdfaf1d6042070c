"""Which model class serves which Hugging Face architecture."""

from __future__ import annotations

from torch import nn

from aserve.config import ModelConfig
from aserve.distributed.group import TPGroup
from aserve.models.decoder import DecoderForCausalLM


def build_model(config: ModelConfig, max_positions: int, tp: TPGroup) -> nn.Module:
    """Construct (uninitialised) the model for `config`; dense families share one class."""
    return DecoderForCausalLM(config, max_positions, tp)
