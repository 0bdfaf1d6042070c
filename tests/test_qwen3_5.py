"""Qwen3.5's hybrid layers (models/gated_deltanet.py, kvcache/states.py) past the parity
tests of test_models.py, test_multimodal.py and test_tp.py: recurrent states that carry a
prompt across chunks and batches and start from zeros for every request, prompts longer
than one chunk of the delta rule's solve, the pool and sizing without KV for the linear
layers, the prefix cache turned off, drafts refused, weights quantized at load or in a GGUF
file's blocks."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, EngineConfig, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.engine.memory import kv_bytes_per_token, working_memory_bytes
from aserve.kvcache.naive import NaiveCache
from aserve.models.gated_deltanet import CHUNK, GatedDeltaNet, chunked_delta_rule
from tests.gguf_files import write_hf_as_gguf
from tests.test_models import PROMPTS, hf_model, our_logits
from tests.tiny_models import hf_greedy_tokens, make_tiny_model

LONG_PROMPT = list(range(3, 310, 2))  # 154 tokens: three chunks of the delta rule


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))


def step_by_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time, as its definition reads."""
    outputs = []
    for t in range(q.shape[0]):
        state = state * decay[t].exp()[:, None, None]
        remembered = torch.einsum("hk,hkv->hv", k[t], state)
        correction = (v[t] - remembered) * beta[t][:, None]
        state = state + k[t][:, :, None] * correction[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outputs), state


@pytest.mark.parametrize("tokens", [1, CHUNK - 1, CHUNK, 2 * CHUNK + 5])
def test_chunked_rule_equals_the_recurrence(tokens: int) -> None:
    """The chunks' triangular solve gives the token-by-token rule's outputs and final
    states, from states that are not zero, over whole chunks and a padded last one, two
    sequences at once."""
    torch.manual_seed(tokens)
    heads, key_dim, value_dim = 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(2, tokens, heads, key_dim), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(2, tokens, heads, key_dim), dim=-1)
    v = torch.randn(2, tokens, heads, value_dim)
    decay = -torch.rand(2, tokens, heads) * 0.5
    beta = torch.rand(2, tokens, heads)
    state = torch.randn(2, heads, key_dim, value_dim)
    out, final = chunked_delta_rule(q, k, v, decay, beta, state)
    for i in range(2):
        expected_out, expected_final = step_by_step(q[i], k[i], v[i], decay[i], beta[i], state[i])
        torch.testing.assert_close(out[i], expected_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i], expected_final, atol=1e-5, rtol=1e-5)


def test_linear_layers_hold_states_not_kv(tiny_qwen3_5: Path) -> None:
    """The two linear attention layers have no KV slots and a state a request row (the
    page table's dummy row too); sizing counts the one attention layer's KV alone."""
    with LLM(str(tiny_qwen3_5), page_size=4, max_running_requests=8) as llm:
        engine = llm.runtime.engine
        config = engine.model_config
        assert config.linear_attention is not None and config.linear_attention.layers == (0, 1)
        pool = engine.pool
        assert [layer.shape[0] for layer in pool.kv[:2]] == [0, 0] and pool.kv[2].shape[0] > 0
        assert pool.states is not None
        conv, delta = pool.states.of(1)
        assert conv.shape == (9, 2 * 2 * 16 + 4 * 24, 3)
        assert delta.shape == (9, 4, 16, 24) and delta.dtype == torch.float32
        one_layer = 2 * config.num_kv_heads * config.head_dim * pool.kv[2].element_size()
        assert kv_bytes_per_token(config, engine.tp, pool.storage_dtype) == one_layer
        assert isinstance(engine.model.model.layers[0].linear_attn, GatedDeltaNet)
        assert isinstance(llm.scheduler.cache, NaiveCache)


