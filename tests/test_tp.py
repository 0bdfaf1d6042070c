"""Tensor parallelism on CPU: two gloo ranks against one, on tiny random checkpoints.

One TP=2 and one TP=1 LLM per checkpoint are shared by the parity tests (spawning a rank
costs seconds); the lifecycle tests start their own.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors import safe_open
from safetensors.torch import save_file

from aserve import LLM, SamplingParams
from aserve.config import ConfigError
from aserve.distributed.fused_norm import RESIDUAL_RMS_NORM, AllReduceAddNorm, workspace_bytes
from aserve.distributed.group import TPGroup
from aserve.engine.step import StepSpec
from aserve.forward import ForwardMode
from aserve.kvcache.pages import PageWrite
from aserve.layers.embedding import VocabParallelEmbedding
from aserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aserve.layers.moe import QuantizedExperts
from aserve.llm import GenerationOutput
from aserve.quant.method import PermutedInputs
from aserve.quant.native import FloatWeight, rounds_activations
from tests.gguf_files import write_hf_as_gguf
from tests.server_utils import ServerProcess, cache_sharing_kernels
from tests.tiny_models import make_tiny_model

OPTIONS = {"device": "cpu", "dtype": "float32", "page_size": 4, "num_pages": 1024}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 12, 250, 31, 8], [300, 4, 4, 61], list(range(3, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=[2, 1], ids=["kv_heads_split", "kv_heads_replicated"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LLM, LLM]]:
    """(TP=1, TP=2) on the same llama checkpoint with 2 KV heads (split over the ranks) or
    1 (replicated on both). Prompts over 16 tokens are prefilled in chunks."""
    kv_heads = request.param
    folder = tmp_path_factory.mktemp(f"kv{kv_heads}")
    make_tiny_model("llama", folder, overrides={"num_key_value_heads": kv_heads})
    one = LLM(str(folder), max_prefill_length=16, **OPTIONS)
    two = LLM(str(folder), max_prefill_length=16, tensor_parallel_size=2, **OPTIONS)
    yield one, two
    two.close()
    one.close()


def assert_same_generations(
    got: list[GenerationOutput], expected: list[GenerationOutput], tolerance: float = 1e-5
) -> None:
    """Same tokens; logprobs and top alternatives equal up to float32 summation order."""
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs is not None and theirs.logprobs is not None
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=tolerance)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=tolerance)


def test_tp2_greedy_tokens_and_logprobs_equal_tp1(pair: tuple[LLM, LLM]) -> None:
    one, two = pair
    assert two.runtime.engine.tp.size == 2
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    assert_same_generations(two.generate(PROMPTS, params), one.generate(PROMPTS, params))
    two.scheduler.check_integrity()


def test_tp2_prefix_hit_and_chunked_prefill_equal_tp1(pair: tuple[LLM, LLM]) -> None:
    one, two = pair
    long_prompt = list(range(100, 150))
    follow_up = [*long_prompt, 7, 8, 9]
    for llm in pair:
        llm.generate([long_prompt], GREEDY)
    cached_before = two.scheduler.planner.prompt_tokens_cached
    got = two.generate([follow_up, PROMPTS[1]], GREEDY)
    assert two.scheduler.planner.prompt_tokens_cached - cached_before >= 48
    assert [o.token_ids for o in got] == [
        o.token_ids for o in one.generate([follow_up, PROMPTS[1]], GREEDY)
    ]
    two.scheduler.check_integrity()


@pytest.mark.parametrize("stored", ["float", "gguf"])
def test_tp2_moe_greedy_tokens_and_logprobs_equal_tp1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: str
) -> None:
    """Qwen3-MoE with every expert's intermediate dimension split over the ranks (and a
    dense MLP layer beside the sparse ones); from a Q8_0 GGUF, each rank keeps its slice of
    every expert's blocks (a float32 KV cache, so that the ranks' sums in another order
    cannot round apart in float16). Where the CPU kernels round activations to 16 bits
    (`rounds_activations`), the ranks' last-bit differences can move a value by a step:
    logprobs then agree to 1e-4 (2.2e-5 apart measured)."""
    options = dict(OPTIONS)
    if stored == "float":
        model = make_tiny_model("qwen3_moe", tmp_path)
    else:
        # the rank's process builds or finds its kernels there too
        monkeypatch.setenv("ASERVE_CACHE_DIR", str(cache_sharing_kernels(tmp_path / "cache")))
        overrides = {"mlp_only_layers": [], "moe_intermediate_size": 64}
        folder = make_tiny_model("qwen3_moe", tmp_path / "hf", overrides=overrides)
        model = write_hf_as_gguf(folder, tmp_path / "moe.gguf", qtype=QType.Q8_0)
        options["kv_cache_dtype"] = "float32"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    with (
        LLM(str(model), **options) as one,
        LLM(str(model), tensor_parallel_size=2, **options) as two,
    ):
        experts = two.runtime.engine.model.model.layers[0].mlp.experts
        if stored == "float":
            assert experts.w2.shape[-1] == 32 // 2
        else:
            assert isinstance(experts, QuantizedExperts) and experts.down.weights[0].cols == 64 // 2
        tolerance = 1e-5 if stored == "float" or not rounds_activations(8) else 1e-4
        assert_same_generations(
            two.generate(PROMPTS, params), one.generate(PROMPTS, params), tolerance
        )


@pytest.mark.parametrize("layout", ["awq", "gptq-channel", "gptq-act-order", "ct-w4a16-act-order"])
def test_tp2_integer_checkpoint_equals_tp1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """An AWQ checkpoint (groups of 32 inputs), a GPTQ one with a scale a row and act-order
    ones (GPTQ's and compressed-tensors'), each rank keeping its rows, or its columns at
    whole groups, of the packed codes (act-order: its inputs' share of each group, padded):
    the same greedy tokens and logprobs as one rank (to 1e-4 where the CPU kernels round
    activations)."""
    from tests.test_int_checkpoints import LAYOUTS, write_int_checkpoint

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(cache_sharing_kernels(tmp_path / "cache")))
    folder = make_tiny_model("llama", tmp_path / "float")
    write_int_checkpoint(folder, tmp_path / "int", tmp_path / "twin", LAYOUTS[layout])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    options = {**OPTIONS, "kv_cache_dtype": "float32"}
    with (
        LLM(str(tmp_path / "int"), **options) as one,
        LLM(str(tmp_path / "int"), tensor_parallel_size=2, **options) as two,
    ):
        down = two.runtime.engine.model.model.layers[0].mlp.down_proj.quantized
        assert down is not None and down.cols == 128 // 2
        if LAYOUTS[layout].act_order:  # each rank's groups padded, a zero input gathered
            product = down.products[0]
            assert isinstance(product, PermutedInputs) and product.padded
            assert product.shape[1] > 128 // 2
        tolerance = 1e-5 if not rounds_activations(4) else 1e-4
        assert_same_generations(
            two.generate(PROMPTS, params), one.generate(PROMPTS, params), tolerance
        )


@pytest.mark.parametrize(
    "family",
    [
        "gemma3",
        "gemma2",
        "phi3",
        "granite",
        "granitemoe",
        "mixtral",
        "qwen2_moe",
        "olmo2",
        "olmo2-one-kv-head",
        "olmo3",
        "olmoe",
        "exaone4",
        "glm4",
        "glm4_moe",
        "dots1",
        "deepseek_v2",
        "deepseek_v3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
    ],
)
def test_tp2_family_greedy_tokens_and_logprobs_equal_tp1(tmp_path: Path, family: str) -> None:
    """Gemma's norms after attention and the MLP reduce the ranks' partial sums before
    they normalise; its layer output is then whole, and the next norm must not sum it again.
    Its windowed layer reads the last 4 positions of the longer prompts; Gemma 2 caps each
    rank's heads' scores. Phi-3's fused projections are split, then sharded by whole heads
    (their rows reordered within each head for the partial rotation); Granite scales the
    ranks' partial sums before they are reduced; Mixtral splits every expert. OLMo 2's Q
    and K norms span the heads of both ranks (their squares summed over ranks), also with
    one KV head that both ranks hold (whose squares then count twice in that sum).
    GLM-4.5's and dots.llm1's float32 routers are replicated, their shared experts split
    as dense MLPs. DeepSeek's latent attention splits its heads (queries, `kv_b_proj`'s
    slices, output columns) while both ranks compute and cache the whole latent row.
    Qwen3.5's linear attention splits its key heads with the value heads they serve, the
    convolution's channels with them, and each rank keeps its heads' recurrent states; its
    gated attention splits queries and gates alike (Qwen3-Next's projections grouped by key
    head are ungrouped at load, then split the same way)."""
    one_kv_head = family == "olmo2-one-kv-head"
    overrides = {"num_key_value_heads": 1} if one_kv_head else None
    model = make_tiny_model(family.removesuffix("-one-kv-head"), tmp_path, overrides=overrides)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    with (
        LLM(str(model), max_prefill_length=16, **OPTIONS) as one,
        LLM(str(model), max_prefill_length=16, tensor_parallel_size=2, **OPTIONS) as two,
    ):
        assert two.runtime.engine.tp.size == 2
        assert_same_generations(two.generate(PROMPTS, params), one.generate(PROMPTS, params))


@pytest.mark.parametrize("stored", ["float", "mxfp4"])
def test_tp2_gpt_oss_greedy_tokens_and_logprobs_equal_tp1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: str
) -> None:
    """gpt-oss's biases are added once over the ranks' partial sums (the output projection's
    and the experts' down biases on rank 0), each rank holds its heads' sinks and its slice
    of every expert's gate and up biases; from a float checkpoint and from a GGUF of MXFP4
    experts (a float32 cache, as for Qwen3-MoE's GGUF above)."""
    options = dict(OPTIONS)
    if stored == "float":
        model = make_tiny_model("gpt_oss", tmp_path)
    else:
        monkeypatch.setenv("ASERVE_CACHE_DIR", str(cache_sharing_kernels(tmp_path / "cache")))
        overrides = {"swiglu_limit": 7.0, "intermediate_size": 64}  # whole blocks a rank
        folder = make_tiny_model("gpt_oss", tmp_path / "hf", overrides=overrides)
        model = write_hf_as_gguf(
            folder, tmp_path / "oss.gguf", qtype=QType.Q8_0, qtype_of={"_exps": QType.MXFP4}
        )
        options["kv_cache_dtype"] = "float32"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    with (
        LLM(str(model), max_prefill_length=16, **options) as one,
        LLM(str(model), max_prefill_length=16, tensor_parallel_size=2, **options) as two,
    ):
        attention = two.runtime.engine.model.model.layers[0].self_attn
        assert attention.sinks is not None and attention.sinks.shape == (4 // 2,)
        tolerance = 1e-5 if stored == "float" or not rounds_activations(8) else 1e-4
        assert_same_generations(
            two.generate(PROMPTS, params), one.generate(PROMPTS, params), tolerance
        )


def test_tp2_of_a_bfloat16_checkpoint_keeps_16_bit_shards(tmp_path: Path) -> None:
    """Each rank keeps its shards of a bfloat16 checkpoint in 16 bits (`FloatWeight`: a
    column-parallel layer's rows, a row-parallel one's columns, its slice of the vocabulary),
    with TP=1's greedy tokens and logprobs."""
    import transformers

    make_tiny_model("llama", tmp_path / "float")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    with (
        LLM(str(tmp_path / "bf16"), **OPTIONS) as one,
        LLM(str(tmp_path / "bf16"), tensor_parallel_size=2, **OPTIONS) as two,
    ):
        layer = two.runtime.engine.model.model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            assert linear.quantized is not None
            (product,) = linear.quantized.products
            assert isinstance(product, FloatWeight) and product.words.dtype == torch.bfloat16
        assert layer.mlp.down_proj.quantized.products[0].shape[1] == 128 // 2
        assert_same_generations(two.generate(PROMPTS, params), one.generate(PROMPTS, params))


def test_tp_that_does_not_split_the_model_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path)
    with pytest.raises(ConfigError, match="--tp 3 does not evenly split .* attention heads"):
        LLM(str(folder), tensor_parallel_size=3, **OPTIONS)


def test_step_spec_survives_packing() -> None:
    spec = StepSpec(
        mode=ForwardMode.PREFILL,
        rows=[3, 0],
        prefix_lens=[8, 0],
        extend_lens=[2, 3],
        scored=[0, 1],
        input_ids=[11, 12, 21, 22, 23],
        page_writes=[PageWrite(3, 2, [7]), PageWrite(0, 0, [4, 5, 9])],
        rope_positions=[8, 9, 0, 0, 1, 8, 9, 0, 1, 1, 8, 9, 0, 0, 2],
        image_rows=[2, 3],
        image_levels=3,
        both_ways=[1, 0, 2],
    )
    assert StepSpec.unpack(spec.pack()) == spec
    decode = StepSpec(ForwardMode.DECODE, [1], [40], [1], [0], [], [])
    assert StepSpec.unpack(decode.pack()) == decode
    shifted = StepSpec(ForwardMode.DECODE, [1, 2], [40, 7], [1, 1], [0, 0], [], [], [33, 7])
    assert StepSpec.unpack(shifted.pack()) == shifted


@dataclass(frozen=True)
class LocalRank(TPGroup):
    """One rank of a group whose collectives the test does by hand (sum or concatenate the
    ranks' outputs), so layers are checked without processes."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


RANKS = [LocalRank(0, 2), LocalRank(1, 2)]


def lazy(tensor: torch.Tensor, tmp_path: Path) -> object:
    """`tensor` as a safetensors slice, read from disk only where indexed."""
    save_file({"t": tensor.contiguous()}, str(tmp_path / "t.safetensors"))
    handle = safe_open(str(tmp_path / "t.safetensors"), framework="pt")
    return handle.get_slice("t")


@torch.no_grad()
def test_sharded_layers_equal_unsharded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 16)

    gate, up = torch.randn(8, 16), torch.randn(8, 16)
    full = ColumnParallelLinear(16, [8, 8], False, TPGroup())
    full.load_weight("weight", gate, 0)
    full.load_weight("weight", up, 1)
    parts = []
    for rank in RANKS:
        layer = ColumnParallelLinear(16, [8, 8], False, rank)
        layer.load_weight("weight", lazy(gate, tmp_path), 0)
        layer.load_weight("weight", up, 1)
        parts.append(layer(x).split(4, dim=-1))
    expected = full(x)
    torch.testing.assert_close(torch.cat([p[0] for p in parts], -1), expected[:, :8])
    torch.testing.assert_close(torch.cat([p[1] for p in parts], -1), expected[:, 8:])

    down = torch.randn(16, 8)
    row = RowParallelLinear(8, 16, False, TPGroup())
    row.load_weight("weight", down)
    h = torch.randn(3, 8)
    summed = torch.zeros(3, 16)
    for rank in RANKS:
        layer = RowParallelLinear(8, 16, False, rank)
        layer.load_weight("weight", lazy(down, tmp_path))
        summed += layer(h[:, rank.rank * 4 : rank.rank * 4 + 4])
    torch.testing.assert_close(summed, row(h))

    vocab = torch.randn(11, 16)
    ids = torch.tensor([0, 5, 6, 10])
    embed = VocabParallelEmbedding(11, 16, TPGroup())
    embed.load_weight("weight", vocab)
    ranks = [VocabParallelEmbedding(11, 16, rank) for rank in RANKS]
    for layer in ranks:
        layer.load_weight("weight", lazy(vocab, tmp_path))
    torch.testing.assert_close(sum(layer(ids) for layer in ranks), embed(ids))
    logits = torch.cat([layer.logits(x) for layer in ranks], -1)[:, :11]
    torch.testing.assert_close(logits, embed.logits(x))


@torch.no_grad()
def test_qkv_replicates_kv_heads_over_more_ranks() -> None:
    """One KV head, two ranks: each rank gets half the query heads and the whole KV head."""
    q, k, v = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4, 16)
    x = torch.randn(2, 16)
    for rank in RANKS:
        layer = QKVParallelLinear(16, 4, 2, 1, False, rank)
        for shard, tensor in enumerate((q, k, v)):
            layer.load_weight("weight", tensor, shard)
        out_q, out_k, out_v = layer(x).split([4, 4, 4], -1)
        torch.testing.assert_close(out_q, x @ q[rank.rank * 4 : rank.rank * 4 + 4].T)
        torch.testing.assert_close(out_k, x @ k.T)
        torch.testing.assert_close(out_v, x @ v.T)


class _Summing:
    """Stands in for the device backend: 'all-reduces' by doubling, as two equal ranks would."""

    def allreduce(self, tensors: list[torch.Tensor]) -> _Summing:
        tensors[0].mul_(2)
        return self

    def wait(self) -> None:
        return None


class _SmallOnly:
    """Stands in for the one-shot path: takes tensors of up to 4 elements."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        return x * 10 if x.numel() <= 4 else None


def test_all_reduce_takes_the_one_shot_path_only_for_what_it_accepts() -> None:
    small_only = _SmallOnly()
    group = TPGroup(rank=0, size=2, device_group=_Summing(), one_shot=small_only)  # type: ignore[arg-type]
    assert group.all_reduce(torch.ones(4)).tolist() == [10.0] * 4
    assert group.all_reduce(torch.ones(5)).tolist() == [2.0] * 5
    without = TPGroup(rank=0, size=2, device_group=_Summing())
    assert without.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]


class _RecordingKernels:
    """Stands in for FlashInfer's fused all-reduce module: records each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def trtllm_allreduce_fusion(self, *args: object) -> None:
        self.calls.append(args)


def test_fused_add_norm_takes_only_what_its_kernel_accepts() -> None:
    """16-bit, contiguous, hidden a multiple of 8 (16-byte vectors), within `max_bytes`;
    anything else is left to the separate all-reduce and norm. A call passes the one-shot
    residual-add-RMSNorm pattern with the residual updated in place."""
    kernels = _RecordingKernels()
    table, state = torch.zeros(7, dtype=torch.int64), torch.zeros(5, dtype=torch.int32)
    fused = AllReduceAddNorm(kernels, table, state, rank=1, size=2, max_bytes=4096)
    half = torch.bfloat16
    x, residual = torch.ones(2, 1024, dtype=half), torch.ones(2, 1024, dtype=half)
    weight = torch.ones(1024, dtype=half)
    assert fused(x.float(), residual.float(), weight.float(), 1e-6) is None
    too_big = torch.ones(3, 1024, dtype=half)
    assert fused(too_big, too_big.clone(), weight, 1e-6) is None
    odd_hidden = torch.ones(2, 12, dtype=half)
    assert fused(odd_hidden, odd_hidden.clone(), weight[:12], 1e-6) is None
    assert fused(torch.ones(1024, 2, dtype=half).t(), residual, weight, 1e-6) is None
    assert kernels.calls == []
    out = fused(x, residual, weight, 1e-6)
    assert out is not None and out[1] is residual and out[0].shape == x.shape
    (args,) = kernels.calls
    assert args[0] is x and args[1:6] == (2, 1, 2, 1024, table)
    assert args[7] is True and args[10] == RESIDUAL_RMS_NORM  # one-shot, add + RMSNorm
    assert args[12] is residual and args[13] is residual and args[14] is out[0]
    assert args[17] is weight and args[18] == 1e-6


def test_fused_add_norm_workspace_follows_flashinfer_layout() -> None:
    """Data buffer, barrier flags, then three Lamport buffers, each 2 MiB aligned."""
    mib = 1 << 20
    assert workspace_bytes(2, 2 * mib) == (4 + 2 + 12) * mib
    assert workspace_bytes(8, 2 * mib) == (16 + 2 + 48) * mib


def test_one_shot_is_never_opened_on_cpu() -> None:
    from aserve.distributed.one_shot import can_use_one_shot

    assert not can_use_one_shot(2, torch.device("cpu"))


class _FakeOneShot:
    """Opens on rank 0 only; sums like NCCL would, so rank 0 on its own would keep it."""

    closed = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def close(self) -> None:
        _FakeOneShot.closed = True


def test_one_shot_that_opens_on_one_rank_only_leaves_both_on_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every rank reaches the agreement, also the one whose opening failed: the group falls
    back on both ranks (no rank left waiting) and rank 0 releases what it opened."""
    import threading
    from datetime import timedelta

    from aserve.distributed import group as group_module

    def open_on_rank_0(store: object, device_group: object, rank: int, *_: object) -> object:
        if rank != 0:
            raise RuntimeError("no peer access")
        return _FakeOneShot()

    monkeypatch.setattr(group_module.OneShotAllReduce, "open", open_on_rank_0)
    timeout = timedelta(seconds=20)
    store = group_module.create_store(2, timeout)
    results: dict[int, TPGroup] = {}

    def rank_main(rank: int) -> None:
        own = store if rank == 0 else group_module.connect_store(store.port, 2, timeout)
        joined = group_module.join_group(own, rank, 2, torch.device("cpu"), timeout, False)
        results[rank] = group_module._with_one_shot(joined, own, torch.device("cpu"))

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == [0, 1], "a rank did not come back from the agreement"
    assert all(g.one_shot is None for g in results.values())
    assert _FakeOneShot.closed
    for joined in results.values():
        joined.close()


def tp2_llm(tmp_path: Path) -> LLM:
    return LLM(str(make_tiny_model("llama", tmp_path)), tensor_parallel_size=2, **OPTIONS)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_close_leaves_no_child_process(tmp_path: Path) -> None:
    llm = tp2_llm(tmp_path)
    pids = [p.pid for p in llm.runtime.followers.processes]
    assert llm.generate([PROMPTS[0]], GREEDY)[0].finish_reason == "length"
    llm.close()
    assert not any(alive(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


def test_killed_worker_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    llm = tp2_llm(tmp_path)
    try:
        worker = llm.runtime.followers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 .* killed by signal 9"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - started < 10
    finally:
        llm.close()


def test_server_exits_with_one_line_when_a_worker_dies(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path)
    server = ServerProcess(["--model", str(folder), "--tp", "2", "--device", "cpu"])
    try:
        server.wait_ready()
        workers = subprocess.run(
            ["pgrep", "-P", str(server.proc.pid), "-f", "spawn_main"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(workers) == 1
        os.kill(int(workers[0]), signal.SIGKILL)
        assert server.proc.wait(30) == 1
        errors = [line for line in server.log().splitlines() if line.startswith("aserve: error")]
        assert errors == [
            f"aserve: error: tensor-parallel rank 1 (pid {workers[0]}) was killed by signal 9"
        ]
    finally:
        server.stop()


@pytest.mark.parametrize(
    "family", ["qwen3", "embedding-gemma", "xlm-roberta", "modernbert", "nomic-bert"]
)
def test_tp2_embeddings_equal_tp1(tmp_path: Path, family: str) -> None:
    """An embedding server over two ranks: the last token's hidden state is whole after the
    final norm's all-reduce, and rank 1 follows steps that sample nothing; EmbeddingGemma's
    prompts attend both ways on both ranks (the step's spec says so) and pool by the mean
    before their Dense modules; an XLM-RoBERTa encoder's products are sharded as a
    decoder's, its LayerNorms whole on each rank, as are ModernBERT's (its fused QKV and
    GeGLU halves split before they are sharded), as are nomic-bert's (SwiGLU)."""
    from tests.embedding_refs import (
        make_embedding_gemma,
        make_tiny_encoder,
        make_tiny_modern_bert,
        make_tiny_nomic_bert,
    )

    model, prompts = tmp_path, PROMPTS
    if family == "qwen3":
        model = make_tiny_model("qwen3", tmp_path)
    elif family == "embedding-gemma":
        make_embedding_gemma(tmp_path)
    elif family == "modernbert":
        make_tiny_modern_bert(tmp_path)
        prompts = [[t % 120 for t in prompt] for prompt in PROMPTS]
    elif family == "nomic-bert":
        make_tiny_nomic_bert(tmp_path)
        prompts = [[t % 120 for t in prompt] for prompt in PROMPTS]
    else:
        make_tiny_encoder(family, tmp_path)
        prompts = [[t % 120 for t in prompt] for prompt in PROMPTS]  # its vocabulary of 120
    options = {"max_prefill_length": 16, "is_embedding": True, **OPTIONS}
    with (
        LLM(str(model), **options) as one,
        LLM(str(model), tensor_parallel_size=2, **options) as two,
    ):
        assert two.runtime.engine.tp.size == 2
        for ours, theirs in zip(two.embed(prompts), one.embed(prompts), strict=True):
            assert ours.embedding is not None and theirs.embedding is not None
            assert ours.embedding == pytest.approx(theirs.embedding, abs=1e-5)


def test_tp2_classifier_equals_tp1(tmp_path: Path) -> None:
    """A sequence classifier over two ranks: its score layer, whole on each rank, reads the
    whole hidden state."""
    labels = {"id2label": {0: "no", 1: "maybe", 2: "yes"}}
    model = make_tiny_model("qwen3", tmp_path, overrides=labels)
    with (
        LLM(str(model), max_prefill_length=16, **OPTIONS) as one,
        LLM(str(model), max_prefill_length=16, tensor_parallel_size=2, **OPTIONS) as two,
    ):
        for ours, theirs in zip(two.classify(PROMPTS), one.classify(PROMPTS), strict=True):
            assert ours.classification is not None and theirs.classification is not None
            assert ours.classification.probs == pytest.approx(theirs.classification.probs, abs=1e-5)
            assert ours.classification.label == theirs.classification.label


def test_tp2_speculative_decoding_equals_tp1(tmp_path: Path) -> None:
    """Verify steps over two ranks: rank 1 takes the drafted ids from the step's spec (only
    rank 0's host knows them) and records the samples rank 0 broadcasts."""
    model = make_tiny_model("llama", tmp_path, overrides={"num_key_value_heads": 2})
    repeating = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], PROMPTS[0]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True)
    ngram = {"speculative_algorithm": "ngram", "tensor_parallel_size": 2}
    with LLM(str(model), **OPTIONS) as one, LLM(str(model), **ngram, **OPTIONS) as two:
        want, got = one.generate(repeating, params), two.generate(repeating, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for ours, theirs in zip(got, want, strict=True):
            assert ours.logprobs is not None and theirs.logprobs is not None
            assert [lp.logprob for lp in ours.logprobs] == pytest.approx(
                [lp.logprob for lp in theirs.logprobs], abs=1e-4
            )
        assert two.scheduler.planner.accepted_draft_tokens > 0


@pytest.mark.parametrize(
    "architecture",
    [
        "LlavaForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Gemma3ForConditionalGeneration",
    ],
)
def test_tp2_images_equal_tp1(tmp_path: Path, architecture: str) -> None:
    """Images over two ranks: rank 0's tower encodes them and broadcasts their features
    (Qwen3-VL's inner layers' too) to the rows the step's spec names; rank 1 takes the
    M-RoPE positions and Gemma 3's both-ways blocks from the spec. Chunks of 3 cut LLaVA's
    and Qwen's images; a text prompt rides in the same batch."""
    from tests.image_refs import image_prompt
    from tests.tiny_models import make_tiny_vision_language, write_word_tokenizer

    make_tiny_vision_language(architecture, tmp_path)
    gemma = architecture.startswith("Gemma3")
    image_token = 310 if gemma else 300
    newlines = {300 + count: "\n" * count for count in range(1, 5)}  # Gemma 3's frames hold them
    specials = {300: "<image_soft_token>", 315: "<end_of_image>", **newlines} if gemma else None
    write_word_tokenizer(tmp_path, 320, image_token, specials)
    if architecture.startswith("Qwen"):
        import transformers

        processor = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 84)
        processor.save_pretrained(tmp_path)
    elif not gemma:
        import transformers

        crop = {"height": 28, "width": 28}
        transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size=crop).save_pretrained(
            tmp_path
        )
    generator = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 56, 84, generator=generator) for _ in range(2)]
    if gemma:
        images = [torch.randn(3, 28, 28, generator=generator) for _ in range(2)]
    from PIL import Image

    def shown(pixels: torch.Tensor) -> object:
        return pixels if gemma else Image.fromarray((pixels * 255).byte().permute(1, 2, 0).numpy())

    prompts = [
        image_prompt([5, 17, image_token, 99, 4, 250], shown(images[0])),
        PROMPTS[0],
        {
            "prompt_token_ids": [7, image_token, 8, image_token, 9],
            "multi_modal_data": {"image": [shown(images[1]), shown(images[0])]},
        },
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    with (
        LLM(str(tmp_path), max_prefill_length=3, **OPTIONS) as one,
        LLM(str(tmp_path), max_prefill_length=3, tensor_parallel_size=2, **OPTIONS) as two,
    ):
        assert two.runtime.engine.tp.size == 2 and two.runtime.engine.images is not None
        got, want = two.generate(prompts, params), one.generate(prompts, params)
        assert all(o.error is None for o in got + want)
        assert_same_generations(got, want)
