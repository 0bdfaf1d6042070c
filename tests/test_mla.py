"""DeepSeek's multi-head latent attention (models/mla.py) past the parity tests of
test_models.py, test_gguf_models.py and test_tp.py: the one-part KV pool, greedy tokens
through chunked prefill, radix-cache hits and batches, and quantized or older GGUF files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.attention.flashinfer_mla import FlashInferMLABackend
from aserve.engine.memory import kv_bytes_per_token
from aserve.models.mla import LatentAttentionLayer
from tests.gguf_files import write_hf_as_gguf
from tests.test_models import PROMPTS, assert_logits_match, hf_model, our_logits
from tests.tiny_models import MLA_GPU_SHAPES, hf_greedy_tokens, make_tiny_model

LONG_PROMPT = list(range(3, 300, 7))


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def tiny_mla(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def test_the_pool_holds_one_latent_row_a_token(tiny_mla: Path) -> None:
    """A slot is the latent and the rotated key part, once: the values are its first
    `kv_lora_rank` columns, a view, not a second copy (half a two-part pool's bytes)."""
    with LLM(str(tiny_mla), page_size=4) as llm:
        engine = llm.runtime.engine
        latent = engine.model_config.latent
        assert latent is not None
        pool = engine.pool
        assert pool.parts == 1 and pool.kv[0].shape[1:] == (1, 1, latent.cache_width)
        assert pool.v[0].shape[-1] == latent.kv_lora_rank
        assert pool.v[0].data_ptr() == pool.k[0].data_ptr()
        layers = engine.model_config.num_layers
        per_token = kv_bytes_per_token(engine.model_config, engine.tp, pool.storage_dtype)
        assert per_token == layers * latent.cache_width * pool.kv[0].element_size()
        attention = engine.model.model.layers[0].self_attn
        assert isinstance(attention, LatentAttentionLayer)


def test_chunks_cache_hits_and_batches_keep_transformers_greedy_tokens(tiny_mla: Path) -> None:
    """Prompts prefilled in chunks of 7 tokens, together and one at a time, again after
    they are cached, and continued from their first five generated tokens (those read back
    from the cache): every time transformers' greedy tokens."""
    hf = hf_model(tiny_mla)
    prompts = [*PROMPTS, LONG_PROMPT]
    expected = [hf_greedy_tokens(hf, prompt, 12) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_mla), page_size=4, max_prefill_length=7) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        cached = llm.scheduler.planner.prompt_tokens_cached
        alone = [llm.generate([prompt], params)[0].token_ids for prompt in prompts]
        assert alone == expected
        assert llm.scheduler.planner.prompt_tokens_cached - cached > len(LONG_PROMPT) // 2
        extended = [prompt + tokens[:5] for prompt, tokens in zip(prompts, expected)]
        shorter = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
        continued = [o.token_ids for o in llm.generate(extended, shorter)]
        assert continued == [tokens[5:] for tokens in expected]
        llm.scheduler.check_integrity()


def test_older_gguf_with_kv_b_whole_matches_transformers(tmp_path: Path) -> None:
    """Files from before llama.cpp's MLA rework: `attn_kv_b` whole, a query head's and a
    value's widths as the key and value lengths, a key head a query head."""
    folder = make_tiny_model("deepseek_v2", tmp_path / "v2")
    model = write_hf_as_gguf(folder, tmp_path / "old.gguf", kv_b_apart=False)
    with LLM(str(model), page_size=4) as llm:
        assert_logits_match(llm, hf_model(folder))