def test_states_carry_chunks_and_batches_to_transformers_greedy_tokens(
    tiny_qwen3_5: Path,
) -> None:
    """Prompts in chunks of 7 tokens (each chunk continuing its request's states), all at
    once and one at a time, then again (fresh states, nothing from a cache), and continued
    from their first five tokens: every time transformers' greedy tokens."""
    hf = hf_model(tiny_qwen3_5)
    prompts = [*PROMPTS, LONG_PROMPT]
    expected = [hf_greedy_tokens(hf, prompt, 12) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_qwen3_5), page_size=4, max_prefill_length=7) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        alone = [llm.generate([prompt], params)[0].token_ids for prompt in prompts]
        assert alone == expected
        assert llm.generate(prompts, params)[-1].token_ids == expected[-1]
        assert llm.scheduler.planner.prompt_tokens_cached == 0
        extended = [prompt + tokens[:5] for prompt, tokens in zip(prompts, expected)]
        shorter = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
        continued = [o.token_ids for o in llm.generate(extended, shorter)]
        assert continued == [tokens[5:] for tokens in expected]
        llm.scheduler.check_integrity()
    with LLM(str(tiny_qwen3_5), page_size=4) as whole:  # the long prompt in one step
        assert whole.generate([LONG_PROMPT], params)[0].token_ids == expected[-1]


def test_retracted_requests_restart_from_fresh_states(tiny_qwen3_5: Path) -> None:
    """A pool too small for every request at once retracts some mid-decode; they prefill
    again from their first token, from zero states, and still give transformers' tokens."""
    hf = hf_model(tiny_qwen3_5)
    prompts = [[5 + i, 17, 42, 9, 100, 3, 77, 12 + i] for i in range(6)]
    expected = [hf_greedy_tokens(hf, prompt, 24) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(tiny_qwen3_5), page_size=4, num_pages=40) as llm:
        outputs = llm.generate(prompts, params)
        assert llm.scheduler.planner.num_retractions > 0
        llm.scheduler.check_integrity()
    assert [o.token_ids for o in outputs] == expected


def test_drafts_are_refused_in_one_line(tiny_qwen3_5: Path) -> None:
    with pytest.raises(ConfigError, match="recurrent states rolled back"):
        LLM(str(tiny_qwen3_5), speculative_algorithm="ngram")


