"""Integer checkpoints as published (AWQ, GPTQ, compressed-tensors): a tiny float model is
quantized here, packed in each publisher's layout with packing code written for the test,
and loaded. Each must unpack to exactly its de-quantized float twin, run on the quantized
kernels with the twin's greedy tokens (products rounded differently, so first tokens on
most prompts), and with `--quantization none` generate exactly the twin's tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, IntScheme, ModelConfig
from aserve.models.weights import iter_weights
from aserve.quant.codes import Codes
from aserve.quant.int_checkpoints import CodesTensor, pair_int_weights, unpack_words
from tests.test_quant import (
    TINY_PROMPTS,
    assert_dequantized_generates_as,
    assert_refused_in_one_line,
    first_tokens_agreeing,
)
from tests.tiny_models import make_tiny_model

LINEAR = "_proj.weight"
AWQ_NIBBLE_HOLDS = [0, 2, 4, 6, 1, 3, 5, 7]
"""AutoAWQ's packing: nibble i of a word holds output AWQ_NIBBLE_HOLDS[i] of its eight."""


class Layout:
    """One publisher's layout: `method`, code `bits`, inputs a `group` (-1: a row),
    `symmetric`, and the format's own switches."""

    def __init__(
        self,
        method: str,
        bits: int = 4,
        group: int = 32,
        symmetric: bool = False,
        gptq_format: str = "gptq",
        packed: bool = True,
        scale_dtype: torch.dtype = torch.float16,
        act_order: bool = False,
        head: bool = False,
    ) -> None:
        self.method, self.bits, self.group, self.symmetric = method, bits, group, symmetric
        self.gptq_format, self.packed, self.scale_dtype = gptq_format, packed, scale_dtype
        self.act_order, self.head = act_order, head


LAYOUTS = {
    "awq": Layout("awq"),
    "gptq": Layout("gptq"),
    "gptq-sym": Layout("gptq", symmetric=True),
    "gptq-8bit": Layout("gptq", bits=8, symmetric=True),
    "gptq-3bit": Layout("gptq", bits=3),
    "gptq-2bit": Layout("gptq", bits=2, symmetric=True),
    "gptq-v2": Layout("gptq", gptq_format="gptq_v2"),
    "gptq-channel": Layout("gptq", group=-1),
    "ct-w4a16": Layout("compressed-tensors", symmetric=True, scale_dtype=torch.bfloat16),
    "ct-w4a16-asym": Layout("compressed-tensors", scale_dtype=torch.bfloat16),
    "ct-w8a16-channel": Layout("compressed-tensors", bits=8, group=-1, symmetric=True),
    "ct-w8a8": Layout("compressed-tensors", bits=8, group=-1, symmetric=True, packed=False),
    "gptq-act-order": Layout("gptq", act_order=True),
    "ct-w4a16-act-order": Layout("compressed-tensors", symmetric=True, act_order=True),
    "gptq-head": Layout("gptq", head=True),  # GPTQModel's `lm_head: true`
}


