"""A random dense Llama GGUF of a chosen shape and block format, for CPU benchmarks beside
llama.cpp on the same file:

    python bench/dense_gguf.py /tmp/dense1b-iq2xxs.gguf --qtype IQ2_XXS
    python bench/offline.py --model /tmp/dense1b-iq2xxs.gguf --peer llamacpp --num-seqs 1 \\
        --input-len 128 128 --output-len 64 64 --temperature 0

The default shape is Llama-3.2-1B's (16 layers, 2,048 wide, 8,192 in the MLP, 32 query and 8
KV heads) with the embedded SmolLM2's vocabulary and tokenizer (bench/moe_gguf.py).
`--arch gemma3` writes Gemma 3's layout instead (its four norms a layer stored as 1 + w,
Q/K norms, a sliding window, a tied head); Gemma 3 1B's shape is
`--arch gemma3 --layers 26 --hidden 1152 --intermediate 6912 --heads 4 1 --head-dim 256`.
`--arch gemma2` writes Gemma 2's (as Gemma 3's without Q/K norms, with its soft caps of 50 on
the scores and 30 on the logits); Gemma 2 2B's shape is `--arch gemma2 --layers 26 --hidden
2304 --intermediate 9216 --heads 8 4 --head-dim 256 --window 4096`. `--arch phi3` writes
Phi-3's (Q|K|V and gate|up fused, as llama.cpp keeps them; three quarters of a head rotating,
as in Phi-4-mini, whose shape is `--arch phi3 --layers 32 --hidden 3072 --intermediate 8192
--heads 24 8`; no LongRoPE factors). `--arch granite` writes Llama's layout with Granite 3's
four multipliers in the metadata (12, 1/64, 0.22 and 8: values of the kind its configs state;
a step's time does not depend on them) and a tied head. `--arch olmo2` writes OLMo 2's (norms
after attention and the MLP alone, Q/K norms as wide as the projections; OLMo 2 1B's shape is
`--arch olmo2 --layers 16 --hidden 2048 --intermediate 8192 --heads 16 16`); `--arch exaone4`
writes EXAONE 4's (OLMo 2's norms, Q/K norms a head; no window, as in its 1.2B, whose shape
is about `--arch exaone4 --layers 30 --hidden 2048 --intermediate 4096 --heads 32 8`);
`--arch glm4` writes GLM-4's (Gemma's four norms a layer with plain weights, Q/K/V biases,
gate|up fused, half of a head rotating; GLM-4-9B's shape is `--arch glm4 --layers 40
--hidden 4096 --intermediate 13696 --heads 32 2 --head-dim 128`). `--arch qwen35` writes
Qwen3.5's (Gated DeltaNet linear attention in three layers of four, with `--linear-heads`
key and value heads of 128; gated attention in every fourth, a quarter of a head rotating;
a tied head); the 9B's shape is `--arch qwen35 --layers 32 --hidden 4096 --intermediate
12288 --heads 16 4 --head-dim 256 --linear-heads 16 32`. The
layers' matrices take `--qtype`; the embedding and the LM head are Q8_0, as llama.cpp keeps
them wider than the layers in its low-bit files. Formats the `gguf` package quantizes
(Q4_0, Q8_0, ...) quantize normal weights; for llama.cpp's codebook formats (IQ1_S to IQ3_S),
which need its importance matrix to quantize, the blocks are random bytes with each block's
float16 scale set so that the weights' root mean square is that of the normal ones.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gguf_files import copy_tokenizer, random_matrix, write_out  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="write a random dense Llama GGUF")
    p.add_argument("out", type=Path)
    p.add_argument("--qtype", default="Q4_0", help="GGUF type of the layers' matrices")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / Q heads")
    p.add_argument(
        "--arch",
        choices=(
            "llama",
            "gemma2",
            "gemma3",
            "phi3",
            "granite",
            "olmo2",
            "exaone4",
            "glm4",
            "qwen35",
        ),
        default="llama",
    )
    p.add_argument("--window", type=int, default=512, help="Gemma's sliding window")
    p.add_argument(
        "--linear-heads",
        type=int,
        nargs=2,
        default=(16, 16),
        metavar=("KEY", "VALUE"),
        help="Qwen3.5's linear attention heads (of 128)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="write no tokenizer and this many tokens (where the embedded model is not "
        "installed, e.g. the GPU machine)",
    )
    return p.parse_args()


LINEAR_HEAD = 128
"""Qwen3.5's linear attention heads' width (keys and values)."""


def qwen35_layer(
    add: Callable[[str, np.ndarray, gguf.GGMLQuantizationType | None], None],
    matrix: Callable[[int, int], np.ndarray],
    blk: str,
    layer: int,
    args: argparse.Namespace,
    rng: np.random.Generator,
) -> None:
    """A Qwen3.5 layer as llama.cpp stores it: Gated DeltaNet in three of four (its SSM
    names; `ssm_a` negative, the decay rate), gated attention in every fourth (`attn_q`
    holds a gate beside each query head), norms weighing by 1 + w stored as that sum."""
    qtype = gguf.GGMLQuantizationType[args.qtype]
    hidden = args.hidden
    ones = np.ones(hidden, np.float32)
    add(f"{blk}.attn_norm.weight", ones, None)
    add(f"{blk}.post_attention_norm.weight", ones, None)
    add(f"{blk}.ffn_gate.weight", matrix(args.intermediate, hidden), qtype)
    add(f"{blk}.ffn_up.weight", matrix(args.intermediate, hidden), qtype)
    add(f"{blk}.ffn_down.weight", matrix(hidden, args.intermediate), qtype)
    if (layer + 1) % 4 == 0:
        heads, kv_heads = args.heads
        head_dim = args.head_dim or hidden // heads
        add(f"{blk}.attn_q.weight", matrix(2 * heads * head_dim, hidden), qtype)
        add(f"{blk}.attn_k.weight", matrix(kv_heads * head_dim, hidden), qtype)
        add(f"{blk}.attn_v.weight", matrix(kv_heads * head_dim, hidden), qtype)
        add(f"{blk}.attn_output.weight", matrix(hidden, heads * head_dim), qtype)
        for norm in ("attn_q_norm", "attn_k_norm"):
            add(f"{blk}.{norm}.weight", np.ones(head_dim, np.float32), None)
        return
    key_heads, value_heads = args.linear_heads
    keys, values = key_heads * LINEAR_HEAD, value_heads * LINEAR_HEAD
    add(f"{blk}.attn_qkv.weight", matrix(2 * keys + values, hidden), qtype)
    add(f"{blk}.attn_gate.weight", matrix(values, hidden), qtype)
    add(f"{blk}.ssm_beta.weight", matrix(value_heads, hidden), qtype)
    add(f"{blk}.ssm_alpha.weight", matrix(value_heads, hidden), qtype)
    conv = rng.standard_normal((2 * keys + values, 4), dtype=np.float32) / 2
    add(f"{blk}.ssm_conv1d.weight", conv, None)
    add(f"{blk}.ssm_a", -rng.uniform(0.5, 8, value_heads).astype(np.float32), None)
    add(f"{blk}.ssm_dt.bias", rng.standard_normal(value_heads, dtype=np.float32), None)
    add(f"{blk}.ssm_norm.weight", np.ones(LINEAR_HEAD, np.float32), None)
    add(f"{blk}.ssm_out.weight", matrix(hidden, values), qtype)


def main() -> None:
    args = parse_args()
    qtype = gguf.GGMLQuantizationType[args.qtype]
    heads, kv_heads = args.heads
    head_dim = args.head_dim or args.hidden // heads
    gemma3 = args.arch == "gemma3"
    gemma = gemma3 or args.arch == "gemma2"
    writer = gguf.GGUFWriter(args.out, args.arch)
    vocab = copy_tokenizer(writer) if args.vocab is None else args.vocab
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    phi3, glm4, qwen35 = args.arch == "phi3", args.arch == "glm4", args.arch == "qwen35"
    rotating = head_dim * 3 // 4 if phi3 else head_dim // 2 if glm4 else head_dim
    rotating = head_dim // 4 if qwen35 else rotating
    writer.add_rope_dimension_count(rotating)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(
        1e4 if args.arch in ("gemma2", "phi3", "glm4") else 1e6 if gemma3 else 5e5
    )
    writer.add_layer_norm_rms_eps(1e-6 if gemma or qwen35 else 1e-5)
    key_heads, value_heads = args.linear_heads
    if qwen35:  # as llama.cpp's converter describes Qwen3.5's linear attention
        writer.add_ssm_conv_kernel(4)
        writer.add_ssm_state_size(LINEAR_HEAD)
        writer.add_ssm_group_count(key_heads)
        writer.add_ssm_time_step_rank(value_heads)
        writer.add_ssm_inner_size(value_heads * LINEAR_HEAD)
        writer.add_full_attention_interval(4)
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if gemma:
        writer.add_sliding_window(args.window)
    if args.arch == "granite":
        writer.add_embedding_scale(12.0)
        writer.add_attention_scale(1 / 64)
        writer.add_residual_scale(0.22)
        writer.add_logit_scale(8.0)
    if args.arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    rng = np.random.default_rng(args.seed)

    def matrix(rows: int, cols: int, kind: gguf.GGMLQuantizationType = qtype) -> np.ndarray:
        return random_matrix((rows, cols), kind, rng)

    def add(name: str, array: np.ndarray, kind: gguf.GGMLQuantizationType | None) -> None:
        writer.add_tensor(name, array, raw_dtype=kind)

    wide = gguf.GGMLQuantizationType.Q8_0
    add("token_embd.weight", matrix(vocab, args.hidden, wide), wide)
    if not (gemma or phi3 or args.arch == "granite" or qwen35):  # these tie it to the embedding
        add("output.weight", matrix(vocab, args.hidden, wide), wide)
    add("output_norm.weight", np.ones(args.hidden, np.float32), None)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    for layer in range(args.layers):
        blk = f"blk.{layer}"
        if qwen35:
            qwen35_layer(add, matrix, blk, layer, args, rng)
            continue
        if phi3:  # fused, as llama.cpp's converter keeps Phi-3's checkpoints
            add(f"{blk}.attn_qkv.weight", matrix(q_rows + 2 * kv_rows, args.hidden), qtype)
        else:
            add(f"{blk}.attn_q.weight", matrix(q_rows, args.hidden), qtype)
            add(f"{blk}.attn_k.weight", matrix(kv_rows, args.hidden), qtype)
            add(f"{blk}.attn_v.weight", matrix(kv_rows, args.hidden), qtype)
        add(f"{blk}.attn_output.weight", matrix(args.hidden, q_rows), qtype)
        for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            if glm4:  # its Q, K and V biases
                add(f"{blk}.{name}.bias", rng.standard_normal(rows, dtype=np.float32) / 8, None)
        if phi3 or glm4:
            add(f"{blk}.ffn_up.weight", matrix(2 * args.intermediate, args.hidden), qtype)
        else:
            add(f"{blk}.ffn_gate.weight", matrix(args.intermediate, args.hidden), qtype)
            add(f"{blk}.ffn_up.weight", matrix(args.intermediate, args.hidden), qtype)
        add(f"{blk}.ffn_down.weight", matrix(args.hidden, args.intermediate), qtype)
        norms = ("attn_norm", "ffn_norm")
        if gemma or glm4:  # Gemma's ones: 1 + w with w = 0, as llama.cpp's converter stores them
            norms += ("post_attention_norm", "post_ffw_norm")
        if args.arch == "olmo2":
            norms = ("post_attention_norm", "post_ffw_norm")
            add(f"{blk}.attn_q_norm.weight", np.ones(q_rows, np.float32), None)
            add(f"{blk}.attn_k_norm.weight", np.ones(kv_rows, np.float32), None)
        if args.arch == "exaone4":
            norms = ("post_attention_norm", "post_ffw_norm")
        for qk_norm in ("attn_q_norm", "attn_k_norm") if gemma3 or args.arch == "exaone4" else ():
            add(f"{blk}.{qk_norm}.weight", np.ones(head_dim, np.float32), None)
        for norm in norms:
            add(f"{blk}.{norm}.weight", np.ones(args.hidden, np.float32), None)
    write_out(writer, args.out)


if __name__ == "__main__":
    main()
