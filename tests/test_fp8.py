"""FP8 weights (`--quantization fp8`) and the FP8 KV cache (`--kv-cache-dtype fp8_e4m3`): the
product against float64, the pool's rounding, saturation, scales and size, the torch
attention backend reading it (the reference the GPU kernels are checked against), and models
run end to end. Users get FP8 on FP8 GPUs only; these tests run the same code on the CPU (its
`torch._scaled_mm` is a reference implementation) by lifting that guard."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.engine import engine as engine_module
from aserve.kvcache.pool import FP8_MAX, KVPool
from aserve.quant.fp8 import Fp8Weight, quantize_rows
from tests.test_quant import (
    TINY_PROMPTS,
    assert_dequantized_generates_as,
    assert_refused_in_one_line,
    first_differences,
    first_tokens_agreeing,
)
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

    pool.set_scales(1, 4.0, 0.5)
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


def test_widened_prefill_copies_the_steps_pages_exactly() -> None:
    """FlashInfer's prefill over an FP8 pool reads a copy of the step's pages in bf16 (the
    kernel itself is test_fp8_gpu.py's): the pages in the plan's order, K and V apart, each
    FP8 byte's value exactly (e4m3 values are bfloat16 values), the pool untouched."""
    from aserve.attention.flashinfer import WidenedPrefill

    pool = KVPool(1, 6, 4, 2, 8, torch.bfloat16, CPU, FP8)
    every_slot = torch.arange(24)
    pool.store(0, every_slot, torch.randn(24, 2, 2, 8, generator=torch.Generator().manual_seed(1)))
    before = pool.kv[0].clone()
    order = torch.tensor([4, 0, 5], dtype=torch.int32)
    k, v = WidenedPrefill(None, order).widen(pool.kv[0], 4, torch.bfloat16)
    assert k.shape == v.shape == (3, 4, 2, 8) and k.dtype == torch.bfloat16
    for position, page in enumerate(order.tolist()):
        slots = pool.kv[0][page * 4 : (page + 1) * 4].float()
        assert torch.equal(k[position].float(), slots[:, 0])
        assert torch.equal(v[position].float(), slots[:, 1])
    assert torch.equal(pool.kv[0].view(torch.uint8), before.view(torch.uint8))


def fp8_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift the FP8-hardware guard: the CPU then runs the torch reference path."""
    monkeypatch.setattr(engine_module, "require_fp8_gpu", lambda device, option: None)


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
    # vLLM's name for the same cache
    fresh = make_llm(folder, num_pages=512, kv_cache_dtype="fp8", attention_backend="torch")
    uncached = [o.token_ids for o in fresh.generate(longer, greedy)]
    assert again == uncached


def test_fp8_refused_without_fp8_hardware(tmp_path: Path) -> None:
    """On a CPU (and on GPUs older than compute capability 8.9) either option is one line."""
    folder = make_tiny_model("llama", tmp_path / "llama")
    for option, value in (
        ("--kv-cache-dtype", "fp8_e4m3"),
        ("--kv-cache-dtype", "fp8"),
        ("--quantization", "fp8"),
    ):
        assert_refused_in_one_line(
            folder,
            ["--device", "cpu", option, value],
            f"{option} {value} needs a GPU with FP8",
            tmp_path / "cache",
        )


@pytest.mark.parametrize("outputs", [96, 90], ids=["fp8-gemm", "unaligned"])
def test_fp8_product_matches_float64(outputs: int) -> None:
    """Per-row weight scales and per-token activation scales: within a tenth of the largest
    output of the float64 product (e4m3 keeps 3 mantissa bits: each factor is off by up to
    1/16, and the errors average out over the inputs); rows whose size the FP8 GEMM does not
    take run de-quantized. A token's scale is its own: alone it gets the same result, up to
    the order of float sums."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(outputs, 128, generator=generator) * 0.05
    bias = torch.randn(outputs, generator=generator)
    x = torch.randn(7, 128, generator=generator)
    x[3] *= 100  # a token of large activations: its scale is its own
    product = Fp8Weight(quantize_rows(weight), CPU)
    assert product.values.dtype == FP8 and product.aligned == (outputs % 16 == 0)
    assert product.nbytes == outputs * 128 + outputs * 4
    exact = x.double() @ weight.double().T + bias.double()
    out = product.linear(x, bias)
    for token in range(7):
        torch.testing.assert_close(
            out[token].double(),
            exact[token],
            rtol=0,
            atol=0.1 * float((exact[token] - bias.double()).abs().max()),
        )
        alone = product.linear(x[token : token + 1], bias)[0]
        torch.testing.assert_close(alone, out[token], rtol=1e-5, atol=1e-5)


def test_fp8_weights_run_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_llm: Callable[..., LLM]
) -> None:
    """A tiny Llama (sizes multiples of 16) quantized to FP8 at load: its linear layers take a
    quarter of their float32 bytes, and the first greedy token agrees with the float model's
    on most prompts (random weights make near-ties); dummy weights quantize too."""
    fp8_on_cpu(monkeypatch)
    folder = make_tiny_model("llama", tmp_path / "llama")
    fp8 = make_llm(folder, num_pages=256, quantization="fp8")
    reference = make_llm(folder, num_pages=256)
    layer = fp8.runtime.engine.model.model.layers[0].mlp.gate_up_proj
    (product,) = layer.quantized.products
    assert isinstance(product, Fp8Weight) and product.aligned
    assert product.values.nbytes == product.shape[0] * product.shape[1]  # a byte a weight
    assert fp8.runtime.engine.weight_bytes < reference.runtime.engine.weight_bytes
    agree, pairs = first_tokens_agreeing(fp8, reference, max_tokens=8)
    print(f"\nfp8: first greedy token agrees on {agree} of 6 prompts")
    assert agree >= 4, pairs
    dummy = make_llm(folder, num_pages=256, dummy_weight=True, quantization="fp8")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(dummy.generate(TINY_PROMPTS[0], greedy)[0].token_ids) == 8


