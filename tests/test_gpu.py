"""The engine on CUDA (run on the GPU machine; skipped without CUDA)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aserve import LLM, GenerationOutput, SamplingParams
from aserve.forward import ForwardBatch
from aserve.kvcache.pool import KVPool
from aserve.scheduler.request import FinishReason
from tests.gguf_files import write_hf_as_gguf
from tests.scenarios import abort_one_of_two
from tests.test_models import our_logits
from tests.tiny_models import FAMILIES, MLA_GPU_SHAPES, make_tiny_model, phi3_rope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 12, 250, 31, 8], [300, 4, 4, 61], list(range(3, 90))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BENCH = Path(__file__).resolve().parent.parent / "bench" / "models"
KERNEL_SHAPES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
EVERY_EXPERT = {"num_experts_per_tok": 8}
"""The tiny gpt-oss with each token routed to all 8 of its experts: comparisons between two
engines in bf16 then cannot part on a routing flipped by rounding (one flip moved a logit by
1.5), and what they check is attention and the experts' arithmetic."""
KV_CACHE_DTYPES = [
    "auto",
    pytest.param(
        "fp8_e4m3",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
            reason="an FP8 cache needs compute capability 8.9 or newer",
        ),
    ),
]
"""The KV cache in the model dtype, and in FP8 (FlashInfer's FP8 prefill, Triton's FP8 decode,
the fused kernel's FP8 write against the torch backend's `KVPool.store`)."""


