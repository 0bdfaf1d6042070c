"""Sequence classifiers (`*ForSequenceClassification`) and pair scores: a classifier's
probabilities against transformers' own classifier, through chunks and prefix hits; a
one-label classifier's pair scores (a reranker: the tokenizer's pair encoding, the logit's
sigmoid) and an embedding model's (cosine similarity); vLLM's `/score`, `/rerank` and
`/classify` routes of real servers, and their refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aserve import LLM
from aserve.server import protocol
from tests.embedding_refs import PROMPTS, WORDS, make_tiny_encoder
from tests.server_utils import ServerProcess, serving
from tests.test_server import post, run
from tests.tiny_models import make_tiny_model, write_word_tokenizer

LABELS = {"id2label": {0: "negative", 1: "neutral", 2: "positive"}}
RERANKER = {"num_labels": 1}
QUERY = "w5 w17 w42"
DOCUMENTS = ["w9 w100 w3", "w5 w17 w77 w12", "w250", "w31 w8 w19 w60"]


def hf_classifier(folder: Path) -> Any:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    return model.float().eval()


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def classifier_folder(tmp_path: Path, family: str, labels: dict[str, Any]) -> Path:
    folder = make_tiny_model(family, tmp_path, overrides=labels)
    write_word_tokenizer(folder, 320)
    return folder


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_classifier_matches_transformers(family: str, tmp_path: Path) -> None:
    """Each prompt's label and probabilities are transformers' classifier's, the same again
    from prefix hits and through chunks of 4 tokens."""
    folder = classifier_folder(tmp_path, family, LABELS)
    model = hf_classifier(folder)
    expected = [torch.softmax(hf_logits(model, p), -1) for p in PROMPTS]
    names = ["negative", "neutral", "positive"]
    with LLM(str(folder), page_size=4) as llm:
        assert llm.runtime.engine.model_config.labels == tuple(names)
        outs = llm.classify(PROMPTS)
        cached = llm.scheduler.planner.prompt_tokens_cached
        again = llm.classify(PROMPTS)
        assert llm.scheduler.planner.prompt_tokens_cached - cached >= 12  # 3 pages of 4
    with LLM(str(folder), page_size=4, max_prefill_length=4) as llm:
        chunked = llm.classify(PROMPTS)
    for theirs, *ours in zip(expected, outs, again, chunked, strict=True):
        for out in ours:
            assert out.error is None and out.classification is not None
            torch.testing.assert_close(
                torch.tensor(out.classification.probs), theirs, atol=1e-5, rtol=0
            )
            assert out.classification.label == names[int(theirs.argmax())]
    assert len({max(o.classification.probs) for o in outs if o.classification}) > 1


def test_reranker_scores_pairs_as_a_cross_encoder(tmp_path: Path) -> None:
    """A one-label classifier scores the query and each document as one sequence (the
    tokenizer's pair encoding): the sigmoid of transformers' logit; lists pair side by
    side."""
    folder = classifier_folder(tmp_path, "qwen3", RERANKER)
    model = hf_classifier(folder)
    with LLM(str(folder)) as llm:
        tokenizer = llm.tokenizer
        assert tokenizer is not None
        scores = llm.score(QUERY, DOCUMENTS)
        side_by_side = llm.score([QUERY, DOCUMENTS[0]], [DOCUMENTS[1], DOCUMENTS[2]])
        expected = [
            torch.sigmoid(hf_logits(model, tokenizer.encode_pair(QUERY, d))[0]).item()
            for d in DOCUMENTS
        ]
        mixed = tokenizer.encode_pair(DOCUMENTS[0], DOCUMENTS[2])
        assert mixed == tokenizer.encode(DOCUMENTS[0]) + tokenizer.encode(DOCUMENTS[2])
        with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
            llm.score([QUERY, QUERY], DOCUMENTS[:3])
        with pytest.raises(ValueError, match="call embed, score or classify"):
            llm.generate([PROMPTS[0]])
        with pytest.raises(ValueError, match="classifier: call classify or score"):
            llm.embed([PROMPTS[0]])
    assert [s.text_2 for s in scores] == DOCUMENTS
    torch.testing.assert_close(torch.tensor([s.score for s in scores]), torch.tensor(expected))
    assert side_by_side[0].score == pytest.approx(scores[1].score, abs=1e-6)
    last = torch.sigmoid(hf_logits(model, mixed)[0]).item()
    assert side_by_side[1].score == pytest.approx(last, abs=1e-5)


def test_embedding_model_scores_by_cosine(tmp_path: Path) -> None:
    """An embedding model's pair score is the cosine of the two texts' embeddings, each
    distinct text embedded once."""
    folder = make_tiny_model("qwen3", tmp_path)
    write_word_tokenizer(folder, 320)
    with LLM(str(folder), is_embedding=True) as llm:
        scores = llm.score(QUERY, DOCUMENTS)
        vectors = [torch.tensor(o.embedding) for o in llm.embed([QUERY, *DOCUMENTS])]
        with pytest.raises(ValueError, match="no classifier"):
            llm.classify([PROMPTS[0]])
    expected = [torch.dot(vectors[0], v).item() for v in vectors[1:]]
    torch.testing.assert_close(torch.tensor([s.score for s in scores]), torch.tensor(expected))


def test_offline_refusals(tmp_path: Path) -> None:
    """Scores on a generating model and on a classifier of three labels are refused."""
    folder = classifier_folder(tmp_path / "labels", "qwen3", LABELS)
    with LLM(str(folder)) as llm, pytest.raises(ValueError, match="has 3 labels"):
        llm.score(QUERY, DOCUMENTS)
    reranker = classifier_folder(tmp_path / "reranker", "qwen3", RERANKER)
    with LLM(str(reranker), max_seq_len_override=8) as llm:
        with pytest.raises(ValueError, match="could not run: .*context"):
            llm.score(QUERY, " ".join(DOCUMENTS))
    plain = make_tiny_model("qwen3", tmp_path / "plain")
    write_word_tokenizer(plain, 320)
    with LLM(str(plain)) as llm:
        with pytest.raises(ValueError, match="generates text"):
            llm.score(QUERY, DOCUMENTS)
        with pytest.raises(ValueError, match="no classifier"):
            llm.classify([PROMPTS[0]])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "reranker": classifier_folder(root / "reranker", "qwen3", RERANKER),
        "labels": classifier_folder(root / "labels", "qwen3", LABELS),
    }


@pytest.fixture(scope="module")
def reranker_server(folders: dict[str, Path]) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(["--model", str(folders["reranker"])]))


@pytest.fixture(scope="module")
def classifier_server(folders: dict[str, Path]) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(["--model", str(folders["labels"])]))


def test_score_and_rerank_routes(reranker_server: ServerProcess, folders: dict[str, Path]) -> None:
    """/v1/score and /score give the offline scores; /rerank orders the documents by them,
    keeps the best top_n, and leaves the documents out when asked; usage counts the pairs'
    tokens."""
    with LLM(str(folders["reranker"])) as llm:
        offline = [s.score for s in llm.score(QUERY, DOCUMENTS)]
        assert llm.tokenizer is not None
        tokens = sum(len(llm.tokenizer.encode_pair(QUERY, d)) for d in DOCUMENTS)
    base = reranker_server.base_url
    for path in ("/v1/score", "/score"):
        status, body = run(post(base + path, {"text_1": QUERY, "text_2": DOCUMENTS}))
        assert status == 200, body
        protocol.ScoreList.model_validate(body)
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        assert [d["score"] for d in body["data"]] == pytest.approx(offline, abs=1e-6)
        assert body["usage"]["prompt_tokens"] == tokens
    order = sorted(range(4), key=lambda i: offline[i], reverse=True)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        status, body = run(post(base + path, {"query": QUERY, "documents": DOCUMENTS}))
        assert status == 200, body
        protocol.RerankList.model_validate(body)
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == pytest.approx([offline[i] for i in order], abs=1e-6)
        assert body["usage"]["total_tokens"] == tokens
    request = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    status, body = run(post(base + "/v1/rerank", request))
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == order[:2]
    assert all("document" not in r for r in body["results"])


def test_classify_route(classifier_server: ServerProcess, folders: dict[str, Path]) -> None:
    """/classify and /v1/classify take text and ids, and give the offline probabilities with
    their label."""
    with LLM(str(folders["labels"])) as llm:
        offline = [o.classification for o in llm.classify(PROMPTS)]
    for path, given in (("/classify", PROMPTS), ("/v1/classify", PROMPTS[0])):
        status, body = run(post(classifier_server.base_url + path, {"input": given}))
        assert status == 200, body
        protocol.ClassificationList.model_validate(body)
        count = len(given) if isinstance(given[0], list) else 1
        assert [d["index"] for d in body["data"]] == list(range(count))
        for data, classes in zip(body["data"], offline, strict=False):
            assert classes is not None
            assert data["label"] == classes.label and data["num_classes"] == 3
            assert data["probs"] == pytest.approx(classes.probs, abs=1e-6)
    status, body = run(post(classifier_server.base_url + "/classify", {"input": "w5 w6 w7"}))
    assert status == 200 and body["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "give one text_1"),
        ("/score", {"text_1": "", "text_2": "c"}, "text_1"),
        ("/score", {"text_1": "a"}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
        ("/rerank", {"query": "a", "documents": ["b"], "model": "other"}, "does not exist"),
        ("/v1/embeddings", {"input": "a"}, "--is-embedding"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "/classify"),
    ],
)
def test_bad_requests_to_a_reranker(
    reranker_server: ServerProcess, path: str, body: dict[str, Any], message: str
) -> None:
    status, reply = run(post(reranker_server.base_url + path, body))
    assert status == 400, reply
    assert message in reply["error"]["message"]


def test_scores_refused_by_a_classifier_of_three_labels(classifier_server: ServerProcess) -> None:
    status, reply = run(post(classifier_server.base_url + "/score", {"text_1": "a", "text_2": "b"}))
    assert status == 400 and "has 3 labels" in reply["error"]["message"]
    assert reply["error"]["code"] == "scores_not_served"


QWEN3_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
"""vLLM's `--hf-overrides` for Qwen3-Reranker as published (a causal LM)."""


@pytest.mark.parametrize("tied", [True, False])
def test_causal_lm_as_a_classifier_of_its_tokens(tmp_path: Path, tied: bool) -> None:
    """A causal LM made a classifier by vLLM's overrides: Qwen3-Reranker's score is the
    softmax of the "no" and "yes" logits at "yes" (the head tied to the embedding or its
    own); `classifier_from_token` alone gives a label a token, its logits' softmax."""
    import transformers

    folder = make_tiny_model("qwen3", tmp_path, overrides={"tie_word_embeddings": tied})
    write_word_tokenizer(folder, 320, specials={310: "no", 311: "yes"})
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    with LLM(str(folder), hf_overrides=QWEN3_RERANKER) as llm:
        assert llm.runtime.engine.model_config.classifier_token_ids == (310, 311)
        assert llm.tokenizer is not None
        pairs = [llm.tokenizer.encode_pair(QUERY, d) for d in DOCUMENTS]
        scores = [s.score for s in llm.score(QUERY, DOCUMENTS)]
    expected = [torch.softmax(hf_lm_logits(model, ids)[[310, 311]], -1)[1].item() for ids in pairs]
    assert scores == pytest.approx(expected, abs=1e-5)
    tokens = {"architectures": ["Qwen3ForSequenceClassification"]}
    tokens["classifier_from_token"] = ["yes", "w7", "no"]  # type: ignore[assignment]
    with LLM(str(folder), hf_overrides=tokens) as llm:
        assert llm.runtime.engine.model_config.labels == ("yes", "w7", "no")
        outs = llm.classify(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        probs = torch.softmax(hf_lm_logits(model, prompt)[[311, 7, 310]], -1)
        assert out.classification is not None
        torch.testing.assert_close(torch.tensor(out.classification.probs), probs, atol=1e-5, rtol=0)


def hf_lm_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def test_hf_overrides_refusals(tmp_path: Path) -> None:
    """Overrides that are no JSON object, and tokens the vocabulary lacks: one-line errors."""
    from aserve.config import ConfigError

    folder = make_tiny_model("qwen3", tmp_path)
    write_word_tokenizer(folder, 320)
    for overrides, message in [
        ("[1, 2]", "must be a JSON object"),
        ("{bad", "not valid JSON"),
        ({**QWEN3_RERANKER, "classifier_from_token": ["yes"]}, "takes two tokens"),
        (QWEN3_RERANKER, "'no' is not a token of this model"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LLM(str(folder), hf_overrides=overrides)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoders_score_pairs_as_transformers(tmp_path: Path, family: str) -> None:
    """A BERT or XLM-RoBERTa reranker (`*ForSequenceClassification`, one label) scores a
    query and each document as transformers' classifier reads the tokenizer's pair: [CLS]'s
    state through the pooler (BERT) or the classifier's dense layer (RoBERTa), the
    second part of a BERT pair of token type 1; the logit's sigmoid. It serves without
    --is-embedding, each pair whole in one step. Pairs cut by `truncate_prompt_tokens` score
    as transformers' classifier reads them cut from the left."""
    import transformers

    model = make_tiny_encoder(family, tmp_path, labels=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    query, documents = "the cat sat", ["on the mat", "a dog ran far away", "the cat sat"]
    expected = []
    with torch.inference_mode():
        for document in documents:
            pair = tokenizer(query, document, return_tensors="pt")
            if family == "bert":
                assert pair["token_type_ids"].any()
            expected.append(torch.sigmoid(model(**pair).logits[0, 0]).item())
    tokenizer.truncation_side = "left"
    cut_expected = []
    with torch.inference_mode():
        for document in documents:
            pair = tokenizer(query, document, truncation=True, max_length=7, return_tensors="pt")
            cut_expected.append(torch.sigmoid(model(**pair).logits[0, 0]).item())
    with LLM(str(tmp_path), page_size=4, max_prefill_length=3) as llm:
        assert llm.runtime.engine.model_config.classifies
        scores = llm.score(query, documents)
        assert llm.scheduler.planner.prompt_tokens_cached == 0
        cut = llm.score(query, documents, truncate_prompt_tokens=7)
        with pytest.raises(ValueError, match="truncate_prompt_tokens is 0"):
            llm.score(query, documents, truncate_prompt_tokens=0)
    torch.testing.assert_close(
        torch.tensor([s.score for s in scores]), torch.tensor(expected), atol=2e-5, rtol=0
    )
    assert len({s.score for s in scores}) == len(documents)  # each document its own
    torch.testing.assert_close(  # pairs cut from the left, the longer part first
        torch.tensor([s.score for s in cut]), torch.tensor(cut_expected), atol=2e-5, rtol=0
    )
    assert cut[0].score != pytest.approx(scores[0].score, abs=1e-4)


def test_an_encoder_classifier_s_labels_and_probabilities(tmp_path: Path) -> None:
    """An XLM-RoBERTa classifier of three labels: each text's probabilities are transformers'
    softmax, whole in one step alone and in a batch."""
    import transformers

    model = make_tiny_encoder("xlm-roberta", tmp_path, labels=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = [" ".join(WORDS[:7]), "far away", "the dog"]
    with torch.inference_mode():
        expected = [
            torch.softmax(model(**tokenizer(t, return_tensors="pt")).logits[0], -1) for t in texts
        ]
    with LLM(str(tmp_path)) as llm:
        together, alone = llm.classify(texts), llm.classify(texts[:1])
    for out, theirs in zip([*together, *alone], [*expected, expected[0]], strict=True):
        assert out.classification is not None
        torch.testing.assert_close(
            torch.tensor(out.classification.probs), theirs, atol=1e-5, rtol=0
        )
