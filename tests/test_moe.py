"""Qwen3-MoE: parity with transformers, the torch backend's grouped dispatch against a naive
per-token reference, the block layout of the fused path, checkpoint layouts, tensor-parallel
expert slices, and (marked gpu) the Triton backend against the torch one."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, ModelConfig
from aserve.distributed.group import TPGroup
from aserve.layers.moe import (
    ExpertWeights,
    QuantizedExperts,
    SparseMoE,
    moe_backend,
    route,
    torch_experts,
)
from aserve.layers.moe_layout import align_blocks, group_by_expert
from aserve.models.registry import build_model
from aserve.models.weights import fill_dummy_weights, iter_weights, load_hf_config
from aserve.quant.fp8 import quantize_rows
from tests.test_models import PROMPTS, assert_logits_match, hf_model, our_logits
from tests.tiny_models import hf_greedy_tokens, make_tiny_model

BENCH_MOE = Path(__file__).resolve().parent.parent / "bench" / "models" / "qwen3-30b-a3b"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_SHAPES = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
GPU_PROMPTS = [*PROMPTS, list(range(3, 90))]
VARIANTS = {
    "raw-topk": {"norm_topk_prob": False},
    "sparse-step-2": {"decoder_sparse_step": 2, "mlp_only_layers": []},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen3_moe family of tests/tiny_models.py (renormalised top-k, one dense layer,
    run by test_models.py) in the variants that it leaves out."""
    folder = tmp_path_factory.mktemp(request.param)
    return make_tiny_model("qwen3_moe", folder, overrides=VARIANTS[request.param])