def small_gpu_engine(**options: Any) -> dict[str, Any]:
    """Options of a bfloat16 engine on the GPU with a small pool of 16-token pages."""
    return {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024, **options}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_greedy_on_gpu_equals_cpu(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    folder = make_tiny_model(family, tmp_path)
    cpu = make_llm(folder, device="cpu", page_size=4)
    gpu = make_llm(folder, device="cuda", dtype="float32", page_size=4)
    assert [o.token_ids for o in gpu.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in cpu.generate(PROMPTS, GREEDY)
    ]


def assert_greedy_logprobs_close(llm: LLM, hf: torch.nn.Module) -> None:
    """Each greedy token's bf16 logprob as transformers gives it on the same sequence."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    device = next(hf.parameters()).device
    for prompt in PROMPTS:
        out = llm.generate([prompt], params)[0]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out.token_ids], device=device)).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        ours = torch.tensor([lp.logprob for lp in out.logprobs], device=device)
        theirs = expected.gather(1, torch.tensor(out.token_ids, device=device)[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_logprobs_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    import transformers

    shapes = {**KERNEL_SHAPES, "head_dim": 128 if family == "qwen3" else 64}
    if family == "phi3":  # its factors for heads of 64
        shapes["rope_scaling"] = phi3_rope(64)
    if family == "gpt_oss":  # the published clamp: older transformers fix it at 7
        shapes |= EVERY_EXPERT | {"swiglu_limit": 7.0}
    latent = family.startswith("deepseek")
    if latent:  # the latent widths FlashInfer's MLA kernels take
        shapes = MLA_GPU_SHAPES
    folder = make_tiny_model(family, tmp_path, overrides=shapes)
    if family == "gpt_oss":
        # transformers' gpt-oss softmaxes scores and sinks in the model dtype: its float32
        # run (on CPU) is the reference for aserve's bf16 one
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf = hf.eval()
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        hf = hf.cuda().eval()
    llm = make_llm(folder, device="cuda", dtype="bfloat16")
    backend = "FlashInferMLABackend" if latent else "FlashInferBackend"
    assert type(llm.runtime.engine.attn).__name__ == backend
    assert llm.runtime.engine.graphs is not None
    assert_greedy_logprobs_close(llm, hf)


def test_phi3_heads_of_96_prefill_on_torch_and_decode_on_triton(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phi-3/3.5-mini's heads of 96 (72 rotating), a size FlashInfer's kernels do not take:
    `auto` prefills through the torch backend and decodes through the Triton kernels, heads
    padded to 128 as they are read, in CUDA graphs. transformers' bf16 logprobs with the
    split kernels (one request) and with the whole-context kernel, in graphs; the graphs'
    batched greedy tokens are an eager run's. FlashInfer's prefill is refused in
    one line (0.6.8's faults on such heads)."""
    import transformers

    from aserve.attention import triton_decode
    from aserve.attention.base import SplitBackend
    from aserve.config import ConfigError

    shapes = {"hidden_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2}
    folder = make_tiny_model("phi3", tmp_path, overrides={**shapes, "rope_scaling": phi3_rope(96)})
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    llm = make_llm(folder, **small_gpu_engine())
    engine = llm.runtime.engine
    assert engine.model_config.head_dim == 96 and engine.model_config.rotary_dim == 72
    assert isinstance(engine.attn, SplitBackend) and engine.graphs is not None
    assert type(engine.attn.prefill).__name__ == "TorchNativeBackend"
    assert type(engine.attn.decode).__name__ == "FlashInferBackend"
    assert_greedy_logprobs_close(llm, hf)
    batched = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    eager = make_llm(folder, **small_gpu_engine(cuda_graph_max_bs=0))
    assert [o.token_ids for o in eager.generate(PROMPTS, GREEDY)] == batched
    monkeypatch.setattr(triton_decode, "WHOLE_MIN_PROGRAMS", 1)
    assert_greedy_logprobs_close(make_llm(folder, **small_gpu_engine()), hf)
    with pytest.raises(ConfigError, match="64, 128 or 256, not 96"):
        LLM(str(folder), **small_gpu_engine(attention_backend="fi"))


def test_gemma3_windows_on_flashinfer(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """Gemma 3's windows in both decode paths: FlashInfer's, planned twice a batch (its
    windowed layers' plan and the rest's), for three requests, and the Triton kernels, given
    the window at each layer's run, for one. Each gives the same greedy tokens in CUDA
    graphs as eagerly, and the two agree with each other up to near ties (one request's
    logprobs against transformers': test_bf16_logprobs_close_to_transformers). FA3 prefill,
    which has no windowed path here, is refused in one line."""
    from aserve.attention.flashinfer import ByWindow
    from aserve.config import ConfigError

    folder = make_tiny_model("gemma3", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=True)
    graphs = make_llm(folder, **small_gpu_engine())
    engine = graphs.runtime.engine
    assert engine.graphs is not None and engine.attn.window == 4
    batched = graphs.generate(PROMPTS, params)
    assert isinstance(engine.attn.prefill_wrapper, ByWindow)
    eager = make_llm(folder, **small_gpu_engine(cuda_graph_max_bs=0))
    assert eager.runtime.engine.graphs is None
    assert [o.token_ids for o in batched] == [o.token_ids for o in eager.generate(PROMPTS, params)]
    # one request at a time: the Triton kernels, given the window at each layer's run
    alone = [graphs.generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in alone] == [
        eager.generate([p], params)[0].token_ids for p in PROMPTS
    ]
    for one, many in zip(alone, batched):  # the two kernels agree but for near ties
        agree = next(
            (i for i, (a, b) in enumerate(zip(one.token_ids, many.token_ids)) if a != b), 16
        )
        assert agree >= 8
        torch.testing.assert_close(
            [t.logprob for t in one.logprobs[:agree]],
            [t.logprob for t in many.logprobs[:agree]],
            atol=0.05,
            rtol=0.05,
        )
    with pytest.raises(ConfigError, match="sliding windows run on --attention-backend fi"):
        LLM(str(folder), **small_gpu_engine(attention_backend="fa"))


def assert_both_decode_kernels_give(
    llm: LLM,
    prompt: list[int],
    continuation: list[int],
    expected: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`llm`'s logits over `prompt` and teacher-forced `continuation` within 0.06 of
    `expected`, decoding through the split Triton kernel, then the whole-context one."""
    from aserve.attention import triton_decode

    for whole in (False, True):
        if whole:  # every batch to the whole-context kernel
            monkeypatch.setattr(triton_decode, "WHOLE_MIN_PROGRAMS", 1)
        torch.testing.assert_close(
            our_logits(llm, prompt, continuation), expected, atol=0.06, rtol=0.03
        )
    monkeypatch.undo()


def test_gpt_oss_sinks_on_flashinfer(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's sinks in FlashInfer's prefill (rescaled by its log-sum-exp) and in both
    Triton decode kernels (a split context merged with the sink, a whole one started at it),
    its windows of 4 on every other layer and its experts (biases, clamped SwiGLU) in the
    fused kernels: the torch backend's logits over a chunked prefill with a cached prefix
    and decode steps; in CUDA graphs the same greedy tokens as eagerly (an FP8 cache:
    test_fp8_cache_with_windows)."""
    shapes = {**KERNEL_SHAPES, "head_dim": 64, **EVERY_EXPERT}
    folder = make_tiny_model("gpt_oss", tmp_path, overrides=shapes)
    options = small_gpu_engine(max_prefill_length=40)
    reference = make_llm(folder, attention_backend="torch", **options)
    # no prefix cache: the second run must prefill in the same chunks as the first
    flashinfer = make_llm(folder, cache_type="naive", **options)
    engine = flashinfer.runtime.engine
    assert type(engine.attn).__name__ == "FlashInferBackend" and engine.attn.sinks
    assert engine.model.model.layers[0].mlp.backend.name == "fused"
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5]
    expected = our_logits(reference, prompt, continuation)
    assert_both_decode_kernels_give(flashinfer, prompt, continuation, expected, monkeypatch)
    assert engine.graphs is not None
    eager = make_llm(folder, **small_gpu_engine(cuda_graph_max_bs=0))
    assert [o.token_ids for o in flashinfer.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in eager.generate(PROMPTS, GREEDY)
    ]


def test_gemma2_soft_caps_on_flashinfer(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2's soft-capped scores (0.5) in FlashInfer's prefill (its soft-cap variant,
    windowed and whole) and in both Triton decode kernels (split and whole context): the
    torch backend's logits over a chunked prefill and decode steps, which the same model
    without the scores' cap misses by far more than the tolerance; in CUDA graphs the same
    greedy tokens as eagerly. FA3 prefill, which has no soft cap here, is refused in one
    line."""
    from aserve.config import ConfigError

    folder = make_tiny_model("gemma2", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    options = small_gpu_engine(max_prefill_length=40)
    reference = make_llm(folder, attention_backend="torch", **options)
    flashinfer = make_llm(folder, cache_type="naive", **options)
    engine = flashinfer.runtime.engine
    assert type(engine.attn).__name__ == "FlashInferBackend" and engine.attn.softcap == 0.5
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5]
    expected = our_logits(reference, prompt, continuation)
    assert_both_decode_kernels_give(flashinfer, prompt, continuation, expected, monkeypatch)
    reference.runtime.engine.attn.softcap = 0.0
    assert (our_logits(reference, prompt, continuation) - expected).abs().max() > 0.3
    assert engine.graphs is not None
    eager = make_llm(folder, **small_gpu_engine(cuda_graph_max_bs=0))
    assert [o.token_ids for o in flashinfer.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in eager.generate(PROMPTS, GREEDY)
    ]
    with pytest.raises(ConfigError, match="soft-capped scores run on --attention-backend fi"):
        LLM(str(folder), **small_gpu_engine(attention_backend="fa"))


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_short_window_pool_on_flashinfer(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    """The windowed layers' own pool at its least (5 pages of 16 for a window of 4 and
    chunks of 40) drops pages through a chunked prefill and decode: FlashInfer's windowed
    plans and the Triton kernels read those layers' pages from the first one a query reads.
    Logits as the torch backend's with a roomy pool; with 8 pages, three prompts at once in
    CUDA graphs as eagerly, and a conversation's next turn (a prefix hit whose window was
    kept) as the torch backend's."""
    shapes = {**KERNEL_SHAPES, "head_dim": 64}
    if family == "gpt_oss":
        shapes |= EVERY_EXPERT
    folder = make_tiny_model(family, tmp_path, overrides=shapes)
    options = small_gpu_engine(max_prefill_length=40, num_pages=64)
    reference = make_llm(folder, attention_backend="torch", **options)
    assert reference.runtime.engine.window_pages > 40
    short = make_llm(folder, swa_full_tokens_ratio=0.01, **options)
    engine = short.runtime.engine
    assert engine.window_pages == 5 and type(engine.attn).__name__ == "FlashInferBackend"
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5] * 4
    torch.testing.assert_close(
        our_logits(short, prompt, continuation),
        our_logits(reference, prompt, continuation),
        atol=0.06,
        rtol=0.03,
    )
    assert short.scheduler.planner.window_pages_dropped > 0
    tight = make_llm(folder, swa_full_tokens_ratio=0.12, **options)
    eager = make_llm(folder, swa_full_tokens_ratio=0.12, **{**options, "cuda_graph_max_bs": 0})
    assert tight.runtime.engine.window_pages == 8
    assert tight.runtime.engine.graphs is not None and eager.runtime.engine.graphs is None
    outputs = tight.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    planner = tight.scheduler.planner
    assert planner.window_pages_dropped > 0
    tight.scheduler.check_integrity()
    # the next turn of a conversation run alone (no pool pressure: its last window kept)
    alone = tight.generate([PROMPTS[0]], GREEDY)[0]
    turn = PROMPTS[0] + alone.token_ids[:-1] + [5, 6, 7]
    cached_before = planner.prompt_tokens_cached
    torch.testing.assert_close(
        our_logits(tight, turn, continuation[:6]),
        our_logits(reference, turn, continuation[:6]),
        atol=0.06,
        rtol=0.03,
    )
    assert planner.prompt_tokens_cached - cached_before >= 32


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="an FP8 cache needs compute capability 8.9 or newer",
)
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_fp8_cache_with_windows(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """An FP8 cache under sliding windows, the windowed layers in their own short pool:
    FlashInfer's prefill over the FP8 pages, then over each pool's pages widened to bf16
    (`WidenedPrefill`), and Triton's FP8 decode with the window give the logits of a roomy
    pool that drops nothing, and the torch backend's on the same FP8 pool within 0.15 (on
    the H200 the tiny Gemma 3's FP8 kernels and the torch backend's de-quantized FP8 parted
    by up to 0.12, a fifth of what FP8 moves its logits from a bf16 cache, 0.15-0.63;
    gpt-oss's within 0.06); CUDA graphs give the same greedy tokens as eagerly."""
    from aserve.attention import flashinfer as backend
    from tests.test_fp8_gpu import count_widened_steps

    shapes = {**KERNEL_SHAPES, "head_dim": 64}
    if family == "gpt_oss":
        shapes |= EVERY_EXPERT
    folder = make_tiny_model(family, tmp_path, overrides=shapes)
    options = small_gpu_engine(max_prefill_length=40, num_pages=64, kv_cache_dtype="fp8_e4m3")
    reference = make_llm(folder, attention_backend="torch", **options)
    roomy = make_llm(folder, **options)
    short = make_llm(folder, swa_full_tokens_ratio=0.01, **options)
    engine = short.runtime.engine
    assert engine.pool.scaled and engine.window_pages == 5
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5] * 4
    expected = our_logits(reference, prompt, continuation)
    widened = count_widened_steps(monkeypatch)
    logits = our_logits(short, prompt, continuation)
    assert not widened  # 4 heads over ~100 slots: FlashInfer's FP8 kernel
    torch.testing.assert_close(logits, our_logits(roomy, prompt, continuation))
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.03)
    engine.attn.widen_max_slots = 1 << 20
    monkeypatch.setattr(backend, "WIDEN_MIN_HEAD_SLOTS", 0)
    torch.testing.assert_close(
        our_logits(short, prompt, continuation), expected, atol=0.15, rtol=0.03
    )
    assert widened
    monkeypatch.undo()
    assert short.scheduler.planner.window_pages_dropped > 0
    eager = make_llm(folder, swa_full_tokens_ratio=0.01, **{**options, "cuda_graph_max_bs": 0})
    assert engine.graphs is not None and eager.runtime.engine.graphs is None
    assert [o.token_ids for o in short.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in eager.generate(PROMPTS, GREEDY)
    ]


