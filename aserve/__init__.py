"""aserve: an LLM inference server in one asyncio process."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aserve.llm import LLM, GenerationOutput
    from aserve.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"

# The names load on first use, not on `import aserve`: the `aserve` command comes in through
# this package, and it starts the GPU's context before torch is imported (gpu_context.py).
_HOMES = {
    "LLM": "aserve.llm",
    "GenerationOutput": "aserve.llm",
    "SamplingParams": "aserve.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'aserve' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