def naive_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, expert by expert: the definition the backends must meet."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_experts(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, used: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Inputs for a backend; `used` confines routing to the first experts, so the rest get
    no tokens."""
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, used or experts, generator=gen)
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def test_logits_match_transformers(tiny_moe: Path) -> None:
    hf = hf_model(tiny_moe)
    with LLM(str(tiny_moe), page_size=4) as llm:
        model = llm.runtime.engine.model
        ours_sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
        assert ours_sparse == [
            type(layer.mlp).__name__.endswith("MoeBlock") for layer in hf.model.layers
        ]
        assert any(ours_sparse) and not all(ours_sparse)
        assert_logits_match(llm, hf)


def test_greedy_matches_transformers_generate(tiny_moe: Path) -> None:
    hf = hf_model(tiny_moe)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_moe), page_size=1) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_greedy_tokens(hf, prompt, 12)
        assert out.token_ids == expected


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "used"),
    [(1, 8, 2, None), (9, 8, 2, 3), (40, 16, 4, None), (5, 32, 8, 10)],
)
def test_torch_backend_equals_naive_reference(
    tokens: int, experts: int, top_k: int, used: int | None
) -> None:
    inputs = random_experts(tokens, experts, top_k, hidden=24, inter=12, used=used)
    torch.testing.assert_close(torch_experts(*inputs), naive_experts(*inputs))


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """These weights loaded expert by expert into FP8 experts: (w13, w13_scale, w2, w2_scale).
    Each part is quantized as it loads, to exactly the rows and scales of quantizing the
    stacked float weights after the load (the FP8 kernels' layout)."""
    inter = w13.shape[1] // 2
    experts = ExpertWeights(w13.shape[0], w13.shape[2], inter, TPGroup(), fp8=True)
    for e in range(w13.shape[0]):
        experts.load_tensor(f"{e}.gate_proj.weight", w13[e, :inter])
        experts.load_tensor(f"{e}.up_proj.weight", w13[e, inter:])
        experts.load_tensor(f"{e}.down_proj.weight", w2[e])
    assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
    assert experts.w13_scale is not None and experts.w2_scale is not None
    for weight, scales, full in (
        (experts.w13, experts.w13_scale, w13),
        (experts.w2, experts.w2_scale, w2),
    ):
        rows = quantize_rows(full.reshape(-1, full.shape[-1]))
        assert torch.equal(
            weight.data.view(torch.uint8).flatten(), rows.values.view(torch.uint8).flatten()
        )
        assert torch.equal(scales.flatten(), rows.scales)
    return experts.w13.data, experts.w13_scale, experts.w2.data, experts.w2_scale


def test_fp8_experts_in_the_torch_backend_equal_their_dequantized_weights() -> None:
    """Each FP8 expert is de-quantized as it is used: the float product of the de-quantized
    weights, which stay within FP8's rounding of the originals."""
    x, w13, w2, weights, ids = random_experts(9, 8, 2, hidden=24, inter=12, used=5)
    q13, s13, q2, s2 = fp8_experts(w13, w2)
    dq13, dq2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
    assert (dq13 - w13).abs().max() <= 0.07 * w13.abs().amax()
    expected = torch_experts(x, dq13, dq2, weights, ids)
    torch.testing.assert_close(torch_experts(x, q13, q2, weights, ids, s13, s2), expected)


def test_moe_experts_run_quantized_as_stored_or_in_fp8() -> None:
    """`--quantization fp8` of a float checkpoint or of a GGUF file (de-quantized, then FP8),
    an FP8 checkpoint as it is (`auto`, or `fp8` as vLLM users pass it) and a GGUF file as it
    is reach the experts (with either MoE backend); other quantizations are refused in one
    line."""
    from aserve.config import EngineConfig
    from aserve.runtime import chosen_quantization

    moe = ModelConfig.from_hf(load_hf_config(BENCH_MOE)[0])
    assert moe.num_experts and moe.quantization is None
    assert chosen_quantization(EngineConfig(quantization="fp8"), moe) == "fp8"
    with pytest.raises(ConfigError, match="MoE experts run quantized as a GGUF file stores"):
        chosen_quantization(EngineConfig(quantization="int4"), moe)
    stored = dataclasses.replace(moe, quantization="fp8")
    assert chosen_quantization(EngineConfig(quantization="auto"), stored) == "fp8"
    assert chosen_quantization(EngineConfig(quantization="fp8"), stored) == "fp8"  # as vLLM
    assert chosen_quantization(EngineConfig(quantization="none"), stored) is None
    with pytest.raises(ConfigError, match="already quantized \\(FP8\\)"):
        chosen_quantization(EngineConfig(quantization="int8"), stored)
    gguf = dataclasses.replace(moe, quantization="gguf")
    assert chosen_quantization(EngineConfig(quantization="auto"), gguf) == "gguf"
    assert chosen_quantization(EngineConfig(quantization="fp8"), gguf) == "fp8"
    assert chosen_quantization(EngineConfig(quantization="none"), gguf) is None
    fused = EngineConfig(quantization="auto", moe_backend="fused")
    assert chosen_quantization(fused, gguf) == "gguf"  # the fused kernels over codes, on CUDA


@pytest.mark.parametrize(
    ("groups", "top_groups", "renormalize", "scaling"),
    [(1, 1, True, 1.0), (4, 2, True, 2.5), (8, 3, False, 1.5)],
)
def test_sigmoid_routing_is_transformers(
    groups: int, top_groups: int, renormalize: bool, scaling: float
) -> None:
    """`route_deepseek` against transformers' GLM-4.5 router (DeepSeek-V3's): the same
    experts (transformers leaves them unsorted) with the same weights, where the bias moves
    the choice and groups bar experts outside the best."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from aserve.config import RouterStyle
    from aserve.layers.moe import route_deepseek

    experts, hidden, top_k = 32, 16, 6
    config = Glm4MoeConfig(
        hidden_size=hidden,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=top_groups,
        norm_topk_prob=renormalize,
        routed_scaling_factor=scaling,
    )
    gen = torch.Generator().manual_seed(groups)
    hf = Glm4MoeTopkRouter(config)
    hf.weight.data = torch.randn(experts, hidden, generator=gen)
    hf.e_score_correction_bias = torch.randn(experts, generator=gen) * 0.5
    x = torch.randn(40, hidden, generator=gen)
    logits, expected_weights, expected_ids = hf(x)
    style = RouterStyle(sigmoid=True, groups=groups, top_groups=top_groups, scaling=scaling)
    weights, ids = route_deepseek(
        logits, hf.e_score_correction_bias, top_k, renormalize, style, torch.float32
    )
    order, expected_order = ids.argsort(dim=1), expected_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))
    unbiased = torch.zeros(experts)
    plain, _ = route_deepseek(logits, unbiased, top_k, renormalize, style, torch.float32)
    assert not torch.equal(plain, weights)  # the bias chose other experts


@pytest.mark.parametrize(
    ("method", "groups", "top_groups", "scaling"),
    [
        ("greedy", 1, 1, 1.0),
        ("group_limited_greedy", 4, 2, 1.5),
        ("group_limited_greedy", 8, 3, 16.0),
    ],
)
def test_deepseek_v2_routing_is_transformers(
    method: str, groups: int, top_groups: int, scaling: float
) -> None:
    """`route_deepseek` with softmax scores and groups ranked by their best score against
    transformers' DeepSeek-V2 router: the same experts and weights (not renormalised)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from aserve.config import ModelConfig
    from aserve.layers.moe import route_deepseek

    experts, hidden, top_k = 32, 16, 6
    settings = {
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "n_group": groups,
        "topk_group": top_groups,
        "topk_method": method,
        "routed_scaling_factor": scaling,
    }
    gen = torch.Generator().manual_seed(groups)
    hf = DeepseekV2TopkRouter(DeepseekV2Config(**settings))
    hf.weight.data = torch.randn(experts, hidden, generator=gen)
    x = torch.randn(40, hidden, generator=gen)
    logits, expected_weights, expected_ids = hf(x)
    config = {
        **DeepseekV2Config(**settings).to_dict(),
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_hidden_layers": 1,
    }
    style = ModelConfig.from_hf(config).router
    assert (style.sigmoid, style.groups, style.group_best) == (False, groups, 1)
    weights, ids = route_deepseek(logits, None, top_k, False, style, torch.float32)
    order, expected_order = ids.argsort(dim=1), expected_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))