def test_gpt_oss_mxfp4_experts_in_the_fused_kernels(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gpt-oss GGUF with MXFP4 experts (as published) on CUDA: its experts stacked for the
    fused code kernels with their biases and clamped SwiGLU, decode in CUDA graphs; the
    logits of the same file's experts run grouped (torch backend: products rounded to bf16
    before the bias and the gate, where the fused kernels keep float32 to the gate's end;
    greedy tokens of the two parted at the third token of one prompt)."""
    from gguf import GGMLQuantizationType as QType

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    shapes = {**KERNEL_SHAPES, "head_dim": 64, **EVERY_EXPERT, "intermediate_size": 64}
    folder = make_tiny_model("gpt_oss", tmp_path / "hf", overrides=shapes | {"swiglu_limit": 7.0})
    model = write_hf_as_gguf(
        folder, tmp_path / "oss.gguf", qtype=QType.Q8_0, qtype_of={"_exps": QType.MXFP4}
    )
    fused = make_llm(model, **small_gpu_engine())
    assert fused.runtime.engine.model.model.layers[0].mlp.experts.stacked is not None
    assert fused.runtime.engine.graphs is not None
    grouped = make_llm(model, **small_gpu_engine(moe_backend="torch"))
    assert grouped.runtime.engine.model.model.layers[0].mlp.experts.stacked is None
    prompt, continuation = list(range(3, 60)), [7, 123, 45, 2, 99, 5]
    torch.testing.assert_close(  # the H200: one logit of 2,240 0.066 apart (bf16 hidden states)
        our_logits(fused, prompt, continuation),
        our_logits(grouped, prompt, continuation),
        atol=0.1,
        rtol=0.03,
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scaled_rope_from_gguf_close_to_transformers(
    make_llm: Callable[..., LLM],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    family: str,
) -> None:
    """A GGUF's Llama-3 `rope_freqs` and a YaRN scaling (cos and sin grown by its attention
    factor) through the CUDA kernels that read the rotary table: bf16 logprobs as
    transformers' on the checkpoint the file was written from."""
    import transformers

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    shapes = {**KERNEL_SHAPES, "head_dim": 128 if family == "qwen3" else 64}
    if family == "qwen3":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
        shapes["rope_scaling"] = yarn
    folder = make_tiny_model(family, tmp_path / family, overrides=shapes)
    model = write_hf_as_gguf(folder, tmp_path / f"{family}.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    llm = make_llm(model, device="cuda", dtype="bfloat16")
    kind = "freq_factors" if family == "llama" else "yarn"
    assert llm.runtime.engine.model_config.rope_scaling["rope_type"] == kind
    assert_greedy_logprobs_close(llm, hf)


def test_qk_norm_in_place_on_strided_heads_equals_torch() -> None:
    """Qwen3's Q/K norm runs in place on Q and K inside the fused QKV output (strided views)
    and leaves V alone."""
    from aserve.layers.fused import fused_ops
    from aserve.layers.norm import RMSNorm

    ops = fused_ops(torch.device("cuda"), torch.bfloat16)
    assert ops is not None
    head_dim, q_heads, kv_heads = 128, 4, 2
    fused, plain = RMSNorm(head_dim, 1e-6, ops).cuda(), RMSNorm(head_dim, 1e-6).cuda()
    for norm in (fused, plain):
        norm.weight.data = torch.linspace(0.5, 1.5, head_dim, device="cuda").bfloat16()
    qkv = torch.randn(5, (q_heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    expected = qkv.clone()
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    eq, ek, ev = expected.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    for norm, (query, key) in ((fused, (q, k)), (plain, (eq, ek))):
        norm.norm_heads(query, head_dim)
        norm.norm_heads(key, head_dim)
    torch.testing.assert_close(q, eq, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k, ek, atol=2e-2, rtol=2e-2)
    assert torch.equal(v, ev)


@pytest.mark.parametrize("qk_norm", ["none", "per head", "across heads"])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"), [(16, 8, 128), (9, 3, 64), (32, 32, 96)]
)
def test_norm_rope_store_kernel_equals_the_separate_steps(
    qk_norm: str, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    """The one-kernel Q/K norm + RoPE + KV write against the plain PyTorch layers doing the
    three steps one after another, on a fused QKV output with random positions and slots;
    heads of 96 (Phi-3-mini) are read as padded to 128; norms one a head (Qwen3's) or one
    over all heads (OLMo 2's)."""
    from aserve.distributed.group import TPGroup
    from aserve.layers.norm import AcrossHeadsNorm, RMSNorm
    from aserve.layers.rope_store import norm_rope_store
    from aserve.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    device, dtype, tokens = torch.device("cuda"), torch.bfloat16, 37
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, None).to(device)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    across = qk_norm == "across heads"
    if across:
        one = TPGroup()  # one rank
        norms = [AcrossHeadsNorm(n, (0, n), 1e-6, one).to(device) for n in (q_size, kv_size)]
    else:
        norms = [RMSNorm(head_dim, 1e-6).to(device) for _ in range(2)]
    for norm in norms:  # float32 weights that bf16 holds exactly
        width = norm.weight.shape[0]
        norm.weight.data = (torch.rand(width, device=device) + 0.5).to(dtype).float()
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    slots = torch.randperm(64 * 16, device=device)[:tokens]
    pools = [KVPool(1, 64, 16, kv_heads, head_dim, dt, device) for dt in (torch.float32, dtype)]

    original, expected = qkv.clone(), qkv.float()
    q, kv = expected.split([q_size, 2 * kv_size], -1)
    if across:
        norms[0].norm_in_place(q)
        norms[1].norm_in_place(kv[:, :kv_size])
    elif qk_norm == "per head":
        norms[0].norm_heads(q, head_dim)
        norms[1].norm_heads(kv[:, :kv_size], head_dim)
    rotary(positions, expected[:, : q_size + kv_size], q_size)
    pools[0].store(0, slots, kv.reshape(tokens, 2, kv_heads, head_dim))

    q, kv = qkv.split([q_size, 2 * kv_size], -1)
    weights = (norms[0].weight.to(dtype), norms[1].weight.to(dtype))
    norm_rope_store(
        q,
        kv,
        positions,
        rotary.cos_sin,
        *(weights if qk_norm != "none" else (None, None)),
        1e-6,
        pools[1].kv[0],
        slots,
        head_dim,
        across_heads=across,
    )
    tolerance = {"atol": 2e-2, "rtol": 2e-2}  # bf16 rounding against a float32 reference
    torch.testing.assert_close(q.float(), expected[:, :q_size], **tolerance)
    torch.testing.assert_close(pools[1].kv[0].float(), pools[0].kv[0], **tolerance)
    assert torch.equal(qkv[:, q_size:], original[:, q_size:])  # attention reads K from the pool


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (1000, 576), (49152, 576)])
def test_one_row_gemv_equals_linear(n: int, k: int, bias: bool) -> None:
    """The Triton GEMV against `F.linear` in float32 on the same bf16 inputs, on shapes that
    fill its blocks and shapes that do not; gated, against SiLU-and-mul then the product."""
    import torch.nn.functional as F

    from aserve.layers.gemv import gemv

    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    b = torch.randn(n, device=device, dtype=dtype) if bias else None
    x = torch.randn(1, k, device=device, dtype=dtype)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    tolerance = {"atol": 2e-2, "rtol": 2e-2}  # bf16 output rounding
    torch.testing.assert_close(gemv(x, weight, b).float(), expected, **tolerance)

    gate_up = torch.randn(1, 2 * k, device=device, dtype=dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    activation = (F.silu(gate) * up).to(dtype).float()  # rounded as the separate kernel stores it
    expected = F.linear(activation, weight.float(), None if b is None else b.float())
    torch.testing.assert_close(gemv(gate_up, weight, b, gated=True).float(), expected, **tolerance)


@pytest.mark.parametrize("kernel", ["split", "whole"])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"), [(32, 8, 128), (16, 8, 128), (9, 3, 64)]
)
def test_triton_decode_equals_plain_attention(
    kernel: str,
    page_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton decode kernels against softmax attention written out in float32, for
    contexts from 1 token to more than the splits cover evenly, on pages scattered over
    the pool, from a wrapper planned for a CUDA graph (static buffers) and one that is not.
    `kernel` forces the split kernels (and their merge) or the whole-context kernel, which
    the wrapper otherwise picks by batch size."""
    from aserve.attention import triton_decode
    from aserve.attention.triton_decode import TritonDecodeWrapper

    threshold = 1 if kernel == "whole" else 1 << 30
    monkeypatch.setattr(triton_decode, "WHOLE_MIN_PROGRAMS", threshold)
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    lengths = [1, 7, 300, 1000, 4097, 33, 256, 2]
    pages_per_row = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_row) + 8
    pool = KVPool(1, num_pages, page_size, kv_heads, head_dim, dtype, device)
    pool.kv[0].copy_(torch.randn_like(pool.kv[0]))
    page_ids, indptr, last = scattered_pages(lengths, page_size, num_pages)
    qkv = torch.randn(len(lengths), (q_heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    q = qkv[:, : q_heads * head_dim].view(len(lengths), q_heads, head_dim)  # strided rows
    expected = plain_decode_attention(pool, q, lengths, page_ids, indptr)
    shape = (-1, page_size, kv_heads, head_dim)
    cache = (pool.k[0].view(shape), pool.v[0].view(shape))
    for wrapper in (
        TritonDecodeWrapper(device),
        TritonDecodeWrapper(device, len(lengths), sum(pages_per_row)),
    ):
        wrapper.plan(
            indptr,
            page_ids.cpu(),  # the wrapper takes the whole layout on the host
            last,
            num_qo_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        assert (wrapper.num_splits == 1) == (kernel == "whole")
        for _ in range(2):  # planned once, run per layer
            out = wrapper.run(q, cache)
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def scattered_pages(
    lengths: list[int], page_size: int, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Requests of these lengths on pages scattered over a pool of `num_pages` (page 0 left
    out), in FlashInfer's layout: page ids (on the GPU), page pointers and last-page lengths
    (on the host)."""
    pages_per_row = [-(-n // page_size) for n in lengths]
    page_ids = (torch.randperm(num_pages - 1, device="cuda") + 1)[: sum(pages_per_row)]
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(pages_per_row).cumsum(0)
    last = [n - (p - 1) * page_size for n, p in zip(lengths, pages_per_row)]
    return page_ids.int(), indptr, torch.tensor(last, dtype=torch.int32)


def plain_decode_attention(
    pool: KVPool, q: torch.Tensor, lengths: list[int], page_ids: torch.Tensor, indptr: torch.Tensor
) -> torch.Tensor:
    """Softmax attention of `q` `[requests, heads, head_dim]` written out in float32 over
    layer 0's K and V as the pool reads them back (de-quantized, for an FP8 pool)."""
    heads, head_dim = q.shape[1:]
    expected = []
    for row, n in enumerate(lengths):
        pages = page_ids[indptr[row] : indptr[row + 1]].long()
        slots = pages[:, None] * pool.page_size + torch.arange(pool.page_size, device="cuda")
        kv = pool.gather(0, slots.flatten()[:n]).float()  # [n, 2, kv_heads, head_dim]
        k, v = (kv[:, i].repeat_interleave(heads // kv.shape[2], dim=1) for i in (0, 1))
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * head_dim**-0.5
        expected.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(expected)


def test_dummy_qwen3_shape_runs_in_bf16(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(BENCH / "qwen3-0.6b", dummy_weight=True, max_seq_len_override=2048)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [16, 16, 16]
    assert llm.runtime.engine.dtype is torch.bfloat16


def test_next_step_is_planned_once_a_prefill_passes_its_middle_layer(
    make_llm: Callable[..., LLM],
) -> None:
    """Behind a prefill chunk the next step is planned only once the GPU has passed the
    chunk's middle layer (Scheduler.run), never straight behind its launch, and every
    chunk carries that event. 24k prompt tokens in 8k chunks of the Qwen3-0.6B shape."""
    llm = make_llm(
        BENCH / "qwen3-0.6b", dummy_weight=True, max_seq_len_override=4096, max_prefill_length=8192
    )
    scheduler, planner = llm.scheduler, llm.scheduler.planner
    launched: list[torch.cuda.Event | None] = []
    unpassed_at_plan: list[bool] = []
    launch_sampling, schedule = scheduler._launch_sampling, planner.schedule

    def recording_launch(step: Any) -> Any:
        launched.append(step.batch.halfway)
        return launch_sampling(step)

    def checking_schedule() -> Any:
        if launched and launched[-1] is not None:
            unpassed_at_plan.append(not launched[-1].query())
        return schedule()

    scheduler._launch_sampling = recording_launch  # type: ignore[method-assign]
    planner.schedule = checking_schedule  # type: ignore[method-assign]
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(3000)] for i in range(8)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [4] * 8
    assert sum(event is not None for event in launched) >= 3  # the prefill chunks
    assert len(unpassed_at_plan) >= 3 and not any(unpassed_at_plan)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_flashinfer_logits_match_torch_backend(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str, page_size: int, kv_cache_dtype: str
) -> None:
    """Chunked prefill (so later chunks attend to a cached prefix), then decode steps; both
    backends read the same cache, in the model dtype or in FP8."""
    shapes = {**KERNEL_SHAPES, "head_dim": 128 if family == "qwen3" else 64}
    folder = make_tiny_model(family, tmp_path, overrides=shapes)
    options = {
        "device": "cuda",
        "dtype": "bfloat16",
        "page_size": page_size,
        "max_prefill_length": 40,
        "num_pages": 4096 // page_size + 2,
        "kv_cache_dtype": kv_cache_dtype,
    }
    reference = make_llm(folder, attention_backend="torch", **options)
    flashinfer = make_llm(folder, attention_backend="fi", **options)
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5]
    expected = our_logits(reference, prompt, continuation)
    actual = our_logits(flashinfer, prompt, continuation)
    torch.testing.assert_close(actual, expected, atol=0.06, rtol=0.03)


def test_flashinfer_batched_greedy_equals_torch_backend(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 64, 200)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
    outputs = {}
    for backend in ("torch", "fi", "fa,fi"):
        llm = make_llm(folder, device="cuda", dtype="bfloat16", attention_backend=backend)
        outputs[backend] = llm.generate(prompts, params)
    for backend in ("fi", "fa,fi"):
        for ours, reference in zip(outputs[backend], outputs["torch"]):
            first = ours.logprobs[0].logprob
            assert first == pytest.approx(reference.logprobs[0].logprob, abs=0.05)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_cuda_graphs_do_not_change_outputs(
    make_llm: Callable[..., LLM], tmp_path: Path, kv_cache_dtype: str
) -> None:
    """Batches of 3, 5 and 20 pad to captured sizes 4, 8 and 32; 40 runs eagerly at first."""
    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)
    options = small_gpu_engine(kv_cache_dtype=kv_cache_dtype)
    with_graphs = make_llm(folder, cuda_graph_max_bs=32, **options)
    without = make_llm(folder, cuda_graph_max_bs=0, **options)
    assert without.runtime.engine.graphs is None
    assert_graphs_keep_outputs(with_graphs, without, params)


def assert_graphs_keep_outputs(with_graphs: LLM, without: LLM, params: SamplingParams) -> None:
    """Batches of 1, 3, 5, 20 and 40 (padded to captured sizes 1, 4, 8 and 32; 40 eagerly):
    the tokens and logprobs of the engine without graphs."""
    graphs = with_graphs.runtime.engine.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24, 32]
    for count in (1, 3, 5, 20, 40):
        prompts = [list(range(7 + i, 7 + i + 5 + 3 * i)) for i in range(count)]
        ours = with_graphs.generate(prompts, params)
        reference = without.generate(prompts, params)
        assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
        for a, b in zip(ours, reference):
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.logprob == pytest.approx(y.logprob, abs=0.02)


def test_graphs_captured_in_two_parts(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """A first start's order: the sizes with Triton attention captured first, while
    FlashInfer's modules would build, the others after with FlashInfer's: the same tokens
    as without graphs."""
    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = small_gpu_engine()
    llm = make_llm(folder, cuda_graph_max_bs=64, **options)
    graphs = llm.runtime.engine.graphs
    first = graphs.sizes_without_flashinfer()
    assert first and set(first) < set(graphs.sizes)
    for size in set(graphs.sizes) - set(first):
        del graphs.graphs[size], graphs.outputs[size]
    assert graphs.graphs.keys() == set(first)
    graphs.capture()
    assert sorted(graphs.graphs) == graphs.sizes
    without = make_llm(folder, cuda_graph_max_bs=0, **options)
    prompts = [list(range(7 + i, 12 + 2 * i)) for i in range(5)]
    ours = llm.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in without.generate(prompts, params)]


def test_a_kernel_census_notes_launches_then_compiles_them_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a census a Triton launch that would compile is noted, once a signature, and
    does not run; after it launches run again, and `compile_all` has compiled what was
    noted: the launches find it."""
    import triton
    import triton.language as tl
    from triton import knobs

    from aserve.engine.kernel_census import KernelCensus

    @triton.jit
    def add_one(x, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x + offsets, tl.load(x + offsets, mask=mask) + 1, mask=mask)

    floats = torch.zeros(100, device="cuda")
    halves = torch.zeros(100, device="cuda", dtype=torch.float16)
    ints = torch.zeros(100, device="cuda", dtype=torch.int32)
    with KernelCensus() as census:
        for x in (floats, floats, halves, ints):
            add_one[(1,)](x, 100, BLOCK=128)
        torch.cuda.synchronize()
    assert len(census.noted) == 3
    assert not floats.any() and not halves.any() and not ints.any()
    assert knobs.runtime.jit_cache_hook is None
    # Nothing of the census is left in the kernel's cache: a launch after it runs.
    add_one[(1,)](ints, 100, BLOCK=128)
    assert (ints == 1).all()
    census.compile_all(threads=2)
    compiled_at_launch: list[str] = []
    monkeypatch.setattr(
        knobs.runtime, "jit_cache_hook", lambda **info: compiled_at_launch.append(info["repr"])
    )
    for x in (floats, halves):
        add_one[(1,)](x, 100, BLOCK=128)
    torch.cuda.synchronize()
    assert compiled_at_launch == []
    assert (floats == 1).all() and (halves == 1).all()


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_the_warm_up_compiles_its_kernels_in_threads_before_it_runs_them(
    make_llm: Callable[..., LLM],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kv_cache_dtype: str,
) -> None:
    """aserve's compiled Triton kernels forgotten, an engine's warm-up notes its kernels in a
    census and compiles them in threads; its forwards and graph captures after then compile
    no kernel at a launch (17-18 were noted on the H200), and the tokens are an engine's
    without graphs."""
    from triton import knobs

    from aserve.engine.kernel_census import KernelCensus

    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    options = small_gpu_engine(kv_cache_dtype=kv_cache_dtype)
    noted: list[str] = []
    compile_all = KernelCensus.compile_all

    def noting(census: KernelCensus, threads: int | None = None) -> None:
        noted.extend(kernel.fn.__name__ for kernel, _ in census.noted)
        compile_all(census, threads)

    compiled_at_launch: list[str] = []

    def record(*, fn: Any, is_manual_warmup: bool, **_: Any) -> None:
        if not is_manual_warmup:
            compiled_at_launch.append(fn.name)

    forget_compiled_triton_kernels()
    monkeypatch.setattr(KernelCensus, "compile_all", noting)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", record)
    llm = make_llm(folder, cuda_graph_max_bs=64, **options)
    assert len(noted) > 5, noted
    assert compiled_at_launch == []
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    without = make_llm(folder, cuda_graph_max_bs=0, **options)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [
        o.token_ids for o in without.generate(PROMPTS, params)
    ]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_a_first_start_serves_before_flashinfer_is_built_then_takes_it(
    make_llm: Callable[..., LLM],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kv_cache_dtype: str,
) -> None:
    """FlashInfer's builds held back (a first start's nvcc): the engine is ready with only
    the Triton sizes' graphs; prefills, and decode batches no captured graph takes, run
    through torch's SDPA; the first step after the builds end takes FlashInfer and captures
    the other sizes, whose tokens then equal an engine's that waited for them."""
    from aserve.engine.engine import Engine

    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    options = small_gpu_engine(cuda_graph_max_bs=64, kv_cache_dtype=kv_cache_dtype)
    waited = make_llm(folder, **options)
    gate = threading.Event()
    held: list[threading.Thread] = []
    start_builds = Engine._start_kernel_builds

    def held_builds(engine: Engine) -> list[threading.Thread]:
        held.append(threading.Thread(target=gate.wait, daemon=True))
        held[-1].start()
        return [*start_builds(engine), held[-1]]

    monkeypatch.setattr(Engine, "_start_kernel_builds", held_builds)
    monkeypatch.setattr(Engine, "finish_kernel_builds", lambda engine: None)  # LLM's wait
    early = make_llm(folder, **options)
    monkeypatch.undo()
    engine = early.runtime.engine
    graphs = engine.graphs
    assert engine._stand_in is not None
    assert sorted(graphs.graphs) == graphs.sizes_without_flashinfer()
    # An FP8 pool decodes through the Triton kernels at every size: only prefills wait.
    assert (sorted(graphs.graphs) == graphs.sizes) == (kv_cache_dtype == "fp8_e4m3")
    stand_in_steps: list[bool] = []
    prepare = engine._stand_in.prepare

    def counted_prepare(batch: ForwardBatch) -> None:
        stand_in_steps.append(batch.is_decode)
        prepare(batch)

    engine._stand_in.prepare = counted_prepare

    def prompts(count: int, first: int) -> list[list[int]]:
        return [list(range(first + i, first + 2 * i + 9)) for i in range(count)]

    # A size left to FlashInfer (it pads to a captured one, or runs eagerly), and past the
    # graphs' largest size.
    uncaptured = min(set(graphs.sizes) - graphs.graphs.keys(), default=3)
    for count in (1, uncaptured, 70):
        ours = early.generate(prompts(count, 3), params)
        reference = waited.generate(prompts(count, 3), params)
        for a, b in zip(ours, reference):  # other attention kernels: close, not the same bits
            assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=0.05)
    assert False in stand_in_steps and True in stand_in_steps  # prefills, eager decodes
    assert engine._stand_in is not None
    gate.set()
    held[0].join()
    for count in (1, uncaptured, 70):
        ours = early.generate(prompts(count, 300), params)
        reference = waited.generate(prompts(count, 300), params)
        assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    assert engine._stand_in is None and sorted(graphs.graphs) == graphs.sizes


