"""Online serving benchmark: concurrent streaming clients against a running OpenAI-compatible
server (aserve, or a peer such as SGLang), with sglang.bench_serving's figures and names.

    python bench/serving.py --num-prompts 64 --max-concurrency 16 \\
        --random-input-len 512 --random-output-len 128 --random-range-ratio 1
    python bench/serving.py --num-prompts 200 --request-rate 8 \\
        --input-len 100 1024 --output-len 100 1024 --label "graph bs 256, page 256"

Prompts are bench/common.py's seeded token-id workload, sent as a list of ids in "prompt", so
input lengths are exact and no tokenizer is needed on the client; with `--tokenizer` they are
decoded to text first, and `--api chat` sends that text as a user message to
/v1/chat/completions (the server's usage then counts the prompt tokens). On a benchmark shape
the stand-in tokenizer of bench/minisgl_peer.py makes the text re-tokenize to the same ids:

    python bench/serving.py --api chat --tokenizer /tmp/shape-with-tokenizer \
        --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --client-processes 4

`--client-processes N` deals the workload round-robin to N processes, each with its own event
loop, connections and share of `--max-concurrency` / `--request-rate`, started together; the
table then shows each process's CPU time over the run, so a client that is itself the bound
(one core busy all the time) shows. TTFT is the time to the first
chunk carrying text, ITL each gap between successive text chunks (a chunk holding several
tokens is one gap, as in sglang), E2E the time until `[DONE]`; output tokens come from the
usage chunk (text chunks are counted when a server sends none). A failed request is counted
and its error shown; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import new_run_id, random_workload, record  # noqa: E402

Prompt = list[int] | str
Workload = list[tuple[Prompt, int]]


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome; times in seconds from the moment it was sent."""

    prompt_len: int
    ok: bool
    output_len: int = 0
    ttft: float = 0.0
    itl: tuple[float, ...] = ()
    latency: float = 0.0
    error: str = ""
    headers: float = 0.0
    text: str = ""  # the streamed text, kept only when the server sent no usage to count


@dataclass(frozen=True)
class BenchmarkRun:
    results: tuple[RequestResult, ...]
    duration: float
    client_cpu: tuple[float, ...] = ()  # each client process's CPU seconds over the run
    started: float = 0.0  # time.perf_counter() at the start (system-wide monotonic on Linux)


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def first_model(base_url: str, api_key: str | None = None) -> str:
    """The served model id, as sglang.bench_serving finds it when --model is not given."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{base_url.rstrip('/')}/v1/models", headers=_headers(api_key)) as response,
    ):
        response.raise_for_status()
        # content_type=None: SGLang's router sends its model list as text/plain.
        return (await response.json(content_type=None))["data"][0]["id"]


class RawResponse:
    """An HTTP/1.1 response read straight off its connection: the status, then the body as
    lines, chunked transfer coding undone.

    The request goes out as one write of headers and body. aiohttp's client, used here
    before, wrote the headers of a burst's requests at once but their bodies one by one
    between the streams it was already reading (seen on an H200: 256 chats reached the
    server over half a second, one every 2 ms), which made the client the bound of the
    arrival it was meant to measure."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.chunked = False
        self.length: int | None = None

    @classmethod
    async def post(cls, url: str, headers: dict[str, str], body: bytes) -> RawResponse:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"the benchmark client speaks plain HTTP, not {parts.scheme}")
        host, port = parts.hostname or "localhost", parts.port or 80
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"POST {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\n{head}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        response = cls(reader, writer)
        status = await reader.readline()
        if not status:
            raise ConnectionError("the server closed the connection without a response")
        response.status = int(status.split()[1])
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "transfer-encoding":
                response.chunked = "chunked" in value.lower()
            elif name == "content-length":
                response.length = int(value)
        return response

    async def body(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])

    async def lines(self) -> AsyncIterator[bytes]:
        pending = b""
        async for piece in self._pieces():
            pending += piece
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line
        if pending:
            yield pending

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self.reader
        if not self.chunked:
            if self.length is not None:
                yield await reader.readexactly(self.length)
                return
            while piece := await reader.read(1 << 16):
                yield piece
            return
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            yield (await reader.readexactly(size + 2))[:-2]

    def close(self) -> None:
        self.writer.close()