@pytest.mark.parametrize("kv_b_apart", [True, False], ids=["k_b-v_b", "kv_b"])
def test_quantized_gguf_runs_its_blocks_close_to_its_float_twin(
    tmp_path: Path, kv_b_apart: bool
) -> None:
    """A Q8_0 file keeps its projections and experts in blocks, and `kv_b_proj`'s heads as
    the CPU kernels' weights (its value rows in their blocks in both layouts; whole
    `attn_kv_b`'s key rows de-quantized to be transposed). Its logits stay within Q8_0's
    error of transformers' on the same float weights, and equal its de-quantized twin's
    (`--quantization none`) up to the order of float sums and the CPU kernels' 16-bit
    activations; the default KV cache of a quantized model on CPU is float16, one part a
    token still, which the CPU kernels' attention reads (its keys as the values too)."""
    folder = make_tiny_model("deepseek_v3", tmp_path / "v3")
    path = tmp_path / "q8.gguf"
    model = write_hf_as_gguf(
        folder, path, qtype=gguf.GGMLQuantizationType.Q8_0, kv_b_apart=kv_b_apart
    )
    prompt, continuation = PROMPTS[0], [7, 123, 45]
    logits = {}
    for quantization in ("auto", "none"):
        with LLM(str(model), page_size=4, quantization=quantization) as llm:
            engine = llm.runtime.engine
            attention = engine.model.model.layers[1].self_attn
            assert isinstance(attention, LatentAttentionLayer)
            assert (attention.q_a_proj.quantized is not None) == (quantization == "auto")
            if quantization == "auto":  # the CPU kernels' attention reads the one-part pool
                assert engine.pool.storage_dtype == torch.float16 and engine.pool.parts == 1
                assert engine.attn.native_decode
                assert attention.kv_b_proj.key_rows is not None
            logits[quantization] = our_logits(llm, prompt, continuation)
    torch.testing.assert_close(logits["auto"], logits["none"], atol=5e-3, rtol=0)
    with torch.inference_mode():
        theirs = hf_model(folder)(torch.tensor([prompt + continuation])).logits[
            0, len(prompt) - 1 :
        ]
    assert (logits["none"] - theirs).abs().max() < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_flashinfer_mla_matches_the_torch_backend(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str, page_size: int
) -> None:
    """bf16 on CUDA: FlashInfer's MLA kernels (the default there) against SDPA over the
    same one-part cache, through chunked prefill (later chunks attend to a cached prefix)
    and decode; then a batch's greedy tokens, and again from the radix cache."""
    folder = make_tiny_model(family, tmp_path, overrides=MLA_GPU_SHAPES)
    options = {
        "device": "cuda",
        "dtype": "bfloat16",
        "page_size": page_size,
        "max_prefill_length": 40,
        "num_pages": 4096 // page_size + 2,
    }
    reference = make_llm(folder, attention_backend="torch", **options)
    flashinfer = make_llm(folder, **options)
    assert isinstance(flashinfer.runtime.engine.attn, FlashInferMLABackend)
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5]
    expected = our_logits(reference, prompt, continuation)
    torch.testing.assert_close(
        our_logits(flashinfer, prompt, continuation), expected, atol=0.06, rtol=0.03
    )
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 64, 200)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
    first = flashinfer.generate(prompts, params)
    for ours, theirs in zip(first, reference.generate(prompts, params)):
        assert ours.logprobs[0].logprob == pytest.approx(theirs.logprobs[0].logprob, abs=0.05)
    again = flashinfer.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mla_decode_graphs_do_not_change_outputs(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """FlashInfer's MLA decode captured in CUDA graphs (its index arrays in static buffers,
    planned before each replay): the tokens and logprobs of eager decoding."""
    from tests.test_gpu import assert_graphs_keep_outputs

    folder = make_tiny_model("deepseek_v2", tmp_path, overrides=MLA_GPU_SHAPES)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024}
    with_graphs = make_llm(folder, cuda_graph_max_bs=32, **options)
    without = make_llm(folder, cuda_graph_max_bs=0, **options)
    assert_graphs_keep_outputs(with_graphs, without, params)


def test_fp8_checkpoint_loads_as_its_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_llm: Callable[..., LLM]
) -> None:
    """DeepSeek-V3-FP8's layout (block scales, `weight_scale_inv`): the reordered query rows
    keep a scale each, `kv_b_proj`'s heads are sliced by whole blocks and its key rows
    de-quantized to be transposed; the same FP8 rows and greedy tokens as the de-quantized
    twin quantized at load (on CPU, where the kernels are deterministic)."""
    from tests.test_fp8 import fp8_on_cpu, write_fp8_checkpoint

    fp8_on_cpu(monkeypatch)
    shapes = {"qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": 32}
    float_folder = make_tiny_model("deepseek_v3", tmp_path / "float", overrides=shapes)
    fp8_folder, twin_folder = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(float_folder, fp8_folder, twin_folder, "fp8-block")
    fp8 = make_llm(fp8_folder, num_pages=256)
    twin = make_llm(twin_folder, quantization="fp8", num_pages=256)
    for llm in (fp8, twin):
        attention = llm.runtime.engine.model.model.layers[1].self_attn
        assert isinstance(attention, LatentAttentionLayer)
        assert attention.kv_b_proj.value_rows is not None  # kept as the kernels' weights
    ours, theirs = (
        llm.runtime.engine.model.model.layers[1].self_attn.q_b_proj.quantized.products
        for llm in (fp8, twin)
    )
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 33, 9], list(range(3, 40, 2))]
    assert [o.token_ids for o in fp8.generate(prompts, params)] == [
        o.token_ids for o in twin.generate(prompts, params)
    ]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="an FP8 cache needs a CUDA device of compute capability 8.9 or newer",
)
def test_fp8_cache_takes_the_torch_backend_on_cuda(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """FlashInfer's MLA kernels read 16-bit caches: an FP8 one runs latent attention through
    the torch backend (no graphs), one part a slot, its logits near the bf16 cache's."""
    folder = make_tiny_model("deepseek_v2", tmp_path, overrides=MLA_GPU_SHAPES)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024}
    fp8 = make_llm(folder, kv_cache_dtype="fp8_e4m3", **options)
    reference = make_llm(folder, **options)
    engine = fp8.runtime.engine
    assert type(engine.attn).__name__ == "TorchNativeBackend" and engine.graphs is None
    assert engine.pool.parts == 1 and engine.pool.storage_dtype == torch.float8_e4m3fn
    prompt, continuation = list(range(3, 60)), [7, 123, 45, 2]
    torch.testing.assert_close(
        our_logits(fp8, prompt, continuation),
        our_logits(reference, prompt, continuation),
        atol=0.15,
        rtol=0.05,
    )


def test_dummy_weights_fill_a_quantized_models_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_llm: Callable[..., LLM]
) -> None:
    """`--dummy-weight` with `--quantization fp8` (the GPU benchmarks'): `kv_b_proj`'s heads,
    kept as products rather than parameters, get random rows too."""
    from tests.test_fp8 import fp8_on_cpu

    fp8_on_cpu(monkeypatch)
    folder = make_tiny_model("deepseek_v2", tmp_path)
    llm = make_llm(folder, num_pages=256, dummy_weight=True, quantization="fp8")
    heads = llm.runtime.engine.model.model.layers[0].self_attn.kv_b_proj
    assert heads.key_rows is not None and all(w.products for w in heads.key_rows.weights)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate([PROMPTS[0]], greedy)[0].token_ids) == 6
