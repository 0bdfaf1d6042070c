"""LoRA adapters: PEFT's layout read, many adapters in one batch, each request's output that of
its adapter merged into the base weights (the reference: `W + scaling * B A`, written as a
checkpoint of its own), the base model's rows untouched, prefix caches kept apart."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve import LLM, SamplingParams
from aserve.cli import parse_config
from aserve.config import ConfigError, build_config, lora_module_pairs
from aserve.engine.step import StepSpec
from aserve.forward import ForwardMode
from aserve.lora.adapter import read_adapter
from aserve.scheduler.request import Req
from tests.server_utils import ServerProcess, cache_sharing_kernels, serving
from tests.tiny_models import make_tiny_model, write_word_tokenizer

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPTIONS = {"device": "cpu", "dtype": "float32", "num_pages": 1024}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 12, 250, 31, 8], [300, 4, 4, 61], list(range(3, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)


def write_adapter(
    base: Path,
    folder: Path,
    targets: tuple[str, ...] = ALL_TARGETS,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 1,
    rslora: bool = False,
    config: dict[str, object] | None = None,
) -> dict[str, torch.Tensor]:
    """A random adapter of `base` (every layer's `targets`) in PEFT's layout; returns each
    targeted weight's change `scaling * B @ A`, by checkpoint weight name."""
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    tensors, deltas = {}, {}
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] not in targets:
            continue
        out, inputs = weight.shape
        a = torch.randn(rank, inputs, generator=generator) * 0.2
        b = torch.randn(out, rank, generator=generator) * 0.2
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        deltas[name] = scaling * b @ a
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": str(base),
        **(config or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return deltas


def write_merged(base: Path, folder: Path, deltas: dict[str, torch.Tensor]) -> Path:
    """`base` with each weight in `deltas` changed by it: the adapter merged."""
    shutil.copytree(base, folder)
    weights = load_file(str(base / "model.safetensors"))
    for name, delta in deltas.items():
        weights[name] = weights[name] + delta
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def assert_same(got: list, expected: list, tolerance: float = 1e-4) -> None:
    """Same greedy tokens; logprobs equal up to float32 rounding (merged weights round
    differently from the adapter's separate product)."""
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=tolerance)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama, two adapters of it (all seven projections at rank 8; only Q and V at
    rank 4 with rsLoRA) and each merged into a checkpoint of its own."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model("llama", root / "base")
    every = write_adapter(base, root / "every")
    qv = write_adapter(base, root / "qv", ("q_proj", "v_proj"), rank=4, seed=2, rslora=True)
    return {
        "base": base,
        "every": root / "every",
        "qv": root / "qv",
        "every_merged": write_merged(base, root / "every_merged", every),
        "qv_merged": write_merged(base, root / "qv_merged", qv),
    }


@pytest.fixture(scope="module")
def served(llama: dict[str, Path]) -> LLM:
    """The base model with both adapters, prompts over 16 tokens prefilled in chunks."""
    adapters = {"every": str(llama["every"]), "qv": str(llama["qv"])}
    llm = LLM(str(llama["base"]), lora_modules=adapters, max_prefill_length=16, **OPTIONS)
    yield llm
    llm.close()


def test_each_adapter_generates_as_its_merged_twin(
    llama: dict[str, Path], served: LLM, make_llm: Callable[..., LLM]
) -> None:
    for name in ("every", "qv"):
        twin = make_llm(llama[f"{name}_merged"], max_prefill_length=16, **OPTIONS)
        assert_same(served.generate(PROMPTS, GREEDY, lora=name), twin.generate(PROMPTS, GREEDY))


