"""bench/offline.py's `--peer minisgl`: each engine in a process of its own per workload, the
same workload for both, and the stand-in tokenizer that mini-SGLang needs beside a shape-only
model folder. A small stand-in for mini-SGLang's offline API (its `LLM` and `SamplingParams`)
takes the peer's place here; the real one runs on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.minisgl_peer import tokenizer_folder
from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parent.parent

FAKE_LLM = '''
import json, os
from transformers import AutoTokenizer

class LLM:
    """Checks what the real one needs of the folder, logs each call, makes max_tokens ids."""

    def __init__(self, model_path, **options):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = json.load(open(os.path.join(model_path, "config.json")))
        assert tokenizer.eos_token_id == config["eos_token_id"], tokenizer.eos_token_id
        self.log = os.environ["FAKE_MINISGL_LOG"]
        self.options = options

    def generate(self, prompts, params):
        with open(self.log, "a") as log:
            log.write(json.dumps([[len(p) for p in prompts], self.options["use_dummy_weight"]]))
            log.write("\\n")
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [{"text": "", "token_ids": [0] * p.max_tokens} for p in params]
'''

FAKE_CORE = """
from dataclasses import dataclass

@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024
"""


def test_minisgl_peer_runs_the_same_workload_in_its_own_process(tmp_path: Path) -> None:
    fake = tmp_path / "fake" / "minisgl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(FAKE_CORE)
    (fake / "llm.py").write_text(FAKE_LLM)
    model = make_tiny_model("llama", tmp_path / "tiny", overrides={"vocab_size": 10240})
    log = tmp_path / "calls.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}",
        "FAKE_MINISGL_LOG": str(log),
        "ASERVE_CACHE_DIR": str(tmp_path / "cache"),
    }
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "offline.py"), "--model", str(model)]
        + ["--dummy-weight", "--num-seqs", "3", "--input-len", "4", "9", "--output-len", "2"]
        + ["5", "--max-seq-len", "64", "--temperature", "0", "--peer", "minisgl"]
        + ["--repeat", "2", "--no-record"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    ours = next(line for line in lines if line.startswith("aserve "))
    theirs = next(line for line in lines if line.startswith("mini-SGLang "))
    assert ours.split()[1] == theirs.split()[1], (ours, theirs)  # the same output tokens
    assert any(line.startswith("aserve/mini-SGLang") for line in lines)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    timed = [lengths for lengths, dummy in calls if len(lengths) == 3 and dummy]
    assert len(timed) == 2 and timed[0] != timed[1], calls  # one process a workload


def test_stand_in_tokenizer_has_the_vocabulary_and_eos(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = tmp_path / "shape"
    model.mkdir()
    config = {"vocab_size": 1000, "eos_token_id": [7, 9], "architectures": ["LlamaForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config))
    folder = tokenizer_folder(model, tmp_path / "with-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.eos_token_id == 7 and len(tokenizer) == 1000
    assert tokenizer.decode([3, 999]).split() == ["<t3>", "<t999>"]
    ids = [5, 17, 999, 0, 3]
    assert tokenizer.encode(" ".join(f"<t{i}>" for i in ids), add_special_tokens=False) == ids
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<t5> <t6>"}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.encode(chat, add_special_tokens=False) == [1, 5, 6, 2]


def test_constrained_requests_keep_the_token_totals(tmp_path: Path, smollm2_dir: Path) -> None:
    """`--constrained N`: N requests decode under the endless grammar, so none ends early (the
    totals equal the free run's), and what they write is its records; a shape-only folder
    borrows the embedded tokenizer."""
    from aserve import LLM, SamplingParams
    from bench.offline import ENDLESS_GRAMMAR, run_aserve, with_tokenizer

    tiny = make_tiny_model("llama", tmp_path / "tiny")
    borrowed = with_tokenizer(str(tiny), tmp_path)
    assert borrowed != str(tiny) and (Path(borrowed) / "tokenizer.json").is_file()
    assert with_tokenizer(str(smollm2_dir), tmp_path) == str(smollm2_dir)
    workload = [([5 + i, 17, 42, 9], 10 + i) for i in range(4)]
    with LLM(str(smollm2_dir), num_pages=512) as llm:
        tokens, _ = run_aserve(llm, workload, 0.6, False, constrained=2)
        assert tokens == sum(n for _, n in workload)
        text = llm.generate(
            [[5, 17]], SamplingParams(max_tokens=12, ignore_eos=True, grammar=ENDLESS_GRAMMAR)
        )[0].text
    assert text.startswith('{"k": ') and len(text) > len('{"k": ')
