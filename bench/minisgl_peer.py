"""mini-SGLang as a benchmark peer (`bench/offline.py --peer minisgl`), benchmark-only.

It runs from a source checkout on PYTHONPATH (`python/` of github.com/sgl-project/mini-sglang:
its dense path needs FlashInfer and tvm-ffi, which the GPU machine's wheels bring), in a
process of its own, as `bench/offline.py` starts it. mini-SGLang loads a tokenizer from the
model folder even when it is fed token ids; the benchmark shapes have none, so the peer runs
on a copy of the folder with a stand-in word-level tokenizer of the model's vocabulary size
and end-of-sequence id (the work is token ids either way, and `ignore_eos` is set).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

Workload = list[tuple[list[int], int]]


CHAT_TEMPLATE = (
    "{% for m in messages %}<t1> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<t2> {% endif %}"
)
"""The stand-in's chat template: a user turn is `<t1>` then its text, the reply starts after
`<t2>` (a text of stand-in words re-tokenizes to exactly its ids, plus these)."""


def tokenizer_folder(model_dir: Path, into: Path) -> Path:
    """`into`, holding `model_dir`'s config.json and a word-level tokenizer whose tokens are
    `<t0>` .. `<tN-1>` for the config's vocabulary size, with its end-of-sequence token. Words
    are split at spaces, so `" ".join(f"<t{i}>" for i in ids)` is a text prompt of exactly
    `ids` (bench/serving.py's text and chat prompts on a benchmark shape)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_dir / "config.json", into / "config.json")
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else int(eos or 0)
    vocab = {f"<t{i}>": i for i in range(int(config["vocab_size"]))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(into / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": f"<t{eos}>",
        "chat_template": CHAT_TEMPLATE,
    }
    (into / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return into


def run_minisgl(args: argparse.Namespace, workload: Workload, scratch: Path) -> tuple[int, float]:
    """Load mini-SGLang on `args.model` with the benchmark's settings, warm it up, and time
    `workload` (sampling as its own benchmark: temperature, `ignore_eos`). Returns (output
    tokens asked for and made, seconds)."""
    try:
        from minisgl.core import SamplingParams
        from minisgl.llm import LLM
    except ImportError as error:
        raise SystemExit(
            f"--peer minisgl needs mini-SGLang's python/ folder on PYTHONPATH ({error})"
        ) from None
    folder = tokenizer_folder(Path(args.model), scratch / "minisgl-model")
    llm = LLM(
        str(folder),
        use_dummy_weight=args.dummy_weight,
        max_seq_len_override=args.max_seq_len,
        max_extend_tokens=args.max_prefill_length,
        max_running_req=args.max_running_requests,
        cuda_graph_max_bs=args.cuda_graph_max_bs or 256,
        page_size=args.page_size,
        # Its own choice on Hopper is "fa,fi", FA3 prefill from the sgl-kernel wheel (hundreds
        # of MB, not carried); FlashInfer for both phases is what aserve runs too.
        attention_backend="fi",
    )
    llm.generate([list(range(1, 17))], SamplingParams(temperature=0.1, max_tokens=4))
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
        for _, n in workload
    ]
    started = time.perf_counter()
    results = llm.generate([prompt for prompt, _ in workload], params)
    seconds = time.perf_counter() - started
    # Its offline API leaves out a last token that happens to be the end-of-sequence id.
    made = [len(result["token_ids"]) for result in results]
    assert all(m >= n - 1 for m, (_, n) in zip(made, workload)), "mini-SGLang stopped early"
    return sum(n for _, n in workload), seconds
