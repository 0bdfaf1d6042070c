"""Server-side sampling defaults: where they come from, how they are overridden, and the
README's first request answered right with them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aserve import LLM
from aserve.cli import parse_config
from aserve.config import ConfigError, build_config
from aserve.generation_defaults import (
    EMBEDDED_MODEL_DEFAULTS,
    from_generation_config,
    resolve_defaults,
)
from aserve.sampling_params import SamplingParams
from tests.server_utils import ServerProcess, serving
from tests.test_server import get, post, run

README_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_generation_config_fields_become_defaults() -> None:
    config = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0,
        "repetition_penalty": 1.05,
        "max_new_tokens": 512,
        "do_sample": True,
        "eos_token_id": [1, 2],
    }
    assert from_generation_config(config) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
        "max_tokens": 512,
    }
    assert from_generation_config(None) == {}
    assert from_generation_config({"temperature": -3, "top_p": True, "top_k": "5"}) == {}


def test_where_defaults_come_from(tmp_path: Path) -> None:
    model = {"temperature": 0.7}
    auto, origin = resolve_defaults(build_config(), model, embedded=False)
    assert auto == {"temperature": 0.7} and "generation_config.json" in origin
    embedded, origin = resolve_defaults(build_config(), None, embedded=True)
    assert embedded == EMBEDDED_MODEL_DEFAULTS and "model card" in origin
    assert resolve_defaults(build_config(), None, embedded=False)[0] == {}
    none, _ = resolve_defaults(build_config(generation_config="none"), model, embedded=True)
    assert none == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5}))
    folder, origin = resolve_defaults(
        build_config(generation_config=str(tmp_path)), model, embedded=False
    )
    assert folder == {"top_k": 5} and str(tmp_path) in origin
    overridden, origin = resolve_defaults(
        build_config(default_sampling={"temperature": 0.1, "max_tokens": 9}), model, False
    )
    assert overridden == {"temperature": 0.1, "max_tokens": 9} and "--default-sampling" in origin
    with pytest.raises(ConfigError, match="not auto, none or a folder"):
        resolve_defaults(build_config(generation_config=str(tmp_path / "x")), None, False)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{bad", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"temp": 1}', "unknown field 'temp'"),
        ('{"temperature": 101}', "temperature must be in [0, 100]"),
        ('{"top_k": 2.5}', "top_k must be an integer"),
        ('{"top_p": "high"}', "top_p must be a number"),
    ],
)
def test_bad_default_sampling_is_one_clear_line(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_config(default_sampling=value)
    assert message in str(error.value)


def test_cli_options_reach_the_config() -> None:
    config, _ = parse_config(
        ["--generation-config", "none", "--default-sampling", '{"top_p": 0.5, "top_k": 3}']
    )
    assert config.generation_config == "none"
    assert config.default_sampling == (("top_k", 3), ("top_p", 0.5))
    result = subprocess.run(
        [sys.executable, "-m", "aserve", "--default-sampling", '{"temp": 1}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "unknown field 'temp'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_offline_api_samples_with_the_defaults(
    make_llm: Callable[..., LLM], smollm2_dir: Path
) -> None:
    llm = make_llm(smollm2_dir, default_sampling={"temperature": 0, "max_tokens": 5})
    assert llm.default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    prompt = "The capital of France is"
    (default,) = llm.generate(prompt)
    (greedy,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5))
    assert default.token_ids == greedy.token_ids and len(default.token_ids) == 5


@pytest.fixture(scope="module")
def default_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    """`aserve` with no --model, as the README starts it (the conversion cached by the
    smollm2_dir fixture is reused)."""
    cache = {"ASERVE_CACHE_DIR": str(smollm2_dir.parent.parent)}
    yield from serving(ServerProcess(["--num-pages", "2048", "--silent-output"], env=cache))


def test_readme_example_answers_paris(default_server: ServerProcess) -> None:
    """The README's curl request (no sampling fields) asked ten times with seeds 0-9: the
    model card's sampling answers it right, where OpenAI's temperature 1 often did not."""
    url = default_server.base_url
    status, body = run(get(url + "/v1/models"))
    card = json.loads(body)["data"][0]
    assert status == 200 and card["default_sampling_params"] == EMBEDDED_MODEL_DEFAULTS
    answers = []
    for seed in range(10):
        status, reply = run(
            post(url + "/v1/chat/completions", {"messages": README_QUESTION, "seed": seed})
        )
        assert status == 200, reply
        answers.append(reply["choices"][0]["message"]["content"])
    paris = sum("Paris" in answer for answer in answers)
    print(f"\nREADME question, 10 seeded tries: {paris} mention Paris")
    assert paris >= 8, answers
    assert "repetition_penalty=1.1, temperature=0.2, top_p=0.9" in default_server.log()
