"""Embedding throughput: the same inputs through aserve's embedding engine (`--is-embedding`,
`LLM.embed`) and, with `--peer transformers`, transformers' base model (batches padded on the
left, the last token pooled and made unit length, as Qwen3-Embedding's model card runs it),
in one process, engines alternating; prints a table and appends each engine's median run to
bench/results.jsonl. Input tokens a second are the figure; both engines count the inputs'
own tokens (not the peer's padding), so equal totals show identical work.

    python bench/embed.py --model bench/models/qwen3-0.6b --dummy-weight --peer transformers
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from aserve import LLM  # noqa: E402
from bench.common import new_run_id, record  # noqa: E402

Inputs = list[list[int]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dummy-weight", action="store_true")
    parser.add_argument("--num-inputs", type=int, default=1024)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--peer", choices=["transformers"])
    parser.add_argument("--peer-batch", type=int, default=32, help="the peer's batch size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="")
    return parser.parse_args()


def draw(args: argparse.Namespace) -> Inputs:
    rng = random.Random(args.seed)
    return [
        [rng.randint(0, 10000) for _ in range(rng.randint(*args.input_len))]
        for _ in range(args.num_inputs)
    ]


def aserve_runner(args: argparse.Namespace) -> Callable[[Inputs], float]:
    llm = LLM(
        args.model,
        dummy_weight=args.dummy_weight,
        is_embedding=True,
        dtype=args.dtype,
        max_prefill_length=16384,
    )
    llm.embed([[1, 2, 3]])

    def run(inputs: Inputs) -> float:
        started = time.perf_counter()
        outputs = llm.embed(inputs)
        seconds = time.perf_counter() - started
        assert all(out.embedding is not None for out in outputs)
        return seconds

    return run


def transformers_runner(args: argparse.Namespace) -> Callable[[Inputs], float]:
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    if args.dummy_weight:
        config = transformers.AutoConfig.from_pretrained(args.model)
        with torch.device(device):
            model = transformers.AutoModel.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModel.from_pretrained(args.model, dtype=dtype).to(device)
    model.eval()

    @torch.inference_mode()
    def run(inputs: Inputs) -> float:
        started = time.perf_counter()
        for start in range(0, len(inputs), args.peer_batch):
            chunk = inputs[start : start + args.peer_batch]
            longest = max(map(len, chunk))
            ids = torch.zeros(len(chunk), longest, dtype=torch.long)
            mask = torch.zeros(len(chunk), longest, dtype=torch.long)
            for row, prompt in enumerate(chunk):
                ids[row, longest - len(prompt) :] = torch.tensor(prompt)
                mask[row, longest - len(prompt) :] = 1
            hidden = model(ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            torch.nn.functional.normalize(hidden[:, -1].float(), dim=-1).cpu()
        return time.perf_counter() - started

    return run


def main() -> None:
    args = parse_args()
    inputs = draw(args)
    tokens = sum(map(len, inputs))
    engines = {"aserve": aserve_runner(args)}
    if args.peer == "transformers":
        engines["transformers"] = transformers_runner(args)
        engines["transformers"](inputs[: args.peer_batch])  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeat):
        for name, run in engines.items():
            runs[name].append(run(inputs))
    run_id = new_run_id()
    settings = {
        "num_inputs": args.num_inputs,
        "input_len": args.input_len,
        "dtype": args.dtype,
        "peer_batch": args.peer_batch,
        "dummy_weight": args.dummy_weight,
    }
    print(f"{len(inputs)} inputs, {tokens} tokens; input tokens a second, median of {args.repeat}")
    print(f"{'engine':14s} {'seconds':>9s} {'tok/s':>10s}  runs")
    for name, seconds in runs.items():
        median = sorted(seconds)[len(seconds) // 2]
        shown = " ".join(f"{tokens / s:,.0f}" for s in seconds)
        print(f"{name:14s} {median:9.3f} {tokens / median:10,.0f}  {shown}")
        record(
            "embed",
            name,
            Path(args.model).name,
            settings,
            tokens,
            median,
            run_id,
            runs_tok_s=[round(tokens / s, 1) for s in seconds],
            note=args.note,
        )


if __name__ == "__main__":
    main()
