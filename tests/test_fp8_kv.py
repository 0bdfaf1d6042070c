"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`): the pool's rounding, saturation, scales and
size, and the torch attention backend reading it, which is the reference the GPU kernels are
checked against. Users get FP8 KV on FP8 GPUs only; these tests run the same reference path on
the CPU by lifting that guard."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.engine import engine as engine_module
from aserve.kvcache.pool import FP8_MAX, KVPool
from tests.test_quant import TINY_PROMPTS, assert_refused_in_one_line, first_differences
from tests.tiny_models import make_tiny_model

FP8 = torch.float8_e4m3fn
CPU = torch.device("cpu")


def test_fp8_pool_rounds_saturates_and_scales() -> None:
    """A stored value comes back within e4m3's rounding (3 mantissa bits: 1/16 relative, and
    2^-9 absolute below its normal range), values past 448 x scale saturate, K and V use their
    own scale, and a token takes a quarter of float32's bytes."""
    pool = KVPool(2, 8, 4, 2, 16, torch.float32, CPU, FP8)
    assert pool.quantized and pool.kv[0].dtype == FP8 and pool.dtype == torch.float32
    generator = torch.Generator().manual_seed(0)
    kv = torch.randn(5, 2, 2, 16, generator=generator) * 20
    slots = torch.tensor([3, 9, 17, 22, 30])
    pool.store(1, slots, kv)
    back = pool.gather(1, slots)
    assert back.dtype == torch.float32
    assert ((back - kv).abs() <= kv.abs() / 16 + 2**-9).all()
    assert torch.equal(pool.gather(0, slots), torch.zeros_like(kv)), "another layer untouched"

    pool.scales[1] = torch.tensor([4.0, 0.5])
    big = torch.full((1, 2, 2, 16), 1000.0)
    pool.store(1, slots[:1], big)
    stored = pool.gather(1, slots[:1])[0]
    assert ((stored[0] - 1000).abs() <= 1000 / 16).all()  # K: 1000 / 4 = 250 fits
    assert stored[1].eq(0.5 * FP8_MAX).all()  # V: 1000 / 0.5 = 2000 saturates at 448
    pool.store(1, slots[1:2], kv[1:2])
    scaled = pool.gather(1, slots[1:2])[0]
    assert ((scaled[0] - kv[1, 0]).abs() <= kv[1, 0].abs() / 16 + 4 * 2**-9).all()

    per_token = [KVPool.bytes_per_token(2, 2, 16, dt) for dt in (torch.float32, FP8)]
    assert per_token == [512, 128]


def fp8_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift the FP8-hardware guard: the CPU then runs the torch reference path."""
    monkeypatch.setattr(engine_module, "check_fp8_kv_cache", lambda device, backend: None)


@pytest.mark.parametrize("stage", [True, False], ids=["decode-stage", "pool-reads"])
def test_fp8_kv_cache_generates_like_the_float_cache(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
    stage: bool,
) -> None:
    """A tiny Llama with an FP8 KV cache: a quarter of the float32 cache's bytes for the same
    pages, greedy tokens that mostly follow the float32 cache's (random weights make near-ties;
    where they part is printed), and a radix-cache hit that changes nothing: the cached
    prefix is read from the same FP8 pool that recomputing it would fill. With and without
    the CPU decode stage (which holds de-quantized copies)."""
    from aserve.attention import torch_native

    fp8_on_cpu(monkeypatch)
    if not stage:
        monkeypatch.setattr(torch_native.TorchNativeBackend, "STAGE_MAX_BYTES", 0)
    folder = make_tiny_model("llama", tmp_path / "llama")
    fp8 = make_llm(folder, num_pages=512, kv_cache_dtype="fp8_e4m3", attention_backend="torch")
    reference = make_llm(folder, num_pages=512)
    engine = fp8.runtime.engine
    assert engine.pool.kv[0].dtype == FP8 and "kv_dtype=float8_e4m3fn" in engine.describe()
    assert engine.kv_cache_bytes * 4 == reference.runtime.engine.kv_cache_bytes

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.token_ids for o in fp8.generate(TINY_PROMPTS, greedy)]
    theirs = [o.token_ids for o in reference.generate(TINY_PROMPTS, greedy)]
    parted = first_differences(ours, theirs, 12)
    with capsys.disabled():
        print(f"\nFP8 KV against float32 KV, first differing token of 6 prompts: {parted}")
    assert sum(p >= 4 for p in parted) >= 4, parted

    longer = [prompt + tokens[:6] for prompt, tokens in zip(TINY_PROMPTS, ours)]
    again = [o.token_ids for o in fp8.generate(longer, greedy)]
    fresh = make_llm(folder, num_pages=512, kv_cache_dtype="fp8_e4m3", attention_backend="torch")
    uncached = [o.token_ids for o in fresh.generate(longer, greedy)]
    assert again == uncached


def test_fp8_kv_cache_refused_without_fp8_hardware(tmp_path: Path) -> None:
    """On a CPU (and on GPUs older than compute capability 8.9) the option is one line."""
    folder = make_tiny_model("llama", tmp_path / "llama")
    assert_refused_in_one_line(
        folder,
        ["--kv-cache-dtype", "fp8_e4m3"],
        "--kv-cache-dtype fp8_e4m3 needs a GPU with FP8",
        tmp_path / "cache",
    )
