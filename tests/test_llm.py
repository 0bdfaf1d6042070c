"""The offline API end to end on a tiny random Llama: sampling semantics through the real
scheduler, logprobs against transformers, error results, aborts and option plumbing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ConfigError
from aserve.scheduler.request import FinishReason
from tests.scenarios import abort_one_of_two
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 42, 9, 100, 3], [300, 4, 4, 61, 7, 7, 7, 8, 250], [11, 12]]
BENCH_QWEN3 = Path(__file__).resolve().parent.parent / "bench" / "models" / "qwen3-0.6b"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_same_seed_same_tokens_whatever_the_batch(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tokens(llm, [PROMPTS[0]], params)[0]
    other = SamplingParams(temperature=0.7, seed=9, max_tokens=30, ignore_eos=True)
    crowded = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [other, params, other])
    assert crowded[1].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=20)
    assert tokens(llm, [PROMPTS[0]], different_seed)[0] != alone


def test_top_k_one_equals_greedy(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny)
    greedy = tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    top1 = tokens(
        llm, PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True)
    )
    assert top1 == greedy


def test_presence_and_frequency_penalties_stop_repetition(
    make_llm: Callable[..., LLM], tiny: Path
) -> None:
    llm = make_llm(tiny)
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = tokens(llm, PROMPTS, base)
    assert any(len(set(t)) < len(t) for t in plain), "the tiny model should repeat itself"
    for field in ("presence_penalty", "frequency_penalty"):
        penalised = tokens(llm, PROMPTS, dataclasses.replace(base, **{field: 2.0}))
        repeats = sum(len(t) - len(set(t)) for t in penalised)
        assert repeats < sum(len(t) - len(set(t)) for t in plain), field


def test_penalty_counts_kept_between_steps_sample_as_rebuilt_ones(
    make_llm: Callable[..., LLM], tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling batches with penalties are reused, their counts updated in place
    (scheduler/batch.py): the same tokens as packing every step afresh, with rows of
    different lengths leaving the batch and the three penalties mixed across rows."""
    from aserve.scheduler.batch import SamplingBatches

    llm = make_llm(tiny)
    params = [
        SamplingParams(
            temperature=0.9, seed=1, max_tokens=20, repetition_penalty=1.3, ignore_eos=True
        ),
        SamplingParams(
            temperature=0.9, seed=2, max_tokens=12, frequency_penalty=0.7, ignore_eos=True
        ),
        SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.5, ignore_eos=True),
    ]
    build = SamplingBatches.build

    def afresh(self: SamplingBatches, planned: Any) -> Any:
        self._last, self._counted = None, None  # nothing kept: every count from the histories
        return build(self, planned)

    kept = [out.token_ids for out in llm.generate(PROMPTS, params)]
    monkeypatch.setattr(SamplingBatches, "build", afresh)
    rebuilt = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert kept == rebuilt
    assert [len(t) for t in kept] == [20, 12, 16]


def test_repetition_penalty_avoids_prompt_tokens(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny)
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = PROMPTS[0] + tokens(llm, [PROMPTS[0]], base)[0]
    plain = tokens(llm, [prompt], base)[0]
    penalised = tokens(llm, [prompt], dataclasses.replace(base, repetition_penalty=10.0))[0]
    assert sum(t in prompt for t in penalised) < sum(t in prompt for t in plain)


def test_logprobs_match_transformers(make_llm: Callable[..., LLM], tiny: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    llm = make_llm(tiny)
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    out = llm.generate([PROMPTS[1]], params)[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPTS[1] + out.token_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)[len(PROMPTS[1]) - 1 : -1]
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(expected[step, token].item(), abs=1e-4)
        assert [i for i, _ in lp.top] == expected[step].topk(3).indices.tolist()
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_stop_token_ids_end_with_stop(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny)
    plain = tokens(
        llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    stop_at = plain[4]
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == plain[: plain.index(stop_at) + 1]


def test_eos_stops_unless_ignored(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny)
    plain = tokens(
        llm, [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    llm.scheduler.eos_ids = frozenset({plain[2]})
    stopped = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=10))[0]
    assert (
        stopped.finish_reason == "stop" and stopped.token_ids == plain[: plain.index(plain[2]) + 1]
    )
    ignored = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == plain


def test_bad_prompts_end_with_an_error_and_spare_the_others(
    make_llm: Callable[..., LLM], tiny: Path
) -> None:
    llm = make_llm(tiny, max_seq_len_override=32)
    params = SamplingParams(temperature=0, max_tokens=8)
    too_long = list(range(1, 40))
    outputs = llm.generate([too_long, PROMPTS[0], [999], []], params)
    assert (
        outputs[0].finish_reason == "error"
        and "39" in outputs[0].error
        and "32" in outputs[0].error
    )
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 8
    assert outputs[2].finish_reason == "error" and "999" in outputs[2].error
    assert outputs[3].finish_reason == "error" and "empty" in outputs[3].error


def test_context_limit_ends_with_length(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny, max_seq_len_override=12)
    out = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length" and len(PROMPTS[1]) + len(out.token_ids) == 12


def test_context_is_capped_at_the_pool_size(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny, num_pages=8, page_size=1)
    assert llm.runtime.engine.max_seq_len == 7
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=20))[0]
    assert out.finish_reason == "error" and "context holds 7" in out.error
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1


