"""Offline throughput: mini-SGLang's workload through `aserve.LLM`, optionally with the
Hugging Face transformers peer on the same model and workload in the same run.

    python bench/offline.py                                  # embedded SmolLM2, small CPU run
    python bench/offline.py --model bench/models/qwen3-0.6b --dummy-weight \\
        --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6 \\
        --max-seq-len 4096 --max-prefill-length 16384 --cuda-graph-max-bs 256 --page-size 256
    python bench/offline.py --model bench/models/qwen3-30b-a3b --dummy-weight --moe-backend fused \\
        --num-seqs 256 --max-seq-len 4096 --cuda-graph-max-bs 256 --page-size 256
    python bench/offline.py --peer hf --num-seqs 16 --max-running-requests 16 \\
        --input-len 128 128 --output-len 64 64 --temperature 0
    python bench/offline.py --peer llamacpp --num-seqs 16 --max-running-requests 16 \\
        --input-len 128 128 --output-len 64 64 --temperature 0 --repeat 3
    PYTHONPATH=mini-sglang/python python bench/offline.py --model bench/models/qwen3-0.6b \\
        --dummy-weight --num-seqs 256 --cuda-graph-max-bs 256 --peer minisgl --repeat 2
    python bench/offline.py --model bench/models/qwen3-0.6b --dummy-weight --num-seqs 256 \\
        --constrained 26     # 26 of the 256 requests (10%) under a grammar

`--constrained N` puts N requests, spread over the workload, under `ENDLESS_GRAMMAR`: its
masks are as selective as a JSON schema's, and it never lets a request end, so the token
totals stay those of the free run. The warm-up compiles it first, as a server that has
served the schema before holds it in its compile cache (the first use, printed, is mostly
xgrammar's import and vocabulary tables). A model folder without a tokenizer (the shape-only
bench models) borrows the embedded model's for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve import LLM, SamplingParams  # noqa: E402
from bench.common import new_run_id, random_workload, record  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="aserve offline throughput benchmark")
    p.add_argument("--model", default=None, help="model folder or .gguf (default: embedded)")
    p.add_argument("--dummy-weight", action="store_true")
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--max-prefill-length", type=int, default=16384)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--memory-ratio", type=float, default=0.9, help="as the server's option")
    p.add_argument(
        "--swa-full-tokens-ratio", type=float, default=0.8, help="as the server's option"
    )
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--moe-backend", default="auto", help="MoE models: auto, torch or fused")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="auto, none, int8, int4 or fp8")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8_e4m3")
    p.add_argument("--seeded", action="store_true", help="give every request its own seed")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    p.add_argument(
        "--peer",
        choices=["hf", "llamacpp", "minisgl"],
        default=None,
        help="also run this peer: transformers, llama.cpp on the same GGUF (CPU, greedy), or "
        "mini-SGLang (a source checkout on PYTHONPATH; each engine in a process of its own)",
    )
    p.add_argument("--child", choices=["aserve", "minisgl"], help=argparse.SUPPRESS)
    p.add_argument("--child-workload", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument(
        "--hf-cache", default=None, help="transformers cache_implementation, e.g. static"
    )
    p.add_argument(
        "--hf-mode",
        choices=["generate", "continuous"],
        default="generate",
        help="the peer's API: batched `generate`, or continuous batching (`generate_batch`)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per engine, each on a workload with its own seed; the median is recorded",
    )
    p.add_argument(
        "--constrained",
        type=int,
        default=0,
        help="requests under a grammar (spread over the workload), to time constrained decoding",
    )
    p.add_argument("--no-record", action="store_true", help="print only, append nothing")
    return p.parse_args()


Workload = list[tuple[list[int], int]]
ENDLESS_GRAMMAR = 'root ::= "{\\"k\\": " [0-9]+ ", " root'
"""Records like JSON's, one after another, never closed: no string it allows can end."""


def with_tokenizer(model: str | None, scratch: Path) -> str | None:
    """`model`, or a copy of its config beside the embedded model's tokenizer where it has no
    tokenizer of its own (a grammar needs one; ids past that vocabulary are never allowed)."""
    from aserve.models.source import resolve_model
    from aserve.tokenizer import has_tokenizer

    if model is None or has_tokenizer(Path(model)):
        return model
    folder = scratch / "with-tokenizer"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text((Path(model) / "config.json").read_text())
    embedded = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((embedded / name).read_text())
    return str(folder)


