"""`aserve` on the command line: options with mini-SGLang's names and aliases (SGLang's and
vLLM's spellings of the same settings among them) -> ServerConfig."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from aserve.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSERS,
    ConfigError,
    ServerConfig,
    build_config,
)

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# Options of the process around the server (its signals, its replicas), not of the server.
PROCESS_OPTIONS = frozenset(
    {"drain_timeout", "drain_delay", "dp_size", "router_policy", "router_args"}
)
# vLLM's flags that aserve's behaviour already has: taken, and nothing to set.
COMPATIBILITY_FLAGS = frozenset({"enable_auto_tool_choice"})


class _OneLineParser(argparse.ArgumentParser):
    """A bad option is one line on stderr and exit code 2, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"aserve: error: {message} (see aserve --help)\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _stream_interval(text: str) -> int | None:
    """`auto` (None) or a positive number of tokens."""
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"takes auto or a number of tokens, got {text!r}")
    return _positive_int(text)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="aserve",
        description="Serve an LLM over an OpenAI-compatible HTTP API from one asyncio process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        default=None,
        help="Hugging Face folder (config.json + safetensors) or a .gguf file; "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float16", "bfloat16", "float32"],
        help="weight and activation dtype; auto is float32 on CPU and the model's dtype on GPU",
    )
    model.add_argument(
        "--dummy-weight",
        action="store_true",
        help="random weights of the model's shapes (config.json alone), for benchmarks",
    )
    model.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto prefers CUDA")
    model.add_argument("--seed", type=int, default=0, help="seed of the dummy weights")
    model.add_argument(
        "--is-embedding",
        action="store_true",
        help="serve /v1/embeddings (the last token's normalised hidden state, unit length: "
        "Qwen3-Embedding, gte-Qwen2, e5-mistral) instead of generating text",
    )
    model.add_argument(
        "--hf-overrides",
        default="",
        help="a JSON object merged into the model's config.json (vLLM's option), e.g. "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}\' for Qwen3-Reranker',
    )
    model.add_argument(
        "--max-seq-len-override",
        "--context-length",
        "--max-model-len",
        dest="max_seq_len_override",
        type=_positive_int,
        default=None,
        help="context length to use instead of the model's",
    )

    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        "--lora-paths",
        dest="lora_modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters in PEFT's layout (a folder with adapter_config.json and "
        "adapter_model.safetensors), served beside the base model: a request names one as "
        'its "model"; also vLLM\'s JSON form \'{"name": "sql", "path": "/adapters/sql"}\'',
    )
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="also make room for adapters loaded at run time (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter) on every attention and dense-MLP projection",
    )
    lora.add_argument(
        "--max-loras",
        type=_positive_int,
        default=None,
        help="adapters held at once, every one usable in any batch (default: the "
        "--lora-modules, or 4 with --enable-lora)",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=_positive_int,
        default=None,
        help="refuse adapters of a larger rank (default: any at start; 16 for adapters "
        "loaded at run time)",
    )

    parallel = p.add_argument_group("parallelism")
    parallel.add_argument(
        "--tensor-parallel-size",
        "--tp-size",
        "--tp",
        dest="tensor_parallel_size",
        type=_positive_int,
        default=1,
        help="GPUs to shard the model over",
    )
    parallel.add_argument(
        "--disable-pynccl",
        action="store_true",
        help="use torch.distributed's NCCL for every tensor-parallel collective (by default "
        "small all-reduces take a one-shot kernel over NVLink when the GPUs allow it)",
    )

    memory = p.add_argument_group("memory and batching")
    memory.add_argument(
        "--max-running-requests",
        "--max-num-seqs",
        dest="max_running_requests",
        type=_positive_int,
        default=256,
        help="requests decoded together at most",
    )
    memory.add_argument(
        "--memory-ratio",
        "--mem-fraction-static",
        "--gpu-memory-utilization",
        dest="memory_ratio",
        type=float,
        default=0.9,
        help="share of GPU memory that weights, KV cache and activations may use",
    )
    memory.add_argument(
        "--num-pages",
        "--num-tokens",
        dest="num_pages",
        type=_positive_int,
        default=None,
        help="KV cache pages (overrides the memory-based size)",
    )
    memory.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=0.8,
        help="models with sliding-window layers (Gemma 3, gpt-oss): tokens of those layers' "
        "KV pool per token of the others' (they drop what their window has passed)",
    )
    memory.add_argument("--page-size", type=_positive_int, default=1, help="tokens per KV page")
    memory.add_argument(
        "--max-prefill-length",
        "--max-extend-length",
        dest="max_prefill_length",
        type=_positive_int,
        default=8192,
        help="prompt tokens one prefill step takes at most; longer prompts are chunked",
    )
    memory.add_argument(
        "--cache-type",
        "--cache",
        dest="cache_type",
        default="radix",
        choices=["radix", "naive"],
        help="prefix cache: radix reuses shared prompt prefixes",
    )

    speculative = p.add_argument_group("speculative decoding")
    speculative.add_argument(
        "--speculative-algorithm",
        type=str.lower,
        default=None,
        choices=SPECULATIVE_ALGORITHMS,
        help="ngram: draft a request's next tokens from where its last tokens occurred "
        "before in its prompt and output, and check them in one forward (outputs that copy "
        "from the prompt, code edits); the tokens are those of decoding without it",
    )
    speculative.add_argument(
        "--speculative-num-draft-tokens",
        type=_positive_int,
        default=4,
        help="drafted tokens a request checks in one step",
    )
    speculative.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=_positive_int,
        default=1,
        help="fewest last tokens that must have occurred before for a draft",
    )
    speculative.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=_positive_int,
        default=12,
        help="most last tokens matched when choosing among earlier occurrences",
    )

    kernels = p.add_argument_group("kernels")
    kernels.add_argument(
        "--attention-backend",
        "--attn",
        dest="attention_backend",
        default="auto",
        help="auto, fi, fa or torch; 'a,b' picks prefill and decode backends separately",
    )
    kernels.add_argument(
        "--cuda-graph-max-bs",
        "--graph",
        dest="cuda_graph_max_bs",
        type=_non_negative_int,
        default=None,
        help="largest decode batch captured in a CUDA graph; 0 disables graphs",
    )
    kernels.add_argument("--moe-backend", default="auto", help="MoE kernels: auto, torch or fused")
    model.add_argument(
        "--quantization",
        "-q",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: run the checkpoint's own (a GGUF, FP8, AWQ, GPTQ or compressed-tensors "
        "integer checkpoint stays quantized; on CPU bfloat16 / float16 weights stay in 16 "
        "bits); awq, gptq, compressed-tensors (and vLLM's awq_marlin, gptq_marlin): as auto, "
        "for a checkpoint of that method; none: "
        "de-quantize its weights to --dtype at load; int8, int4: quantize a float "
        "checkpoint's linear layers at load (groups of 32, as Q8_0 and Q4_1); fp8: into "
        "FP8 with per-channel scales, activations per token (GPUs of compute capability 8.9+; "
        "an FP8 checkpoint runs as it is, a GGUF file's weights are de-quantized first)",
    )
    model.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the KV cache in --dtype (quantized models on CPU: float16, as llama.cpp); "
        "fp8_e4m3 (or fp8): in FP8, half the bytes a token, with the checkpoint's KV scales "
        "if it has them (compute capability 8.9+); float16 / float32: a float32 model's cache "
        "on CPU in half the bytes, or in full",
    )

    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=1919, help="port to listen on")
    server.add_argument("--api-key", default=None, help="require this bearer token")
    server.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: the path)"
    )
    server.add_argument(
        "--num-tokenizer",
        "--tokenizer-count",
        dest="num_tokenizer",
        type=_positive_int,
        default=1,
        help="tokenizer threads",
    )
    server.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        default=None,
        help="requests accepted beyond --max-running-requests (parsing, tokenizing or waiting "
        "for a slot); more get 503 with Retry-After; unset: no bound",
    )
    server.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves unset: auto (the model's "
        "generation_config.json), none (OpenAI's) or a folder holding a generation_config.json",
    )
    server.add_argument(
        "--default-sampling",
        default=None,
        help="JSON object of sampling defaults over --generation-config's, e.g. "
        '\'{"temperature": 0.7, "top_p": 0.9}\'',
    )
    server.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="reasoning models (Qwen3, QwQ, DeepSeek-R1): chat replies carry the <think> block "
        "as reasoning_content and the answer alone as content",
    )
    server.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls (vLLM's names; auto: read from the chat "
        "template's markers, Hermes <tool_call> blocks where it has none)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: chat requests with tools always have their "
        "replies' calls parsed",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, as a file or the text itself, in place of the model's",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging verbosity",
    )
    server.add_argument(
        "--silent-output", action="store_true", help="no periodic batch statistics in the log"
    )
    server.add_argument(
        "--stream-interval",
        type=_stream_interval,
        default=None,
        help="tokens a streamed choice gathers before its next SSE event (the first token and "
        "the last go out at once); auto (default): one, or two while the GPU waits on the "
        "event loop under 64 or more streams; 1 sends every token as it comes",
    )
    server.add_argument(
        "--shell-mode",
        "--shell",
        dest="shell_mode",
        action="store_true",
        help="chat in the terminal instead of serving HTTP",
    )
    server.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGINT/SIGTERM before they abort",
    )
    server.add_argument(
        "--drain-delay",
        type=_non_negative_float,
        default=0.0,
        help="seconds after SIGINT/SIGTERM during which /health answers 503 but new requests "
        "are still taken, so a load balancer stops sending before they are refused",
    )

    replicas = p.add_argument_group("data parallelism (replicas behind SGLang's router)")
    replicas.add_argument(
        "--data-parallel-size",
        "--dp-size",
        "--dp",
        dest="dp_size",
        type=_positive_int,
        default=1,
        help="replicas of the server, each with its own --tp GPUs (or share of the CPU cores) "
        "and loopback port, behind SGLang's router on --host/--port (pip install "
        '"aserve[router]")',
    )
    replicas.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=ROUTER_POLICIES,
        help="how the router picks a replica: cache_aware sends requests to the replica "
        "holding their longest prefix unless the load is uneven",
    )
    replicas.add_argument(
        "--router-args",
        default="",
        help="more options for sglang_router.launch_router, as one string, e.g. "
        "'--retry-max-retries 3'",
    )
    return p


def parse_config(argv: Sequence[str] | None = None) -> tuple[ServerConfig, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    ignored = PROCESS_OPTIONS | COMPATIBILITY_FLAGS
    options = {k: v for k, v in vars(args).items() if k not in ignored}
    try:
        return build_config(**options), args
    except ConfigError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    config, args = parse_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="[%(asctime)s] %(levelname)s %(message)s"
    )
    if args.dp_size > 1:
        if config.shell_mode:
            build_parser().error("--shell-mode chats with one server: leave out --dp")
        from aserve.replicas import run_replicas

        return run_replicas(config, args, list(sys.argv[1:] if argv is None else argv))
    if config.shell_mode:
        from aserve.server.shell import run_shell

        return run_shell(config)
    from aserve.server.serve import run

    return run(config, args.drain_timeout, args.drain_delay)


if __name__ == "__main__":
    sys.exit(main())