def quantize(weight: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """Codes, zeros (int64, `[rows, cols]` and `[rows, groups]`) and scales (the layout's
    dtype, `[rows, groups]`) of a float weight, by each group's range."""
    rows, cols = weight.shape
    group = cols if layout.group == -1 else layout.group
    grouped = weight.reshape(rows, cols // group, group)
    top = (1 << layout.bits) - 1
    if layout.symmetric:
        middle = 1 << (layout.bits - 1)
        scales = (grouped.abs().amax(-1) / (middle - 1)).to(layout.scale_dtype)
        zeros = torch.full(scales.shape, middle)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = ((high - low) / top).to(layout.scale_dtype)
        zeros = (-low / scales.float()).round().clamp(0, top).long()
    steps = (grouped / scales.float()[..., None]).round().long() + zeros[..., None]
    return steps.clamp(0, top).reshape(rows, cols), zeros, scales


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of `32 // bits` values each along `dim`, the first in the lowest bits;
    for 3 bits AutoGPTQ's layout: each value's bits run on into the next word (10 values and
    2 bits of the 11th in the first word, its last bit and 10 more and 1 bit in the second)."""
    if 32 % bits:
        moved = values.long().movedim(dim, -1)  # [..., count]
        stream = (moved[..., None] >> torch.arange(bits)) & 1  # each value's bits, lowest first
        bits_of_words = stream.flatten(-2).unflatten(-1, (-1, 32))
        words = (bits_of_words << torch.arange(32)).sum(-1)
        words = words.movedim(-1, dim).contiguous()
        return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))
    per_word = 32 // bits
    grouped = values.long().unflatten(dim, (-1, per_word))
    shifts = torch.arange(per_word) * bits
    words = (grouped << (shifts[:, None] if dim == 0 else shifts)).sum(dim + 1)
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def checkpoint_tensors(
    name: str, weight: torch.Tensor, layout: Layout
) -> tuple[dict, torch.Tensor]:
    """The tensors a publisher stores for linear weight `name`, and the float weight they
    stand for (zero points as the format's readers take them)."""
    base = name.removesuffix(".weight")
    rows, cols = weight.shape
    group = cols if layout.group == -1 else layout.group
    # act-order: group g gathers the inputs `order[g * group : (g + 1) * group]`
    order = torch.arange(cols)
    if layout.act_order:
        order = torch.randperm(cols, generator=torch.Generator().manual_seed(rows))
    index = torch.empty(cols, dtype=torch.int32)
    index[order] = (torch.arange(cols) // group).int()
    grouped, zeros, scales = quantize(weight[:, order], layout)
    if layout.method == "gptq" and layout.gptq_format == "gptq":
        zeros = ((zeros - 1) & ((1 << layout.bits) - 1)) + 1  # stored minus one; a 0 reads 16
    codes, twin = torch.empty_like(grouped), torch.empty_like(weight)
    codes[:, order] = grouped
    steps = grouped - zeros.repeat_interleave(group, 1)
    twin[:, order] = steps * scales.float().repeat_interleave(group, 1)
    if layout.method == "awq":
        order = (torch.arange(rows) // 8 * 8).reshape(-1, 8) + torch.tensor(AWQ_NIBBLE_HOLDS)
        stored = {
            "qweight": pack(codes.t()[:, order.reshape(-1)], 4, 1),
            "qzeros": pack(zeros.t()[:, order.reshape(-1)], 4, 1),
            "scales": scales.t().contiguous(),
        }
    elif layout.method == "gptq":
        stored_zeros = zeros - 1 if layout.gptq_format == "gptq" else zeros
        stored = {
            "qweight": pack(codes.t(), layout.bits, 0),
            "qzeros": pack(stored_zeros.t() & ((1 << layout.bits) - 1), layout.bits, 1),
            "scales": scales.t().contiguous(),
            "g_idx": index,
        }
    elif layout.packed:
        stored = {
            "weight_packed": pack(codes, layout.bits, 1),
            "weight_scale": scales,
            "weight_shape": torch.tensor([rows, cols]),
        }
        if not layout.symmetric:
            stored["weight_zero_point"] = pack(zeros, layout.bits, 0)
        if layout.act_order:
            stored["weight_g_idx"] = index
    else:
        stored = {"weight": (codes - 128).to(torch.int8), "weight_scale": scales}
    return {f"{base}.{part}": tensor for part, tensor in stored.items()}, twin


def quantization_config(layout: Layout) -> dict[str, object]:
    if layout.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": layout.group,
                "zero_point": True, "version": "gemm"}  # fmt: skip
    if layout.method == "gptq":
        return {"quant_method": "gptq", "bits": layout.bits, "group_size": layout.group,
                "desc_act": layout.act_order, "sym": layout.symmetric, "static_groups": False,
                "checkpoint_format": layout.gptq_format, "lm_head": layout.head}  # fmt: skip
    weights = {
        "num_bits": layout.bits,
        "type": "int",
        "symmetric": layout.symmetric,
        "strategy": "channel" if layout.group == -1 else "group",
        "group_size": None if layout.group == -1 else layout.group,
        "actorder": "group" if layout.act_order else None,
        "dynamic": False,
    }
    activations = None
    if not layout.packed:
        activations = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if layout.packed else "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations}},
        "ignore": ["lm_head"],
    }  # fmt: skip


def write_int_checkpoint(
    float_folder: Path, folder: Path, twin_folder: Path, layout: Layout
) -> None:
    """The float checkpoint's linear weights in `layout` (`folder`) and the float checkpoint
    of exactly what they stand for (`twin_folder`)."""
    from safetensors.torch import load_file, save_file

    quantized: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(float_folder / "model.safetensors")).items():
        if name.endswith(LINEAR) or (layout.head and name == "lm_head.weight"):
            stored, twin[name] = checkpoint_tensors(name, tensor, layout)
            quantized.update(stored)
        else:
            quantized[name] = twin[name] = tensor
    for target, contents in ((folder, quantized), (twin_folder, twin)):
        target.mkdir()
        save_file(contents, str(target / "model.safetensors"))
        config = json.loads((float_folder / "config.json").read_text())
        if target == folder:
            config["quantization_config"] = quantization_config(layout)
        (target / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_unpacks_to_its_twin_exactly(tmp_path: Path, layout: str) -> None:
    """Every packed weight unpacks into codes whose weight is the twin's to the last bit
    (zero points of every layout, AWQ's nibble order, GPTQ's zeros stored minus one,
    act-order groups gathered from across the row)."""
    from safetensors.torch import load_file

    float_folder = make_tiny_model("llama", tmp_path / "float")
    folder, twin_folder = tmp_path / "int", tmp_path / "twin"
    write_int_checkpoint(float_folder, folder, twin_folder, LAYOUTS[layout])
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert config.quantization == "gguf" and config.int_scheme is not None
    twin = load_file(str(twin_folder / "model.safetensors"))
    weights = dict(pair_int_weights(iter_weights(folder, False), config.int_scheme, False))
    assert set(weights) == set(twin)
    linear = [name for name in twin if name.endswith(LINEAR)]
    if LAYOUTS[layout].head:
        linear.append("lm_head.weight")
    for name in linear:
        weight = weights[name]
        assert isinstance(weight, CodesTensor)
        assert weight.decode().bits == LAYOUTS[layout].bits
        assert (weight.order is not None) == LAYOUTS[layout].act_order
        assert torch.equal(weight.dequantize(), twin[name]), name
    as_float = dict(pair_int_weights(iter_weights(folder, False), config.int_scheme, True))
    assert all(torch.equal(as_float[name], twin[name]) for name in linear)


@pytest.mark.parametrize(
    ("family", "layout"),
    [("llama", layout) for layout in LAYOUTS]
    + [("phi3", "awq"), ("qwen3_moe", "gptq"), ("qwen3_moe", "ct-w4a16")],
)
def test_int_checkpoint_generates_as_its_twin(
    tmp_path: Path, make_llm: Callable[..., LLM], family: str, layout: str
) -> None:
    """Each layout runs quantized on the CPU kernels (Phi-3's fused projections and partial
    rotation, Qwen3-MoE's experts and a quantized LM head too) with the twin's first greedy
    tokens on most prompts, and de-quantized (`--quantization none`) with exactly the twin's
    tokens."""
    float_folder = make_tiny_model(family, tmp_path / "float")
    folder, twin_folder = tmp_path / "int", tmp_path / "twin"
    write_int_checkpoint(float_folder, folder, twin_folder, LAYOUTS[layout])
    quantized = make_llm(folder, num_pages=256)
    twin = make_llm(twin_folder, num_pages=256)
    assert quantized.runtime.model_config.quantization == "gguf"
    attention = quantized.runtime.engine.model.model.layers[1].self_attn
    assert attention.o_proj.quantized is not None
    assert not isinstance(attention.o_proj.quantized.products[0], torch.Tensor)
    if LAYOUTS[layout].head:  # the LM head's codes on the CPU kernels, 4 bits a weight
        assert quantized.runtime.engine.model.lm_head.table.head.code_bits == 4
    agree, pairs = first_tokens_agreeing(quantized, twin, max_tokens=8)
    assert agree >= 5, pairs
    assert_dequantized_generates_as(make_llm, folder, twin)


def test_vllm_method_names_are_taken_for_their_own_checkpoints(
    tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """`--quantization awq` (or awq_marlin) runs an AWQ checkpoint as auto does; the name of
    another method, or a load-time quantization, is refused in one line."""
    float_folder = make_tiny_model("llama", tmp_path / "float")
    folder, twin_folder = tmp_path / "int", tmp_path / "twin"
    write_int_checkpoint(float_folder, folder, twin_folder, LAYOUTS["awq"])
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    auto = [o.token_ids for o in make_llm(folder, num_pages=256).generate(TINY_PROMPTS, greedy)]
    named = make_llm(folder, num_pages=256, quantization="awq_marlin")
    assert [o.token_ids for o in named.generate(TINY_PROMPTS, greedy)] == auto
    cache = tmp_path / "cache"
    assert_refused_in_one_line(folder, ["-q", "gptq"], "this checkpoint is not gptq", cache)
    assert_refused_in_one_line(folder, ["-q", "int4"], "already quantized (AWQ)", cache)


def test_act_order_group_index_is_refused_at_load(tmp_path: Path) -> None:
    """A group index that gathers inputs out of order where the config says groups are runs
    of inputs (desc_act false) stops the load with a message that says so; a missing part
    too."""
    from safetensors.torch import load_file, save_file

    float_folder = make_tiny_model("llama", tmp_path / "float")
    folder, twin_folder = tmp_path / "int", tmp_path / "twin"
    write_int_checkpoint(float_folder, folder, twin_folder, LAYOUTS["gptq"])
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.g_idx: this group index gathers inputs"):
        LLM(str(folder), num_pages=256)
    del tensors[name], tensors["model.layers.0.mlp.down_proj.qzeros"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj lacks .qzeros"):
        LLM(str(folder), num_pages=256)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"quant_method": "gptq", "bits": 6, "group_size": 128}, "has 6-bit weights"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "runs AWQ's 4"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "in the 'gemv' layout"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin' format"),
    ],
    ids=["gptq-6bit", "awq-8bit", "awq-gemv", "gptq-marlin"],
)
def test_unsupported_integer_checkpoints_refused_in_one_line(
    tmp_path: Path, change: dict[str, object], says: str
) -> None:
    folder = make_tiny_model("llama", tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = change
    (folder / "config.json").write_text(json.dumps(config))
    assert_refused_in_one_line(folder, ["--device", "cpu"], says, tmp_path / "cache")


def test_compressed_tensors_int_schemes() -> None:
    """compressed-tensors' integer configs read as their schemes (act-ordered groups too);
    tensor-wide int scales are refused."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 128}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights}
    setting = {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": group}}  # fmt: skip
    config = json.loads(json.dumps(setting))
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}  # fmt: skip
    scheme = ModelConfig.from_hf({**base, "quantization_config": config}).int_scheme
    assert scheme == IntScheme("compressed-tensors", 4, 128, symmetric=True, packed=True)
    weights["actorder"] = "group"
    scheme = ModelConfig.from_hf({**base, "quantization_config": setting}).int_scheme
    assert scheme is not None and scheme.act_order
    weights["strategy"] = "tensor"
    with pytest.raises(ConfigError, match="scales its int weights by 'tensor'"):
        ModelConfig.from_hf({**base, "quantization_config": setting})


def test_codes_tensor_slices_whole_groups() -> None:
    """A rank's rows or columns carry their groups' scales; columns that cut a group are
    refused; a scale a row slices anywhere."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 128), generator=generator, dtype=torch.uint8)
    scales = torch.rand(16, 4, generator=generator)
    offsets = torch.rand(16, 4, generator=generator)
    weight = CodesTensor(Codes(codes, scales, offsets, 32, 4))
    full = weight.decode().dequantize()
    assert torch.equal(weight[4:12].decode().dequantize(), full[4:12])
    assert torch.equal(weight[:, 64:128].decode().dequantize(), full[:, 64:128])
    with pytest.raises(ValueError, match="split a group of 32 inputs"):
        weight[:, 16:80]
    per_row = CodesTensor(Codes(codes, scales[:, :1], offsets[:, :1], 128, 4))
    assert torch.equal(
        per_row[:, 32:96].decode().dequantize(), per_row.decode().dequantize()[:, 32:96]
    )
    order = torch.arange(16).flip(0)
    assert torch.equal(weight.permute_rows(order).decode().dequantize(), full[order])
    inputs = torch.randperm(128, generator=generator)
    act_order = CodesTensor(Codes(codes, scales, offsets, 32, 4), inputs)
    assert torch.equal(act_order[4:12].dequantize()[:, inputs], full[4:12])
    # a rank's inputs of an act-order weight: each group's share padded to 32 columns, the
    # pads gathering a zero appended past the rank's inputs
    in_row_order = act_order.dequantize()
    for start, stop in ((0, 64), (64, 128), (32, 48)):
        part = act_order[2:10, start:stop]
        assert part.shape == (8, stop - start) and part.inputs == stop - start
        padded = part.decode()
        assert padded.group == 32 and padded.shape[1] % 32 == 0
        assert padded.shape[1] >= stop - start and padded.codes.shape[0] == 8
        assert torch.equal(part.dequantize(), in_row_order[2:10, start:stop])
        x = torch.randn(3, stop - start, generator=generator, dtype=torch.float64)
        gathered = torch.nn.functional.pad(x, (0, 1))[:, part.order]
        torch.testing.assert_close(
            gathered @ padded.dequantize().double().T, x @ in_row_order[2:10, start:stop].double().T
        )


def test_act_order_experts_are_refused(tmp_path: Path) -> None:
    """Act-order MoE experts would each gather their inputs in another order: refused at
    load with a ConfigError that says so (which the CLI prints as its one line; dense
    act-order layers run, above)."""
    float_folder = make_tiny_model("qwen3_moe", tmp_path / "float")
    folder, twin_folder = tmp_path / "int", tmp_path / "twin"
    write_int_checkpoint(float_folder, folder, twin_folder, LAYOUTS["gptq-act-order"])
    with pytest.raises(ConfigError, match="act-order experts"):  # one line from the CLI
        LLM(str(folder), num_pages=256)


@pytest.mark.parametrize(
    ("layout", "separate"), [("gptq", "quantize_config.json"), ("awq", "quant_config.json")]
)
def test_older_checkpoints_settings_file_and_zero_biases(
    tmp_path: Path, make_llm: Callable[..., LLM], layout: str, separate: str
) -> None:
    """Older AutoGPTQ and AutoAWQ checkpoints keep their settings in a file of their own
    (`quantize_config.json`, `quant_config.json` with AutoAWQ's own keys), and GPTQ files may
    hold a zero bias for every layer: such a checkpoint generates as the one with its
    settings in config.json. A bias that is not zero, for a layer without one, is refused."""
    from safetensors.torch import load_file, save_file

    float_folder = make_tiny_model("llama", tmp_path / "float")
    folder, twin_folder = tmp_path / "int", tmp_path / "twin"
    write_int_checkpoint(float_folder, folder, twin_folder, LAYOUTS[layout])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in make_llm(folder, num_pages=256).generate(TINY_PROMPTS, greedy)]
    config = json.loads((folder / "config.json").read_text())
    settings = config.pop("quantization_config")
    del settings["quant_method"]
    if layout == "awq":  # AutoAWQ's names
        settings = {"w_bit": 4, "q_group_size": settings["group_size"], "zero_point": True,
                    "version": "GEMM"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / separate).write_text(json.dumps(settings))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(folder / "model.safetensors"))
    older = make_llm(folder, num_pages=256)
    assert (
        older.runtime.model_config.int_scheme
        == ModelConfig.from_hf(
            {**config, "quantization_config": {"quant_method": layout, **settings}}
        ).int_scheme
    )
    assert [o.token_ids for o in older.generate(TINY_PROMPTS, greedy)] == expected
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="a bias for a layer that has none"):
        LLM(str(folder), num_pages=256)