def test_graph_captures_survive_flashinfer_builds_in_threads() -> None:
    """The engine captures its first decode graphs while FlashInfer's modules build and
    plan one token in threads (`build_kernels`). A builder that synchronized the whole
    device invalidated a capture under way ("operation failed due to a previous error
    during capture", seen once in the GPU suite); each builder now waits on its own stream.
    Graphs are captured back to back while three rounds of builders run, each graph then
    replayed and checked."""
    from aserve.attention.flashinfer import build_kernels

    device = torch.device("cuda")
    x = torch.zeros(4096, device=device)
    captures = 0
    for _ in range(3):
        threads = build_kernels(
            device, 4, 2, 64, torch.bfloat16, torch.bfloat16, 16, "fa2", max_batch=64
        )
        assert len(threads) >= 2  # prefill and at least one decode module
        while any(thread.is_alive() for thread in threads):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="relaxed"):
                for _ in range(32):
                    x.add_(1.0)
            x.zero_()
            graph.replay()
            torch.cuda.current_stream().synchronize()
            assert x[0].item() == 32.0
            captures += 1
    assert captures > 0


@pytest.mark.parametrize(
    ("dtype", "num_pages"), [("float32", 24), ("bfloat16", 1024)], ids=["fp32-retracting", "bf16"]
)
def test_overlap_on_and_off_give_the_same_tokens(
    make_llm: Callable[..., LLM], tmp_path: Path, dtype: str, num_pages: int
) -> None:
    """In float32 (torch attention) also under retraction. In bf16 retraction is left out:
    overlap moves the retraction points, and a re-prefill in bf16 rounds differently from
    the decode steps it replaces, which can flip near-tied tokens of a random model."""
    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    options = {"device": "cuda", "dtype": dtype, "page_size": 16, "num_pages": num_pages}
    overlapped = make_llm(folder, **options)
    plain = make_llm(folder, **options)
    plain.scheduler.overlap = False
    assert overlapped.scheduler.overlap
    prompts = [list(range(7 + i, 7 + i + 5 + 9 * i)) for i in range(12)]
    params = [
        SamplingParams(temperature=0, max_tokens=5 + 4 * i, ignore_eos=True) for i in range(12)
    ]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in overlapped.generate(prompts, params)] == expected
    retracted = overlapped.scheduler.planner.num_retractions > 0
    assert retracted == (dtype == "float32")