async def _read_stream(
    response: RawResponse, sent: float, prompt_len: int, headers: float
) -> RequestResult:
    ttft = 0.0
    last = sent
    gaps: list[float] = []
    chunks = 0
    completion_tokens: int | None = None
    pieces: list[str] = []
    async for raw in response.lines():
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            latency = time.perf_counter() - sent
            output_len = chunks if completion_tokens is None else completion_tokens
            first = ttft if chunks else latency
            text = "".join(pieces) if completion_tokens is None else ""
            return RequestResult(
                prompt_len, True, output_len, first, tuple(gaps), latency, "", headers, text
            )
        frame = orjson.loads(data)
        if "error" in frame:
            return RequestResult(prompt_len, False, error=f"stream error: {frame['error']}")
        usage = frame.get("usage")
        if usage:
            completion_tokens = usage.get("completion_tokens", completion_tokens)
            prompt_len = usage.get("prompt_tokens", prompt_len)
        choices = frame.get("choices")
        if choices and _carries_text(choices[0]):
            if completion_tokens is None:
                choice = choices[0]
                pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content", ""))
            now = time.perf_counter()
            if chunks:
                gaps.append(now - last)
            else:
                ttft = now - sent
            last = now
            chunks += 1
    return RequestResult(prompt_len, False, error="stream ended before [DONE]")


def _carries_text(choice: dict[str, Any]) -> bool:
    """A completions chunk's text or token ids, or a chat chunk's content."""
    return bool(
        choice.get("text") or choice.get("token_ids") or (choice.get("delta") or {}).get("content")
    )


async def send_request(url: str, headers: dict[str, str], payload: dict[str, Any]) -> RequestResult:
    """Any failure (HTTP status, connection, malformed stream) becomes a failed result, so one
    bad request is reported instead of ending the benchmark."""
    prompt = payload["prompt"] if "prompt" in payload else payload["messages"][0]["content"]
    prompt_len = len(prompt) if isinstance(prompt, list) else 0  # text: from the usage
    sent = time.perf_counter()
    response = None
    try:
        response = await RawResponse.post(url, headers, orjson.dumps(payload))
        if response.status != 200:
            body = (await response.body())[:200].decode(errors="replace")
            return RequestResult(prompt_len, False, error=f"HTTP {response.status}: {body}")
        headers_at = time.perf_counter() - sent
        if payload["stream"]:
            return await _read_stream(response, sent, prompt_len, headers_at)
        reply = orjson.loads(await response.body())
        latency = time.perf_counter() - sent
        usage = reply.get("usage") or {}
        output_len = usage.get("completion_tokens", payload["max_tokens"])
        prompt_len = usage.get("prompt_tokens", prompt_len)
        return RequestResult(prompt_len, True, output_len, latency, (), latency, headers=headers_at)
    except Exception as e:
        return RequestResult(prompt_len, False, error=f"{type(e).__name__}: {e}")
    finally:
        if response is not None:
            response.close()


