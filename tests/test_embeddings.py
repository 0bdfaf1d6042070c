"""Embeddings (`--is-embedding`): the last token's normalised hidden state against
transformers' base model, the same through chunked prefill, prefix hits and batches, an
untied checkpoint without its LM head; the `/v1/embeddings` route of a real server (float and
base64, `dimensions`, text and ids, the openai SDK, refusals both ways)."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve import LLM
from aserve.config import ConfigError
from aserve.server import protocol
from tests.embedding_refs import (
    CLS,
    DENSE,
    ENCODER_PROMPTS,
    ENCODERS,
    LAST,
    MEAN,
    PROMPTS,
    WORDS,
    embedded,
    make_embedding_gemma,
    make_tiny_encoder,
    make_tiny_modern_bert,
    make_tiny_nomic_bert,
    pooled_reference,
    reference,
    sentence_transformers_files,
)
from tests.gguf_files import (
    write_bert_as_gguf,
    write_hf_as_gguf,
    write_modern_bert_as_gguf,
    write_nomic_bert_as_gguf,
)
from tests.server_utils import ServerProcess, serving
from tests.test_gguf_models import GEMMA3_AS_LLAMA_CPP
from tests.test_server import get, metric_value, post, run
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_embeddings_match_transformers(family: str, tmp_path: Path) -> None:
    """Each prompt's embedding is transformers' pooled base model's; then the same again
    through chunks of 4 tokens and prefix hits, and one prompt at a time."""
    folder = make_tiny_model(family, tmp_path)
    expected = reference(folder, PROMPTS)
    with LLM(str(folder), is_embedding=True, page_size=4) as llm:
        assert llm.runtime.engine.pooling
        got = embedded(llm, PROMPTS)
        for ours, theirs in zip(got, expected, strict=True):
            assert ours.shape == (64,)
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(ours.norm(), torch.tensor(1.0))
        cached = llm.scheduler.planner.prompt_tokens_cached
        again = embedded(llm, PROMPTS)
        assert llm.scheduler.planner.prompt_tokens_cached - cached >= 12  # 3 pages of 4
        alone = [embedded(llm, [p])[0] for p in PROMPTS]
        for first, hit, single in zip(got, again, alone, strict=True):
            torch.testing.assert_close(hit, first, atol=2e-6, rtol=0)
            torch.testing.assert_close(single, first, atol=2e-6, rtol=0)
    with LLM(str(folder), is_embedding=True, page_size=4, max_prefill_length=4) as llm:
        for chunked, first in zip(embedded(llm, PROMPTS), got, strict=True):
            torch.testing.assert_close(chunked, first, atol=2e-6, rtol=0)


def test_untied_checkpoint_without_its_head(tmp_path: Path) -> None:
    """An embedding model published without an LM head (untied config): the head is
    neither read nor needed."""
    folder = make_tiny_model("llama", tmp_path)  # untied: its own lm_head.weight
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["lm_head.weight"]
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="lm_head"):
        LLM(str(folder))
    with LLM(str(folder), is_embedding=True) as llm:
        torch.testing.assert_close(
            torch.stack(embedded(llm, PROMPTS)),
            torch.stack(reference(folder, PROMPTS)),
            atol=2e-5,
            rtol=1e-4,
        )


def test_offline_refusals(tmp_path: Path) -> None:
    """generate on an embedding LLM and embed on a generating one raise; an input too long
    for the context comes back with its error."""
    folder = make_tiny_model("qwen3", tmp_path)
    with LLM(str(folder), is_embedding=True, max_seq_len_override=16) as llm:
        with pytest.raises(ValueError, match="call embed"):
            llm.generate([PROMPTS[0]])
        too_long = llm.embed([list(range(1, 40)), PROMPTS[1]])
        assert too_long[0].embedding is None and "context" in (too_long[0].error or "")
        assert too_long[1].embedding is not None
    with LLM(str(folder)) as llm, pytest.raises(ValueError, match="is_embedding=True"):
        llm.embed([PROMPTS[0]])


MODEL = "smollm2-embed"


@pytest.fixture(scope="module")
def embedding_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(
        ServerProcess(["--model", str(smollm2_dir), "--served-model-name", MODEL, "--is-embedding"])
    )


def embeddings(server: ServerProcess, **body: Any) -> tuple[int, Any]:
    return run(post(server.base_url + "/v1/embeddings", {"model": MODEL, **body}))


def test_embeddings_route(embedding_server: ServerProcess, smollm2_dir: Path) -> None:
    """Text and its token ids give one vector, the offline API's; base64 holds the same
    float32 values; `dimensions` cuts and renormalises; usage counts the input tokens."""
    texts = ["The capital of France is Paris.", "Embeddings map text to vectors."]
    status, body = embeddings(embedding_server, input=texts)
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == MODEL
    protocol.EmbeddingList.model_validate(body)
    vectors = [np.array(item["embedding"], np.float32) for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert all(v.shape == (576,) and abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    with LLM(str(smollm2_dir), is_embedding=True) as llm:
        ids = [llm.tokenizer.encode(t) for t in texts]
        offline = [np.array(out.embedding, np.float32) for out in llm.embed(texts)]
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, ids)),
        "total_tokens": sum(map(len, ids)),
    }
    for served, mine in zip(vectors, offline, strict=True):
        np.testing.assert_allclose(served, mine, atol=1e-6)
    status, by_ids = embeddings(embedding_server, input=ids)
    assert status == 200
    for item, vector in zip(by_ids["data"], vectors, strict=True):
        np.testing.assert_allclose(np.array(item["embedding"], np.float32), vector, atol=1e-6)
    _, metrics = run(get(embedding_server.base_url + "/metrics"))
    # both requests' inputs count as prompt tokens (the server embedded nothing else)
    assert metric_value(metrics.decode(), "aserve:prompt_tokens_total") == 2 * sum(map(len, ids))
    status, packed = embeddings(embedding_server, input=texts[0], encoding_format="base64")
    assert status == 200
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, vectors[0], atol=1e-6)
    status, cut = embeddings(embedding_server, input=texts[0], dimensions=64)
    assert status == 200
    short = np.array(cut["data"][0]["embedding"], np.float32)
    np.testing.assert_allclose(short, vectors[0][:64] / np.linalg.norm(vectors[0][:64]), atol=1e-6)


def test_pair_scores_of_an_embedding_server(embedding_server: ServerProcess) -> None:
    """/v1/score and /v1/rerank on an embedding model: the cosine of /v1/embeddings'
    vectors."""
    query, documents = "Where is Paris?", ["Paris is in France.", "Bananas are yellow."]
    _, body = embeddings(embedding_server, input=[query, *documents])
    vectors = [np.array(item["embedding"], np.float64) for item in body["data"]]
    cosines = [float(vectors[0] @ v) for v in vectors[1:]]
    url = embedding_server.base_url
    status, scored = run(post(url + "/v1/score", {"text_1": query, "text_2": documents}))
    assert status == 200, scored
    assert [d["score"] for d in scored["data"]] == pytest.approx(cosines, abs=1e-5)
    status, ranked = run(post(url + "/v1/rerank", {"query": query, "documents": documents}))
    assert status == 200, ranked
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    assert [by_index[0], by_index[1]] == pytest.approx(cosines, abs=1e-5)
    status, refused = run(post(url + "/classify", {"input": query}))
    assert status == 400 and "no classifier" in refused["error"]["message"]


def test_openai_sdk_embeddings(embedding_server: ServerProcess) -> None:
    """The SDK asks for base64 unless told otherwise, and decodes it."""
    import openai

    client = openai.OpenAI(base_url=embedding_server.base_url + "/v1", api_key="unused")
    reply = client.embeddings.create(model=MODEL, input=["one", "two", "three"])
    assert len(reply.data) == 3 and len(reply.data[0].embedding) == 576
    floats = client.embeddings.create(model=MODEL, input="two", encoding_format="float")
    np.testing.assert_allclose(reply.data[1].embedding, floats.data[0].embedding, atol=1e-6)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "hi", "dimensions": 577}, "dimensions is 577, but this model's embeddings"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1, 49152]]}, "outside the vocabulary"),
        ({"input": [list(range(1, 9000))]}, "has 8999 tokens, but this model's context holds"),
        ({"input": "hi", "model": "other"}, "does not exist"),
    ],
)
def test_bad_embedding_requests(
    embedding_server: ServerProcess, body: dict[str, Any], message: str
) -> None:
    status, reply = run(post(embedding_server.base_url + "/v1/embeddings", body))
    assert status == 400, reply
    assert message in reply["error"]["message"]


def test_generation_routes_refuse_on_an_embedding_server(embedding_server: ServerProcess) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/generate", {"text": "hi"}),
    ):
        status, reply = run(post(embedding_server.base_url + path, body))
        assert status == 400 and "/v1/embeddings" in reply["error"]["message"], (path, reply)
        assert reply["error"]["code"] == "generation_not_served"


@pytest.mark.parametrize(("mode", "pooling"), [("last", LAST), ("mean", MEAN), ("cls", CLS)])
@pytest.mark.parametrize("dense", [None, DENSE], ids=["plain", "dense"])
def test_sentence_transformers_pooling_as_published(
    tmp_path: Path, mode: str, pooling: dict[str, bool], dense: list[torch.Tensor] | None
) -> None:
    """A folder's sentence-transformers modules say how it pools (the last token, the mean
    over the prompt, the first token) and what Dense modules follow: the embeddings are
    theirs on transformers' hidden states, in chunks of 3 where the pooling allows (the
    mean and the first token take each prompt whole, past the step's budget, and never from
    the prefix cache); a generating server reads none of it."""
    import transformers

    folder = make_tiny_model("qwen3", tmp_path)
    sentence_transformers_files(folder, pooling, dense)
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [*PROMPTS, PROMPTS[0][:6], PROMPTS[0]]
    with torch.inference_mode():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    expected = [pooled_reference(h, mode, dense) for h in hidden]
    with LLM(str(folder), is_embedding=True, page_size=4, max_prefill_length=3) as llm:
        assert llm.runtime.engine.whole_prompts == (mode != "last")
        got = embedded(llm, prompts) + embedded(llm, prompts[-1:])
        cached = llm.scheduler.planner.prompt_tokens_cached
    assert (cached == 0) == (mode != "last")
    for ours, theirs in zip(got, [*expected, expected[-1]], strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    with LLM(str(folder)) as llm:
        assert llm.generate([PROMPTS[0]])[0].token_ids


@pytest.mark.parametrize(
    ("pooling", "dense", "refusal"),
    [
        ({**LAST, "lasttoken": False, "max_tokens": True}, False, "pools by max_tokens"),
        ({**MEAN, "cls_token": True}, False, "pools by cls_token, mean_tokens"),
        (LAST, True, "activation 'torch.nn.modules.activation.GELU'"),
    ],
)
def test_sentence_transformers_pooling_refusals(
    tmp_path: Path, pooling: dict[str, bool], dense: bool, refusal: str
) -> None:
    """Poolings aserve does not compute (the maximum, two at once) and a Dense module's
    activation it does not apply: one-line errors."""
    folder = make_tiny_model("qwen3", tmp_path)
    sentence_transformers_files(folder, pooling, DENSE[:1] if dense else None)
    if dense:
        settings_file = folder / "2_Dense" / "config.json"
        settings = json.loads(settings_file.read_text())
        settings["activation_function"] = "torch.nn.modules.activation.GELU"
        settings_file.write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=refusal):
        LLM(str(folder), is_embedding=True)


@pytest.mark.parametrize(
    ("pooling_type", "mode"),
    [(None, "last"), (3, "last"), (1, "mean"), (2, "cls"), (4, None)],
)
def test_a_gguf_file_s_pooling_type_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pooling_type: int | None, mode: str | None
) -> None:
    """llama.cpp writes `{arch}.pooling_type` into an embedding model's GGUF: the last token
    (3, or a file without it), the mean (1) and the first token (2) pool as transformers'
    hidden states pooled so; rank (4) is refused in one line; a generating server reads
    none of it."""
    import transformers

    folder = make_tiny_model("qwen3", tmp_path / "hf")

    def pooling(writer: gguf.GGUFWriter) -> None:
        if pooling_type is not None:
            writer.add_uint32("qwen3.pooling_type", pooling_type)

    path = write_hf_as_gguf(folder, tmp_path / "model.gguf", vocabulary=pooling)
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    if mode is None:
        with pytest.raises(ConfigError, match="pools by rank"):
            LLM(str(path), is_embedding=True)
    else:
        model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
        with LLM(str(path), is_embedding=True) as llm:
            got = embedded(llm, PROMPTS)
        for ours, theirs in zip(got, hidden, strict=True):
            expected = pooled_reference(theirs, mode, None)
            torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
    with LLM(str(path)) as llm:
        assert llm.generate([PROMPTS[0]])[0].token_ids


@pytest.mark.parametrize("qtype", [None, "Q8_0"], ids=["float", "q8_0"])
def test_embedding_gemma_gguf_pools_as_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str | None
) -> None:
    """EmbeddingGemma as llama.cpp's converter writes it (`gemma-embedding`, the mean's
    pooling type, its Dense modules as `dense_2` and `dense_3`; five windowed layers of six,
    as llama.cpp fixes them): it attends both ways and pools as its Hugging Face folder does
    (float: to float32's noise; Q8_0, the Dense modules quantized too: a cosine past 0.99),
    and only embeds."""
    import gguf

    hf, dense = make_embedding_gemma(tmp_path / "hf", GEMMA3_AS_LLAMA_CPP)
    prompts = [*PROMPTS, list(range(3, 40))]
    with torch.inference_mode():
        hidden = [hf(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    expected = [pooled_reference(h, "mean", dense) for h in hidden]
    kind = None if qtype is None else gguf.GGMLQuantizationType[qtype]
    path = write_hf_as_gguf(tmp_path / "hf", tmp_path / "model.gguf", qtype=kind)
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    with LLM(str(path), is_embedding=True, page_size=4, max_prefill_length=3) as llm:
        config = llm.runtime.engine.model_config
        assert config.bidirectional and config.architecture == "Gemma3ForCausalLM"
        got = embedded(llm, prompts)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == (48,)
        if qtype is None:
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        else:
            assert torch.dot(ours, theirs) > 0.99
    with pytest.raises(ConfigError, match="attends both ways: it only embeds"):
        LLM(str(path))


def test_embedding_gemma_attends_both_ways(tmp_path: Path) -> None:
    """EmbeddingGemma's layout: every position reads every other (the windowed layer those
    less than 4 away on either side), the mean over the prompt, two Dense modules; equal to
    transformers' model pooled so, each prompt whole in one step (past a budget of 3) and
    none from the prefix cache, alone and in batches; a causal read would differ. It only
    embeds: a generating server is refused in one line."""
    hf, dense = make_embedding_gemma(tmp_path)
    prompts = [*PROMPTS, PROMPTS[0][:6], list(range(3, 40))]
    with torch.inference_mode():
        hidden = [hf(torch.tensor([p])).last_hidden_state[0] for p in prompts]
        hf.config.use_bidirectional_attention = False
        for layer in hf.layers:
            layer.self_attn.is_causal = True
        causal = hf(torch.tensor([prompts[-1]])).last_hidden_state[0]
    expected = [pooled_reference(h, "mean", dense) for h in hidden]
    assert (pooled_reference(causal, "mean", dense) - expected[-1]).abs().max() > 1e-3
    with LLM(str(tmp_path), is_embedding=True, page_size=4, max_prefill_length=3) as llm:
        config = llm.runtime.engine.model_config
        assert config.bidirectional and config.architecture == "Gemma3ForCausalLM"
        got = embedded(llm, prompts)
        alone = [embedded(llm, [p])[0] for p in prompts]
        assert llm.scheduler.planner.prompt_tokens_cached == 0
    for ours, single, theirs in zip(got, alone, expected, strict=True):
        assert ours.shape == (48,)
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(single, ours, atol=2e-6, rtol=0)
    with pytest.raises(ConfigError, match="attends both ways: it only embeds"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("pooling", [None, "mean"], ids=["cls-default", "mean-files"])
def test_encoders_embed_as_transformers(tmp_path: Path, family: str, pooling: str | None) -> None:
    """BERT and XLM-RoBERTa (positions from padding id + 1) embed as transformers' encoder
    pooled so: by the first token ([CLS]) without sentence-transformers files, as vLLM pools
    an encoder, or as the files say (the mean, then a Dense module); each prompt whole in
    one step past a budget of 3 and never from the prefix cache; text wrapped in [CLS] ...
    [SEP] by its tokenizer. They only embed: a generating start is refused in one line."""
    import transformers

    model = make_tiny_encoder(family, tmp_path)
    dense = None
    if pooling == "mean":
        dense = [torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) / 8]
        sentence_transformers_files(tmp_path, MEAN, dense)
    text = " ".join(WORDS[:6])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text_ids = tokenizer(text)["input_ids"]
    assert text_ids[0] == tokenizer.cls_token_id and text_ids[-1] == tokenizer.sep_token_id
    with torch.inference_mode():
        hidden = [
            model(torch.tensor([p])).last_hidden_state[0] for p in [*ENCODER_PROMPTS, text_ids]
        ]
    expected = [pooled_reference(h, pooling or "cls", dense) for h in hidden]
    with LLM(str(tmp_path), is_embedding=True, page_size=4, max_prefill_length=3) as llm:
        assert llm.runtime.engine.model_config.bidirectional
        got = embedded(llm, ENCODER_PROMPTS) + embedded(llm, [text])
        alone = embedded(llm, ENCODER_PROMPTS[:1])
        assert llm.scheduler.planner.prompt_tokens_cached == 0
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(alone[0], got[0], atol=2e-6, rtol=0)
    with pytest.raises(ConfigError, match="attends both ways: it only embeds"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"position_embedding_type": "relative_key"}, "relative_key position embeddings"),
        ({"hidden_act": "relu"}, "activation 'relu'"),
    ],
)
def test_encoders_aserve_does_not_compute_are_refused(
    tmp_path: Path, change: dict[str, str], refusal: str
) -> None:
    make_tiny_encoder("bert", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=refusal):
        LLM(str(tmp_path), is_embedding=True)


def test_a_quantized_encoder_on_cpu_stays_near_its_float_embeddings(tmp_path: Path) -> None:
    """`--quantization int8` on an encoder: its linear layers quantized at load and
    multiplied by the CPU kernels, the embeddings within a cosine of 0.999 of transformers'."""
    model = make_tiny_encoder("bert", tmp_path)
    with torch.inference_mode():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in ENCODER_PROMPTS]
    with LLM(str(tmp_path), is_embedding=True, quantization="int8") as llm:
        assert llm.runtime.engine.model_config.quantization == "int8"
        got = embedded(llm, ENCODER_PROMPTS)
    for ours, theirs in zip(got, hidden, strict=True):
        assert torch.dot(ours, pooled_reference(theirs, "cls", None)) > 0.999


