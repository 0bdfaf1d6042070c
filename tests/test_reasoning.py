"""`--reasoning-parser`: a reply's <think> block split from its answer, whole or streamed."""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, build_config
from aserve.server.reasoning import ReasoningStream, opens_thinking, split_reasoning
from tests.server_utils import ServerProcess, serving
from tests.test_server import post, run, stream, typed_events

CASES = [
    # (reply, the prompt opened the block, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "\nLet me see.\n", "Paris."),
    ("  <think>a < b</think>b", False, "a < b", "b"),
    ("Paris.", False, None, "Paris."),
    ("<b>bold</b> claim", False, None, "<b>bold</b> claim"),
    ("  <thi", False, None, "  <thi"),
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.\n", "Paris."),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("<think>cut off", False, "cut off", ""),
    ("<think>\n\n</think>\n\n", False, "\n\n", ""),
    ("</think>answer </think> again", True, "", "answer </think> again"),
]


@pytest.mark.parametrize(("reply", "opened", "reasoning", "content"), CASES)
def test_whole_replies_split(reply: str, opened: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(reply, opened) == (reasoning, content)


@pytest.mark.parametrize(("reply", "opened", "reasoning", "content"), CASES)
def test_any_cut_into_pieces_streams_the_same(
    reply: str, opened: bool, reasoning: str | None, content: str
) -> None:
    """Streamed in pieces of every size (one character, at random), the parts add up to the
    whole split, and no piece of a tag ever goes out as text before it is settled."""
    rng = random.Random(len(reply))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(0, 6))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        stream = ReasoningStream(opened)
        thought, answered = "", ""
        for piece in pieces:
            part = stream.push(piece)
            thought, answered = thought + part.reasoning, answered + part.content
            assert "</think>" not in thought and "<think>" not in thought
        last = stream.finish()
        assert (thought + last.reasoning, answered + last.content) == (reasoning or "", content)
        assert stream.thought == (reasoning is not None)


def test_prompt_tail_says_whether_the_reply_starts_thinking() -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


# ---- over HTTP: the embedded model under a Qwen3-like template, its replies steered by a
# regular expression into the shapes a reasoning model writes -----------------------------