LINEAR = ("_proj.weight",)
LAYOUTS: dict[str, tuple[str, str, str]] = {
    "fp8-block": ("fp8", "block", "weight_scale_inv"),
    "fp8-tensor": ("fp8", "tensor", "weight_scale"),
    "fbgemm-channel": ("fbgemm_fp8", "channel", "weight_scale"),
    "compressed-channel": ("compressed-tensors", "channel", "weight_scale"),
    "compressed-tensor": ("compressed-tensors", "tensor", "weight_scale"),
    "compressed-block": ("compressed-tensors", "block", "weight_scale"),
    "compressed-group": ("compressed-tensors", "group", "weight_scale"),
}
"""Published FP8 layouts: (quant_method, what one scale covers, the scale's tensor name)."""


def write_fp8_checkpoint(
    float_folder: Path, fp8_folder: Path, twin_folder: Path, layout: str = "fp8-block"
) -> None:
    """The float checkpoint's linear weights as a published FP8 checkpoint in `layout`
    (`LAYOUTS`): float8_e4m3fn values with a scale per 32x32 block (Qwen3-FP8's
    `weight_scale_inv`, or compressed-tensors' block strategy), per tensor (a scalar for
    "fp8", one element for compressed-tensors), per row (`[rows, 1]`: Meta's fbgemm_fp8,
    compressed-tensors' channel strategy, the latter in bfloat16 as llm-compressor stores
    them) or per 32 columns of a row (compressed-tensors' group strategy), and the
    config's `quantization_config` as each publisher writes it; a static `input_scale` too,
    which aserve drops. `twin_folder` gets the float checkpoint whose weights are exactly
    the FP8 ones de-quantized."""
    from safetensors.torch import load_file, save_file

    method, covers, scale_name = LAYOUTS[layout]
    tensors = load_file(str(float_folder / "model.safetensors"))
    fp8_tensors: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not name.endswith(LINEAR):
            fp8_tensors[name] = twin[name] = tensor
            continue
        rows, cols = tensor.shape
        b0, b1 = {"block": (32, 32), "group": (1, 32), "channel": (1, cols)}.get(
            covers, (rows, cols)
        )
        blocks = tensor.unflatten(0, (-1, b0)).unflatten(2, (-1, b1))
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        if layout == "compressed-channel":
            scale = scale.bfloat16()
        full = scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        values = (tensor / full).to(FP8)
        base = name.removesuffix(".weight")
        fp8_tensors[name] = values
        fp8_tensors[f"{base}.{scale_name}"] = (
            scale.reshape(())
            if layout == "fp8-tensor"
            else (scale.reshape(1) if covers == "tensor" else scale)
        )
        fp8_tensors[f"{base}.input_scale"] = torch.tensor(1.0)
        twin[name] = values.float() * full
    for folder, contents in ((fp8_folder, fp8_tensors), (twin_folder, twin)):
        folder.mkdir()
        save_file(contents, str(folder / "model.safetensors"))
        config = json.loads((float_folder / "config.json").read_text())
        if folder == fp8_folder:
            config["quantization_config"] = published_quantization_config(method, covers)
        (folder / "config.json").write_text(json.dumps(config))