def test_group_by_expert_keeps_token_order_and_counts_empty_experts() -> None:
    ids = torch.tensor([[3, 0], [3, 5], [0, 3]])
    order, counts = group_by_expert(ids, 7)
    assert counts.tolist() == [2, 0, 0, 3, 0, 1, 0]
    assert order.tolist() == [1, 4, 0, 2, 5, 3]


@pytest.mark.parametrize("block", [1, 4, 16])
def test_align_blocks_handles_experts_without_tokens(block: int) -> None:
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 3], [3, 0]])
    num_pairs, num_experts = ids.numel(), 8
    layout = align_blocks(ids, num_experts, block)
    pairs = layout.sorted_pairs.view(-1, block)
    assert pairs.shape[0] == layout.block_expert.numel()
    flat = ids.flatten()
    seen: list[int] = []
    for row, expert in zip(pairs.tolist(), layout.block_expert.tolist()):
        real = [p for p in row if p < num_pairs]
        if expert == num_experts:
            assert not real, "blocks past the last expert hold no pairs"
            continue
        assert real, "an expert's block holds at least one pair"
        assert all(flat[p] == expert for p in real)
        assert row[: len(real)] == real, "padding only at the end of an expert's run"
        seen += real
    assert sorted(seen) == list(range(num_pairs))
    counts = torch.bincount(flat, minlength=num_experts)
    used_blocks = sum(-(-c // block) for c in counts.tolist())
    assert (layout.block_expert < num_experts).sum().item() == used_blocks
    assert layout.block_expert.tolist() == sorted(layout.block_expert.tolist())


def test_expert_slices_of_tensor_parallel_ranks_sum_to_the_whole() -> None:
    """Each rank holds every expert's slice of the intermediate dimension; the all-reduce of
    their partial sums is the unsharded output."""
    x, w13, w2, weights, ids = random_experts(6, 8, 2, hidden=16, inter=12)
    inter = w13.shape[1] // 2
    checkpoint = {}
    for e in range(8):
        checkpoint[f"{e}.gate_proj.weight"] = w13[e, :inter]
        checkpoint[f"{e}.up_proj.weight"] = w13[e, inter:]
        checkpoint[f"{e}.down_proj.weight"] = w2[e]
    total = torch.zeros_like(x)
    for rank in range(2):
        moe = SparseMoE(16, inter, 8, 2, True, TPGroup(rank, 2), moe_backend("torch", x.device))
        for name, tensor in checkpoint.items():
            moe.experts.load_tensor(name, tensor)
        assert moe.experts.w13.shape == (8, inter, 16) and moe.experts.w2.shape == (
            8,
            16,
            inter // 2,
        )
        total += torch_experts(x, moe.experts.w13, moe.experts.w2, weights, ids)
    torch.testing.assert_close(total, torch_experts(x, w13, w2, weights, ids))


def test_fp8_checkpoint_experts_split_over_tensor_parallel_ranks() -> None:
    """A published FP8 checkpoint's experts (32x32 block scales) on two ranks: each rank
    takes whole blocks of its slice; its gate and up rows are exactly those of one rank
    holding everything, and the ranks' partial sums add up to the float product within FP8's
    rounding (twice: the file's blocks, then each row). FP8 values without a scale, and a
    slice that starts inside a block, are refused in one line."""
    from aserve.quant.fp8 import FP8, FP8_MAX, Fp8Tensor

    x, w13, w2, weights, ids = random_experts(6, 4, 2, hidden=64, inter=64)
    inter = w13.shape[1] // 2

    def published(weight: torch.Tensor) -> Fp8Tensor:
        blocks = weight.unflatten(0, (-1, 32)).unflatten(2, (-1, 32))
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        return Fp8Tensor((weight / full).to(FP8), scale, (32, 32))

    checkpoint = {}
    for e in range(4):
        checkpoint[f"{e}.gate_proj.weight"] = published(w13[e, :inter])
        checkpoint[f"{e}.up_proj.weight"] = published(w13[e, inter:])
        checkpoint[f"{e}.down_proj.weight"] = published(w2[e])

    def loaded(rank: int, ranks: int) -> ExpertWeights:
        experts = ExpertWeights(4, 64, inter, TPGroup(rank, ranks), fp8=True)
        for name, tensor in checkpoint.items():
            experts.load_tensor(name, tensor)
        return experts

    whole, total = loaded(0, 1), torch.zeros_like(x)
    for rank in range(2):
        experts = loaded(rank, 2)
        assert experts.w2.shape == (4, 64, inter // 2) and experts.w2.dtype == FP8
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        gate_rows = whole.w13.view(torch.uint8)[:, :inter][:, half]
        assert torch.equal(experts.w13.view(torch.uint8)[:, : inter // 2], gate_rows)
        total += torch_experts(
            x, experts.w13, experts.w2, weights, ids, experts.w13_scale, experts.w2_scale
        )
    expected = torch_experts(x, w13, w2, weights, ids)
    assert (total - expected).norm() <= 0.1 * expected.norm()
    stacked = torch.zeros(4, 2 * inter, 64, dtype=FP8)  # FP8 values with no scale paired
    with pytest.raises(ValueError, match="FP8 expert tensor without its scale"):
        whole.load_tensor("gate_up_proj", stacked)
    odd = ExpertWeights(4, 64, 48, TPGroup(1, 2), fp8=True)  # rank 1 starts at column 24
    down = Fp8Tensor(w2[0, :, :48].to(FP8), torch.ones(2, 2), (32, 32))
    with pytest.raises(ValueError, match="inside a 32x32 scale block"):
        odd.load_tensor("0.down_proj.weight", down)


def build_tiny(folder: Path) -> torch.nn.Module:
    config = ModelConfig.from_hf(*load_hf_config(folder))
    return build_model(config, 64, TPGroup())


def test_stacked_expert_checkpoint_loads_like_per_expert(tmp_path: Path) -> None:
    """Transformers saves experts one by one, but its modules hold them stacked
    (`experts.gate_up_proj`, `experts.down_proj`); a state dict saved as is loads the same."""
    folder = make_tiny_model("qwen3_moe", tmp_path / "per-expert")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((folder / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf_model(folder).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, stacked / "model.safetensors")
    reference, ours = build_tiny(folder), build_tiny(stacked)
    reference.load_weights(iter_weights(folder, progress=False))
    ours.load_weights(iter_weights(stacked, progress=False))
    for (name, a), (_, b) in zip(reference.state_dict().items(), ours.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_prediction_layer_is_left_unread(tmp_path: Path, family: str) -> None:
    """GLM-4.5's and DeepSeek-V3's checkpoints hold a next-token prediction layer after the
    last (`num_nextn_predict_layers`, as `model.layers.{num_layers}`, with its own
    projections and norms); aserve does not run it, so it loads as the same model without
    it. A checkpoint without the setting has no place for such a layer."""
    folder = make_tiny_model(family, tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1  # GLM-4.5's and DeepSeek-V3's own
    (folder / "config.json").write_text(json.dumps(config))
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    extra = {
        f"model.layers.{layers}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
        f"model.layers.{layers}.enorm.weight": torch.ones(hidden),
        f"model.layers.{layers}.mlp.experts.0.gate_proj.weight": torch.randn(32, hidden),
        f"model.layers.{layers}.self_attn.q_proj.weight": torch.randn(64, hidden),
    }
    reference = build_tiny(folder)
    reference.load_weights(iter_weights(folder, progress=False))
    ours = build_tiny(folder)
    ours.load_weights([*iter_weights(folder, progress=False), *extra.items()])
    for (name, a), (_, b) in zip(reference.state_dict().items(), ours.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    config["num_nextn_predict_layers"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no place"):
        build_tiny(folder).load_weights([*iter_weights(folder, progress=False), *extra.items()])


def test_checkpoint_missing_one_expert_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_model("qwen3_moe", tmp_path)
    model = build_tiny(folder)
    missing = "model.layers.0.mlp.experts.3.up_proj.weight"
    weights = ((n, t) for n, t in iter_weights(folder, progress=False) if n != missing)
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        model.load_weights(weights)


def test_moe_backend_option(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    folder = make_tiny_model("qwen3_moe", tmp_path)
    for name in ("auto", "torch"):
        llm = make_llm(folder, moe_backend=name)
        assert llm.runtime.engine.model.model.layers[0].mlp.backend.name == "torch"
    with pytest.raises(ConfigError, match=r"^--moe-backend fused needs a CUDA device"):
        LLM(str(folder), device="cpu", moe_backend="fused")
    with pytest.raises(ConfigError, match="--moe-backend must be"):
        LLM(str(folder), moe_backend="triton")


def test_dummy_weights_run_from_the_bench_config(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """bench/models/qwen3-30b-a3b shrunk: every parameter gets finite, small random values."""
    config = json.loads((BENCH_MOE / "config.json").read_text())
    assert ModelConfig.from_hf(config).num_experts == 128
    config.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, vocab_size=512)
    config.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16)
    config.update(moe_intermediate_size=64, mlp_only_layers=[1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = build_tiny(tmp_path)
    fill_dummy_weights(model)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if "experts" in name or "mlp.gate" in name:
            assert 0.01 < param.std().item() < 0.03, name
    llm = make_llm(tmp_path, dummy_weight=True, num_pages=256)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    # FP8 experts (--quantization fp8) are filled one expert at a time, quantized as they go
    fp8_config = dataclasses.replace(ModelConfig.from_hf(config), quantization="fp8")
    fp8_model = build_model(fp8_config, 64, TPGroup())
    fill_dummy_weights(fp8_model)
    experts = fp8_model.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
    for weight, scales in ((experts.w13, experts.w13_scale), (experts.w2, experts.w2_scale)):
        assert scales is not None
        values = weight.float() * scales[..., None]
        assert torch.isfinite(values).all() and 0.01 < values.std().item() < 0.03


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "used"),
    [(1, 8, 2, None), (7, 128, 8, None), (300, 8, 2, 3), (1000, 64, 4, None)],
)
def test_fused_experts_match_torch_backend(
    dtype: torch.dtype, tokens: int, experts: int, top_k: int, used: int | None
) -> None:
    """Odd sizes (inter 96, hidden 200) leave partial tiles on both GEMMs."""
    fused = moe_backend("fused", torch.device("cuda"))
    inputs = random_experts(tokens, experts, top_k, hidden=200, inter=96, used=used)
    x, w13, w2, weights, ids = (t.cuda() for t in inputs)
    x, w13, w2, weights = (t.to(dtype) for t in (x, w13, w2, weights))
    expected = torch_experts(x.float(), w13.float(), w2.float(), weights.float(), ids)
    actual = fused.experts(x, w13, w2, weights, ids).float()
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(actual, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (300, 64, 4)])
def test_fused_fp8_experts_match_torch_backend(tokens: int, experts: int, top_k: int) -> None:
    """FP8 experts (bf16 activations): the fused kernels against the torch backend on the
    same FP8 weights, which it de-quantizes."""
    fused = moe_backend("fused", torch.device("cuda"))
    x, w13, w2, weights, ids = random_experts(tokens, experts, top_k, hidden=200, inter=96)
    q13, s13, q2, s2 = (t.cuda() for t in fp8_experts(w13, w2))
    x, weights, ids = x.cuda().bfloat16(), weights.cuda().bfloat16(), ids.cuda()
    expected = torch_experts(x.float(), q13, q2, weights.float(), ids, s13, s2)
    actual = fused.experts(x, q13, q2, weights, ids, s13, s2).float()
    torch.testing.assert_close(actual, expected, atol=3e-2, rtol=3e-2)


def force_wide_tiles(
    monkeypatch: pytest.MonkeyPatch, launcher: ModuleType, block_m_at: int
) -> list[int]:
    """The fused MoE kernels' wide tiles at any size; returns the block rows that each launch
    of `launcher._launch` gets (its argument `block_m_at`), as it gets them."""
    from aserve.layers import moe_triton

    monkeypatch.setattr(moe_triton, "WIDE_PAIRS", 0)
    monkeypatch.setattr(moe_triton, "WIDE_INTER", 0)
    monkeypatch.setattr(moe_triton, "wide_tiles_fit", lambda device: True)
    launch, blocks = launcher._launch, []

    def recorded(*args: object) -> None:
        blocks.append(args[block_m_at])
        launch(*args)

    monkeypatch.setattr(launcher, "_launch", recorded)
    return blocks


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
def test_fused_experts_in_wide_tiles_match_torch_backend(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 128 x 128 tiles of long prefill batches of wide experts, taken here at any size
    (odd sizes: partial tiles), float and FP8 experts."""
    from aserve.layers import moe_triton

    blocks = force_wide_tiles(monkeypatch, moe_triton, block_m_at=8)
    fused = moe_backend("fused", torch.device("cuda"))
    x, w13, w2, weights, ids = random_experts(300, 16, 4, hidden=200, inter=96)
    x, weights, ids = x.cuda(), weights.cuda(), ids.cuda()
    if kind == "fp8":
        q13, s13, q2, s2 = (t.cuda() for t in fp8_experts(w13, w2))
        x, weights = x.bfloat16(), weights.bfloat16()
        expected = torch_experts(x.float(), q13, q2, weights.float(), ids, s13, s2)
        actual = fused.experts(x, q13, q2, weights, ids, s13, s2).float()
    else:
        dtype = getattr(torch, kind)
        x, w13, w2, weights = (t.cuda().to(dtype) for t in (x, w13, w2, weights))
        expected = torch_experts(x.float(), w13.float(), w2.float(), weights.float(), ids)
        actual = fused.experts(x, w13, w2, weights, ids).float()
    assert blocks == [moe_triton.WIDE_BLOCK_M] * 2
    tolerance = 1e-4 if kind == "float32" else 3e-2
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    ("family", "stored"),
    [("qwen3_moe", False), ("qwen3_moe", True), ("glm4_moe", False)],
    ids=["quantized-at-load", "fp8-checkpoint", "glm-4.5-quantized-at-load"],
)
def test_fp8_moe_model_in_cuda_graphs(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str, stored: bool
) -> None:
    """FP8 experts from `--quantization fp8` of a float checkpoint, or from a published FP8
    checkpoint (block scales): under graphs and eagerly the fused FP8 path gives the same
    tokens. From a float checkpoint the first greedy tokens mostly agree with the float
    model's; an FP8 checkpoint's rows are those of its de-quantized twin quantized at load
    (on CPU bit for bit, tests/test_fp8.py; on the GPU experts' rows differed by an FP8
    code on GLM-4.5's tiny model, which moved its routing), and Qwen3-MoE's generates the
    twin's FP8 tokens."""
    pytest.importorskip("flashinfer")
    from tests.test_fp8 import write_fp8_checkpoint
    from tests.test_quant import first_tokens_agreeing

    folder = make_tiny_model(family, tmp_path / "float", overrides=GPU_SHAPES)
    quantization = "fp8"
    if stored:
        write_fp8_checkpoint(folder, tmp_path / "fp8", tmp_path / "twin", "fp8-block")
        folder, quantization = tmp_path / "fp8", "auto"
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024}
    fp8 = make_llm(folder, quantization=quantization, moe_backend="fused", **options)
    experts = next(m for m in fp8.runtime.engine.model.modules() if isinstance(m, ExpertWeights))
    assert experts.w13.dtype == torch.float8_e4m3fn and fp8.runtime.engine.graphs is not None
    eager = make_llm(folder, quantization=quantization, cuda_graph_max_bs=0, **options)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = [o.token_ids for o in fp8.generate(GPU_PROMPTS, params)]
    assert tokens == [o.token_ids for o in eager.generate(GPU_PROMPTS, params)]
    if stored:
        twin = make_llm(tmp_path / "twin", quantization="fp8", moe_backend="fused", **options)
        assert tokens == [o.token_ids for o in twin.generate(GPU_PROMPTS, params)]
    else:
        agree, pairs = first_tokens_agreeing(fp8, make_llm(folder, **options), max_tokens=8)
        assert agree >= 4, pairs


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_fused_backend_greedy_equals_torch_backend_in_float32(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    """GLM-4.5's sigmoid routing: in one kernel in decode, in torch ops for prefill."""
    folder = make_tiny_model(family, tmp_path, overrides=GPU_SHAPES)
    options = {"device": "cuda", "dtype": "float32", "attention_backend": "torch"}
    fused = make_llm(folder, moe_backend="fused", **options)
    reference = make_llm(folder, moe_backend="torch", **options)
    assert fused.runtime.engine.model.model.layers[-1].mlp.backend.name == "fused"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in fused.generate(GPU_PROMPTS, params)] == [
        o.token_ids for o in reference.generate(GPU_PROMPTS, params)
    ]


@pytest.mark.gpu
@requires_cuda
def test_fused_backend_bf16_logits_close_to_torch_backend(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    folder = make_tiny_model("qwen3_moe", tmp_path, overrides=GPU_SHAPES)
    options = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "torch"}
    fused = make_llm(folder, moe_backend="fused", max_prefill_length=40, **options)
    reference = make_llm(folder, moe_backend="torch", max_prefill_length=40, **options)
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5]
    expected = our_logits(reference, prompt, continuation)
    torch.testing.assert_close(
        our_logits(fused, prompt, continuation), expected, atol=0.06, rtol=0.03
    )


def assert_graphs_generate_as_eager(graphed: LLM, eager: LLM) -> None:
    """Greedy tokens equal, logprobs to bf16's noise, over five short prompts."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)
    prompts = [list(range(7 + i, 12 + 3 * i)) for i in range(5)]
    for ours, reference in zip(graphed.generate(prompts, params), eager.generate(prompts, params)):
        assert ours.token_ids == reference.token_ids
        for a, b in zip(ours.logprobs, reference.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=0.02)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_fused_moe_runs_in_cuda_graphs(
    make_llm: Callable[..., LLM], tmp_path: Path, family: str
) -> None:
    """The fused path has no host sync, so decode is captured; the torch path turns graphs
    off rather than failing the capture."""
    pytest.importorskip("flashinfer")
    folder = make_tiny_model(family, tmp_path, overrides=GPU_SHAPES)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024}
    graphed = make_llm(folder, moe_backend="fused", cuda_graph_max_bs=8, **options)
    eager = make_llm(folder, moe_backend="fused", cuda_graph_max_bs=0, **options)
    assert graphed.runtime.engine.graphs is not None
    assert make_llm(folder, moe_backend="torch", **options).runtime.engine.graphs is None
    assert_graphs_generate_as_eager(graphed, eager)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_experts_on_cuda_close_to_their_float_twin(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str
) -> None:
    """A Qwen3-MoE GGUF keeps its experts in blocks on CUDA too: stacked for the fused
    kernels over codes (the default), or one expert at a time with `--moe-backend torch`
    (graphs off). Both give the float32 logits of the de-quantized twin's torch experts up
    to the order of float sums (in bf16 the twin's weights are rounded and the two part
    further)."""
    import gguf

    from tests.gguf_files import write_hf_as_gguf

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_tiny_model("qwen3_moe", tmp_path, overrides={**GPU_SHAPES, "mlp_only_layers": []})
    kind = gguf.GGMLQuantizationType[qtype]
    model = write_hf_as_gguf(folder, tmp_path / "moe.gguf", qtype=kind)
    options = {"device": "cuda", "dtype": "float32", "attention_backend": "torch"}
    twin = make_llm(model, quantization="none", moe_backend="torch", **options)
    prompt, continuation = list(range(3, 100)), [7, 123, 45, 2, 99, 5]
    expected = our_logits(twin, prompt, continuation)
    for backend in ("auto", "torch"):
        quantized = make_llm(model, moe_backend=backend, **options)
        experts = quantized.runtime.engine.model.model.layers[0].mlp.experts
        assert isinstance(experts, QuantizedExperts)
        assert (experts.stacked is not None) == (backend == "auto")
        assert quantized.runtime.engine.model.graph_capturable == (backend == "auto")
        torch.testing.assert_close(
            our_logits(quantized, prompt, continuation), expected, atol=1e-3, rtol=1e-3
        )


@pytest.mark.gpu
@requires_cuda
def test_gguf_experts_in_the_fused_kernels_run_in_cuda_graphs(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 with the experts in Q4_0 codes: decode under CUDA graphs gives the eager tokens
    (and logprobs to bf16's noise), and the eager fused kernels, like the torch backend,
    pick the float32 twin's first token wherever its lead is beyond bf16's noise. (Where
    the random model's top two are closer, ~0.01-0.03 apart, either bf16 path flips some,
    whichever way it rounds: the fused kernels round gate|up once, in float32, the torch
    backend to bf16 first. Seen on an H200: both bf16 paths within 0.05 of the float32
    logits on five prompts, 0.36-0.43 off on one, leads above 0.19 kept by both.)"""
    pytest.importorskip("flashinfer")
    import gguf

    from tests.gguf_files import write_hf_as_gguf
    from tests.test_quant import TINY_PROMPTS

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_tiny_model("qwen3_moe", tmp_path, overrides={**GPU_SHAPES, "mlp_only_layers": []})
    model = write_hf_as_gguf(folder, tmp_path / "moe.gguf", qtype=gguf.GGMLQuantizationType.Q4_0)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024}
    graphed = make_llm(model, cuda_graph_max_bs=8, **options)
    eager = make_llm(model, cuda_graph_max_bs=0, **options)
    assert graphed.runtime.engine.graphs is not None
    assert_graphs_generate_as_eager(graphed, eager)
    torch_backend = make_llm(model, moe_backend="torch", cuda_graph_max_bs=0, **options)
    twin = make_llm(
        model, quantization="none", moe_backend="torch", device="cuda", dtype="float32",
        attention_backend="torch",
    )  # fmt: skip
    decisive = 0
    for prompt in TINY_PROMPTS:
        expected = our_logits(twin, prompt, [])[-1]
        lead = expected.topk(2).values
        if lead[0] - lead[1] < 0.1:  # a near-tie, left to rounding
            continue
        decisive += 1
        for llm in (eager, torch_backend):
            assert int(our_logits(llm, prompt, [])[-1].argmax()) == int(expected.argmax()), prompt
    assert decisive >= 3  # the model and prompts are fixed: this check cannot go empty


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 needs compute capability 8.9 or newer",
)
def test_gguf_moe_in_fp8_runs_the_fused_kernels_in_graphs(
    make_llm: Callable[..., LLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--quantization fp8` of a GGUF MoE: its de-quantized experts in FP8 rows through the
    fused kernels, decode under CUDA graphs; first greedy tokens mostly as the bf16 twin's."""
    import gguf

    from tests.gguf_files import write_hf_as_gguf
    from tests.test_quant import first_tokens_agreeing

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_tiny_model("qwen3_moe", tmp_path, overrides={**GPU_SHAPES, "mlp_only_layers": []})
    model = write_hf_as_gguf(folder, tmp_path / "moe.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 1024}
    fp8 = make_llm(model, quantization="fp8", **options)
    experts = fp8.runtime.engine.model.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertWeights) and experts.w13.dtype == torch.float8_e4m3fn
    assert fp8.runtime.engine.graphs is not None
    agree, pairs = first_tokens_agreeing(fp8, make_llm(model, quantization="none", **options))
    assert agree >= 4, pairs