SMOLLM2_GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_cpu_tokens(smollm2_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The embedded model's prompts and its float32 greedy tokens on the CPU (the reference)."""
    from tests.test_generation import TEXTS

    llm = LLM(str(smollm2_dir), device="cpu", num_pages=4096, quantization="none")
    try:
        assert llm.tokenizer is not None
        prompts = [llm.tokenizer.encode(text) for text in TEXTS]
        return prompts, [o.token_ids for o in llm.generate(prompts, SMOLLM2_GREEDY)]
    finally:
        llm.close()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_prefill_length": 7},
        {"page_size": 1},
        {"page_size": 16},
        {"page_size": 256},
        {"cache_type": "naive"},
        {"overlap": False},
    ],
    ids=["default", "chunked-prefill", "page-1", "page-16", "page-256", "naive", "no-overlap"],
)
def test_embedded_smollm2_float32_greedy_on_gpu_equals_cpu(
    make_llm: Callable[..., LLM], smollm2_dir: Path, smollm2_cpu_tokens, options: dict
) -> None:
    """Eight prompts, batched, 32 tokens each; a second run of the same prompts on the GPU
    takes their prefixes from the radix cache (in whole pages: none with pages of 256 tokens,
    longer than every prompt) and must not change a token either. (Float32
    runs torch attention without graphs: FlashInfer has no float32 kernels; graphs on / off
    is checked in bfloat16 by test_cuda_graphs_do_not_change_outputs.)"""
    options = dict(options)
    overlap = options.pop("overlap", True)
    llm = make_llm(smollm2_dir, device="cuda", dtype="float32", quantization="none", **options)
    llm.scheduler.overlap = overlap
    prompts, expected = smollm2_cpu_tokens
    assert [o.token_ids for o in llm.generate(prompts, SMOLLM2_GREEDY)] == expected
    cached_before = llm.scheduler.planner.prompt_tokens_cached
    assert [o.token_ids for o in llm.generate(prompts, SMOLLM2_GREEDY)] == expected
    whole_pages_cached = options.get("page_size", 1) <= max(len(p) for p in prompts)
    if options.get("cache_type") != "naive" and whole_pages_cached:
        assert llm.scheduler.planner.prompt_tokens_cached > cached_before


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
def test_tp2_greedy_equals_tp1_on_cuda(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """float32 (torch attention): all-reduces (the one-shot kernel over NVLink, and NCCL
    with `--disable-pynccl`), all-gather and the id broadcast. The one-shot path opens once
    per process (`one_shot.py` says why): the first two-GPU engine of the run takes it."""
    from aserve.distributed import one_shot

    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    options = {"device": "cuda", "dtype": "float32", "page_size": 4, "max_prefill_length": 40}
    expected = [o.token_ids for o in make_llm(folder, **options).generate(PROMPTS, GREEDY)]
    for disable_pynccl in (False, True):
        first_in_process = not one_shot.opened_in_this_process()
        two = make_llm(folder, tensor_parallel_size=2, disable_pynccl=disable_pynccl, **options)
        assert two.runtime.engine.tp.size == 2
        if disable_pynccl or not first_in_process:
            assert two.runtime.engine.tp.one_shot is None
        else:
            assert two.runtime.engine.tp.one_shot is not None
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == expected


@two_gpus
def test_tp2_bf16_cuda_graphs_on_both_ranks(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """bfloat16 with FlashInfer and decode graphs captured on both ranks in lockstep. The
    one-shot all-reduce and its fusion with the residual add and RMSNorm (`fused_norm.py`)
    open once per process (`one_shot.py` says why): run first in its process, the first
    two-GPU engine takes them, and the later ones NCCL with separate norms. Graphs change
    nothing (same tokens on the NCCL engines with and without graphs); the fused kernel
    sums in float32 and rounds once, so its tokens may part from NCCL's only at a near tie;
    TP=2 agrees with TP=1 as closely as bf16 sums allow."""
    from aserve.distributed import one_shot

    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    one = make_llm(folder, device="cuda", dtype="bfloat16")
    first_in_process = not one_shot.opened_in_this_process()
    fused = make_llm(folder, device="cuda", dtype="bfloat16", tensor_parallel_size=2)
    graphs = make_llm(folder, device="cuda", dtype="bfloat16", tensor_parallel_size=2)
    eager = make_llm(
        folder, device="cuda", dtype="bfloat16", tensor_parallel_size=2, cuda_graph_max_bs=0
    )
    assert fused.runtime.engine.graphs is not None and graphs.runtime.engine.graphs is not None
    assert eager.runtime.engine.graphs is None
    assert (fused.runtime.engine.tp.add_norm is not None) == first_in_process
    assert (fused.runtime.engine.tp.one_shot is not None) == first_in_process
    for engine in (graphs.runtime.engine, eager.runtime.engine):
        assert engine.tp.one_shot is None and engine.tp.add_norm is None
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    with_graphs = graphs.generate(PROMPTS, params)
    assert [o.token_ids for o in with_graphs] == [
        o.token_ids for o in eager.generate(PROMPTS, params)
    ]
    with_fused = fused.generate(PROMPTS, params)
    assert_equal_until_a_near_tie(with_fused, with_graphs, tolerance=0.1)
    for ours, theirs in zip(with_fused, one.generate(PROMPTS, params)):
        assert ours.token_ids[0] == theirs.token_ids[0]
        assert ours.logprobs is not None and theirs.logprobs is not None
        assert ours.logprobs[0].logprob == pytest.approx(theirs.logprobs[0].logprob, abs=0.05)


def assert_equal_until_a_near_tie(
    ours: list[GenerationOutput], theirs: list[GenerationOutput], tolerance: float
) -> None:
    """Greedy sequences of two numerically different paths agree token by token with close
    logprobs; where one parts from the other, its choice and the other's were within
    `tolerance` of a tie (after that the contexts differ and nothing more is compared)."""
    for a, b in zip(ours, theirs):
        assert a.logprobs is not None and b.logprobs is not None
        for step, (mine, other) in enumerate(zip(a.logprobs, b.logprobs)):
            if mine.token_id != other.token_id:
                alternatives = dict(mine.top)
                assert other.token_id in alternatives, (step, mine, other)
                assert mine.logprob - alternatives[other.token_id] <= tolerance, (step, mine)
                break
            assert mine.logprob == pytest.approx(other.logprob, abs=tolerance), step


def constrained_requests() -> tuple[list[list[dict[str, str]]], list[SamplingParams]]:
    """Chat requests under a JSON schema, a regex and a choice, beside two free ones."""
    from tests.test_structured import City, ask

    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    conversations = [
        ask(City),
        [{"role": "user", "content": "Say hello."}],
        [{"role": "user", "content": "Give a date."}],
        [{"role": "user", "content": "Pick a colour."}],
        [{"role": "user", "content": "Count to five."}],
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=120, json_schema=City.model_json_schema()),
        free,
        SamplingParams(temperature=0, max_tokens=20, regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"),
        SamplingParams(temperature=0, max_tokens=8, choice=("red", "green", "blue")),
        free,
    ]
    return conversations, params


def test_constrained_greedy_on_gpu_equals_cpu(
    make_llm: Callable[..., LLM], smollm2_dir: Path
) -> None:
    """Masks applied to CUDA logits (overlap on, matchers advanced as tokens come back) give
    the CPU's tokens in float32; in bf16 with CUDA graphs each reply still obeys its grammar."""
    import re

    from tests.test_structured import City

    conversations, params = constrained_requests()
    cpu = make_llm(smollm2_dir, device="cpu", quantization="none")
    expected = [o.token_ids for o in cpu.chat(conversations, params)]
    gpu = make_llm(smollm2_dir, device="cuda", dtype="float32", quantization="none")
    assert gpu.scheduler.overlap
    assert [o.token_ids for o in gpu.chat(conversations, params)] == expected
    fast = make_llm(smollm2_dir, device="cuda", dtype="bfloat16", quantization="none")
    assert fast.runtime.engine.graphs is not None
    city, _, date, colour, _ = fast.chat(conversations, params)
    City.model_validate_json(city.text)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date.text), date.text
    assert colour.text in ("red", "green", "blue")


def test_prompt_logprobs_on_gpu_equal_cpu(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """Prompt scoring on CUDA (scored chunks of a chunked prefill, beside a free request;
    one prompt scored from its 23rd token, its logits rows at its chunks' ends) gives the
    CPU's values in float32 and values close to them in bf16 (FlashInfer)."""
    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    prompt = [(11 * i + 5) % 300 + 3 for i in range(41)]
    scored = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    tail = dataclasses.replace(scored, prompt_logprobs_from=23)
    free = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    batch = [[9, 8, 7, 6, 5], prompt, prompt[:-1]]

    def scores(llm: LLM) -> torch.Tensor:
        outputs = llm.generate(batch, [free, scored, tail])
        assert outputs[0].prompt_logprobs is None
        entries = outputs[1].prompt_logprobs
        assert entries is not None and [lp.token_id for lp in entries] == prompt[1:]
        late = outputs[2].prompt_logprobs
        assert late is not None and [lp.token_id for lp in late] == prompt[23:-1]
        rows = [[lp.logprob, *(v for _, v in lp.top)] for lp in entries]
        torch.testing.assert_close(
            torch.tensor([[lp.logprob, *(v for _, v in lp.top)] for lp in late]),
            torch.tensor(rows[22:-1]),
            atol=0.05,
            rtol=0.02,
        )
        return torch.tensor(rows)

    reference = scores(make_llm(folder, device="cpu", page_size=4, max_prefill_length=16))
    on_gpu = make_llm(folder, device="cuda", dtype="float32", page_size=4, max_prefill_length=16)
    torch.testing.assert_close(scores(on_gpu), reference, atol=1e-4, rtol=1e-4)
    bf16 = make_llm(folder, device="cuda", dtype="bfloat16", page_size=16, max_prefill_length=16)
    torch.testing.assert_close(scores(bf16), reference, atol=0.05, rtol=0.02)


def test_an_aborted_penalised_request_spares_its_batch_on_gpu(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """Aborts landing at several points of overlapped steps: the penalised sampling launched
    right after the step in flight counts the aborted request's tokens, which must all be
    real ids (a placeholder there was a device-side assert that took the process down)."""
    folder = make_tiny_model("llama", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64})
    llm = make_llm(folder, device="cuda", dtype="bfloat16")
    assert llm.scheduler.overlap
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=1.5)
    expected = llm.generate([PROMPTS[1]], params)[0].token_ids
    for outputs_before_abort in (1, 2, 3, 5, 8):
        reason, produced = abort_one_of_two(
            llm, PROMPTS[0], PROMPTS[1], params, outputs_before_abort
        )
        assert reason is FinishReason.ABORT and produced == expected
    llm.scheduler.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mask_kernel_equals_the_torch_path(dtype: torch.dtype) -> None:
    """The Triton kernel's -inf masking equals the CPU path's on masked rows and leaves the
    others alone, for a vocabulary no multiple of 32 or of its block, mask words included."""
    from aserve.constrained.masks import apply_token_masks
    from tests.step_masks import masks_of

    vocab, batch = 151_936 - 7, 6
    generator = torch.Generator().manual_seed(0)
    full = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), generator=generator)
    masks = masks_of(full.to(torch.int32), [5, 1, 2])
    logits = torch.randn(batch, vocab, generator=generator).to(dtype)
    expected = logits.clone()
    apply_token_masks(expected, masks)
    on_gpu = logits.cuda()
    apply_token_masks(on_gpu, masks)
    assert torch.equal(on_gpu.cpu(), expected)
    assert torch.isinf(expected[[1, 2, 5]]).any() and not torch.isinf(expected[[0, 3, 4]]).any()