def published_quantization_config(method: str, covers: str) -> dict[str, object]:
    """`quantization_config` as the publishers of `LAYOUTS` write it."""
    if method == "fp8":
        block = {"weight_block_size": [32, 32]} if covers == "block" else {}
        return {"quant_method": "fp8", "activation_scheme": "dynamic", **block}
    if method == "fbgemm_fp8":
        return {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        }
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": covers,
        "block_structure": [32, 32] if covers == "block" else None,
        "group_size": 32 if covers == "group" else None,
    }
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


@pytest.mark.parametrize(
    ("family", "layout"),
    [("llama", layout) for layout in LAYOUTS]
    + [
        ("qwen3_moe", "fp8-block"),
        ("qwen3_moe", "fp8-tensor"),
        ("qwen3_moe", "compressed-channel"),
    ],
)
def test_fp8_checkpoint_loads_as_published(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_llm: Callable[..., LLM],
    family: str,
    layout: str,
) -> None:
    """An FP8 checkpoint in each published layout runs in FP8, MoE experts included (first
    greedy tokens as its de-quantized float twin on most prompts); with `--quantization
    none` it loads de-quantized and generates exactly the twin's tokens; a weight without
    its scale is a clear error."""
    from safetensors.torch import load_file, save_file

    fp8_on_cpu(monkeypatch)
    float_folder = make_tiny_model(family, tmp_path / "float")
    fp8_folder, twin_folder = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(float_folder, fp8_folder, twin_folder, layout)
    fp8 = make_llm(fp8_folder, num_pages=256)
    twin = make_llm(twin_folder, num_pages=256)
    assert fp8.runtime.model_config.quantization == "fp8"
    (product,) = fp8.runtime.engine.model.model.layers[1].self_attn.o_proj.quantized.products
    assert isinstance(product, Fp8Weight)
    if family == "qwen3_moe":
        experts = fp8.runtime.engine.model.model.layers[0].mlp.experts
        assert experts.w13.dtype == experts.w2.dtype == FP8
        twin_experts = twin.runtime.engine.model.model.layers[0].mlp.experts
        dequantized = experts.w13.float() * experts.w13_scale[..., None]
        error = (dequantized - twin_experts.w13).abs().max()
        # exact for a tensor's or a row's scale; block scales are applied, then each row
        # re-quantized
        assert error <= 0.07 * twin_experts.w13.abs().max()
    else:
        twin_file = load_file(str(twin_folder / "model.safetensors"))
        twin_weight = twin_file["model.layers.1.self_attn.o_proj.weight"]
        dequantized = product.values.float() * product.scales.reshape(-1, 1)
        error = (dequantized - twin_weight).abs().max()
        if LAYOUTS[layout][1] in ("tensor", "channel"):  # the file's values and scales
            assert error == 0
        else:  # block scales are applied, then each row re-quantized
            assert error <= 0.07 * twin_weight.abs().max()
    agree, pairs = first_tokens_agreeing(fp8, twin, max_tokens=8)
    assert agree >= 4, pairs
    assert_dequantized_generates_as(make_llm, fp8_folder, twin)

    tensors = load_file(str(fp8_folder / "model.safetensors"))
    del tensors[f"model.layers.1.mlp.down_proj.{LAYOUTS[layout][2]}"]
    save_file(tensors, str(fp8_folder / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.weight has no scale"):
        LLM(str(fp8_folder), num_pages=256)


def test_fp8_checkpoint_of_partly_rotating_heads_loads_as_its_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_llm: Callable[..., LLM]
) -> None:
    """Where half of a head rotates (GLM-4.5's; GLM-4.5-Air-FP8 publishes block scales),
    the query and key rows load reordered; an FP8 checkpoint's are reordered with one scale
    a row, which is what its de-quantized twin quantized at load holds: the same FP8 rows
    and scales, and (on CPU, where the kernels are deterministic) the same greedy tokens."""
    fp8_on_cpu(monkeypatch)
    float_folder = make_tiny_model("glm4_moe", tmp_path / "float")
    fp8_folder, twin_folder = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(float_folder, fp8_folder, twin_folder, "fp8-block")
    fp8 = make_llm(fp8_folder, num_pages=256)
    twin = make_llm(twin_folder, quantization="fp8", num_pages=256)
    for layer in (0, 2):
        ours, theirs = (
            llm.runtime.engine.model.model.layers[layer].self_attn.qkv_proj.quantized.products
            for llm in (fp8, twin)
        )
        for a, b in zip(ours, theirs, strict=True):
            assert isinstance(a, Fp8Weight) and isinstance(b, Fp8Weight)
            assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
            assert torch.equal(a.scales, b.scales)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 33, 9], list(range(3, 40, 2))]
    assert [o.token_ids for o in fp8.generate(prompts, params)] == [
        o.token_ids for o in twin.generate(prompts, params)
    ]