def build_llm(args: argparse.Namespace) -> LLM:
    model = args.model
    if args.constrained:
        model = with_tokenizer(model, Path(tempfile.mkdtemp(prefix="aserve-bench-")))
    llm = LLM(
        model,
        dummy_weight=args.dummy_weight,
        max_seq_len_override=args.max_seq_len,
        max_prefill_length=args.max_prefill_length,
        max_running_requests=args.max_running_requests,
        page_size=args.page_size,
        num_pages=args.num_pages,
        memory_ratio=args.memory_ratio,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        attention_backend=args.attention_backend,
        moe_backend=args.moe_backend,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.runtime.engine
    print(f"weights {engine.weight_bytes / 2**30:.2f} GiB", flush=True)
    windowed = (engine.window_pages - 1) * args.page_size
    window = f", {windowed} in the windowed layers" if engine.window_pages else ""
    print(
        f"KV cache {engine.kv_cache_bytes / 2**30:.2f} GiB: "
        f"{(engine.num_pages - 1) * args.page_size} tokens{window}",
        flush=True,
    )
    llm.generate([list(range(1, 17))], SamplingParams(max_tokens=4, ignore_eos=True))
    if args.constrained:  # once per server: xgrammar's import, its vocabulary tables, a compile
        started = time.perf_counter()
        warm = SamplingParams(max_tokens=4, ignore_eos=True, grammar=ENDLESS_GRAMMAR)
        llm.generate([list(range(1, 17))], warm)
        print(f"grammar backend ready in {time.perf_counter() - started:.2f} s", flush=True)
    return llm


def run_aserve(
    llm: LLM, workload: Workload, temperature: float, seeded: bool, constrained: int = 0
) -> tuple[int, float]:
    """Requests carry no seed unless `seeded`, as in mini-SGLang's benchmark: on CUDA a seeded
    request takes the slower batch-invariant sampling path (aserve/engine/sampler.py).
    `constrained` of them, spread evenly, decode under ENDLESS_GRAMMAR."""
    under = {i * len(workload) // constrained for i in range(constrained)} if constrained else set()
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=n,
            ignore_eos=True,
            seed=i if seeded else None,
            grammar=ENDLESS_GRAMMAR if i in under else None,
        )
        for i, (_, n) in enumerate(workload)
    ]
    started = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(n for _, n in workload), "every request must produce its tokens"
    return tokens, seconds