async def benchmark(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    temperature: float = 0.0,
    api_key: str | None = None,
    stream: bool = True,
    seed: int = 0,
    warmup_requests: int = 1,
    api: str = "completions",
    start_together: Any = None,
) -> BenchmarkRun:
    """Send `workload` with Poisson arrivals at `request_rate` (inf: all at once), at most
    `max_concurrency` in flight, to the completions or the chat route; warm-up requests come
    first and are not measured. `start_together` (a multiprocessing barrier) holds the first
    request until every client process is ready."""
    chat = api == "chat"
    url = f"{base_url.rstrip('/')}/v1/{'chat/completions' if chat else 'completions'}"
    headers = _headers(api_key)

    def payload(prompt: Prompt, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True,
            "stream": stream,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
            body["return_token_ids"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def limited(prompt: Prompt, max_tokens: int) -> RequestResult:
        async with limit:
            return await send_request(url, headers, payload(prompt, max_tokens))

    if warmup_requests:
        prompt, max_tokens = workload[0]
        warm = payload(prompt[:16], min(max_tokens, 16))
        outcomes = await asyncio.gather(
            *(send_request(url, headers, warm) for _ in range(warmup_requests))
        )
        if not any(r.ok for r in outcomes):
            raise RuntimeError(f"warm-up failed against {url}: {outcomes[0].error}")
    arrivals = random.Random(seed)
    if start_together is not None:
        start_together.wait()
    started = time.perf_counter()
    cpu_before = time.process_time()  # inside the wall-clock window, so cpu <= duration
    tasks = []
    for i, (prompt, max_tokens) in enumerate(workload):
        if i and math.isfinite(request_rate):
            await asyncio.sleep(arrivals.expovariate(request_rate))
        tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
    results = await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu_before
    duration = time.perf_counter() - started
    return BenchmarkRun(tuple(results), duration, (cpu,), started)


def _client_process(
    shard: Workload, options: dict[str, Any], barrier: Any, results: Any, index: int
) -> None:
    """One client process of `benchmark_in_processes`: its shard, then its run on the queue."""
    try:
        run = asyncio.run(benchmark(workload=shard, start_together=barrier, **options))
        results.put((index, run))
    except BaseException as error:  # reported by the parent, which would otherwise wait
        barrier.abort()
        results.put((index, f"{type(error).__name__}: {error}"))


def benchmark_in_processes(processes: int, workload: Workload, **options: Any) -> BenchmarkRun:
    """`benchmark` from `processes` client processes (spawned), the workload dealt round-robin
    and `max_concurrency` / `request_rate` shared out; they start together at a barrier and
    the run lasts from then until the last one ends. Warm-up requests (and one short request)
    are sent once, before. At most `max_concurrency` processes, when that is set."""
    assert not options["max_concurrency"] or processes <= options["max_concurrency"]
    warmup = options.pop("warmup_requests", 1)
    if warmup:
        prompt, max_tokens = workload[0]
        short = [(prompt[:16], min(max_tokens, 16))]
        asyncio.run(benchmark(workload=short, warmup_requests=warmup, **options))
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes + 1)
    queue = context.Queue()
    limit, rate, seed = options["max_concurrency"], options["request_rate"], options["seed"]
    workers = []
    for index in range(processes):
        share = {
            **options,
            "max_concurrency": limit and limit // processes + (index < limit % processes),
            "request_rate": rate / processes,
            "seed": seed + index,
            "warmup_requests": 0,
        }
        shard = workload[index::processes]
        worker = context.Process(
            target=_client_process, args=(shard, share, barrier, queue, index), daemon=True
        )
        worker.start()
        workers.append(worker)
    with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: its error follows
        barrier.wait()
    runs: dict[int, BenchmarkRun] = {}
    for _ in workers:
        index, run = queue.get()
        if isinstance(run, str):
            raise RuntimeError(f"client process {index} failed: {run}")
        runs[index] = run
    # From the first client's start to the last one's end, on the clients' own clocks: the
    # parent may be scheduled late after the barrier while its clients already run.
    started = min(run.started for run in runs.values())
    duration = max(run.started + run.duration for run in runs.values()) - started
    for worker in workers:
        worker.join()
    # Back in workload order: request i ran in process i % processes, as its (i // processes)th.
    results = [runs[i % processes].results[i // processes] for i in range(len(workload))]
    cpu = tuple(runs[i].client_cpu[0] for i in range(processes))
    return BenchmarkRun(tuple(results), duration, cpu, started)


def _latency_figures(name: str, seconds: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(seconds or [0.0]) * 1000
    return {
        f"mean_{name}_ms": round(float(ms.mean()), 3),
        f"median_{name}_ms": round(float(np.median(ms)), 3),
        f"p90_{name}_ms": round(float(np.percentile(ms, 90)), 3),
        f"p99_{name}_ms": round(float(np.percentile(ms, 99)), 3),
    }


def summarize(run: BenchmarkRun) -> dict[str, Any]:
    """sglang.bench_serving's figures under its key names (p90 added beside p99); throughputs
    and latencies count successful requests only, and `concurrency` is the mean number of
    requests in flight."""
    done = [r for r in run.results if r.ok]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    duration = run.duration
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    return {
        "completed": len(done),
        "failed": len(run.results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": round(len(done) / duration, 3),
        "input_throughput": round(total_input / duration, 3),
        "output_throughput": round(total_output / duration, 3),
        "total_throughput": round((total_input + total_output) / duration, 3),
        "concurrency": round(sum(r.latency for r in done) / duration, 3),
        **_latency_figures("ttft", [r.ttft for r in done]),
        **_latency_figures("tpot", tpots),
        **_latency_figures("itl", [gap for r in done for gap in r.itl]),
        **_latency_figures("e2e_latency", [r.latency for r in done]),
        **_latency_figures("headers", [r.headers for r in done]),
        "client_processes": len(run.client_cpu) or 1,
        "client_cpu_busy_pct": round(100 * max(run.client_cpu, default=0.0) / duration, 1),
    }


def format_result(
    run: BenchmarkRun,
    figures: dict[str, Any],
    request_rate: float,
    max_concurrency: int | None,
) -> str:
    """The table in sglang.bench_serving's layout, so that the two read side by side."""
    rows = [
        ("Traffic request rate:", request_rate),
        ("Max request concurrency:", max_concurrency or "not set"),
        ("Successful requests:", figures["completed"]),
        ("Failed requests:", figures["failed"]),
        ("Benchmark duration (s):", f"{run.duration:.2f}"),
        ("Total input tokens:", figures["total_input_tokens"]),
        ("Total generated tokens:", figures["total_output_tokens"]),
        ("Request throughput (req/s):", f"{figures['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{figures['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{figures['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{figures['total_throughput']:.2f}"),
        ("Concurrency:", f"{figures['concurrency']:.2f}"),
        ("Client processes:", len(run.client_cpu) or 1),
        ("Client CPU busy (%, busiest process):", f"{figures['client_cpu_busy_pct']:.1f}"),
    ]
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{label:<40} {value}" for label, value in rows]
    for title, name, short in (
        ("End-to-End Latency", "e2e_latency", "E2E Latency"),
        ("Time to First Token", "ttft", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("Inter-Token Latency", "itl", "ITL"),
        ("Time to Response Headers (connect + accept)", "headers", "Headers"),
    ):
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p90", "p99"):
            label = f"{stat.capitalize()} {short} (ms):"
            lines.append(f"{label:<40} {figures[f'{stat}_{name}_ms']:.2f}")
    lines.append("=" * 50)
    errors = Counter(r.error for r in run.results if not r.ok)
    lines += [f"{count} x {error}" for error, count in errors.most_common(3)]
    return "\n".join(lines)


def _ratio_range(length: int, ratio: float) -> tuple[int, int]:
    """sglang's random lengths: uniform in [length * ratio, length], at least one token."""
    return max(int(length * ratio), 1), length


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="aserve online serving benchmark")
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--model", default=None, help="model id (default: first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=None, help="default: unlimited")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s, Poisson (default: inf)"
    )
    inputs = p.add_mutually_exclusive_group()
    inputs.add_argument("--random-input-len", type=int, default=1024)
    inputs.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    outputs = p.add_mutually_exclusive_group()
    outputs.add_argument("--random-output-len", type=int, default=1024)
    outputs.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--disable-stream", action="store_true", help="TTFT then equals E2E")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--engine", default="aserve", help="name recorded for the server measured")
    p.add_argument("--label", default="", help="free text stored with the settings")
    p.add_argument("--no-record", action="store_true", help="print only, append nothing")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", default=None, help="send text: the ids decoded with this")
    p.add_argument("--client-processes", type=int, default=1)
    args = p.parse_args(argv)
    if args.api == "chat" and not args.tokenizer:
        p.error("--api chat sends text: give --tokenizer")
    if args.client_processes < 1 or args.client_processes > (args.max_concurrency or math.inf):
        p.error("--client-processes: from 1 to --max-concurrency")
    return args


def as_text(workload: Workload, tokenizer_path: str) -> Workload:
    """Each prompt's ids decoded with the tokenizer at `tokenizer_path` (transformers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return [(tokenizer.decode(prompt), max_tokens) for prompt, max_tokens in workload]


def counted_without_usage(
    run: BenchmarkRun, workload: Workload, tokenizer_path: str
) -> BenchmarkRun:
    """Token counts for a server that sends no usage (mini-SGLang's): the prompt and the
    streamed text re-tokenized, as sglang.bench_serving counts (the chat template's tokens
    are then not in the prompt count)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    results = tuple(
        replace(r, prompt_len=r.prompt_len or count(str(prompt)), output_len=count(r.text))
        if r.ok and r.text
        else r
        for r, (prompt, _) in zip(run.results, workload, strict=True)
    )
    return replace(run, results=results)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    input_range = args.input_len or _ratio_range(args.random_input_len, args.random_range_ratio)
    output_range = args.output_len or _ratio_range(args.random_output_len, args.random_range_ratio)
    workload: Workload = list(
        random_workload(args.num_prompts, tuple(input_range), tuple(output_range), args.seed)
    )
    if args.tokenizer:
        workload = as_text(workload, args.tokenizer)
    try:
        model = args.model or asyncio.run(first_model(args.base_url, args.api_key))
        options = {
            "base_url": args.base_url,
            "model": model,
            "max_concurrency": args.max_concurrency,
            "request_rate": args.request_rate,
            "temperature": args.temperature,
            "api_key": args.api_key,
            "stream": not args.disable_stream,
            "seed": args.seed,
            "warmup_requests": args.warmup_requests,
            "api": args.api,
        }
        if args.client_processes > 1:
            run = benchmark_in_processes(args.client_processes, workload, **options)
        else:
            run = asyncio.run(benchmark(workload=workload, **options))
    except (aiohttp.ClientError, OSError, RuntimeError) as e:
        sys.exit(f"cannot benchmark {args.base_url}: {e}")
    if args.tokenizer:
        run = counted_without_usage(run, workload, args.tokenizer)
    figures = summarize(run)
    print(format_result(run, figures, args.request_rate, args.max_concurrency))
    if not figures["completed"]:
        sys.exit("no request succeeded; nothing recorded")
    if args.no_record:
        return
    settings = {
        "num_prompts": args.num_prompts,
        "input_len": list(input_range),
        "output_len": list(output_range),
        "seed": args.seed,
        "temperature": args.temperature,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "stream": not args.disable_stream,
        "api": args.api,
        "text": bool(args.tokenizer),
        "client_processes": args.client_processes,
        "label": args.label,
    }
    record(
        "serving",
        args.engine,
        Path(model).name,
        settings,
        figures["total_output_tokens"],
        run.duration,
        new_run_id(),
        **figures,
    )


if __name__ == "__main__":
    main()