def check_gguf_embeddings(
    path: Path,
    texts: list[str],
    ids: list[list[int]],
    expected: list[torch.Tensor],
    quantized: bool = False,
    pair: tuple[str, str, list[int]] | None = None,
) -> None:
    """A GGUF embedding file's tokenizer, built by the conversion, gives `ids` for `texts`
    (and a pair's ids), and its embeddings are `expected`: to 2e-5, or past a cosine of
    0.999 where the file is `quantized`."""
    with LLM(str(path), is_embedding=True) as llm:
        assert llm.tokenizer is not None
        assert [llm.tokenizer.encode(text) for text in texts] == ids
        if pair is not None:
            assert llm.tokenizer.encode_pair(pair[0], pair[1]) == pair[2]
        got = embedded(llm, texts)
    for ours, theirs in zip(got, expected, strict=True):
        if quantized:
            assert torch.dot(ours, theirs) > 0.999
        else:
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("qtype", [None, "Q8_0"], ids=["float", "q8_0"])
def test_a_bert_gguf_embeds_as_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str | None
) -> None:
    """A BERT as llama.cpp's converter writes it (`bert`, pooling by the mean, its WordPiece
    vocabulary respelled): the tokenizer built from the file gives the folder's ids (lower
    case, a plural split into `cat ##s`, [CLS] ... [SEP]), and the embeddings are
    transformers' mean-pooled states (float: to 2e-5; Q8_0: a cosine past 0.999)."""
    import gguf
    import transformers

    model = make_tiny_encoder("bert", tmp_path / "hf")
    kind = None if qtype is None else gguf.GGMLQuantizationType[qtype]
    path = write_bert_as_gguf(tmp_path / "hf", tmp_path / "m.gguf", gguf.PoolingType.MEAN, kind)
    texts = ["The cats sat on the mat", "a DOG ran far away"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert tokenizer.convert_ids_to_tokens(ids[0])[:4] == ["[CLS]", "the", "cat", "##s"]
    with torch.inference_mode():
        expected = [
            pooled_reference(model(torch.tensor([i])).last_hidden_state[0], "mean", None)
            for i in ids
        ]
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    check_gguf_embeddings(path, texts, ids, expected, quantized=qtype is not None)


def make_sentencepiece_xlm_roberta(folder: Path, labels: int = 0) -> tuple[Any, Any]:
    """A tiny XLM-RoBERTa (with `labels`, its classifier) whose vocabulary is a SentencePiece
    unigram model trained here (NFKC rules: full-width letters folded), saved in `folder`
    as sentencepiece.bpe.model, as bge-m3's is. Returns transformers' model and its
    tokenizer of that sentencepiece model."""
    import sentencepiece
    import transformers

    spm = folder.parent / f"{folder.name}-spm"
    spm.mkdir(parents=True)
    corpus = [" ".join(WORDS), "Café naïve résumé", "ｆｕｌｌ ｗｉｄｔｈ", "hello world"] * 20
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_prefix=str(spm / "m"),
        vocab_size=60,
        model_type="unigram",
        normalization_rule_name="nmt_nfkc",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (spm / "m.model").rename(spm / "sentencepiece.bpe.model")
    tokenizer = transformers.XLMRobertaTokenizer.from_pretrained(spm)
    overrides = {"vocab_size": len(tokenizer)}
    model = make_tiny_encoder("xlm-roberta", folder, labels=labels, overrides=overrides)
    shutil.copy(spm / "sentencepiece.bpe.model", folder)
    return model, tokenizer


def test_an_xlm_roberta_gguf_embeds_as_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bge-m3's layout: an XLM-RoBERTa as llama.cpp's converter writes it (`bert`, the
    positions before padding id + 1 cut off, its SentencePiece unigram vocabulary as `t5`
    with the precompiled normaliser): the tokenizer built from the file gives the ids that
    transformers gives from the sentencepiece model (full-width letters folded, runs of
    spaces, accents, a pair with two separators between its parts), and the embeddings are
    transformers' [CLS] states (to 2e-5)."""
    model, tokenizer = make_sentencepiece_xlm_roberta(tmp_path / "hf")
    path = write_bert_as_gguf(tmp_path / "hf", tmp_path / "m.gguf", gguf.PoolingType.CLS)
    texts = ["ｆｕｌｌ  width: the cat sat", "Café  naïve résumé", "hello\tworld, a dog ran far"]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert tokenizer.convert_ids_to_tokens(ids[0])[1:3] == ["\u2581f", "u"]
    with torch.inference_mode():
        expected = [
            pooled_reference(model(torch.tensor([i])).last_hidden_state[0], "cls", None)
            for i in ids
        ]
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    pair = (texts[1], texts[2], tokenizer(texts[1], texts[2])["input_ids"])
    check_gguf_embeddings(path, texts, ids, expected, pair=pair)


def test_a_reranker_gguf_scores_as_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bge-reranker-v2-m3's layout: an XLM-RoBERTa classifier of one label as llama.cpp's
    converter writes it (pooling rank, its head as `cls` and `cls.output`) serves as a
    reranker without --is-embedding: each query-document pair scores transformers'
    classifier's sigmoid (to 2e-5). A BERT classifier's file, whose converter left the
    pooler out (`cls.output` alone), is refused in one line."""
    model, tokenizer = make_sentencepiece_xlm_roberta(tmp_path / "hf", labels=1)
    path = write_bert_as_gguf(tmp_path / "hf", tmp_path / "m.gguf", gguf.PoolingType.RANK)
    query, documents = "the cat sat", ["on the mat", "ｆｕｌｌ ｗｉｄｔｈ dog", "the cat sat"]
    with torch.inference_mode():
        expected = [
            torch.sigmoid(model(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]).item()
            for d in documents
        ]
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    with LLM(str(path)) as llm:
        assert llm.runtime.engine.model_config.classifies
        scores = [s.score for s in llm.score(query, documents)]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=2e-5, rtol=0)
    assert len(set(scores)) == len(documents)
    make_tiny_encoder("bert", tmp_path / "bert", labels=1)
    bert = write_bert_as_gguf(tmp_path / "bert", tmp_path / "bert.gguf", gguf.PoolingType.RANK)
    with pytest.raises(ConfigError, match="not the pooler before it"):
        LLM(str(bert))


MODERN_BERT_PROMPTS = [list(range(5, 40)), [2, 9, 17, 3], [2, *range(60, 70), 3]]
"""Prompts longer and shorter than the tiny ModernBERT's window (4 tokens either way)."""


@pytest.mark.parametrize(
    ("pooling", "activation"),
    [(None, "gelu"), ("mean", "gelu"), (None, "silu")],
    ids=["cls-default", "mean-files", "silu"],
)
def test_modern_bert_embeds_as_transformers(
    tmp_path: Path, pooling: str | None, activation: str
) -> None:
    """ModernBERT (rotary positions of two bases, windowed layers attending 4 tokens either
    way beside whole ones, bias-free LayerNorms, GeGLU, or SiLU's gate as in Granite
    Embedding R2) embeds as transformers' model pooled by [CLS] or as sentence-transformers
    files say, prompts longer than the window included, in a batch and alone; the window
    matters (a wider one gives other vectors)."""
    model = make_tiny_modern_bert(tmp_path, hidden_activation=activation)
    if pooling == "mean":
        sentence_transformers_files(tmp_path, MEAN)
    with torch.inference_mode():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in MODERN_BERT_PROMPTS]
    expected = [pooled_reference(h, pooling or "cls", None) for h in hidden]
    with LLM(str(tmp_path), is_embedding=True, page_size=4, max_prefill_length=8) as llm:
        assert llm.runtime.engine.model_config.layer_windows == (0, 5, 5, 0)
        got = embedded(llm, MODERN_BERT_PROMPTS)
        alone = embedded(llm, MODERN_BERT_PROMPTS[:1])
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(alone[0], got[0], atol=2e-6, rtol=0)
    with LLM(str(tmp_path), is_embedding=True, hf_overrides={"local_attention": 64}) as wide:
        assert (embedded(wide, MODERN_BERT_PROMPTS[:1])[0] - expected[0]).abs().max() > 1e-3


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_modern_bert_classifier_s_probabilities(tmp_path: Path, pooling: str) -> None:
    """ModernBERT's classifier (the pooled state, [CLS]'s or the mean, through a dense
    layer, GELU and a LayerNorm): each prompt's probabilities are transformers' (to 1e-5);
    its one-label twin scores a pair as transformers' classifier reads the tokenizer's
    pair."""
    import transformers

    model = make_tiny_modern_bert(tmp_path / "labels", 3, classifier_pooling=pooling)
    with torch.inference_mode():
        expected = [
            torch.softmax(model(torch.tensor([p])).logits[0], -1) for p in MODERN_BERT_PROMPTS
        ]
    with LLM(str(tmp_path / "labels")) as llm:
        outs = llm.classify(MODERN_BERT_PROMPTS)
    for out, theirs in zip(outs, expected, strict=True):
        assert out.classification is not None
        torch.testing.assert_close(
            torch.tensor(out.classification.probs), theirs, atol=1e-5, rtol=0
        )
    reranker = make_tiny_modern_bert(tmp_path / "rank", 1, classifier_pooling=pooling)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "rank")
    query, documents = "the cat sat", ["on the mat", "a dog ran far away"]
    with torch.inference_mode():
        scores = [
            torch.sigmoid(reranker(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]).item()
            for d in documents
        ]
    with LLM(str(tmp_path / "rank")) as llm:
        got = [s.score for s in llm.score(query, documents)]
    assert got == pytest.approx(scores, abs=1e-5)