def median_run(runs: list[tuple[int, float]]) -> tuple[int, float]:
    """The run with the median throughput (runs are few; ties take the lower one)."""
    ordered = sorted(runs, key=lambda r: r[0] / r[1])
    return ordered[(len(ordered) - 1) // 2]


def report(name: str, runs: list[tuple[int, float]]) -> tuple[int, float]:
    tokens, seconds = median_run(runs)
    spread = ", ".join(f"{t / s:.1f}" for t, s in runs)
    print(
        f"{name:<12} {tokens:>8} tokens {seconds:8.2f} s {tokens / seconds:10.1f} tok/s "
        f"(median of {len(runs)}: {spread})"
    )
    return tokens, seconds


def run_in_processes(
    args: argparse.Namespace, workloads: list[Workload]
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """`--peer minisgl`: per workload, each engine in a process of its own (two engines do not
    fit one GPU's memory), which one goes first alternating from workload to workload."""
    ours: list[tuple[int, float]] = []
    peers: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, workload in enumerate(workloads):
            path = Path(scratch) / f"workload-{index}.json"
            path.write_text(json.dumps(workload))
            order = ("aserve", "minisgl") if index % 2 == 0 else ("minisgl", "aserve")
            for engine in order:
                out = Path(scratch) / f"{engine}-{index}.json"
                command = [sys.executable, __file__, *sys.argv[1:], "--child", engine]
                command += ["--child-workload", str(path), "--child-out", str(out)]
                subprocess.run(command, check=True)
                tokens, seconds = json.loads(out.read_text())
                (ours if engine == "aserve" else peers).append((tokens, seconds))
    return ours, peers


def run_child(args: argparse.Namespace) -> None:
    """One engine on one workload, in the process `run_in_processes` started."""
    workload = [(prompt, n) for prompt, n in json.loads(args.child_workload.read_text())]
    if args.child == "aserve":
        llm = build_llm(args)
        result = run_aserve(llm, workload, args.temperature, args.seeded, args.constrained)
        llm.close()
    else:
        from bench.minisgl_peer import run_minisgl

        with tempfile.TemporaryDirectory() as scratch:
            result = run_minisgl(args, workload, Path(scratch))
    args.child_out.write_text(json.dumps(result))


def main() -> None:
    args = parse_args()
    # ASERVE_STEP_TIMING's lines (aserve/scheduler/timing.py), which the server's log shows
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.WARNING)
    logging.getLogger("aserve.scheduler.timing").setLevel(logging.INFO)
    if args.constrained and args.peer:
        raise SystemExit("--constrained runs beside aserve's free run, not beside a peer")
    if args.child:
        run_child(args)
        return
    if args.peer == "minisgl" and not (args.model and args.dummy_weight):
        raise SystemExit("--peer minisgl runs a model folder with --dummy-weight")
    workloads = [
        random_workload(args.num_seqs, tuple(args.input_len), tuple(args.output_len), args.seed + r)
        for r in range(args.repeat)
    ]
    settings = {
        k: getattr(args, k)
        for k in (
            "num_seqs",
            "input_len",
            "output_len",
            "seed",
            "temperature",
            "max_seq_len",
            "max_prefill_length",
            "max_running_requests",
            "page_size",
            "num_pages",
            "swa_full_tokens_ratio",
            "cuda_graph_max_bs",
            "attention_backend",
            "moe_backend",
            "dtype",
            "quantization",
            "kv_cache_dtype",
            "dummy_weight",
            "repeat",
            "seeded",
            "tp",
            "constrained",
        )
    }
    settings["input_len"], settings["output_len"] = list(args.input_len), list(args.output_len)
    run_id = new_run_id()
    model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    ours: list[tuple[int, float]] = []
    peers: list[tuple[int, float]] = []
    peer_name = {"hf": "transformers", "llamacpp": "llama.cpp", "minisgl": "mini-SGLang"}.get(
        args.peer or "", ""
    )
    llm = build_llm(args) if args.peer != "minisgl" else None
    if llm is None:
        ours, peers = run_in_processes(args, workloads)
    elif args.peer and llm.runtime.engine.device.type == "cpu":
        # Both engines stay loaded and take turns on each workload, so a noisy neighbour on
        # a shared CPU slows both alike instead of whichever ran during it.
        run_peer = load_llamacpp(args, llm) if args.peer == "llamacpp" else load_peer(args, llm)
        for workload in workloads:
            ours.append(run_aserve(llm, workload, args.temperature, args.seeded, args.constrained))
            peers.append(run_peer(workload))
        llm.close()
    else:
        ours = [
            run_aserve(llm, w, args.temperature, args.seeded, args.constrained) for w in workloads
        ]
        if args.peer == "llamacpp":
            raise SystemExit("--peer llamacpp runs on CPU only, beside aserve on CPU")
        if args.peer == "hf":
            # On a GPU one engine at a time: the peer loads after ours has freed its memory.
            run_peer = load_peer(args, llm)
            peers = [run_peer(w) for w in workloads]
        else:
            llm.close()
    tokens, seconds = report("aserve", ours)
    if not args.no_record:
        record(
            "offline",
            "aserve",
            model_name,
            settings,
            tokens,
            seconds,
            run_id,
            runs_tok_s=[round(t / s, 1) for t, s in ours],
        )
    if not peers:
        return
    peer_tokens, peer_seconds = report(peer_name, peers)
    assert peer_tokens == tokens, "both engines must make the same tokens"
    print(f"aserve/{peer_name} {(tokens / seconds) / (peer_tokens / peer_seconds):.2f}x")
    if not args.no_record:
        peer_settings = dict(settings)
        if args.peer == "hf":
            peer_settings.update(hf_cache=args.hf_cache, hf_mode=args.hf_mode)
        if args.peer == "minisgl":  # its own bf16 weights and cache, FlashInfer both phases
            peer_settings.update(quantization="none", kv_cache_dtype="auto", attention_backend="fi")
        record(
            "offline",
            peer_name,
            model_name,
            peer_settings,
            peer_tokens,
            peer_seconds,
            run_id,
            runs_tok_s=[round(t / s, 1) for t, s in peers],
        )


def load_llamacpp(args: argparse.Namespace, llm: LLM) -> Callable[[Workload], tuple[int, float]]:
    """llama.cpp on the GGUF file that aserve loaded, with as many threads as torch uses."""
    import torch

    from aserve.models.source import embedded_gguf, is_gguf
    from bench.llamacpp_peer import LlamaCppPeer

    gguf = Path(args.model) if args.model else embedded_gguf()
    if not is_gguf(gguf) or args.dummy_weight:
        raise SystemExit("--peer llamacpp needs --model FILE.gguf (or the embedded model)")
    if args.temperature != 0:
        raise SystemExit("--peer llamacpp decodes greedily: pass --temperature 0")
    longest = max(args.input_len) + max(args.output_len)
    peer = LlamaCppPeer(gguf, torch.get_num_threads(), args.max_running_requests, longest)
    peer.run([([1, 2, 3, 4], 2)])
    return peer.run


def load_peer(args: argparse.Namespace, llm: LLM) -> Callable[[Workload], tuple[int, float]]:
    """Load transformers on our model, warm it up, and return a function that runs a
    workload through it. On a GPU `llm` is closed first, to free its memory."""
    from bench.hf_baseline import load_hf_model, run_hf, run_hf_continuous

    engine = llm.runtime.engine
    model_dir, dtype, device = llm.runtime.model_dir, engine.dtype, engine.device
    if device.type != "cpu":
        llm.close()
    hf = load_hf_model(model_dir, args.dummy_weight, dtype, str(device))
    if args.hf_mode == "continuous":
        run_hf_continuous(hf, [([1, 2, 3, 4], 2)], 0.0)
        return lambda w: run_hf_continuous(hf, w, args.temperature)
    run_hf(hf, [([1, 2, 3, 4], 2)], 1, 0.0, args.hf_cache)
    return lambda w: run_hf(hf, w, args.max_running_requests, args.temperature, args.hf_cache)


if __name__ == "__main__":
    main()