def test_fp8_tensor_slices_whole_blocks() -> None:
    """A rank's rows or columns of a block-scaled weight carry their blocks' scales; a shard
    that would start inside a block is refused."""
    from aserve.quant.fp8 import Fp8Tensor

    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(96, 64, generator=generator) * 100).to(FP8)
    scale = torch.rand(3, 2, generator=generator) + 0.5
    weight = Fp8Tensor(values, scale, (32, 32))
    full = weight.dequantize()
    assert torch.equal(weight[32:96].dequantize(), full[32:96])
    assert torch.equal(weight[:, 32:64].dequantize(), full[:, 32:64])
    with pytest.raises(ValueError, match="inside a 32x32 scale block"):
        weight[16:48]
    per_row = Fp8Tensor(values, scale.new_ones(96, 1) * 2, None)
    assert torch.equal(per_row[40:50].rows().dequantize(), values[40:50].float() * 2)


@pytest.mark.parametrize(
    "quantization_config",
    [
        {"type": "int", "num_bits": 2, "format": "pack-quantized", "says": "weights are int 2-bit"},
        {"type": "int", "num_bits": 4, "format": "marlin-24", "says": "format is 'marlin-24'"},
        {"type": "float", "num_bits": 4, "format": "nvfp4-pack-quantized", "says": "float 4-bit"},
        {"type": "float", "num_bits": 8, "format": "float-quantized", "strategy": "token",
         "says": "scales its FP8 weights by 'token'"},
        {"type": "float", "num_bits": 8, "format": "marlin-24", "says": "format is 'marlin-24'"},
    ],
    ids=["w2a16", "int-marlin-24", "nvfp4", "unknown-strategy", "packed-fp8"],
)  # fmt: skip
def test_compressed_tensors_other_than_fp8_refused_in_one_line(
    tmp_path: Path, quantization_config: dict[str, object]
) -> None:
    """Compressed-tensors checkpoints that are neither FP8 tensors nor integers of 4 or 8 bits
    in the layouts tests/test_int_checkpoints.py loads (FP4, 2-bit, Marlin-packed) are
    refused at start in one line that says what the file holds."""
    folder = make_tiny_model("llama", tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    setting = published_quantization_config("compressed-tensors", "channel")
    weights = setting["config_groups"]["group_0"]["weights"]  # type: ignore[index]
    weights.update(type=quantization_config["type"], num_bits=quantization_config["num_bits"])
    weights["strategy"] = quantization_config.get("strategy", "channel")
    setting["format"] = quantization_config["format"]
    config["quantization_config"] = setting
    (folder / "config.json").write_text(json.dumps(config))
    says = str(quantization_config["says"])
    assert_refused_in_one_line(folder, ["--device", "cpu"], says, tmp_path / "cache")


def test_kv_scales_of_every_publisher_are_read() -> None:
    """Each publisher's spelling of a layer's K and V cache scales lands on that layer (one
    `kv_scale` on both), per-head scales take their largest, scales of FP8 queries and
    probabilities are dropped, every other tensor passes, and a scale that is no scale is an
    error that names it."""
    from aserve.kvcache.scales import KVScales

    weights = [
        ("model.layers.0.self_attn.k_scale", torch.tensor(2.0)),
        ("model.layers.0.self_attn.v_scale", torch.tensor([3.0])),
        ("model.layers.1.self_attn.kv_scale", torch.tensor(4.0)),
        ("model.layers.2.self_attn.k_proj.k_scale", torch.tensor(5.0)),
        ("model.layers.2.self_attn.v_proj.v_scale", torch.tensor([6.0, 6.5])),
        ("model.layers.3.self_attn.k_proj.output_scale", torch.tensor([7.0])),
        ("model.layers.3.self_attn.v_proj.output_scale", torch.tensor(8.0)),
        ("model.layers.3.self_attn.attn.k_scale", torch.tensor(9.0)),
        ("model.layers.3.self_attn.q_scale", torch.tensor(10.0)),
        ("model.layers.3.self_attn.prob_scale", torch.tensor(11.0)),
        ("model.layers.3.self_attn.k_proj.weight", torch.ones(2, 2)),
        ("model.layers.3.self_attn.k_proj.weight_scale", torch.tensor(12.0)),
    ]
    scales = KVScales()
    passed = [name for name, _ in scales.take(weights)]
    assert passed == [
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.k_proj.weight_scale",
    ]
    assert scales.k == {0: 2.0, 1: 4.0, 2: 5.0, 3: 9.0}
    assert scales.v == {0: 3.0, 1: 4.0, 2: 6.5, 3: 8.0}
    assert scales.per_head
    for bad in (torch.tensor(0.0), torch.tensor(float("nan")), torch.tensor([1.0, -1.0])):
        with pytest.raises(ValueError, match="layers.5.self_attn.k_scale is no KV-cache scale"):
            list(KVScales().take([("model.layers.5.self_attn.k_scale", bad)]))


KV_SCALE_SPELLINGS = {
    "compressed-tensors": ("self_attn.k_scale", "self_attn.v_scale"),
    "autofp8": ("self_attn.kv_scale",),
    "quark": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
}


def write_large_kv_checkpoint(original: Path, folder: Path, spelling: str | None) -> Path:
    """`original` (a float checkpoint) with K and V 10^4 times larger and Q and the
    attention output 10^4 times smaller (the same model), and with `spelling`, KV-cache
    scales of 100 in that publisher's names (`KV_SCALE_SPELLINGS`) for every layer."""
    from safetensors.torch import load_file, save_file

    config = json.loads((original / "config.json").read_text())
    tensors = load_file(str(original / "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        attention = f"model.layers.{layer}.self_attn"
        for proj, factor in (("q", 1e-4), ("k", 1e4), ("v", 1e4), ("o", 1e-4)):
            tensors[f"{attention}.{proj}_proj.weight"] *= factor
        for name in KV_SCALE_SPELLINGS[spelling] if spelling else ():
            tensors[f"model.layers.{layer}.{name}"] = torch.tensor(100.0)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("spelling", KV_SCALE_SPELLINGS)
def test_checkpoint_kv_scales_keep_large_keys_and_values_in_fp8(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
    spelling: str,
) -> None:
    """A tiny Llama whose K and V are 10^4 times larger (q and o divided to match: the same
    model) with calibrated KV-cache scales of 100 in its file: the FP8 cache stores K / 100
    and V / 100 and generates like the original model's float cache (as the unscaled FP8
    test above); with the scales taken out of the file K and V saturate at 448 and every
    prompt's tokens part within three. A float cache loads the same file and leaves the
    scales unused."""
    fp8_on_cpu(monkeypatch)
    original = make_tiny_model("llama", tmp_path / "llama")
    large = write_large_kv_checkpoint(original, tmp_path / "large", spelling)
    unscaled = write_large_kv_checkpoint(original, tmp_path / "unscaled", None)

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(folder: Path, **options: object) -> list[list[int]]:
        llm = make_llm(folder, num_pages=512, attention_backend="torch", **options)
        return [o.token_ids for o in llm.generate(TINY_PROMPTS, greedy)]

    reference = tokens(original)
    fp8 = make_llm(large, num_pages=512, kv_cache_dtype="fp8_e4m3", attention_backend="torch")
    assert fp8.runtime.engine.pool.scale_pairs == [(100.0, 100.0)] * 2
    scaled = first_differences(
        [o.token_ids for o in fp8.generate(TINY_PROMPTS, greedy)], reference, 12
    )
    saturated = first_differences(tokens(unscaled, kv_cache_dtype="fp8_e4m3"), reference, 12)
    with capsys.disabled():
        print(
            f"\nFP8 KV of 10^4 x K and V, first differing token: scaled {scaled}, not {saturated}"
        )
    assert sum(p >= 4 for p in scaled) >= 4, scaled
    assert max(saturated) <= 2, saturated
    assert tokens(large) == reference


def test_quantization_configs_read_as_their_scale_layouts() -> None:
    """What each publisher's `quantization_config` tells the loader: FP8 or not, and the
    scales' block; a compressed-tensors file with only a `kv_cache_scheme` has float
    weights, and early ones spell a block "128x128"."""
    from aserve.config import _quantization_settings

    compressed = published_quantization_config("compressed-tensors", "block")
    early = json.loads(json.dumps(compressed))
    early["config_groups"]["group_0"]["weights"]["block_structure"] = "128x128"
    kv_only = {**compressed, "config_groups": {}, "kv_cache_scheme": {"num_bits": 8}}
    cases = [
        (published_quantization_config("fp8", "block"), ("fp8", True, (32, 32))),
        (published_quantization_config("fp8", "tensor"), ("fp8", True, None)),
        (published_quantization_config("fbgemm_fp8", "channel"), ("fp8", True, None)),
        (compressed, ("fp8", True, (32, 32))),
        (early, ("fp8", True, (128, 128))),
        (published_quantization_config("compressed-tensors", "group"), ("fp8", True, (1, 32))),
        (published_quantization_config("compressed-tensors", "tensor"), ("fp8", True, None)),
        (kv_only, (None, False, None)),
        ({"quant_method": "bitsandbytes"}, ("bitsandbytes", False, None)),
        ({}, (None, False, None)),
    ]
    for config, expected in cases:
        settings = _quantization_settings(config)
        read = (
            settings["quantization"],
            settings.get("fp8_checkpoint", False),
            settings.get("fp8_block"),
        )
        assert read == expected, config
