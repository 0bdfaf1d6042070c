"""A random Qwen3-MoE GGUF (llama.cpp's `qwen3moe`), gpt-oss, OLMoE or GraniteMoe GGUF of a chosen
shape, for CPU benchmarks of quantized experts beside llama.cpp on the same file:

    python bench/moe_gguf.py /tmp/moe.gguf --qtype Q4_0
    python bench/moe_gguf.py /tmp/oss.gguf --arch gpt-oss --qtype Q8_0 --expert-qtype MXFP4 \
        --layers 4 --hidden 2880 --heads 64 8 --experts 32 4 --expert-rows 2880
    python bench/offline.py --model /tmp/moe.gguf --peer llamacpp --num-seqs 16 \\
        --max-running-requests 16 --input-len 128 128 --output-len 64 64 --temperature 0

No model hub here, so the weights are random (normal, scaled so that activations stay
finite); the tokenizer is the embedded SmolLM2's, copied from its GGUF, since llama.cpp
loads no model without a vocabulary. The default shape keeps the 30B-A3B's proportions
(128 experts, 8 a token, Qwen3's per-head Q/K norm) at a size a 2-core CPU runs: about
0.7 B parameters, 60 M of them active a token besides the embedding and LM head. gpt-oss's
layers add biases to every projection, the router and the experts, a sink logit a head, a
window of 128 on every other layer, and YaRN; its published files keep the experts in MXFP4
(`--expert-qtype`). `--arch olmoe` writes OLMoE's (Q/K norms across all heads, experts'
weights not renormalised); OLMoE-1B-7B's shape is `--arch olmoe --layers 16 --hidden 2048
--heads 16 16 --head-dim 128 --experts 64 8 --expert-rows 1024`. `--arch granitemoe` writes
Granite's (its four multipliers, no Q/K norms); granite-3.1-1b-a400m's shape is `--arch
granitemoe --layers 24 --hidden 1024 --heads 16 8 --head-dim 64 --experts 32 8
--expert-rows 512`. `--arch qwen2moe` writes Qwen2-MoE's (QKV biases, a shared expert of
`--shared-rows` and its gate); Qwen1.5-MoE-A2.7B's layers are `--arch qwen2moe --hidden 2048
--heads 16 16 --head-dim 128 --experts 60 4 --expert-rows 1408 --shared-rows 5632`.
`--arch glm4moe` writes GLM-4.5's (QKV biases, a dense first layer of `--dense-rows`, a
shared expert as wide as the others beside them without a gate, experts chosen by sigmoid
scores plus a bias of their own, half of each head rotating); GLM-4.5-Air's layers are
`--arch glm4moe --hidden 4096 --heads 96 8 --head-dim 128 --experts 128 8 --expert-rows 1408
--dense-rows 10944`.
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
    p.add_argument(
        "--arch",
        default="qwen3moe",
        choices=["qwen3moe", "qwen2moe", "gpt-oss", "olmoe", "granitemoe", "glm4moe", "deepseek2"],
    )
    p.add_argument("--q-lora", type=int, default=384, help="deepseek2: the query row (0: none)")
    p.add_argument("--kv-lora", type=int, default=512, help="deepseek2: the latent's width")
    p.add_argument("--shared-rows", type=int, default=5632, help="qwen2moe: the shared expert")
    p.add_argument(
        "--dense-rows", type=int, default=1536, help="glm4moe, deepseek2: the first layer's MLP"
    )
    p.add_argument("--qtype", default="Q4_0", help="GGUF type of the matrices: Q4_0, IQ4_XS, ...")
    p.add_argument("--expert-qtype", default=None, help="the experts' type (default: --qtype)")
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


ROPE = 64
"""DeepSeek's rotating dimensions a head (llama.cpp's `rope.dimension_count`)."""


def add_latent_sizes(writer: gguf.GGUFWriter, args: argparse.Namespace) -> None:
    """DeepSeek's widths as llama.cpp's converter states them since its MLA rework: one key
    head of the latent and its rotating part, values the latent's width, a query head's and
    a value's widths as `*_mla`."""
    writer.add_key_length(args.kv_lora + ROPE)
    writer.add_value_length(args.kv_lora)
    writer.add_key_length_mla(args.head_dim + ROPE)
    writer.add_value_length_mla(args.head_dim)
    writer.add_kv_lora_rank(args.kv_lora)
    if args.q_lora:
        writer.add_q_lora_rank(args.q_lora)
    writer.add_rope_dimension_count(ROPE)