def write_byte_level_bpe(folder: Path) -> Any:
    """A byte-level BPE tokenizer trained here as ModernBERT's is built (NFC, GPT-2's split,
    [CLS] A [SEP], a pair's second part of type 1), saved in `folder`; returned."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS), "Café naïve résumé", "numbers 1234 and 56", "hello, world!"] * 20
    backend.train_from_iterator(corpus, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[
            ("[CLS]", backend.token_to_id("[CLS]")),
            ("[SEP]", backend.token_to_id("[SEP]")),
        ],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.mark.parametrize("qtype", [None, "Q8_0"], ids=["float", "q8_0"])
def test_a_modern_bert_gguf_embeds_as_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str | None
) -> None:
    """A ModernBERT as llama.cpp's converter writes it (`modern-bert`: its window and
    pattern, both rope bases, GELU's gate; a byte-level BPE as `gpt2` pieces and merges):
    the tokenizer built from the file gives the folder's ids (accents composed by NFC,
    digits, punctuation, a pair), and the embeddings are transformers' [CLS] states (float:
    to 2e-5; Q8_0: a cosine past 0.999)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    tokenizer = write_byte_level_bpe(folder)
    model = make_tiny_modern_bert(
        folder, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id
    )
    tokenizer.save_pretrained(folder)  # over the tiny model's WordPiece files
    kind = None if qtype is None else gguf.GGMLQuantizationType[qtype]
    path = write_modern_bert_as_gguf(folder, tmp_path / "m.gguf", gguf.PoolingType.CLS, kind)
    texts = ["the cats sat on a mat, 1234!", "Cafe\u0301 naïve résumé", " ".join(WORDS * 3)]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    with torch.inference_mode():
        expected = [
            pooled_reference(model(torch.tensor([i])).last_hidden_state[0], "cls", None)
            for i in ids
        ]
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    with LLM(str(path), is_embedding=True) as llm:
        assert llm.tokenizer is not None
        assert llm.runtime.engine.model_config.layer_windows == (0, 5, 5, 0)
        assert [llm.tokenizer.encode(text) for text in texts] == ids
        assert (
            llm.tokenizer.encode_pair(texts[0], texts[1])
            == tokenizer(texts[0], texts[1])["input_ids"]
        )
        got = embedded(llm, texts)
    for ours, theirs in zip(got, expected, strict=True):
        if qtype is None:
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        else:
            assert torch.dot(ours, theirs) > 0.999


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_modern_bert_reranker_gguf_scores_as_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pooling: str
) -> None:
    """gte-reranker-modernbert's layout: a ModernBERT classifier of one label as llama.cpp's
    converter writes it (pooling rank, its head as `cls`, `cls.norm` and `cls.output`, its
    classifier pooling) serves as a reranker: pairs score transformers' sigmoid (to
    2e-5)."""
    import transformers

    folder = tmp_path / "hf"
    folder.mkdir()
    tokenizer = write_byte_level_bpe(folder)
    model = make_tiny_modern_bert(folder, 1, vocab_size=len(tokenizer), classifier_pooling=pooling)
    tokenizer.save_pretrained(folder)
    path = write_modern_bert_as_gguf(folder, tmp_path / "m.gguf", gguf.PoolingType.RANK)
    query, documents = "the cat sat", ["on the mat, 1234!", "Café naïve résumé", "the cat"]
    with torch.inference_mode():
        expected = [
            torch.sigmoid(model(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]).item()
            for d in documents
        ]
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    with LLM(str(path)) as llm:
        assert llm.runtime.engine.model_config.classifier_pooling == pooling
        scores = [s.score for s in llm.score(query, documents)]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=2e-5, rtol=0)