MODEL = "smol"
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if fail is defined %}{{ raise_exception('asked to fail') }}{% endif -%}"
    "<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- elif think_in_prompt is defined and think_in_prompt %}<think>\n{% endif -%}"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THINK_THEN_ANSWER = "<think>[a-z ]{3,24}</think>\n\n(Paris|Rome)"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def with_think_tokens(model: Path, folder: Path) -> Path:
    """The embedded model whose tokenizer spells <think> and </think> as one token each, as
    Qwen3's does: two of its code-data special tokens renamed (ids 6 and 5), kept as text."""
    for item in model.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    spec = json.loads((model / "tokenizer.json").read_text())
    renamed = {"<file_sep>": "</think>", "<filename>": "<think>"}
    for token in spec["added_tokens"]:
        if token["content"] in renamed:
            token["content"], token["special"] = renamed[token["content"]], False
    vocab = spec["model"]["vocab"]
    for old, new in renamed.items():
        vocab[new] = vocab.pop(old)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def reasoning_server(model: Path, template_folder: Path) -> Iterator[ServerProcess]:
    template = template_folder / "qwen3-like.jinja"
    template.write_text(TEMPLATE)
    args = ["--model", str(model), "--served-model-name", MODEL]
    args += ["--reasoning-parser", "qwen3", "--chat-template", str(template)]
    yield from serving(ServerProcess(args))


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded model spells </think> in pieces: a grammar writes a constrained reply
    from its first token, which lets a regular expression write a whole <think> block."""
    yield from reasoning_server(smollm2_dir, tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="module")
def thinking_server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    model = with_think_tokens(smollm2_dir, tmp_path_factory.mktemp("thinking-smol"))
    yield from reasoning_server(model, tmp_path_factory.mktemp("template"))


def chat(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 60, **fields}
    status, reply = run(post(server.base_url + "/v1/chat/completions", body))
    assert status == 200, reply
    return reply


def streamed(server: ServerProcess, **fields: Any) -> tuple[str, str]:
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 60, **fields}
    chunks, _ = run(stream(server.base_url + "/v1/chat/completions", body))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return (
        "".join(d.get("reasoning_content") or "" for d in deltas),
        "".join(d.get("content") or "" for d in deltas),
    )


def test_thinking_goes_to_reasoning_content(server: ServerProcess) -> None:
    """A reply that opens <think> itself (Qwen3's hybrid models), whole and streamed."""
    message = chat(server, guided_regex=THINK_THEN_ANSWER)["choices"][0]["message"]
    assert re.fullmatch("[a-z ]{3,24}", message["reasoning_content"])
    assert message["content"] in ("Paris", "Rome")
    assert streamed(server, guided_regex=THINK_THEN_ANSWER) == (
        message["reasoning_content"],
        message["content"],
    )


def test_a_prompt_that_opens_thinking(server: ServerProcess) -> None:
    """DeepSeek-R1's and the Qwen3 thinking models' templates end the prompt with <think>
    (chat_template_kwargs reach the template here): the reply starts inside the block, so
    one cut off before </think> is all reasoning. Under a grammar the reply is the grammar's
    from its first token: an answer, no reasoning."""
    fields = {"chat_template_kwargs": {"think_in_prompt": True}, "max_tokens": 6}
    reply = chat(server, **fields, return_token_ids=True)
    choice = reply["choices"][0]
    _, raw = run(post(server.base_url + "/detokenize", {"tokens": choice["token_ids"]}))
    assert choice["finish_reason"] == "length" and raw["prompt"].strip()
    assert choice["message"]["reasoning_content"] == raw["prompt"]
    assert choice["message"]["content"] == ""
    assert streamed(server, **fields) == (raw["prompt"], "")
    plain = chat(server, max_tokens=6)
    assert reply["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_a_grammar_starts_after_the_thinking(thinking_server: ServerProcess) -> None:
    """A constrained reply thinks freely and its grammar starts after </think> (here the
    bias makes </think> the first token; the grammar then rules it out); with the block
    closed in the prompt the grammar writes the reply from its first token."""
    _, tokens = run(post(thinking_server.base_url + "/tokenize", {"prompt": "</think>"}))
    (end,) = tokens["tokens"]
    fields = {"guided_regex": "Paris", "logit_bias": {str(end): 100}, "return_token_ids": True}
    opened = chat(thinking_server, chat_template_kwargs={"think_in_prompt": True}, **fields)
    choice = opened["choices"][0]
    assert choice["token_ids"][0] == end and end not in choice["token_ids"][1:]
    assert choice["message"]["reasoning_content"] == ""
    assert choice["message"]["content"] == "Paris" and choice["finish_reason"] == "stop"
    closed = chat(thinking_server, chat_template_kwargs={"enable_thinking": False}, **fields)
    choice = closed["choices"][0]
    assert end not in choice["token_ids"]
    assert choice["message"] == {"role": "assistant", "content": "Paris", "reasoning_content": None}


def test_thinking_switched_off_in_the_template(server: ServerProcess) -> None:
    off = chat(server, chat_template_kwargs={"enable_thinking": False}, max_tokens=8)
    on = chat(server, max_tokens=8)
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    assert off["choices"][0]["message"]["reasoning_content"] is None


def test_tool_calls_after_thinking(server: ServerProcess) -> None:
    """The answer after the thinking is where tool calls are looked for."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pattern = "<think>[a-z ]{3,24}</think>\n\n" + re.escape(call)
    reply = chat(server, tools=[WEATHER], guided_regex=pattern, max_tokens=80)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"]
    (made,) = choice["message"]["tool_calls"]
    assert made["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"messages": []}, "cannot set 'messages'"), ({"fail": True}, "asked to fail")],
)
def test_template_kwargs_errors_are_400(
    server: ServerProcess, kwargs: dict[str, Any], fragment: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "chat_template_kwargs": kwargs}
    status, reply = run(post(server.base_url + "/v1/chat/completions", body))
    assert status == 400 and fragment in reply["error"]["message"], reply


def test_chat_template_option_reads_a_file_or_the_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert build_config(chat_template=str(path)).chat_template == TEMPLATE
    assert build_config(chat_template=TEMPLATE).chat_template == TEMPLATE
    with pytest.raises(ConfigError, match="no file"):
        build_config(chat_template=str(tmp_path / "missing.jinja"))


def test_offline_chat_takes_template_kwargs(
    smollm2_dir: Path, make_llm: Callable[..., LLM]
) -> None:
    """LLM.chat(..., chat_template_kwargs=...) (vLLM's) renders the template with them."""
    llm = make_llm(smollm2_dir)
    assert llm.tokenizer is not None
    llm.tokenizer.hf.chat_template = TEMPLATE
    params = SamplingParams(temperature=0, max_tokens=1)
    on, off = (
        llm.chat(ASK, params, chat_template_kwargs=kwargs)[0]
        for kwargs in (None, {"enable_thinking": False})
    )
    added = llm.tokenizer.decode(off.prompt_token_ids[len(on.prompt_token_ids) :], False)
    assert added == "<think>\n\n</think>"  # the template's whitespace control ate the rest


def test_responses_api_gives_thinking_its_own_item(server: ServerProcess) -> None:
    """/v1/responses: the <think> block as a reasoning item before the message, whole and
    as reasoning_text events, the same split as chat's."""
    message = chat(server, guided_regex=THINK_THEN_ANSWER)["choices"][0]["message"]
    body = {
        "model": MODEL,
        "input": ASK,
        "temperature": 0,
        "max_output_tokens": 60,
        "guided_regex": THINK_THEN_ANSWER,
    }
    status, reply = run(post(server.base_url + "/v1/responses", body))
    assert status == 200, reply
    reasoning, answer = reply["output"]
    assert reasoning["type"] == "reasoning" and answer["type"] == "message"
    assert reasoning["content"][0]["text"] == message["reasoning_content"]
    assert answer["content"][0]["text"] == message["content"]
    events = run(typed_events(server.base_url + "/v1/responses", body))

    def joined(kind: str) -> str:
        return "".join(e["delta"] for e in events if e["type"] == kind)

    assert joined("response.reasoning_text.delta") == message["reasoning_content"]
    assert joined("response.output_text.delta") == message["content"]
    final = events[-1]["response"]
    assert final["output"][0]["type"] == "reasoning"
    # after the block only "\n\n", the word and the end token: at most five tokens
    usage = final["usage"]
    thinking = usage["output_tokens_details"]["reasoning_tokens"]
    assert usage["output_tokens"] - 5 <= thinking < usage["output_tokens"]
    assert thinking >= len(message["reasoning_content"].split())