def main() -> None:
    args = parse_args()
    qtype = gguf.GGMLQuantizationType[args.qtype]
    expert_qtype = gguf.GGMLQuantizationType[args.expert_qtype or args.qtype]
    oss, glm, deepseek = args.arch == "gpt-oss", args.arch == "glm4moe", args.arch == "deepseek2"
    heads, kv_heads = args.heads
    experts, used = args.experts
    writer = gguf.GGUFWriter(args.out, args.arch)
    vocab = copy_tokenizer(writer) if args.vocab is None else args.vocab
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.dense_rows if glm or deepseek else args.expert_rows)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if deepseek:
        add_latent_sizes(writer, args)
    else:
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    if args.arch not in ("olmoe", "granitemoe"):  # these take feed_forward_length
        writer.add_expert_feed_forward_length(args.expert_rows)
    if args.arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(args.shared_rows)
    if glm:  # GLM-4.5-Air's routing, without its prediction layer
        writer.add_expert_shared_count(1)
        writer.add_leading_dense_block_count(1)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(1.0)
        writer.add_expert_weights_norm(True)
        writer.add_nextn_predict_layers(0)
        writer.add_rope_dimension_count(args.head_dim // 2)
    if deepseek:  # DeepSeek-V2-Lite's routing: softmax scores, two shared experts
        writer.add_expert_shared_count(2)
        writer.add_leading_dense_block_count(1)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        writer.add_expert_weights_scale(1.0)
    if args.arch == "granitemoe":  # granite-3.1-1b-a400m's multipliers
        writer.add_embedding_scale(12.0)
        writer.add_attention_scale(0.015625)
        writer.add_residual_scale(0.22)
        writer.add_logit_scale(6.0)
    if oss:
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    rng = np.random.default_rng(args.seed)

    def matrix(*shape: int) -> np.ndarray:
        return random_matrix(shape, qtype, rng)

    def experts_of(*shape: int) -> np.ndarray:
        return random_matrix(shape, expert_qtype, rng)

    def add(name: str, array: np.ndarray, quantized: bool = True) -> None:
        kind = (expert_qtype if "_exps" in name else qtype) if quantized else None
        writer.add_tensor(name, array, raw_dtype=kind)

    def small(*shape: int) -> np.ndarray:  # biases and sinks
        return rng.standard_normal(shape, dtype=np.float32) / 8

    def glm_layer(blk: str, dense: bool) -> None:
        """The rest of a GLM-4.5 layer: QKV biases, norms, a dense MLP or the experts (and
        of a DeepSeek layer: no biases, `ffn_norm`, two shared experts, no choice bias)."""
        if glm:
            for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                add(f"{blk}.{name}.bias", small(rows), quantized=False)
        for norm in ("attn_norm", "ffn_norm" if deepseek else "post_attention_norm"):
            add(f"{blk}.{norm}.weight", np.ones(args.hidden, np.float32), quantized=False)
        shared = (1 + deepseek) * args.expert_rows
        mlps = [("", args.dense_rows)] if dense else [("_shexp", shared)]
        for suffix, rows in mlps:
            add(f"{blk}.ffn_gate{suffix}.weight", matrix(rows, args.hidden))
            add(f"{blk}.ffn_up{suffix}.weight", matrix(rows, args.hidden))
            add(f"{blk}.ffn_down{suffix}.weight", matrix(args.hidden, rows))
        if dense:
            return
        for part in ("gate", "up"):
            shape = (experts, args.expert_rows, args.hidden)
            add(f"{blk}.ffn_{part}_exps.weight", experts_of(*shape))
        add(f"{blk}.ffn_down_exps.weight", experts_of(experts, args.hidden, args.expert_rows))
        router = rng.standard_normal((experts, args.hidden), dtype=np.float32) / 32
        add(f"{blk}.ffn_gate_inp.weight", router, quantized=False)
        if glm:
            add(f"{blk}.exp_probs_b.bias", small(experts), quantized=False)

    def latent_attention(blk: str) -> None:
        """DeepSeek's attention, as llama.cpp's converter writes it since its MLA rework."""
        rank, nope = args.kv_lora, args.head_dim
        if args.q_lora:
            add(f"{blk}.attn_q_a.weight", matrix(args.q_lora, args.hidden))
            add(f"{blk}.attn_q_a_norm.weight", np.ones(args.q_lora, np.float32), quantized=False)
            add(f"{blk}.attn_q_b.weight", matrix(heads * (nope + ROPE), args.q_lora))
        else:
            add(f"{blk}.attn_q.weight", matrix(heads * (nope + ROPE), args.hidden))
        add(f"{blk}.attn_kv_a_mqa.weight", matrix(rank + ROPE, args.hidden))
        add(f"{blk}.attn_kv_a_norm.weight", np.ones(rank, np.float32), quantized=False)
        add(f"{blk}.attn_k_b.weight", matrix(heads, rank, nope))
        add(f"{blk}.attn_v_b.weight", matrix(heads, nope, rank))
        add(f"{blk}.attn_output.weight", matrix(args.hidden, heads * nope))

    add("token_embd.weight", matrix(vocab, args.hidden))
    add("output.weight", matrix(vocab, args.hidden))
    add("output_norm.weight", np.ones(args.hidden, np.float32), quantized=False)
    q_rows, kv_rows = heads * args.head_dim, kv_heads * args.head_dim
    for layer in range(args.layers):
        blk = f"blk.{layer}"
        if deepseek:  # GLM-4.5's kind of layer otherwise, without its biases
            latent_attention(blk)
            glm_layer(blk, layer == 0)
            continue
        add(f"{blk}.attn_q.weight", matrix(q_rows, args.hidden))
        add(f"{blk}.attn_k.weight", matrix(kv_rows, args.hidden))
        add(f"{blk}.attn_v.weight", matrix(kv_rows, args.hidden))
        add(f"{blk}.attn_output.weight", matrix(args.hidden, q_rows))
        if glm:
            glm_layer(blk, layer == 0)
            continue
        add(f"{blk}.ffn_gate_exps.weight", experts_of(experts, args.expert_rows, args.hidden))
        add(f"{blk}.ffn_up_exps.weight", experts_of(experts, args.expert_rows, args.hidden))
        add(f"{blk}.ffn_down_exps.weight", experts_of(experts, args.hidden, args.expert_rows))
        router = rng.standard_normal((experts, args.hidden), dtype=np.float32) / 32
        add(f"{blk}.ffn_gate_inp.weight", router, quantized=False)
        pre_mlp_norm = "post_attention_norm" if oss else "ffn_norm"
        for norm, size in (("attn_norm", args.hidden), (pre_mlp_norm, args.hidden)):
            add(f"{blk}.{norm}.weight", np.ones(size, np.float32), quantized=False)
        if args.arch == "qwen2moe":  # QKV biases, a shared expert and its gate
            for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                add(f"{blk}.{name}.bias", small(rows), quantized=False)
            add(f"{blk}.ffn_gate_shexp.weight", matrix(args.shared_rows, args.hidden))
            add(f"{blk}.ffn_up_shexp.weight", matrix(args.shared_rows, args.hidden))
            add(f"{blk}.ffn_down_shexp.weight", matrix(args.hidden, args.shared_rows))
            gate = rng.standard_normal(args.hidden, dtype=np.float32) / 32
            add(f"{blk}.ffn_gate_inp_shexp.weight", gate, quantized=False)
        if args.arch in ("granitemoe", "qwen2moe"):  # no Q/K norms
            continue
        if not oss:  # Q/K norms a head, or OLMoE's across all heads of the projection
            widths = (q_rows, kv_rows) if args.arch == "olmoe" else (args.head_dim, args.head_dim)
            for norm, width in zip(("attn_q_norm", "attn_k_norm"), widths):
                add(f"{blk}.{norm}.weight", np.ones(width, np.float32), quantized=False)
            continue
        for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            add(f"{blk}.{name}.bias", small(rows), quantized=False)
        add(f"{blk}.attn_output.bias", small(args.hidden), quantized=False)
        add(f"{blk}.attn_sinks.weight", small(heads), quantized=False)
        add(f"{blk}.ffn_gate_inp.bias", small(experts), quantized=False)
        for part, rows in (("gate", args.expert_rows), ("up", args.expert_rows)):
            add(f"{blk}.ffn_{part}_exps.bias", small(experts, rows), quantized=False)
        add(f"{blk}.ffn_down_exps.bias", small(experts, args.hidden), quantized=False)
    write_out(writer, args.out)


if __name__ == "__main__":
    main()