def test_gptq_three_bit_codes_run_on_across_words() -> None:
    """GPTQ's 3-bit `qweight`: 32 codes in 3 words, the first 10 in bits 0-29 of word 0, code
    10 in its bits 30-31 and bit 0 of word 1, codes 11-20 in bits 1-30, code 21 in bit 31
    and bits 0-1 of word 2, codes 22-31 in bits 2-31; the same along the outputs for
    `qzeros`."""
    codes = torch.tensor([(5 * i + 3) % 8 for i in range(64)], dtype=torch.uint8)
    words = torch.zeros(6, dtype=torch.int64)
    for block in range(2):
        c = [int(v) for v in codes[32 * block : 32 * block + 32]]
        w = [sum(c[j] << (3 * j) for j in range(10)) | (c[10] & 3) << 30]
        w.append(c[10] >> 2 | sum(c[11 + j] << (3 * j + 1) for j in range(10)) | (c[21] & 1) << 31)
        w.append(c[21] >> 1 | sum(c[22 + j] << (3 * j + 2) for j in range(10)))
        words[3 * block : 3 * block + 3] = torch.tensor(w)
    stored = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))
    assert torch.equal(unpack_words(stored[:, None], 3, 0)[:, 0], codes)
    assert torch.equal(unpack_words(stored[None, :], 3, 1)[0], codes)
    assert torch.equal(pack(codes[:, None], 3, 0)[:, 0], stored)
