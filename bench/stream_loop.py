"""The event loop's CPU time per streamed token, on this machine, without a model's forward.

The server runs in this process with a stand-in scheduler: every `--step-ms` it hands one
token to each running request (and ends a request after its `max_tokens`), as a decode step
would, through the same channels. bench/serving.py then sends bursts of chat streams; for each
burst the loop thread's CPU time over the tokens handed out is printed. This is the cost that
bounds 256 streams on a slow host (bench/NOTES.md, issue 21): handlers, detokenizing, SSE
writes and metrics, measurable on a laptop.

    python bench/stream_loop.py                     # the embedded model's tokenizer, 256 x 256
    python bench/stream_loop.py --streams 64 --bursts 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aserve.models.source import resolve_model  # noqa: E402
from aserve.replicas import free_port, http_status  # noqa: E402
from aserve.scheduler.request import FinishReason, Req, ReqOutput  # noqa: E402
from aserve.scheduler.scheduler import Scheduler, StepObserver  # noqa: E402


class StandIn:
    """Replaces the scheduler's loop: requests get a token each step until max_tokens."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.running: list[Req] = []
        self.results: list[float] = []

    def submit(self, scheduler: Scheduler, req: Req) -> None:
        self.running.append(req)

    def abort(self, scheduler: Scheduler, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        req.finish_reason = FinishReason.ABORT

    async def run(self, scheduler: Scheduler, on_step: StepObserver | None = None) -> None:
        rng = random.Random(0)
        vocab = scheduler.vocab_size
        cpu_start, tokens = 0.0, 0
        while not scheduler._stopping:
            await asyncio.sleep(self.step_s)
            if self.running and not tokens:
                cpu_start = time.thread_time()
            for req in list(self.running):
                token = rng.randrange(vocab // 10, vocab // 2)
                req.output_ids.append(token)
                done = len(req.output_ids) >= req.params.max_tokens
                if done:
                    req.finish_reason = FinishReason.LENGTH
                    self.running.remove(req)
                req.channel.put_nowait(ReqOutput((token,), (), req.finish_reason))
                tokens += 1
            if tokens and not self.running:
                us = (time.thread_time() - cpu_start) * 1e6 / tokens
                self.results.append(us)
                print(f"burst: {tokens} tokens, loop CPU {us:.1f} us a token", flush=True)
                tokens = 0


def drive(args: argparse.Namespace, port: int, tokenizer: Path) -> None:
    """Wait for the server, send the bursts (the first one unreported), then stop it."""
    url = f"http://127.0.0.1:{port}"
    while http_status(url + "/health") != 200:
        time.sleep(0.2)
    for _ in range(args.bursts + 1):
        command = [
            sys.executable,
            str(ROOT / "bench" / "serving.py"),
            "--base-url",
            url,
            "--api",
            "chat",
            "--tokenizer",
            str(tokenizer),
            "--num-prompts",
            str(args.streams),
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.tokens),
            "--random-range-ratio",
            "1",
            "--warmup-requests",
            "0",
            "--no-record",
        ]
        subprocess.run(command, check=True, capture_output=True)
    os.kill(os.getpid(), signal.SIGINT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="its tokenizer is used (default: embedded)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="tokens a stream")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=10.0)
    args = p.parse_args()
    model = resolve_model(args.model)
    stand_in = StandIn(args.step_ms / 1000)
    # plain functions, so that each is bound to the server's scheduler as its method
    Scheduler.submit = lambda self, req: stand_in.submit(self, req)  # type: ignore[method-assign]
    Scheduler.abort = lambda self, req: stand_in.abort(self, req)  # type: ignore[method-assign]
    Scheduler.run = lambda self, on_step=None: stand_in.run(self, on_step)  # type: ignore[method-assign]
    port = free_port()
    threading.Thread(target=drive, args=(args, port, model), daemon=True).start()
    from aserve.cli import main as serve

    serve(["--model", str(model), "--port", str(port), "--silent-output"])
    measured = stand_in.results[1:]  # the first burst warms the server up
    if measured:
        print(f"loop CPU a streamed token: {', '.join(f'{us:.1f}' for us in measured)} us")


if __name__ == "__main__":
    main()