def test_adapters_and_the_base_model_mixed_in_one_batch(
    llama: dict[str, Path], served: LLM, make_llm: Callable[..., LLM]
) -> None:
    """Rows of two adapters and of the base model decode together, each as it does alone;
    the base rows exactly as a server without adapters gives them."""
    plain = make_llm(llama["base"], max_prefill_length=16, **OPTIONS)
    base = plain.generate(PROMPTS, GREEDY)
    adapters = ["every", None, "qv", None, "every", "qv"]
    prompts = [PROMPTS[i % 3] for i in range(len(adapters))]
    mixed = served.generate(prompts, GREEDY, lora=adapters)
    for prompt, adapter, got in zip(prompts, adapters, mixed, strict=True):
        alone = served.generate([prompt], GREEDY, lora=adapter)
        assert_same([got], alone)
        if adapter is None:
            assert got.token_ids == base[PROMPTS.index(prompt)].token_ids
    assert [o.token_ids for o in mixed[:3]] != [o.token_ids for o in base[:3]]


def test_prefix_cache_is_shared_only_within_an_adapter(served: LLM) -> None:
    """The same prompt under another adapter (or none) takes nothing from the cache; the
    same adapter again takes its own cached prefix, and the same tokens."""
    prompt = [list(range(100, 140))]
    planner = served.scheduler.planner

    def run(adapter: str | None) -> tuple[list, int]:
        before = planner.prompt_tokens_cached
        out = served.generate(prompt, GREEDY, lora=adapter)
        return out, planner.prompt_tokens_cached - before

    every, hit = run("every")
    assert hit == 0
    assert [run(adapter)[1] for adapter in (None, "qv")] == [0, 0]
    again, hit = run("every")
    assert hit > 0
    assert_same(again, every)
    assert run(None)[1] > 0
    req = Req(rid=0, prompt_ids=[], params=GREEDY, seed=0)
    keys = set()
    for adapter in range(3):
        req.adapter_key = adapter
        keys.add(tuple(req.cache_key([7, 8])))
    assert len(keys) == 3 and (7, 8) in keys


def test_tp2_adapters_equal_tp1(llama: dict[str, Path], served: LLM) -> None:
    """Two gloo ranks: column-parallel layers keep their rank's rows of B, row-parallel ones
    their rank's columns of A; a mixed batch gives the one-rank tokens."""
    adapters = {"every": str(llama["every"]), "qv": str(llama["qv"])}
    names = ["every", None, "qv"]
    with LLM(
        str(llama["base"]),
        lora_modules=adapters,
        max_prefill_length=16,
        tensor_parallel_size=2,
        **OPTIONS,
    ) as two:
        expected = served.generate(PROMPTS, GREEDY, lora=names)
        assert_same(two.generate(PROMPTS, GREEDY, lora=names), expected)


def test_tokens_of_unknown_adapters_are_refused(served: LLM) -> None:
    with pytest.raises(ValueError, match="no LoRA adapter 'nope'"):
        served.generate(PROMPTS[:1], GREEDY, lora="nope")
    with pytest.raises(ValueError, match="2 adapters for 1 prompts"):
        served.generate(PROMPTS[:1], GREEDY, lora=["every", None])


