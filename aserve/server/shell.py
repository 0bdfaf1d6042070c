"""`aserve --shell`: chat with the model in the terminal, replies streamed as they decode.

The conversation history is kept across turns; `/reset` forgets it and `/exit` (or EOF)
leaves. As in mini-SGLang, one request runs at a time and decode graphs stop at batch 1.
Replies are sampled with the model's recommended sampling (the server's defaults, see
aserve/generation_defaults.py), else temperature 0.7 and top-p 0.9, with a fixed seed, so
the same conversation replays the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import TextIO

from aserve.config import ConfigError, ServerConfig
from aserve.runtime import Runtime
from aserve.sampling_params import SamplingParams
from aserve.server.generation import Choice

BANNER = "aserve shell: type a message; /reset clears the history, /exit quits."
# What the shell samples with where the model recommends nothing (its defaults win).
SHELL_SAMPLING: dict[str, float] = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512}


def shell_config(config: ServerConfig) -> ServerConfig:
    engine = dataclasses.replace(config.engine, max_running_requests=1, cuda_graph_max_bs=1)
    scheduler = dataclasses.replace(config.scheduler, max_running_requests=1)
    return dataclasses.replace(config, engine=engine, scheduler=scheduler)


async def _reply(runtime: Runtime, history: list[dict[str, str]], out: TextIO) -> str:
    assert runtime.tokenizer is not None
    prompt = runtime.tokenizer.apply_chat_template(history)
    room = runtime.engine.max_seq_len - len(prompt)
    if room < 1:
        raise ConfigError("the conversation no longer fits the context: /reset to start over")
    chosen = {**SHELL_SAMPLING, **runtime.sampling_defaults}
    chosen["max_tokens"] = min(room, int(chosen["max_tokens"]))
    params = SamplingParams(**chosen, seed=0)  # type: ignore[arg-type]
    choice = Choice(runtime.scheduler, runtime.tokenizer, prompt, params, [])
    problem = choice.prepare()
    if problem is not None:
        raise ConfigError(problem)
    pieces = []
    async for delta in choice.run():
        pieces.append(delta.text)
        out.write(delta.text)
        out.flush()
    out.write("\n")
    return "".join(pieces)


def run_shell(config: ServerConfig, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    try:
        runtime = Runtime(shell_config(config))
    except ConfigError as error:
        print(f"aserve: error: {error}", file=sys.stderr)
        return 2
    if runtime.tokenizer is None:
        print("aserve: error: the shell needs a model with a tokenizer", file=sys.stderr)
        return 2
    loop = asyncio.new_event_loop()
    scheduler_task = loop.create_task(runtime.scheduler.run())
    history: list[dict[str, str]] = []
    out.write(BANNER + "\n")
    try:
        while True:
            out.write("> ")
            out.flush()
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                break
            text = line.strip()
            if text == "/reset":
                history.clear()
                out.write("(history cleared)\n")
                continue
            if not text:
                continue
            history.append({"role": "user", "content": text})
            try:
                answer = loop.run_until_complete(_reply(runtime, history, out))
            except ConfigError as error:
                history.pop()
                out.write(f"(error: {error})\n")
                continue
            history.append({"role": "assistant", "content": answer})
    except KeyboardInterrupt:
        out.write("\n")
    finally:
        runtime.scheduler.stop()
        loop.run_until_complete(asyncio.wait([scheduler_task]))
        runtime.close()
        loop.close()
    return 0
