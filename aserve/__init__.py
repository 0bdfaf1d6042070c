"""aserve: an LLM inference server in one asyncio process."""

from __future__ import annotations

from aserve.llm import LLM, GenerationOutput
from aserve.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"
