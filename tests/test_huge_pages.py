"""CPU kernel weights placed on memory advised for transparent huge pages
(quant/huge_pages.py): the same values, blocks that start on a huge page, every kernel
weight of a loaded model in them, experts still views of their stack."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.models.decoder import cpu_kernel_weights
from aserve.quant import huge_pages
from aserve.quant.huge_pages import HUGE_PAGE_BYTES, WeightBlocks
from aserve.quant.native import ExpertStack
from tests.gguf_files import write_hf_as_gguf
from tests.test_gguf_models import MOE_LAYERS
from tests.test_quant import needs_kernels
from tests.tiny_models import make_tiny_model


def test_placed_tensors_keep_their_values_in_blocks_from_a_huge_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors copy into a block advised as a whole, one after another on cache lines; one
    larger than a block gets its own; empty, strided and non-CPU ones stay as they are."""
    monkeypatch.setattr(huge_pages, "BLOCK_BYTES", 4 << 20)
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(
        huge_pages, "advise_huge_pages", lambda t: advised.append((t.data_ptr(), t.nbytes))
    )
    blocks = WeightBlocks()
    generator = torch.Generator().manual_seed(0)
    small = torch.randint(-128, 127, (1000, 3), dtype=torch.int8, generator=generator)
    half = torch.randn(7, 5, generator=generator).half()
    big = torch.randn(3 << 20, generator=generator)  # 12 MiB: a block of its own
    placed = [blocks.place(t) for t in (small, half, big)]
    for before, after in zip((small, half, big), placed, strict=True):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before) and after.data_ptr() != before.data_ptr()
    assert placed[1].data_ptr() - placed[0].data_ptr() == 3008  # 3,000 bytes to a cache line
    assert [size for _, size in advised] == [4 << 20, 12 << 20]
    assert all(start % HUGE_PAGE_BYTES == 0 for start, _ in advised)
    assert placed[0].data_ptr() == advised[0][0] and placed[2].data_ptr() == advised[1][0]
    strided, empty = torch.ones(4, 4).t(), torch.empty(0)
    assert blocks.place(strided) is strided and blocks.place(empty) is empty


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_blocks_are_advised_for_huge_pages() -> None:
    """The block's memory is marked for huge pages (`hg` among its mapping's flags in
    /proc/self/smaps: set by the advice, whether or not the system has huge pages free)."""
    placed = WeightBlocks().place(torch.ones(1 << 20))
    address = placed.data_ptr()
    flags, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
            break
    assert flags is not None and "hg" in flags


@needs_kernels
def test_a_loaded_model_keeps_its_kernel_weights_in_the_blocks(tmp_path: Path) -> None:
    """Every CPU kernel weight of a GGUF MoE model (linear products, the tables, the expert
    stacks) lies in a few blocks, and each expert's weight is still a view of its stack."""
    folder = make_tiny_model("qwen3_moe", tmp_path / "moe", overrides=MOE_LAYERS)
    model = write_hf_as_gguf(folder, tmp_path / "moe.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    with LLM(str(model), page_size=4) as llm:
        weights = cpu_kernel_weights(llm.runtime.engine.model)
        stacks = [w for w in weights if isinstance(w, ExpertStack)]
        assert stacks and len(weights) > len(stacks)
        tensors = [t for w in weights for t in (w.words, w.scales, w.offsets, w.bases) if t.numel()]
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        nbytes = sum(t.nbytes for t in tensors)
        assert len(storages) <= -(-nbytes // huge_pages.BLOCK_BYTES) + 1
        for stack in stacks:
            base, size = stack.words.data_ptr(), stack.words.nbytes
            for expert in stack.experts:
                assert base <= expert.words.data_ptr() < base + size
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
