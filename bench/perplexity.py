"""How much do FP8 weights and an FP8 KV cache cost in quality? The mean log-probability of a
fixed passage of plain English under the embedded model, one line per setting.

    python bench/perplexity.py                       # bf16, FP8 weights, FP8 KV (FP8 GPU)
    python bench/perplexity.py --settings float32 float16-kv   # what a CPU runs

The passage is scored through the server's own path (`SamplingParams.prompt_logprobs`: every
token after the first, given the ones before it). The embedded model is a Q4_1 GGUF file;
its weights are de-quantized once into a bf16 safetensors folder so that every setting
starts from the same float weights: `bf16` runs them as they are, `fp8-weights` quantizes
them at load (`--quantization fp8`), `fp8-kv` keeps them and stores the KV cache in FP8;
`float16-kv` runs them in float32 with the cache in float16 (`--kv-cache-dtype float16`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve import LLM, SamplingParams  # noqa: E402
from aserve.models.source import resolve_model  # noqa: E402
from aserve.models.weights import iter_weights  # noqa: E402
from bench.common import new_run_id, record  # noqa: E402

PASSAGE = (
    "The lighthouse stood at the end of a long stone pier, and for most of the year its keeper "
    "saw more gulls than people. Every evening she climbed the spiral stairs, trimmed the wick "
    "and wound the clockwork that turned the great lens. Ships far out at sea counted the "
    "flashes to learn which stretch of coast they were passing: three short and one long "
    "meant the harbour was near, and the captains who knew the signal slowed down before the "
    "rocks. In winter the storms came in from the west. Waves broke over the pier, spray froze "
    "on the windows, and the keeper wrote in her log that the wind had torn two slates from the "
    "roof. When spring returned she repaired the roof, painted the railings white again and "
    "planted potatoes in the small garden behind the cottage. Visitors sometimes walked out "
    "along the pier on sunny afternoons. They asked whether she was lonely, and she usually "
    "answered that the sea was never quiet enough to feel alone. Years later, when an "
    "automatic lamp replaced the clockwork, the town turned the cottage into a small museum, "
    "and her logbooks were placed in a glass case near the door."
)

SETTINGS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "float16-kv": {"dtype": "float32", "kv_cache_dtype": "float16"},
    "bf16": {"dtype": "bfloat16"},
    "fp8-weights": {"dtype": "bfloat16", "quantization": "fp8"},
    "fp8-kv": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=["bf16", "fp8-weights", "fp8-kv"])
    p.add_argument("--no-record", action="store_true")
    return p.parse_args()


def float_checkpoint(out: Path) -> Path:
    """The embedded model's weights de-quantized into a bf16 safetensors folder, with its
    config (no quantization_config: a float checkpoint) and tokenizer."""
    from safetensors.torch import save_file

    source = resolve_model(None)
    tensors = {
        name: tensor.to(torch.bfloat16).contiguous()
        for name, tensor in iter_weights(source, progress=False, dequantize=True)
        if isinstance(tensor, torch.Tensor)
    }
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def mean_logprob(folder: Path, options: dict[str, Any]) -> tuple[float, int, float]:
    """Mean log-probability of the passage's tokens after the first, how many, and the
    seconds the scoring took."""
    with LLM(str(folder), **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        started = time.perf_counter()
        out = llm.generate(PASSAGE, params)[0]
        seconds = time.perf_counter() - started
    if out.prompt_logprobs is None or out.error:
        raise SystemExit(f"scoring failed: {out.error}")
    values = [lp.logprob for lp in out.prompt_logprobs]
    return sum(values) / len(values), len(values), seconds


def main() -> None:
    args = parse_args()
    unknown = set(args.settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}: choose from {sorted(SETTINGS)}")
    run_id = new_run_id()
    with tempfile.TemporaryDirectory() as scratch:
        folder = float_checkpoint(Path(scratch))
        print(f"{'setting':<12} {'tokens':>6} {'mean logprob':>13} {'perplexity':>10}")
        for name in args.settings:
            mean, count, seconds = mean_logprob(folder, SETTINGS[name])
            print(f"{name:<12} {count:>6} {mean:>13.4f} {math.exp(-mean):>10.3f}")
            if not args.no_record:
                record(
                    "perplexity",
                    "aserve",
                    "SmolLM2-135M-Instruct",
                    {"setting": name, **SETTINGS[name]},
                    count,
                    seconds,
                    run_id,
                    mean_logprob=round(mean, 5),
                    perplexity=round(math.exp(-mean), 4),
                )


if __name__ == "__main__":
    main()
