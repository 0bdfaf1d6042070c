"""aserve: an LLM inference server in one asyncio process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from aserve.llm import LLM, GenerationOutput

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The offline API loads torch (~4 s), so it is imported when first asked for: the
    `aserve` command imports this package too, and answers --help and a bad option before
    torch is loaded."""
    if name in ("LLM", "GenerationOutput"):
        from aserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'aserve' has no attribute {name!r}")