def test_int8_weights_at_load_stay_close_to_float(tiny_qwen3_5: Path) -> None:
    """`--quantization int8` quantizes the linear layers' fused projection and output with
    every other product; the greedy tokens of the float model, mostly."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_qwen3_5), page_size=4) as float_llm:
        expected = [o.token_ids for o in float_llm.generate(PROMPTS, params)]
    with LLM(str(tiny_qwen3_5), page_size=4, quantization="int8") as llm:
        linear = llm.runtime.engine.model.model.layers[0].linear_attn
        assert linear is not None and linear.in_proj.quantized is not None
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    agree = sum(a == b for x, y in zip(got, expected) for a, b in zip(x, y))
    assert agree >= 12, (got, expected)


GPU_SHAPES = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
"""Heads that FlashInfer's kernels take, a quarter of each rotating."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_keep_outputs_on_gpu(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """Linear attention's decode step in CUDA graphs (its rows read from the static
    buffer; padded entries update the dummy row's states): the tokens and logprobs of
    eager decoding, batches of 1 to 40."""
    from tests.test_gpu import assert_graphs_keep_outputs

    folder = make_tiny_model("qwen3_5", tmp_path, overrides=GPU_SHAPES)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024}
    with_graphs = make_llm(folder, cuda_graph_max_bs=32, **options)
    without = make_llm(folder, cuda_graph_max_bs=0, **options)
    assert type(with_graphs.runtime.engine.attn).__name__ == "FlashInferBackend"
    assert_graphs_keep_outputs(with_graphs, without, params)
    # chunks of a long prompt continue its states as one whole prefill does
    chunked = make_llm(folder, max_prefill_length=48, **options)
    prompt = list(range(3, 300, 2))
    whole = without.generate([prompt], params)[0]
    parts = chunked.generate([prompt], params)[0]
    assert parts.token_ids == whole.token_ids


def test_decode_kernels_equal_the_torch_step(tiny_qwen3_5: Path) -> None:
    """The Triton decode step (compiled on a GPU, under Triton's interpreter on CPU) against
    the torch one: the same normed, gated outputs, states and convolution windows at the
    rows it names, the other rows untouched; the projection's gates read from its wider
    rows."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = ModelConfig.from_hf(json.loads((tiny_qwen3_5 / "config.json").read_text()))
    torch.manual_seed(0)
    layer = GatedDeltaNet(config, 0, TPGroup()).to(device)
    layer.conv1d.weight.data.normal_(0, 0.5)
    layer.A_log.data.uniform_(-1, 1)
    layer.dt_bias.data.normal_(0, 1)
    channels, value_width = layer.conv1d.weight.shape[0], 4 * 24
    heads = layer.value_heads
    projected = torch.randn(3, channels + value_width + 2 * heads, device=device)
    mixed, z, gates = projected.split([channels, value_width, 2 * heads], -1)
    rows = torch.tensor([4, 0, 2], device=device)
    conv = torch.randn(6, channels, 3, device=device)
    delta = torch.randn(6, heads, 16, 24, device=device) * 0.3
    conv_ref, delta_ref = conv.clone(), delta.clone()
    b, a = gates.split(heads, -1)
    decay = -layer.A_log.exp() * torch.nn.functional.softplus(a + layer.dt_bias)
    layer.norm.weight.data.normal_(1, 0.2)
    expected = layer._decode(mixed, b.sigmoid(), decay, conv_ref, delta_ref, rows, [4, 0, 2])
    expected = layer.norm(expected, z.reshape(3, heads, 24)).reshape(3, value_width)
    out = layer._decode_kernels(mixed, z, gates, conv, delta, rows)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(delta, delta_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv, conv_ref)


def test_quantized_gguf_keeps_its_blocks_close_to_its_float_twin(tmp_path: Path) -> None:
    """A Q8_0 file (llama.cpp's order of value heads) runs its blocks on the CPU kernels,
    the linear attention's fused projection and output too: greedy tokens of the float file,
    mostly, and logits close to transformers'. Under --tp 2 its value heads could not split
    as the key heads do: refused in one line."""
    folder = make_tiny_model("qwen3_5", tmp_path / "hf")
    float_file = write_hf_as_gguf(folder, tmp_path / "f32.gguf")
    quantized = write_hf_as_gguf(folder, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(float_file), page_size=4) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(quantized), page_size=4) as llm:
        linear = llm.runtime.engine.model.model.layers[0].linear_attn
        assert linear is not None and linear.tiled and linear.in_proj.quantized is not None
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        logits = our_logits(llm, PROMPTS[0], [])[0]
    with torch.inference_mode():
        reference = hf_model(folder)(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert (logits.float() - reference).abs().max() < 0.05 * reference.abs().max()
    agree = sum(a == b for x, y in zip(got, expected) for a, b in zip(x, y))
    assert agree >= 12, (got, expected)
    with pytest.raises(ConfigError, match="llama.cpp's order"):
        LLM(str(quantized), tensor_parallel_size=2)


def test_working_memory_holds_the_chunk_matrices(tiny_qwen3_5: Path) -> None:
    """On a GPU a step's working memory, kept out of the KV pool, counts the delta rule's
    chunk matrices of a whole prefill: more than the same model without linear attention."""
    config = ModelConfig.from_hf(json.loads((tiny_qwen3_5 / "config.json").read_text()))
    engine = EngineConfig(max_prefill_length=4096)
    dense = dataclasses.replace(config, linear_attention=None)
    hybrid_bytes = working_memory_bytes(engine, config, TPGroup(), torch.bfloat16)
    dense_bytes = working_memory_bytes(engine, dense, TPGroup(), torch.bfloat16)
    assert hybrid_bytes - dense_bytes == 4096 * 2 * 4 * 3 * CHUNK * 4
