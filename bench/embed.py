"""Embedding throughput: the same inputs through aserve's embedding engine (`--is-embedding`,
`LLM.embed`) and, with `--peer transformers`, transformers' base model (batches padded on the
left, the last token pooled and made unit length, as Qwen3-Embedding's model card runs it)
or, with `--peer llamacpp` on a GGUF file, llama.cpp (bench/llamacpp_embedder.py), in one
process, engines alternating; prints a table and appends each engine's median run to
bench/results.jsonl. A BERT-style encoder's peer pads on the right and pools [CLS] (its
first token), as sentence-transformers runs bge and all-MiniLM. Input tokens a second are
the figure; both engines count the inputs' own tokens (not the peer's padding), so equal
totals show identical work. Each repeat draws
new inputs (the same for both engines), and a draw of its own warms both up: inputs seen
before would come from aserve's prefix cache. With `--labels N` both engines run the model
as a sequence classifier of N labels instead (its `*ForSequenceClassification`, a copy of
the folder with that architecture; aserve's `LLM.classify`, transformers' classifier on
the same left-padded batches), a reranker's work with `--labels 1`.

    python bench/embed.py --model bench/models/qwen3-0.6b --dummy-weight --peer transformers
    python bench/embed.py --model FILE.gguf --peer llamacpp --num-inputs 64 --dtype float32
    python bench/embed.py --model bench/models/qwen3-0.6b --dummy-weight --peer transformers \
        --labels 1

(Leave the peer room on the GPU: `--memory-ratio 0.5` beside an 8B model.)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from aserve import LLM  # noqa: E402
from bench.common import new_run_id, record  # noqa: E402

Inputs = list[list[int]]
Runner = Callable[[Inputs], tuple[float, np.ndarray]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dummy-weight", action="store_true")
    parser.add_argument("--num-inputs", type=int, default=1024)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--peer", choices=["transformers", "llamacpp"])
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--peer-batch", type=int, default=32, help="the peer's batch size")
    parser.add_argument(
        "--memory-ratio", type=float, default=0.9, help="aserve's share of GPU memory"
    )
    parser.add_argument(
        "--labels", type=int, default=0, help="run the model as a classifier of this many labels"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="")
    return parser.parse_args()


def classifier_folder(model: str, labels: int) -> str:
    """A copy of the model folder as its `*ForSequenceClassification` of `labels` labels
    (padding id: the vocabulary's last, which the draws never take)."""
    folder = Path(tempfile.mkdtemp(prefix="aserve-classifier-"))
    shutil.copytree(model, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    architecture = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    config["architectures"] = [architecture]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(labels)}
    config["pad_token_id"] = config["vocab_size"] - 1
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def draw(args: argparse.Namespace, seed: int) -> Inputs:
    rng = random.Random(seed)
    return [
        [rng.randint(1, 10000) for _ in range(rng.randint(*args.input_len))]
        for _ in range(args.num_inputs)
    ]


def aserve_runner(args: argparse.Namespace) -> Runner:
    llm = LLM(
        args.model,
        dummy_weight=args.dummy_weight,
        is_embedding=not args.labels,
        dtype=args.dtype,
        max_prefill_length=16384,
        memory_ratio=args.memory_ratio,
    )

    def pooled(inputs: Inputs) -> list[list[float] | None]:
        if args.labels:
            return [o.classification and o.classification.probs for o in llm.classify(inputs)]
        return [out.embedding for out in llm.embed(inputs)]

    pooled([[1, 2, 3]])

    def run(inputs: Inputs) -> tuple[float, np.ndarray]:
        started = time.perf_counter()
        outputs = pooled(inputs)
        seconds = time.perf_counter() - started
        assert all(out is not None for out in outputs)
        return seconds, np.array(outputs, np.float32)

    return run


def llamacpp_runner(args: argparse.Namespace) -> Runner:
    from aserve.models.gguf_header import read_header
    from bench.llamacpp_embedder import LlamaCppEmbedder

    longest = args.input_len[1]
    metadata = read_header(Path(args.model)).metadata
    file_pools = f"{metadata['general.architecture']}.pooling_type" in metadata
    peer = LlamaCppEmbedder(Path(args.model), args.threads, 16, max(4096, longest), file_pools)

    def run(inputs: Inputs) -> tuple[float, np.ndarray]:
        started = time.perf_counter()
        vectors = peer.embed(inputs)
        return time.perf_counter() - started, vectors

    return run


def transformers_runner(args: argparse.Namespace) -> Runner:
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    kind = (
        transformers.AutoModelForSequenceClassification if args.labels else transformers.AutoModel
    )
    if args.dummy_weight:
        config = transformers.AutoConfig.from_pretrained(args.model)
        with torch.device(device):
            model = kind.from_config(config, dtype=dtype)
    else:
        model = kind.from_pretrained(args.model, dtype=dtype).to(device)
    model.eval()
    pad = model.config.pad_token_id or 0
    encoder = model.config.model_type in ("bert", "roberta", "xlm-roberta", "modernbert")

    @torch.inference_mode()
    def run(inputs: Inputs) -> tuple[float, np.ndarray]:
        started = time.perf_counter()
        rows = []
        for start in range(0, len(inputs), args.peer_batch):
            chunk = inputs[start : start + args.peer_batch]
            longest = max(map(len, chunk))
            ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
            mask = torch.zeros(len(chunk), longest, dtype=torch.long)
            for row, prompt in enumerate(chunk):
                start = 0 if encoder else longest - len(prompt)
                ids[row, start : start + len(prompt)] = torch.tensor(prompt)
                mask[row, start : start + len(prompt)] = 1
            out = model(ids.to(device), attention_mask=mask.to(device))
            if args.labels:  # the classifier scores the last token that is not padding
                rows.append(torch.softmax(out.logits.float(), dim=-1).cpu())
                continue
            hidden = out.last_hidden_state
            pooled = hidden[:, 0] if encoder else hidden[:, -1]
            rows.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
        return time.perf_counter() - started, torch.cat(rows).numpy()

    return run


def main() -> None:
    args = parse_args()
    model_name = Path(args.model).name
    if args.labels:
        args.model = classifier_folder(args.model, args.labels)
    engines = {"aserve": aserve_runner(args)}
    if args.peer == "transformers":
        engines["transformers"] = transformers_runner(args)
    if args.peer == "llamacpp":
        engines["llama.cpp"] = llamacpp_runner(args)
    for run in engines.values():
        run(draw(args, args.seed + args.repeat))
    draws = [draw(args, args.seed + r) for r in range(args.repeat)]
    counts = [sum(map(len, inputs)) for inputs in draws]
    runs: dict[str, list[float]] = {name: [] for name in engines}
    vectors: dict[str, np.ndarray] = {}
    for inputs in draws:
        for name, run in engines.items():
            seconds, vectors[name] = run(inputs)
            runs[name].append(seconds)
    run_id = new_run_id()
    settings = {
        "num_inputs": args.num_inputs,
        "input_len": args.input_len,
        "dtype": args.dtype,
        "peer_batch": args.peer_batch,
        "dummy_weight": args.dummy_weight,
        "labels": args.labels,
    }
    task = f"a classifier of {args.labels} labels" if args.labels else "embeddings"
    print(
        f"{task}: {args.num_inputs} inputs a draw, {'/'.join(map(str, counts))} tokens; input "
        f"tokens a second, the median draw of {args.repeat}"
    )
    if len(vectors) == 2 and not args.dummy_weight:  # the same weights: the same embeddings?
        ours, theirs = vectors.values()
        cosines = (ours * theirs).sum(axis=1)
        low, mean = float(cosines.min()), float(cosines.mean())
        print(
            f"cosine of the last draw's embeddings, engine to engine: min {low:.4f}, "
            f"mean {mean:.4f}"
        )
    print(f"{'engine':14s} {'tokens':>8s} {'seconds':>9s} {'tok/s':>10s}  draws")
    for name, seconds in runs.items():
        rates = [n / s for n, s in zip(counts, seconds, strict=True)]
        middle = sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]
        shown = " ".join(f"{rate:,.0f}" for rate in rates)
        figures = f"{counts[middle]:8d} {seconds[middle]:9.3f} {rates[middle]:10,.0f}"
        print(f"{name:14s} {figures}  {shown}")
        record(
            "classify" if args.labels else "embed",
            name,
            model_name,
            settings,
            counts[middle],
            seconds[middle],
            run_id,
            runs_tok_s=[round(rate, 1) for rate in rates],
            note=args.note,
        )


if __name__ == "__main__":
    main()