def test_nomic_bert_embeds_as_its_reference(tmp_path: Path) -> None:
    """nomic-bert (nomic-embed-text v1 / v1.5: BERT's post-norm layers with rotary positions,
    a fused QKV, SwiGLU and no biases) embeds as the reference written from nomic's modeling
    code (transformers has none), pooled by [CLS] or by the mean its sentence-transformers
    files ask for, to 2e-5, prompts of up to the 80 positions it was trained for; settings
    it does not compute (experts, pre-norm) are refused."""
    reference = make_tiny_nomic_bert(tmp_path)
    prompts = [*ENCODER_PROMPTS, [2, *range(5, 83), 3]]
    with torch.inference_mode():
        hidden = [reference(p) for p in prompts]
    with LLM(str(tmp_path), is_embedding=True, page_size=4) as llm:
        assert llm.runtime.engine.context_length == 80
        got = embedded(llm, prompts)
    for ours, h in zip(got, hidden, strict=True):
        torch.testing.assert_close(ours, pooled_reference(h, "cls", None), atol=2e-5, rtol=1e-4)
    sentence_transformers_files(tmp_path, MEAN)
    with LLM(str(tmp_path), is_embedding=True) as llm:
        means = embedded(llm, prompts[:2])
    for ours, h in zip(means, hidden[:2], strict=True):
        torch.testing.assert_close(ours, pooled_reference(h, "mean", None), atol=2e-5, rtol=1e-4)
    for change in ({"moe_every_n_layers": 2}, {"prenorm": True}):
        with pytest.raises(ConfigError, match=f"NomicBertModel with {next(iter(change))}"):
            LLM(str(tmp_path), is_embedding=True, hf_overrides=change)


