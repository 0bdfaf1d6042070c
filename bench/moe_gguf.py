"""A random Qwen3-MoE GGUF (llama.cpp's `qwen3moe`) of a chosen shape, for CPU benchmarks
of quantized experts beside llama.cpp on the same file:

    python bench/moe_gguf.py /tmp/moe.gguf --qtype Q4_0
    python bench/offline.py --model /tmp/moe.gguf --peer llamacpp --num-seqs 16 \\
        --max-running-requests 16 --input-len 128 128 --output-len 64 64 --temperature 0

No model hub here, so the weights are random (normal, scaled so that activations stay
finite); the tokenizer is the embedded SmolLM2's, copied from its GGUF, since llama.cpp
loads no model without a vocabulary. The default shape keeps the 30B-A3B's proportions
(128 experts, 8 a token, Qwen3's per-head Q/K norm) at a size a 2-core CPU runs: about
0.7 B parameters, 60 M of them active a token besides the embedding and LM head.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gguf_files import copy_tokenizer, random_matrix, write_out  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="write a random Qwen3-MoE GGUF")
    p.add_argument("out", type=Path)
    p.add_argument("--qtype", default="Q4_0", help="GGUF type of the matrices: Q4_0, IQ4_XS, ...")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, nargs=2, default=(16, 4), metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, nargs=2, default=(128, 8), metavar=("ALL", "USED"))
    p.add_argument("--expert-rows", type=int, default=192, help="moe_intermediate_size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="write no tokenizer and this many tokens (for token-id benchmarks where the "
        "embedded model is not installed, e.g. the GPU machine)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    qtype = gguf.GGMLQuantizationType[args.qtype]
    heads, kv_heads = args.heads
    experts, used = args.experts
    writer = gguf.GGUFWriter(args.out, "qwen3moe")
    vocab = copy_tokenizer(writer) if args.vocab is None else args.vocab
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.expert_rows)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    writer.add_expert_feed_forward_length(args.expert_rows)
    rng = np.random.default_rng(args.seed)

    def matrix(*shape: int) -> np.ndarray:
        return random_matrix(shape, qtype, rng)

    def add(name: str, array: np.ndarray, quantized: bool = True) -> None:
        writer.add_tensor(name, array, raw_dtype=qtype if quantized else None)

    add("token_embd.weight", matrix(vocab, args.hidden))
    add("output.weight", matrix(vocab, args.hidden))
    add("output_norm.weight", np.ones(args.hidden, np.float32), quantized=False)
    q_rows, kv_rows = heads * args.head_dim, kv_heads * args.head_dim
    for layer in range(args.layers):
        blk = f"blk.{layer}"
        add(f"{blk}.attn_q.weight", matrix(q_rows, args.hidden))
        add(f"{blk}.attn_k.weight", matrix(kv_rows, args.hidden))
        add(f"{blk}.attn_v.weight", matrix(kv_rows, args.hidden))
        add(f"{blk}.attn_output.weight", matrix(args.hidden, q_rows))
        add(f"{blk}.ffn_gate_exps.weight", matrix(experts, args.expert_rows, args.hidden))
        add(f"{blk}.ffn_up_exps.weight", matrix(experts, args.expert_rows, args.hidden))
        add(f"{blk}.ffn_down_exps.weight", matrix(experts, args.hidden, args.expert_rows))
        router = rng.standard_normal((experts, args.hidden), dtype=np.float32) / 32
        add(f"{blk}.ffn_gate_inp.weight", router, quantized=False)
        for norm, size in (("attn_norm", args.hidden), ("ffn_norm", args.hidden)):
            add(f"{blk}.{norm}.weight", np.ones(size, np.float32), quantized=False)
        for norm in ("attn_q_norm", "attn_k_norm"):
            add(f"{blk}.{norm}.weight", np.ones(args.head_dim, np.float32), quantized=False)
    write_out(writer, args.out)


if __name__ == "__main__":
    main()