def test_abort_frees_pages_and_spares_the_others(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = tokens(llm, [PROMPTS[1]], params)[0]

    reason, produced = abort_one_of_two(llm, PROMPTS[0], PROMPTS[1], params, 1)
    assert reason is FinishReason.ABORT
    assert produced == expected


def test_options_reach_the_engine(make_llm: Callable[..., LLM], tiny: Path) -> None:
    llm = make_llm(tiny, page_size=16, num_pages=64, max_running_requests=4, cache_type="naive")
    assert llm.runtime.engine.num_pages == 64
    assert llm.runtime.engine.page_table.slots.shape[0] == 5
    assert llm.scheduler.allocator.page_size == 16
    assert type(llm.scheduler.cache).__name__ == "NaiveCache"
    with pytest.raises(ConfigError, match="unknown option"):
        LLM(str(tiny), no_such_option=1)
    with pytest.raises(ConfigError, match="cache"):
        LLM(str(tiny), cache_type="lru")


@pytest.mark.skipif(not BENCH_QWEN3.exists(), reason="bench/models/qwen3-0.6b not present")
def test_dummy_weights_run_from_a_config_alone(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    import json

    config = json.loads((BENCH_QWEN3 / "config.json").read_text())
    config.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, vocab_size=512)
    config.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = make_llm(tmp_path, dummy_weight=True, num_pages=256)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.text == ""


def test_failing_step_ends_its_requests_and_the_loop_goes_on(
    make_llm: Callable[..., LLM], tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make_llm(tiny)
    engine = llm.runtime.engine
    real_forward = engine.forward_logits
    calls = {"n": 0}

    def flaky_forward(*args: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("kernel fault")
        return real_forward(*args)

    monkeypatch.setattr(engine, "forward_logits", flaky_forward)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    failed = llm.generate([PROMPTS[0]], params)[0]
    assert failed.finish_reason == "error" and "kernel fault" in failed.error
    assert llm.generate([PROMPTS[0]], params)[0].finish_reason == "length"


def test_tokenizer_loads_while_the_engine_starts(
    make_llm: Callable[..., LLM], tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer's load waits here until the engine has begun: loaded one after the
    other (tokenizer first), it would time out."""
    from aserve import runtime

    engine_began = threading.Event()
    real_start = runtime.start_engine

    def starting(*args: Any) -> Any:
        engine_began.set()
        return real_start(*args)

    seen: list[bool] = []

    def load(self: runtime.Runtime, num_threads: int) -> None:
        seen.append(engine_began.wait(timeout=30))

    monkeypatch.setattr(runtime, "start_engine", starting)
    monkeypatch.setattr(runtime.Runtime, "_load_tokenizer", load)
    llm = make_llm(tiny)
    assert seen == [True]
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids


def test_setuptools_is_imported_before_the_tokenizer_thread_starts(tiny: Path) -> None:
    """setuptools' import takes a finder in and out of the front of sys.meta_path, which made
    a concurrent import in the tokenizer's thread miss installed packages now and then; the
    start imports it before that thread exists. In a fresh interpreter, where nothing has
    imported it yet."""
    script = f"""
import sys
from aserve import LLM, runtime
seen = []
runtime.Runtime._load_tokenizer = lambda self, n: seen.append("setuptools" in sys.modules)
LLM({str(tiny)!r}, num_pages=64)
print("imported first:", seen)
"""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "imported first: [True]" in done.stdout, done.stdout


def test_a_failure_of_either_start_is_raised_and_the_other_closed(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aserve import runtime

    closed: list[str] = []

    class Loaded:
        def close(self) -> None:
            closed.append("tokenizer")

    def broken_engine(*args: Any) -> Any:
        raise ConfigError("engine broke")

    monkeypatch.setattr(runtime.Runtime, "_load_tokenizer", lambda self, n: Loaded())
    monkeypatch.setattr(runtime, "start_engine", broken_engine)
    with pytest.raises(ConfigError, match="engine broke"):
        LLM(str(tiny), num_pages=64)
    assert closed == ["tokenizer"]

    def broken_tokenizer(self: runtime.Runtime, num_threads: int) -> None:
        raise RuntimeError("tokenizer broke")

    monkeypatch.undo()
    monkeypatch.setattr(runtime.Runtime, "_load_tokenizer", broken_tokenizer)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        LLM(str(tiny), num_pages=64)