@pytest.mark.parametrize("qtype", [None, "Q8_0"], ids=["float", "q8_0"])
def test_a_nomic_bert_gguf_embeds_as_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str | None
) -> None:
    """nomic-embed-text's GGUF layout (`nomic-bert`, pooling by the mean, its WordPiece
    vocabulary): the tokenizer built from the file gives the folder's ids, and the
    embeddings are the reference's mean (float: to 2e-5; Q8_0: a cosine past 0.999)."""
    import transformers

    reference = make_tiny_nomic_bert(tmp_path / "hf")
    kind = None if qtype is None else gguf.GGMLQuantizationType[qtype]
    path = write_nomic_bert_as_gguf(
        tmp_path / "hf", tmp_path / "m.gguf", gguf.PoolingType.MEAN, kind
    )
    texts = ["The cats sat on the mat", "a DOG ran far away"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = [tokenizer(text)["input_ids"] for text in texts]
    with torch.inference_mode():
        expected = [pooled_reference(reference(i), "mean", None) for i in ids]
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    check_gguf_embeddings(path, texts, ids, expected, quantized=qtype is not None)


def test_an_encoder_input_may_fill_every_learned_position(tmp_path: Path) -> None:
    """A BERT of 80 learned positions embeds an input of 80 tokens (transformers' own limit)
    as transformers does and refuses 81 in one line; a context longer than its positions is
    refused at start."""
    model = make_tiny_encoder("bert", tmp_path)
    full = [2, *range(5, 83), 3]
    assert len(full) == 80
    with torch.inference_mode():
        hidden = model(torch.tensor([full])).last_hidden_state[0]
    with LLM(str(tmp_path), is_embedding=True) as llm:
        ours, longer = llm.embed([full, [*full, 3]])
    assert ours.embedding is not None and longer.embedding is None
    assert longer.error is not None and "81 tokens" in longer.error
    expected = pooled_reference(hidden, "cls", None)
    torch.testing.assert_close(torch.tensor(ours.embedding), expected, atol=2e-5, rtol=1e-4)
    with pytest.raises(ConfigError, match="inputs of up to 80 tokens"):
        LLM(str(tmp_path), is_embedding=True, max_seq_len_override=200)


def test_an_encoder_server_embeds_text_and_tells_its_positions(tmp_path: Path) -> None:
    """A BERT embedding server: /v1/models gives its learned positions as max_model_len (80),
    text embeds as transformers' [CLS] of the tokenizer's ids, an input of 80 tokens is
    taken and one of 81 is a 400 that names the context; /v1/score scores by cosine.
    `truncate_prompt_tokens` cuts text as transformers does from the left ([CLS] and [SEP]
    kept), ids to the 80 the model takes with -1, each of /v1/score's texts alike; a count
    that leaves no room beside [CLS] and [SEP] is a 400."""
    import transformers

    model = make_tiny_encoder("bert", tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "the cats sat on a mat"
    with torch.inference_mode():
        hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
    expected = pooled_reference(hidden, "cls", None).numpy()
    server = ServerProcess(
        ["--model", str(tmp_path), "--served-model-name", MODEL, "--is-embedding"]
    )
    try:
        server.wait_ready()
        _, models = run(get(server.base_url + "/v1/models"))
        assert json.loads(models)["data"][0]["max_model_len"] == 80
        status, body = embeddings(server, input=text)
        assert status == 200, body
        np.testing.assert_allclose(np.array(body["data"][0]["embedding"]), expected, atol=2e-5)
        status, body = embeddings(server, input=[[2, *range(5, 83), 3]])
        assert status == 200 and body["usage"]["prompt_tokens"] == 80, body
        status, body = embeddings(server, input=[[2, *range(5, 84), 3]])
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        status, body = run(post(server.base_url + "/v1/score", {"text_1": text, "text_2": text}))
        assert status == 200 and body["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
        long_text = " ".join(WORDS * 3)
        tokenizer.truncation_side = "left"
        kept = tokenizer(long_text, truncation=True, max_length=6, return_tensors="pt")
        assert kept["input_ids"][0, 0] == tokenizer.cls_token_id
        with torch.inference_mode():
            hidden = model(**kept).last_hidden_state[0]
        status, body = embeddings(server, input=long_text, truncate_prompt_tokens=6)
        assert status == 200 and body["usage"]["prompt_tokens"] == 6, body
        np.testing.assert_allclose(
            np.array(body["data"][0]["embedding"]),
            pooled_reference(hidden, "cls", None).numpy(),
            atol=2e-5,
        )
        status, body = embeddings(server, input=[list(range(5, 105))], truncate_prompt_tokens=-1)
        assert status == 200 and body["usage"]["prompt_tokens"] == 80, body
        status, body = embeddings(server, input=text, truncate_prompt_tokens=1)
        assert status == 400 and "2 special tokens" in body["error"]["message"], body
        scored = {"text_1": long_text, "text_2": [text, long_text], "truncate_prompt_tokens": 6}
        status, body = run(post(server.base_url + "/v1/score", scored))
        assert status == 200 and body["usage"]["prompt_tokens"] == 12, body
    finally:
        assert server.stop() == 0, server.log()