def aserve_kernel_caches() -> Iterator[tuple[str, dict[Any, Any]]]:
    """(module.name, compiled variants by key) of each of aserve's Triton kernels, per device."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("aserve.") or module is None:
            continue
        for attr, value in vars(module).items():
            # a JITFunction, or an autotuner around one
            kernel = value if hasattr(value, "device_caches") else getattr(value, "fn", None)
            for entry in getattr(kernel, "device_caches", {}).values():
                yield f"{name}.{attr}", entry[0]


def compiled_triton_shared_memory() -> dict[str, int]:
    """The most shared memory any compiled variant of each of aserve's Triton kernels uses."""
    most: dict[str, int] = {}
    for key, compiled_variants in aserve_kernel_caches():
        for compiled in compiled_variants.values():
            most[key] = max(most.get(key, 0), compiled.metadata.shared)
    return most


def forget_compiled_triton_kernels() -> None:
    """Empty the in-memory caches of aserve's compiled Triton kernels: what runs next is
    loaded again (from Triton's disk cache) and `compiled_triton_shared_memory` then sees
    only the variants that run used."""
    for _, compiled_variants in aserve_kernel_caches():
        compiled_variants.clear()


def test_pretended_ampere_and_ada_gpus_run_their_fallbacks(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ASERVE_GPU_CAPABILITY lowers what aserve believes of the GPU: as an A100 (8.0), an
    RTX 30xx (8.6) or an Ada card (8.9) the server gives the tokens it gives on the Hopper
    it runs on (greedy and seeded), refuses FA3 (and FP8 below 8.9) in one line, and every
    Triton kernel compiled for the pretended cards fits the smallest shared memory of them
    (99 KB). What ran before them in the process (the Hopper's own run, other tests' kernel
    settings) may take more and is forgotten first."""
    from aserve.config import ConfigError
    from aserve.engine.gpu import CAPABILITY_ENV, shared_memory_limit

    folder = make_tiny_model("qwen3", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 128})
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.token_ids for p in (GREEDY, seeded) for o in llm.generate(PROMPTS, p)]

    hopper = tokens(make_llm(folder, device="cuda", dtype="bfloat16"))
    forget_compiled_triton_kernels()
    for pretended in ("8.0", "8.6", "8.9"):
        monkeypatch.setenv(CAPABILITY_ENV, pretended)
        assert tokens(make_llm(folder, device="cuda", dtype="bfloat16")) == hopper, pretended
        with pytest.raises(ConfigError, match="needs a Hopper GPU"):
            make_llm(folder, device="cuda", dtype="bfloat16", attention_backend="fa")
        if pretended != "8.9":
            with pytest.raises(ConfigError, match="compute capability 8.9 or newer"):
                make_llm(folder, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    used = compiled_triton_shared_memory()
    assert used, "no Triton kernel was compiled: the check below would prove nothing"
    limit = shared_memory_limit((8, 6))
    assert {k: v for k, v in used.items() if v > limit} == {}, used


def test_pretended_gpus_run_moe_quantized_and_fp8_models_as_the_hopper(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rest of item 3: the fused MoE kernels, the GGUF int4 / int8 products (Triton, on
    the codes as stored) and FP8 weights with an FP8 KV cache give the Hopper's greedy tokens
    on a pretended A100 / RTX 30xx (FP8: an Ada card, the least that has it), and every
    Triton kernel compiled for the pretended cards fits the smallest shared memory of those
    (99 KB)."""
    from gguf import GGMLQuantizationType as QType

    from aserve.engine.gpu import CAPABILITY_ENV, shared_memory_limit
    from tests.test_moe import GPU_SHAPES
    from tests.test_quant import write_tiny_llama

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    bf16 = {"device": "cuda", "dtype": "bfloat16", "num_pages": 1024}
    moe = make_tiny_model("qwen3_moe", tmp_path / "moe", overrides=GPU_SHAPES)
    dense = make_tiny_model(
        "qwen3", tmp_path / "dense", overrides={**KERNEL_SHAPES, "head_dim": 128}
    )
    models: list[tuple[str, Path, dict[str, object], tuple[str, ...]]] = [
        ("moe fused", moe, {**bf16, "moe_backend": "fused"}, ("8.0", "8.6")),
        ("moe fused fp8", moe, {**bf16, "moe_backend": "fused", "quantization": "fp8"}, ("8.9",)),
        (
            "fp8 weights and kv",
            dense,
            {**bf16, "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
            ("8.9",),
        ),
    ]
    for qtype in (QType.Q4_0, QType.Q8_0):
        path = tmp_path / f"tiny-{qtype.name}.gguf"
        write_tiny_llama(path, qtype)
        models.append((qtype.name, path, {**bf16, "num_pages": 256}, ("8.0", "8.6")))

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]

    used: dict[str, int] = {}
    for name, folder, options, pretences in models:
        monkeypatch.delenv(CAPABILITY_ENV, raising=False)
        hopper = greedy(make_llm(folder, **options))
        # The Hopper's own settings may take more shared memory (FP8 products: 144 KB)
        forget_compiled_triton_kernels()
        for pretended in pretences:
            monkeypatch.setenv(CAPABILITY_ENV, pretended)
            assert greedy(make_llm(folder, **options)) == hopper, (name, pretended)
        for kernel, shared in compiled_triton_shared_memory().items():
            used[kernel] = max(used.get(kernel, 0), shared)
    assert any("moe" in k for k in used) and any("quant.cuda" in k for k in used), used
    limit = shared_memory_limit((8, 6))
    assert {k: v for k, v in used.items() if v > limit} == {}, used
