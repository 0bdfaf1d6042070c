"""What LoRA adapters cost: one offline workload on one model, three ways in one process, one
engine after the other: no adapters; adapters loaded but every request on the model (its
steps keep the CUDA graphs); every request on an adapter, spread over them (those steps run
eagerly, two thin products a targeted layer). Then one stream, the model against an adapter.
Adapters are random, of rank `--rank` on the seven projections of every layer, written in
PEFT's layout for the model's shapes (read from the loaded model: `--dummy-weight` folders
and GGUF files work). Token totals are equal by construction (`ignore_eos`), and checked.

    python bench/lora.py --model bench/models/llama-3.1-8b --dummy-weight --adapters 4
    python bench/lora.py --num-seqs 16 --input-len 64 128 --output-len 32 64   # embedded, CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from aserve import LLM, SamplingParams  # noqa: E402
from aserve.config import ModelConfig  # noqa: E402
from bench.common import new_run_id, random_workload, record  # noqa: E402


def write_random_adapter(config: ModelConfig, folder: Path, rank: int, seed: int) -> None:
    """A rank-`rank` adapter on every layer's seven projections of a model of `config`."""
    hidden, heads, head_dim = config.hidden_size, config.num_heads, config.head_dim
    kv, inter = config.num_kv_heads * head_dim, config.intermediate_size
    shapes = {  # (out, in)
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out, inputs) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, inputs, generator=generator) / inputs**0.5
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            b = torch.randn(out, rank, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({module.rpartition(".")[2] for module in shapes})
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(settings))


def timed(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], lora: list[str | None]
) -> tuple[float, int]:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora=lora)
    seconds = time.perf_counter() - started
    failed = [o.error for o in outputs if o.error]
    assert not failed, failed[0]
    return seconds, sum(len(o.token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a folder or a GGUF file (default: the embedded model)")
    parser.add_argument("--dummy-weight", action="store_true")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(256, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(128, 256))
    parser.add_argument("--single-input", type=int, default=1000)
    parser.add_argument("--single-output", type=int, default=256)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    llm = LLM(args.model, dummy_weight=args.dummy_weight)  # the model alone: the first mode
    config = llm.runtime.model_config
    limit = min(10000, config.vocab_size - 1)
    workload = random_workload(
        args.num_seqs, tuple(args.input_len), tuple(args.output_len), 0, limit
    )
    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    single = [[(7 * i) % limit for i in range(args.single_input)]]
    single_params = [SamplingParams(temperature=0, max_tokens=args.single_output, ignore_eos=True)]
    names = [f"adapter{i}" for i in range(args.adapters)]
    spread = [names[i % len(names)] for i in range(len(prompts))]
    run_id = new_run_id()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folders = {}
        for i, adapter in enumerate(names):
            folders[adapter] = str(Path(scratch) / adapter)
            write_random_adapter(config, Path(folders[adapter]), args.rank, seed=i)
        modes = [("no adapters", {}, [None] * len(prompts), None)]
        modes.append(
            ("adapters loaded, requests on the model", folders, [None] * len(prompts), None)
        )
        modes.append((f"requests spread over {len(names)} adapters", folders, spread, names[0]))
        for label, modules, lora, single_lora in modes:
            if modules:
                llm = LLM(args.model, dummy_weight=args.dummy_weight, lora_modules=modules)
            timed(llm, prompts[:4], params[:4], lora[:4])  # warm-up
            seconds, tokens = timed(llm, prompts, params, lora)
            one_seconds, one_tokens = timed(llm, single, single_params, [single_lora])
            llm.close()
            torch.cuda.empty_cache()
            ms = 1000 * one_seconds / one_tokens
            rows.append((label, tokens, seconds, ms))
            if not args.no_record:
                settings = {
                    "mode": label,
                    "adapters": args.adapters,
                    "rank": args.rank,
                    "n": args.num_seqs,
                    "in": list(args.input_len),
                    "out": list(args.output_len),
                    "single": [args.single_input, args.single_output],
                }
                record("lora", "aserve", name, settings, tokens, seconds, run_id, single_ms=ms)
    assert len({tokens for _, tokens, _, _ in rows}) == 1, "token totals differ"
    print(f"| {name}, rank {args.rank} | output tokens | tok/s | one stream ms/token |")
    print("| --- | --- | --- | --- |")
    for label, tokens, seconds, ms in rows:
        print(f"| {label} | {tokens} | {tokens / seconds:,.1f} | {ms:.2f} |")


if __name__ == "__main__":
    main()