def test_fused_checkpoint_names_and_partial_rotation(
    tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """Phi-3 stores Q, K and V (and gate and up) fused, and rotates part of each head (its
    rows reordered at load): an adapter on its fused projections matches its merged twin."""
    base = make_tiny_model("phi3", tmp_path / "base")
    deltas = write_adapter(base, tmp_path / "adapter", ("qkv_proj", "o_proj", "gate_up_proj"))
    twin = make_llm(write_merged(base, tmp_path / "merged", deltas), **OPTIONS)
    llm = make_llm(base, lora_modules={"fused": str(tmp_path / "adapter")}, **OPTIONS)
    assert_same(llm.generate(PROMPTS, GREEDY, lora="fused"), twin.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize(
    "family",
    ["qwen2", "qwen3", "gemma3", "gemma2", "granite", "olmo2", "smollm3", "glm4", "qwen3_moe"],
)
def test_each_family_generates_as_its_merged_twin(
    tmp_path: Path, make_llm: Callable[..., LLM], family: str
) -> None:
    """The families' differences around the projections (Qwen2's QKV bias, Qwen3's Q/K norms,
    Gemma's sandwich norms and GELU, Granite's multipliers, OLMo 2's post norms, GLM-4's
    fused gate|up, attention beside Qwen3-MoE's experts) leave an adapter's tokens those of
    its merged twin."""
    base = make_tiny_model(family, tmp_path / "base")
    targets = (*ALL_TARGETS, "gate_up_proj")
    if family == "qwen3_moe":  # experts take none (refused): attention takes the adapter
        targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    deltas = write_adapter(base, tmp_path / "adapter", targets, alpha=4.0)
    assert deltas
    twin = make_llm(write_merged(base, tmp_path / "merged", deltas), **OPTIONS)
    llm = make_llm(base, lora_modules={"a": str(tmp_path / "adapter")}, **OPTIONS)
    assert_same(llm.generate(PROMPTS, GREEDY, lora="a"), twin.generate(PROMPTS, GREEDY))


def test_adapter_on_a_quantized_base(llama: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    """On int8 base weights (the CPU kernels, their C++ decode layers for base-only steps)
    an adapter's tokens follow its merged twin's, as the int8 model follows the float one."""
    quantized = make_llm(
        llama["base"], quantization="int8", lora_modules={"every": str(llama["every"])}, **OPTIONS
    )
    twin = make_llm(llama["every_merged"], **OPTIONS)
    pairs = [
        (a.token_ids, b.token_ids)
        for a, b in zip(
            quantized.generate(PROMPTS, GREEDY, lora="every"), twin.generate(PROMPTS, GREEDY)
        )
    ]
    assert sum(a[:2] == b[:2] for a, b in pairs) >= 2, pairs
    base = make_llm(llama["base"], quantization="int8", **OPTIONS).generate(PROMPTS, GREEDY)
    plain = quantized.generate(PROMPTS, GREEDY)  # the base rows through the C++ layers
    assert [o.token_ids for o in plain] == [o.token_ids for o in base]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "trained biases"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_unsupported_adapter_settings_are_refused(
    llama: dict[str, Path], tmp_path: Path, change: dict[str, object], message: str
) -> None:
    write_adapter(llama["base"], tmp_path / "a", ("q_proj",), config=change)
    with pytest.raises(ConfigError, match=message):
        read_adapter("a", tmp_path / "a")


def test_unusable_adapters_are_refused_at_start(llama: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no adapter_config.json"):
        read_adapter("a", tmp_path / "missing")
    write_adapter(llama["base"], tmp_path / "big", ("q_proj",), rank=8)
    with pytest.raises(ConfigError, match="rank 8, over --max-lora-rank 4"):
        read_adapter("big", tmp_path / "big", max_rank=4)
    other = make_tiny_model("llama", tmp_path / "wide", overrides={"hidden_size": 96})
    write_adapter(other, tmp_path / "other", ("o_proj",))
    with pytest.raises(ConfigError, match="an adapter of another model"):
        LLM(str(llama["base"]), lora_modules={"o": str(tmp_path / "other")}, **OPTIONS)
    embedding = tmp_path / "embedding"
    write_adapter(llama["base"], embedding, ("q_proj",))
    tensors = load_file(str(embedding / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 320)
    save_file(tensors, str(embedding / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="not a LoRA matrix of a linear layer"):
        read_adapter("e", embedding)


def test_adapters_on_experts_are_refused(tmp_path: Path) -> None:
    base = make_tiny_model("qwen3_moe", tmp_path / "moe", overrides={"mlp_only_layers": []})
    write_adapter(base, tmp_path / "experts", ("gate_proj",))
    with pytest.raises(ConfigError, match="attention's and dense MLPs' projections do"):
        LLM(str(base), lora_modules={"x": str(tmp_path / "experts")}, **OPTIONS)


@pytest.mark.parametrize("target", ["q_proj", "kv_b_proj"])
def test_adapters_on_latent_attention_projections_are_refused(tmp_path: Path, target: str) -> None:
    """DeepSeek's query rows load reordered and `kv_b_proj` as heads' slices: an adapter
    there is refused in one line (its o_proj takes them)."""
    base = make_tiny_model("deepseek_v2", tmp_path / "deepseek")
    write_adapter(base, tmp_path / "latent", (target,))
    with pytest.raises(ConfigError, match=f"latent attention's {target} are not supported"):
        LLM(str(base), lora_modules={"x": str(tmp_path / "latent")}, **OPTIONS)
    write_adapter(base, tmp_path / "output", ("o_proj",))
    with LLM(str(base), lora_modules={"x": str(tmp_path / "output")}, **OPTIONS) as llm:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 17, 42]], params)[0].token_ids) == 4


def test_lora_options() -> None:
    config, _ = parse_config(
        ["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--max-lora-rank", "32"]
    )
    assert config.engine.lora_modules == (("a", "/x"), ("b", "/y"))
    assert config.engine.max_lora_rank == 32
    config, _ = parse_config(["--enable-lora", "--lora-paths", "c=/z"])
    assert config.engine.lora_modules == (("c", "/z"),)
    assert lora_module_pairs({"d": "/w"}) == (("d", "/w"),)
    own_names = (
        ["--lora-modules", "SmolLM2-135M-Instruct=/x"],
        ["--served-model-name", "m", "--lora-modules", "m=/x"],
    )
    for argv in own_names:  # the embedded model's name, or the served one
        with pytest.raises(SystemExit):
            parse_config(argv)
    with pytest.raises(ConfigError, match="takes the model's own name"):
        build_config(served_model_name="m", lora_modules=["m=/x"])
    for bad, message in [
        (["x"], "NAME=PATH"),
        (["a=/x", "a=/y"], "twice"),
        (['{"name": 3}'], '"name" and "path"'),
        (["{oops"], "not valid JSON"),
    ]:
        with pytest.raises(ConfigError, match=message):
            lora_module_pairs(bad)


def test_step_spec_carries_adapters() -> None:
    spec = StepSpec(
        mode=ForwardMode.PREFILL,
        rows=[3, 0],
        prefix_lens=[0, 0],
        extend_lens=[2, 3],
        scored=[0, 0],
        input_ids=[11, 12, 21, 22, 23],
        page_writes=[],
        adapters=[2, 0],
    )
    assert StepSpec.unpack(spec.pack()) == spec


@pytest.fixture(scope="module")
def server(
    llama: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    write_word_tokenizer(llama["base"], 320)
    cache = cache_sharing_kernels(tmp_path_factory.mktemp("cache"))
    args = ["--model", str(llama["base"]), "--served-model-name", "tiny", "--device", "cpu"]
    args += ["--lora-modules", f"every={llama['every']}", f"qv={llama['qv']}"]
    yield from serving(ServerProcess(args, env={"ASERVE_CACHE_DIR": str(cache)}))


async def _requests(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession() as session:

        async def one(body: dict) -> tuple[int, dict]:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                return response.status, await response.json()

        return list(await asyncio.gather(*(one(body) for body in bodies)))


def test_requests_name_their_adapter_as_the_model(server: ServerProcess, served: LLM) -> None:
    """Over HTTP, concurrent requests of each adapter and of the model get the offline API's
    tokens for their adapter, and replies name it; /v1/models lists the adapters as vLLM
    does; an unknown name is a 400."""

    async def models() -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.base_url}/v1/models") as response:
                return await response.json()

    cards = asyncio.run(models())["data"]
    assert [card["id"] for card in cards] == ["tiny", "every", "qv"]
    assert cards[1]["parent"] == "tiny" and cards[1]["root"].endswith("every")
    names = ["every", "tiny", "qv", None, "every"]
    bodies = [
        {"prompt": PROMPTS[i % 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        | ({"model": name} if name else {})
        | {"return_token_ids": True}
        for i, name in enumerate(names)
    ]
    replies = asyncio.run(_requests(server.base_url, bodies))
    for i, (name, (status, reply)) in enumerate(zip(names, replies, strict=True)):
        assert status == 200, reply
        assert reply["model"] == (name or "tiny")
        adapter = None if name in (None, "tiny") else name
        expected = served.generate([PROMPTS[i % 3]], GREEDY, lora=adapter)[0].token_ids
        assert reply["choices"][0]["token_ids"] == expected
    ((status, reply),) = asyncio.run(_requests(server.base_url, [{"model": "nope", "prompt": [5]}]))
    assert status == 400 and reply["error"]["code"] == "model_not_found"
    assert "'tiny', 'every', 'qv'" in reply["error"]["message"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 needs compute capability 8.9 or newer",
)
KERNEL_SHAPES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama of heads of 64 (the GPU kernels' sizes), an adapter and its twin."""
    root = tmp_path_factory.mktemp("wide")
    base = make_tiny_model("llama", root / "base", overrides=KERNEL_SHAPES | {"head_dim": 64})
    deltas = write_adapter(base, root / "every", alpha=2.0)
    return {
        "base": base,
        "every": root / "every",
        "every_merged": write_merged(base, root / "every_merged", deltas),
    }


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapters_on_the_gpu(
    wide_llama: dict[str, Path], make_llm: Callable[..., LLM], dtype: str
) -> None:
    """On CUDA (in bf16 FlashInfer, the one-row GEMV and CUDA graphs, those with adapter rows
    graphs of their own): an adapter's logprobs as its merged twin's, and the base rows of a
    mixed batch as the model alone (its plain graphs) gives them."""
    options = {"device": "cuda", "dtype": dtype, "page_size": 16, "num_pages": 512}
    adapters = {"every": str(wide_llama["every"])}
    llm = make_llm(wide_llama["base"], lora_modules=adapters, **options)
    if dtype == "bfloat16":  # float32 decodes on the torch backend, without graphs
        graphs = llm.runtime.engine.graphs
        assert graphs is not None and graphs.adapter_graphs.keys() == graphs.graphs.keys()
    twin = make_llm(wide_llama["every_merged"], **options)
    tolerance = {"abs": 1e-3} if dtype == "float32" else {"abs": 0.05, "rel": 0.05}
    ours = llm.generate(PROMPTS, GREEDY, lora="every")
    theirs = twin.generate(PROMPTS, GREEDY)
    if dtype == "float32":
        assert_same(ours, theirs, tolerance["abs"])
    else:  # rounding may part the greedy paths late: compare while they agree
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_ids[:2] == b.token_ids[:2]
            pairs = zip(a.token_ids, b.token_ids, strict=True)
            agree = next((i for i, (x, y) in enumerate(pairs) if x != y), len(a.token_ids))
            for x, y in zip(a.logprobs[:agree], b.logprobs[:agree]):
                assert x.logprob == pytest.approx(y.logprob, **tolerance)
    alone = llm.generate(PROMPTS, GREEDY)
    mixed = llm.generate(PROMPTS * 2, GREEDY, lora=[None] * 3 + ["every"] * 3)
    for a, b in zip(mixed[:3], alone, strict=True):
        assert a.token_ids[:4] == b.token_ids[:4]
        for x, y in zip(a.logprobs[:4], b.logprobs[:4]):
            assert x.logprob == pytest.approx(y.logprob, **tolerance)


@pytest.mark.gpu
@needs_fp8
def test_adapter_on_fp8_weights(wide_llama: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    """`--quantization fp8` with an adapter: the norms keep bf16 rows for the adapters, the
    adapter's first tokens follow its bf16 twin's, and the base rows still take the FP8 path."""
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 512}
    adapters = {"every": str(wide_llama["every"])}
    fp8 = make_llm(wide_llama["base"], quantization="fp8", lora_modules=adapters, **options)
    twin = make_llm(wide_llama["every_merged"], **options)
    ours = fp8.generate(PROMPTS, GREEDY, lora="every")
    theirs = twin.generate(PROMPTS, GREEDY)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(ours, theirs)) >= 2
    plain = make_llm(wide_llama["base"], quantization="fp8", **options).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in fp8.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain]


def test_native_generate_takes_sglangs_lora_path(server: ServerProcess, served: LLM) -> None:
    """SGLang's /generate: `lora_path` names the adapter of every prompt or of each (null:
    the model); an unknown one is a 400 naming the field."""

    async def generate(body: dict) -> tuple[int, object]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.base_url}/generate", json=body) as response:
                return response.status, await response.json()

    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, replies = asyncio.run(
        generate(
            {"input_ids": PROMPTS, "sampling_params": sampling, "lora_path": ["qv", None, "every"]}
        )
    )
    assert status == 200, replies
    expected = served.generate(PROMPTS, GREEDY, lora=["qv", None, "every"])
    assert [r["output_ids"] for r in replies] == [o.token_ids for o in expected]
    status, reply = asyncio.run(
        generate({"input_ids": PROMPTS[0], "sampling_params": sampling, "lora_path": "every"})
    )
    assert reply["output_ids"] == served.generate(PROMPTS[:1], GREEDY, lora="every")[0].token_ids
    status, reply = asyncio.run(generate({"input_ids": [5], "lora_path": "nope"}))
    assert status == 400 and reply["error"]["param"] == "lora_path"


@pytest.mark.parametrize(("parts", "rank", "tokens"), [(3, 16, 5), (1, 8, 1), (2, 32, 3)])
def test_gathered_kernels_equal_the_dense_products(parts: int, rank: int, tokens: int) -> None:
    """The Triton shrink and expand (each token its own adapter's matrices; on CPU under
    Triton's interpreter) against the dense form: a one-hot over every adapter's product.
    Tokens of no adapter keep the base output bit for bit."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
    from aserve.lora.layers import LoraRows, LoraWeights
    from aserve.lora.triton_ops import add_lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(parts * rank)
    slots, k = 3, 1100  # the shrink's inputs in 3 splits of 512 for rank 16
    sizes = [96, 32, 32][:parts]
    offsets = [sum(sizes[:i]) for i in range(parts)]
    a = torch.randn(parts * slots * rank, k, generator=generator).half().to(device)
    b = torch.randn(sum(sizes), slots, rank, generator=generator).half().to(device)
    x = torch.randn(tokens, k, generator=generator).half().to(device)
    y = torch.randn(tokens, sum(sizes), generator=generator).half().to(device)
    ids = torch.tensor([2, 0, 3, 1, 0][:tokens], device=device)
    rows = LoraRows(slots, torch.float32, device)
    rows.begin(ids)
    dense = LoraWeights(rows, a.float(), b.float(), offsets).add_to(y.float(), x.float())
    got = add_lora(y.clone(), x, ids, a, b, offsets)
    torch.testing.assert_close(got.float(), dense, atol=2e-2, rtol=2e-3)
    plain = ids == 0
    assert torch.equal(got[plain], y[plain])
    assert not torch.equal(got[~plain], y[~plain])


@pytest.fixture(scope="module")
def roomy_server(
    llama: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server with room for two adapters (`--enable-lora --max-loras 2`), one taken at
    start."""
    write_word_tokenizer(llama["base"], 320)
    cache = cache_sharing_kernels(tmp_path_factory.mktemp("roomy"))
    args = ["--model", str(llama["base"]), "--served-model-name", "tiny", "--device", "cpu"]
    args += ["--enable-lora", "--max-loras", "2", "--lora-modules", f"every={llama['every']}"]
    yield from serving(ServerProcess(args, env={"ASERVE_CACHE_DIR": str(cache)}))


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as response:
            return response.status, await response.json()


def test_adapters_load_and_unload_at_run_time(
    roomy_server: ServerProcess, server: ServerProcess, served: LLM, llama: dict[str, Path]
) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (and SGLang's paths): a
    loaded adapter serves its tokens (those of the same adapter given at start elsewhere);
    a full server, a taken name, an unknown one and a server without --enable-lora are
    refused; an unloaded adapter's name is a 400, and an adapter loaded into its slot after
    takes nothing of its prefix cache."""
    url = roomy_server.base_url

    def post(path: str, body: dict) -> tuple[int, dict]:
        return asyncio.run(_post(url + path, body))

    def tokens(model: str) -> list[int]:
        body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        status, reply = post("/v1/completions", body)
        assert status == 200, reply
        return reply["choices"][0]["token_ids"]

    expected = {
        name: served.generate([PROMPTS[2]], GREEDY, lora=name)[0].token_ids
        for name in ("every", "qv")
    }
    assert tokens("every") == expected["every"]
    qv = {"lora_name": "qv", "lora_path": str(llama["qv"])}
    status, reply = post("/v1/load_lora_adapter", qv)
    assert status == 200 and set(reply["loaded_adapters"]) == {"every", "qv"}, reply
    assert tokens("qv") == expected["qv"]  # its prompt's KV now cached under its key
    third = {"lora_name": "more", "lora_path": str(llama["every"])}
    status, reply = post("/load_lora_adapter", third)
    assert status == 400 and "slots are taken" in reply["error"]["message"]
    status, reply = post("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": "/x"})
    assert status == 400 and "loaded already" in reply["error"]["message"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "nope"})[0] == 404
    status, reply = post("/unload_lora_adapter", {"lora_name": "qv"})
    assert status == 200 and set(reply["loaded_adapters"]) == {"every"}
    status, reply = post("/v1/completions", {"model": "qv", "prompt": [5], "max_tokens": 1})
    assert status == 400 and reply["error"]["code"] == "model_not_found"
    # the every adapter again, in qv's old slot: nothing of qv's cached prompt is taken
    assert post("/v1/load_lora_adapter", third)[0] == 200
    assert tokens("more") == expected["every"]
    status, reply = asyncio.run(_post(server.base_url + "/v1/load_lora_adapter", third))
    assert status == 400 and "--enable-lora" in reply["error"]["message"]


def test_a_request_whose_adapter_went_is_refused(
    llama: dict[str, Path], served: LLM, make_llm: Callable[..., LLM]
) -> None:
    """A request made for an adapter that is unloaded before its submission fails there; an
    adapter put into the emptied slot has a key of its own (and its tokens)."""
    every = {"every": str(llama["every"])}
    llm = make_llm(llama["base"], enable_lora=True, max_loras=2, lora_modules=every, **OPTIONS)
    slots = llm.runtime.engine.adapters
    assert slots is not None and slots.rank == 16
    assert len(slots.layers) == 2 * 4  # qkv, o, gate|up and down of both layers
    key = slots.names["every"]
    req = llm.scheduler.make_request(PROMPTS[0], GREEDY, None, key)
    assert llm.scheduler.check_request(req) is None
    slots.remove("every")
    assert llm.scheduler.check_request(req) == "the LoRA adapter of this request has been unloaded"
    with pytest.raises(ValueError, match="unloaded"):
        llm.scheduler.make_request(PROMPTS[0], GREEDY, None, key)
    again = slots.place(read_adapter("again", llama["every"]))
    assert again != key and slots.slot_of(again) == req.adapter
    assert llm.scheduler.check_request(req) is not None
    expected = served.generate(PROMPTS, GREEDY, lora="every")
    assert_same(llm.generate(PROMPTS, GREEDY, lora="again"), expected)
    with pytest.raises(ConfigError, match="rank 32; this server holds rank 16"):
        write_adapter(llama["base"], llama["base"].parent / "wide_rank", ("o_proj",), rank=32)
        slots.place(read_adapter("wide", llama["base"].parent / "wide_rank"))
