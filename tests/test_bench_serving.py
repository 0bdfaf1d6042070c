"""bench/serving.py against a fake OpenAI-compatible SSE server on loopback: request and token
counts, failures, arrival pacing, the order of the latency figures, and the serving table that
bench/report.py renders from the recorded line."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

import bench.common
from bench import report, serving

MODEL_ID = "fake-org/fake-model"
FAIL_LEN = 7
CUT_LEN = 3
NO_USAGE_LEN = 5
TOKENS_PER_CHUNK = 2
CHUNK_DELAY_S = 0.002


class FakeServer:
    """aserve's OpenAI completions route in miniature. Prompt lengths pick the behaviour:
    FAIL_LEN answers HTTP 500, CUT_LEN stops before [DONE], NO_USAGE_LEN sends no usage chunk.
    It runs its own loop in a thread so that main()'s asyncio.run can run beside it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_ID}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt_len, max_tokens = len(body["prompt"]), body["max_tokens"]
        usage = {"prompt_tokens": prompt_len, "completion_tokens": max_tokens}
        if prompt_len == FAIL_LEN:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if not body["stream"]:
            await asyncio.sleep(CHUNK_DELAY_S)
            return web.json_response({"choices": [{"text": "x" * max_tokens}], "usage": usage})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)

            async def send(frame: dict[str, Any]) -> None:
                await response.write(b"data: " + orjson.dumps(frame) + b"\n\n")

            await send({"choices": [{"index": 0, "text": ""}]})
            for first in range(0, max_tokens, TOKENS_PER_CHUNK):
                await asyncio.sleep(CHUNK_DELAY_S)
                text = "x" * min(TOKENS_PER_CHUNK, max_tokens - first)
                await send({"choices": [{"index": 0, "text": text}]})
            if prompt_len == CUT_LEN:
                return response
            if prompt_len != NO_USAGE_LEN and body["stream_options"]["include_usage"]:
                await send({"choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer() as fake:
        yield fake


def chunks_of(max_tokens: int) -> int:
    return math.ceil(max_tokens / TOKENS_PER_CHUNK)


def assert_figures_ordered(figures: dict[str, Any]) -> None:
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        median, p90, p99 = (figures[f"{s}_{name}_ms"] for s in ("median", "p90", "p99"))
        assert 0 < median <= p90 <= p99, name
    assert figures["mean_ttft_ms"] < figures["mean_e2e_latency_ms"]
    assert figures["p99_ttft_ms"] < figures["p99_e2e_latency_ms"]


def test_streaming_run_counts_requests_and_tokens(server: FakeServer) -> None:
    workload = [(list(range(10 + i)), 3 + i) for i in range(8)]
    run = asyncio.run(serving.benchmark(server.url, MODEL_ID, workload, max_concurrency=4))
    figures = serving.summarize(run)

    assert figures["completed"] == 8 and figures["failed"] == 0
    assert figures["total_input_tokens"] == sum(len(p) for p, _ in workload)
    assert figures["total_output_tokens"] == sum(n for _, n in workload)
    for result, (_, max_tokens) in zip(run.results, workload):
        assert result.ok and result.output_len == max_tokens
        assert len(result.itl) == chunks_of(max_tokens) - 1
        assert 0 < result.ttft < result.latency
    assert_figures_ordered(figures)
    assert figures["output_throughput"] == pytest.approx(
        figures["total_output_tokens"] / run.duration, rel=1e-3
    )
    assert len(server.bodies) == 1 + len(workload)
    assert server.bodies[0]["max_tokens"] == 3 and len(server.bodies[0]["prompt"]) == 10
    assert 1 < server.max_in_flight <= 4
    sent = server.bodies[1]
    assert sent["model"] == MODEL_ID and sent["ignore_eos"] and sent["stream"]
    assert sent["stream_options"] == {"include_usage": True}
    assert all(isinstance(t, int) for t in sent["prompt"])


def test_failed_requests_are_counted_not_raised(server: FakeServer) -> None:
    lengths = [12, FAIL_LEN, 13, CUT_LEN, NO_USAGE_LEN, 14]
    workload = [(list(range(n)), 5) for n in lengths]
    run = asyncio.run(serving.benchmark(server.url, MODEL_ID, workload, max_concurrency=4))
    figures = serving.summarize(run)

    assert figures["completed"] == 4 and figures["failed"] == 2
    assert figures["total_input_tokens"] == 12 + 13 + NO_USAGE_LEN + 14
    assert figures["total_output_tokens"] == 3 * 5 + chunks_of(5)
    failed = {r.prompt_len: r.error for r in run.results if not r.ok}
    assert failed[FAIL_LEN].startswith("HTTP 500") and "boom" in failed[FAIL_LEN]
    assert "before [DONE]" in failed[CUT_LEN]
    table = serving.format_result(run, figures, math.inf, 4)
    assert "Failed requests:" in table and "1 x HTTP 500" in table


def test_unreachable_server_fails_every_request() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    workload = [([1, 2, 3, 4], 2)] * 3
    run = asyncio.run(serving.benchmark(url, MODEL_ID, workload, warmup_requests=0))
    figures = serving.summarize(run)
    assert figures["completed"] == 0 and figures["failed"] == 3
    assert figures["total_output_tokens"] == 0 and figures["p99_ttft_ms"] == 0
    with pytest.raises(RuntimeError, match="warm-up failed"):
        asyncio.run(serving.benchmark(url, MODEL_ID, workload))


def test_request_rate_spaces_arrivals_poisson(server: FakeServer) -> None:
    workload = [(list(range(10)), 2)] * 6
    run = asyncio.run(serving.benchmark(server.url, MODEL_ID, workload, request_rate=200.0, seed=3))
    gaps = random.Random(3)
    assert run.duration >= sum(gaps.expovariate(200.0) for _ in workload[1:])
    assert serving.summarize(run)["completed"] == 6


def test_disable_stream_takes_ttft_as_e2e(server: FakeServer) -> None:
    workload = [(list(range(10)), 4), (list(range(11)), 6)]
    run = asyncio.run(serving.benchmark(server.url, MODEL_ID, workload, stream=False))
    assert [r.output_len for r in run.results] == [4, 6]
    assert all(r.ok and r.ttft == r.latency and not r.itl for r in run.results)
    assert "stream_options" not in server.bodies[-1]


def test_main_records_a_line_that_report_renders(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    offline = {
        "bench": "offline",
        "engine": "aserve",
        "run_id": "20260101-000000",
        "date": "2026-01-01",
        "model": "m",
        "device": "cpu",
        "commit": "abc",
        "settings": {
            "num_seqs": 1,
            "input_len": [4, 4],
            "output_len": [4, 4],
            "max_running_requests": 1,
            "temperature": 0.0,
        },
        "output_tokens": 4,
        "seconds": 1.0,
        "tok_s": 4.0,
    }
    jsonl = tmp_path / "results.jsonl"
    jsonl.write_text(json.dumps(offline) + "\n")
    monkeypatch.setattr(bench.common, "RESULTS_JSONL", jsonl)
    monkeypatch.setattr(report, "BENCH_DIR", tmp_path)
    args = ["--base-url", server.url, "--num-prompts", "4", "--max-concurrency", "2"]
    args += ["--input-len", "8", "12", "--output-len", "4", "4", "--label", "a|b"]

    serving.main(args)
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    line = json.loads(jsonl.read_text().splitlines()[-1])
    assert (line["bench"], line["engine"], line["model"]) == ("serving", "aserve", "fake-model")
    assert line["output_tokens"] == 16 and line["completed"] == 4 and line["failed"] == 0
    assert line["settings"]["label"] == "a|b" and line["settings"]["request_rate"] == "inf"
    for name in ("ttft", "itl", "e2e_latency"):
        for stat in ("mean", "median", "p90", "p99"):
            assert f"{stat}_{name}_ms" in line
    for key in ("request_throughput", "input_throughput", "output_throughput"):
        assert line[key] > 0

    serving.main([*args, "--no-record"])
    assert len(jsonl.read_text().splitlines()) == 2

    report.main()
    text = (tmp_path / "RESULTS.md").read_text()
    offline_table, serving_table = text.split("## Serving")
    assert "| offline | m |" in offline_table and "fake-model" not in offline_table
    row = next(r for r in serving_table.splitlines() if "fake-model" in r)
    assert "| aserve |" in row and "n=4 in=8-12 out=4 T=0.0 | 2 | inf |" in row
    assert row.endswith("| 0 | a/b |")


def test_workload_is_mini_sglangs_draw() -> None:
    """The offline workload draws what mini-SGLang's benchmark/offline/bench.py draws (its
    token totals, the first prompt's length and first ids), so that a comparison runs the
    same prompts and lengths."""
    workload = bench.common.random_workload(256, (100, 1024), (100, 1024), seed=0)
    assert sum(len(prompt) for prompt, _ in workload) == 142_827
    assert sum(output_len for _, output_len in workload) == 133_966
    generator = random.Random(0)
    first_len = generator.randint(100, 1024)
    first_ids = [generator.randint(0, 10000) for _ in range(first_len)]
    assert workload[0][0] == first_ids


def test_client_processes_share_the_workload(server: FakeServer) -> None:
    """Three client processes: every request answered once, results back in workload order,
    at most the concurrency asked for in flight, one CPU figure a process."""
    workload = [(list(range(10 + i)), 3 + i % 4) for i in range(12)]
    run = serving.benchmark_in_processes(
        3,
        workload,
        base_url=server.url,
        model=MODEL_ID,
        max_concurrency=6,
        request_rate=math.inf,
        temperature=0.0,
        api_key=None,
        stream=True,
        seed=0,
        warmup_requests=1,
    )
    assert [r.prompt_len for r in run.results] == [len(p) for p, _ in workload]
    assert [r.output_len for r in run.results] == [n for _, n in workload]
    assert all(r.ok for r in run.results)
    # Each process's own figure; not compared with the wall time: a run this short (~20 ms) is
    # within the kernel's CPU-accounting granularity (CI saw 30.6 ms of CPU in a 29.8 ms run).
    assert len(run.client_cpu) == 3 and all(cpu > 0 for cpu in run.client_cpu)
    assert run.duration >= max(r.latency for r in run.results)
    measured = [b for b in server.bodies if b["max_tokens"] != 3 or len(b["prompt"]) != 10]
    assert len(server.bodies) == 2 + len(workload)  # a warm-up and a short request first
    assert sorted(len(b["prompt"]) for b in measured) == [len(p) for p, _ in workload[1:]]
    assert server.max_in_flight <= 6
    figures = serving.summarize(run)
    assert figures["client_processes"] == 3 and figures["client_cpu_busy_pct"] > 0


def test_chat_text_prompts_against_aserve_keep_the_token_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--api chat --tokenizer` from two client processes against a real server on a tiny
    shape with the stand-in tokenizer (a vocabulary that holds the workload's ids, which go up
    to 10,000): the text prompts re-tokenize to exactly their ids (plus the chat template's
    two), and every output token is counted."""
    from bench.minisgl_peer import tokenizer_folder
    from tests.server_utils import ServerProcess
    from tests.tiny_models import make_tiny_model

    shape = make_tiny_model("llama", tmp_path / "tiny", overrides={"vocab_size": 10240})
    folder = tokenizer_folder(shape, tmp_path / "with-tokenizer")
    options = ["--dummy-weight", "--device", "cpu", "--dtype", "float32"]
    lengths = ["--num-prompts", "6", "--input-len", "5", "40", "--output-len", "3", "9"]
    aserve = ServerProcess(["--model", str(folder), *options])
    try:
        aserve.wait_ready()
        serving.main(
            ["--base-url", aserve.base_url, "--api", "chat", "--tokenizer", str(folder)]
            + ["--client-processes", "2", "--temperature", "0.6", "--no-record", *lengths]
        )
    finally:
        assert aserve.stop() == 0, aserve.log()
    workload = bench.common.random_workload(6, (5, 40), (3, 9), 0)
    table = capsys.readouterr().out
    assert "Successful requests:                     6" in table
    assert (
        f"Total input tokens:                      {sum(len(p) + 2 for p, _ in workload)}" in table
    )
    assert f"Total generated tokens:                  {sum(n for _, n in workload)}" in table
    assert "Client processes:                        2" in table


def test_a_server_without_usage_is_counted_by_re_tokenizing(
    server: FakeServer, tmp_path: Path
) -> None:
    """With a tokenizer, a stream that carried no usage gets its prompt and streamed text
    counted by the tokenizer (sglang.bench_serving's way); streams with usage keep it."""
    from bench.minisgl_peer import tokenizer_folder

    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": 0}))
    folder = tokenizer_folder(shape, tmp_path / "with-tokenizer")
    workload = [(list(range(12)), 4), (list(range(NO_USAGE_LEN)), 6)]
    run = asyncio.run(serving.benchmark(server.url, MODEL_ID, workload, warmup_requests=0))
    assert [r.text for r in run.results] == ["", "xxxxxx"]
    assert [r.output_len for r in run.results] == [4, 3]  # chunks, without usage
    texts = serving.as_text(workload, str(folder))
    assert texts[1][0] == " ".join(f"<t{i}>" for i in range(NO_USAGE_LEN))
    counted = serving.counted_without_usage(
        replace(run, results=tuple(replace(r, prompt_len=0) for r in run.results)),
        texts,
        str(folder),
    )
    assert [r.prompt_len for r in counted.results] == [0, NO_USAGE_LEN]
    assert [r.output_len for r in counted.results] == [4, 1]  # "xxxxxx" is one (unknown) word


def test_stream_loop_reports_the_loops_time_per_streamed_token() -> None:
    """bench/stream_loop.py end to end at a small size: the server with its stand-in
    scheduler, two bursts of chat streams, one figure for the measured burst."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "stream_loop.py"
    command = [sys.executable, str(script), "--streams", "4", "--tokens", "8"]
    done = subprocess.run(command + ["--bursts", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    bursts = [line for line in done.stdout.splitlines() if line.startswith("burst:")]
    assert len(bursts) == 2 and all(line.startswith("burst: 32 tokens") for line in bursts)
    figure = done.stdout.splitlines()[-1]
    assert figure.startswith("loop CPU a streamed token: ") and float(figure.split()[-2]) > 0
