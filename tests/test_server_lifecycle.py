"""Start-up, auth, queue limits, faults, shutdown and the CLI's one-line errors, each on its
own short-lived server process; plus shell mode driven through a pseudo-terminal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from aserve.runtime import Runtime
from tests.server_utils import ServerProcess
from tests.test_server import get, post, run

HELLO = [{"role": "user", "content": "Say hello."}]


def test_sglang_and_vllm_spellings_reach_the_same_settings() -> None:
    """A command line written for SGLang or vLLM sets what aserve's own names set;
    `--enable-auto-tool-choice` is taken (aserve always parses tool calls)."""
    from aserve.cli import parse_config

    ours = parse_config(
        ["--max-seq-len-override", "2048", "--memory-ratio", "0.5", "--max-running-requests", "8"]
    )[0]
    for argv in (
        ["--context-length", "2048", "--mem-fraction-static", "0.5", "--max-running-requests", "8"],
        ["--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8"],
    ):
        config = parse_config([*argv, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])[
            0
        ]
        assert config.engine.max_seq_len_override == ours.engine.max_seq_len_override == 2048
        assert config.engine.memory_ratio == ours.engine.memory_ratio == 0.5
        assert config.scheduler.max_running_requests == ours.scheduler.max_running_requests == 8
        assert config.tool_call_parser == "hermes" and ours.tool_call_parser == "auto"


def test_bad_option_is_one_line_and_exit_code_2() -> None:
    for args in (
        ["--page-size", "0"],
        ["--cache", "lru"],
        ["--dtype", "float8"],
        ["--memory-ratio", "3"],
        ["--tp", "0"],
        ["--tool-call-parser", "deepseek"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "aserve", *args], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2, args
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_missing_model_is_one_line(tmp_path: Path) -> None:
    process = ServerProcess(["--model", str(tmp_path / "nope")])
    code = process.proc.wait(60)
    log = process.log()
    assert code == 2 and "does not exist" in log and "Traceback" not in log
    process.stop()


def test_busy_port_is_one_clear_line(smollm2_dir: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "aserve", "--model", str(smollm2_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_health_is_503_while_loading_then_ready(smollm2_dir: Path) -> None:
    process = ServerProcess(["--model", str(smollm2_dir), "--num-pages", "2048"])
    try:
        codes = set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 200 not in codes:
            codes.add(process.health())
            time.sleep(0.05)
        assert 503 in codes and 200 in codes
        log = process.log()
        for fragment in (
            "LlamaForCausalLM",
            "dtype=float32",
            "device=cpu",
            "max_total_num_tokens=2047",
            "kv_cache=",
            "free_mem_before_load",
            "free_mem_after_load",
            "http://127.0.0.1:",
        ):
            assert fragment in log, fragment
        # One line a start-up phase, with its time, in the order they run.
        phases = [
            r"CPU kernels ready in \d+\.\d s",
            r"weights: 92 MiB on cpu in \d+\.\d s",  # scales in float16, as in the file
            r"KV cache: 2047 tokens, 0\.04 GiB of float16, allocated in \d+\.\d s",
            r"ready: serving",
        ]
        found = [re.search(phase, log) for phase in phases]
        assert all(found), [p for p, f in zip(phases, found) if not f]
        assert [f.start() for f in found] == sorted(f.start() for f in found)
    finally:
        assert process.stop() == 0


def test_api_key_queue_limit_and_stream_interval(smollm2_dir: Path) -> None:
    process = ServerProcess(
        [
            "--model",
            str(smollm2_dir),
            "--num-pages",
            "2048",
            "--api-key",
            "s3cret",
            "--max-running-requests",
            "1",
            "--max-queued-requests",
            "1",
            "--silent-output",
            "--stream-interval",
            "3",
        ]
    )
    auth = {"Authorization": "Bearer s3cret"}
    try:
        process.wait_ready()
        url = process.base_url + "/v1/chat/completions"
        assert process.health() == 200
        status, body = run(post(url, {"messages": HELLO, "max_tokens": 2}))
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = run(
            post(url, {"messages": HELLO, "max_tokens": 2}, {"Authorization": "Bearer wrong"})
        )
        assert status == 401
        status, _ = run(get(process.base_url + "/v1/models"))
        assert status == 401
        status, body = run(post(url, {"messages": HELLO, "max_tokens": 2}, auth))
        assert status == 200
        # --stream-interval 3: the first token at once, then events of three tokens each.
        streamed = {"messages": HELLO, "max_tokens": 10, "ignore_eos": True, "stream": True}
        per_event = run(tokens_per_event(url, {**streamed, "return_token_ids": True}, auth))
        assert per_event == [1, 3, 3, 3]

        async def overload() -> list[tuple[int, str | None]]:
            # long enough that the first still runs when the third arrives (at ~4 ms a token
            # on a 2-core box, 60 tokens had ended by then)
            long = {"messages": HELLO, "max_tokens": 300, "ignore_eos": True}
            async with aiohttp.ClientSession(headers=auth) as session:

                async def one(delay: float) -> tuple[int, str | None]:
                    await asyncio.sleep(delay)
                    async with session.post(url, json=long) as response:
                        await response.read()
                        return response.status, response.headers.get("Retry-After")

                return list(await asyncio.gather(one(0), one(0.1), one(0.2)))

        results = run(overload())
        assert sorted(s for s, _ in results) == [200, 200, 503]
        assert [r for s, r in results if s == 503] == ["1"]
        assert "Prefill batch." not in process.log()
    finally:
        assert process.stop() == 0


async def tokens_per_event(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[int]:
    """How many token ids each SSE event of a streamed request carries (events with none
    left out)."""
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(url, json=body) as response:
            assert response.status == 200
            text = (await response.read()).decode()
    counts = []
    for frame in text.split("\n\n"):
        if frame.startswith("data: {"):
            choices = orjson.loads(frame[6:])["choices"]
            if choices and choices[0].get("token_ids"):
                counts.append(len(choices[0]["token_ids"]))
    return counts


def test_burst_gets_exactly_the_bounded_number_of_answers(smollm2_dir: Path) -> None:
    """5x capacity at once, chat and completions, streamed and not: exactly running +
    queued requests are answered, the rest get 503 with Retry-After, and every one of them
    gets a whole terminal reply. Places are taken before a body is even read, so requests
    still being parsed or tokenized count too."""
    running, queued, burst = 4, 8, 60
    process = ServerProcess(
        [
            "--model",
            str(smollm2_dir),
            "--num-pages",
            "2048",
            "--max-running-requests",
            str(running),
            "--max-queued-requests",
            str(queued),
            "--silent-output",
        ]
    )
    try:
        process.wait_ready()

        async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str | None, bytes]:
            chat = i % 2 == 0
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body: dict = {"max_tokens": 64, "ignore_eos": True, "stream": i % 3 == 0}
            body |= {"messages": HELLO} if chat else {"prompt": "Once upon a time"}
            async with session.post(process.base_url + path, json=body) as response:
                return response.status, response.headers.get("Retry-After"), await response.read()

        async def storm() -> list[tuple[int, str | None, bytes]]:
            async with aiohttp.ClientSession() as session:
                return list(await asyncio.gather(*(one(session, i) for i in range(burst))))

        results = run(storm())
        answered = [body for status, _, body in results if status == 200]
        refused = [(after, body) for status, after, body in results if status == 503]
        assert len(answered) == running + queued and len(refused) == burst - running - queued
        for after, body in refused:
            error = orjson.loads(body)["error"]
            assert after == "1" and error["code"] == "queue_full", error
        for body in answered:
            if body.startswith(b"data: "):
                assert body.endswith(b"data: [DONE]\n\n")
            else:
                assert orjson.loads(body)["usage"]["completion_tokens"] == 64
        _, metrics = run(get(process.base_url + "/metrics"))
        assert 'reason="queue_full"} 48.0' in metrics.decode()
        status, _ = run(
            post(process.base_url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
        )
        assert status == 200
    finally:
        assert process.stop() == 0


def test_sigterm_drains_running_requests(smollm2_dir: Path) -> None:
    """SIGTERM while a stream runs: /health and new requests get 503 at once, the stream
    ends normally, the process exits 0. The signal goes after the stream's first chunk, so
    the request is running whatever the machine's speed."""
    process = ServerProcess(["--model", str(smollm2_dir), "--num-pages", "2048"])
    try:
        process.wait_ready()
        url = process.base_url + "/v1/completions"

        async def scenario() -> tuple[list[bytes], int, int]:
            body = {
                "prompt": "Count:",
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
                first = await r.content.readline()
                process.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                health = process.health()
                refused, _ = await post(url, {"prompt": "late", "max_tokens": 2})
                rest = (await r.read()).split(b"\n\n")
            return [first, *rest], health, refused

        lines, health, refused = run(scenario())
        assert health == 503 and refused == 503
        events = [line.strip() for line in lines if line.strip()]
        assert events[-1] == b"data: [DONE]"
        assert orjson.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert process.proc.wait(60) == 0
        assert "Prefill batch. #new-seq: 1, #new-token:" in process.log()
    finally:
        process.stop()


def test_drain_delay_keeps_taking_requests_while_health_says_503(smollm2_dir: Path) -> None:
    """--drain-delay: after SIGTERM /health is 503 at once, yet requests are still answered
    until the delay ends (a router's health check has then taken the replica out); later
    ones are refused; the process exits 0."""
    process = ServerProcess(["--model", str(smollm2_dir), "--drain-delay", "3"])
    try:
        process.wait_ready()
        url = process.base_url + "/v1/completions"
        process.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert process.health() == 503
        status, body = run(post(url, {"prompt": "Hi", "max_tokens": 2, "temperature": 0}))
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert "new requests taken for 3.0 s more" in process.log()
        time.sleep(3.0)
        try:
            late, _ = run(post(url, {"prompt": "Hi", "max_tokens": 2}))
        except aiohttp.ClientConnectionError:
            late = 0  # nothing was running, so it has already stopped listening
        assert late in (0, 503)
        assert process.proc.wait(60) == 0
    finally:
        process.stop()


def test_drain_timeout_aborts_the_rest(smollm2_dir: Path) -> None:
    process = ServerProcess(
        ["--model", str(smollm2_dir), "--num-pages", "4096", "--drain-timeout", "0.5"]
    )
    try:
        process.wait_ready()

        async def scenario() -> int:
            body = {"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession() as session:
                async with session.post(process.base_url + "/v1/completions", json=body) as r:
                    await r.content.readline()
                    process.proc.send_signal(signal.SIGINT)
                    started = time.monotonic()
                    await r.read()
                    return int(time.monotonic() - started)

        assert run(scenario()) < 20
        assert process.proc.wait(60) == 0
    finally:
        process.stop()


@contextlib.asynccontextmanager
async def in_process_server(model_dir: Path) -> AsyncIterator[tuple[Any, str]]:
    """The server on this loop (loaded, listening on a free port) and its base URL; drained
    afterwards. For tests that reach into it or patch what it calls."""
    from aiohttp.test_utils import TestServer

    from aserve.config import build_config
    from aserve.server.app import Server

    server = Server(build_config(model=str(model_dir), num_pages=1024))
    await server.load()
    test_server = TestServer(server.make_app())
    await test_server.start_server()
    try:
        yield server, f"http://127.0.0.1:{test_server.port}"
    finally:
        await test_server.close()
        await server.drain(1.0)


def test_the_model_loads_on_a_thread_that_ends_with_the_load(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread that ran torch's parallel loading keeps an OpenMP team; alive beside the
    scheduler's, it made every CPU decode step wait on sleeping threads (Server.load)."""
    import aserve.server.app as app

    loaders: list[threading.Thread] = []

    def recorded(config: Any) -> Any:
        loaders.append(threading.current_thread())
        return Runtime(config)

    monkeypatch.setattr(app, "Runtime", recorded)

    async def scenario() -> bool:
        async with in_process_server(smollm2_dir) as (_, base):
            status, _ = await post(base + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 200
            return loaders[0].is_alive()

    alive_while_serving = run(scenario())
    assert len(loaders) == 1 and loaders[0] is not threading.main_thread()
    assert not alive_while_serving


def test_internal_fault_fails_only_that_request(smollm2_dir: Path) -> None:
    """A fault inside one request's generation is a 500 for it; the next request is fine."""

    async def scenario() -> tuple[int, dict, int]:
        async with in_process_server(smollm2_dir) as (server, base):
            tokenizer = server.runtime.tokenizer
            original = tokenizer.encode

            def flaky(text: str) -> list[int]:
                if text == "explode":
                    raise RuntimeError("tokenizer fault")
                return original(text)

            tokenizer.encode = flaky
            bad_status, bad = await post(base + "/v1/completions", {"prompt": "explode"})
            good_status, _ = await post(
                base + "/v1/completions", {"prompt": "fine", "max_tokens": 2}
            )
        return bad_status, bad, good_status

    bad_status, bad, good_status = run(scenario())
    assert bad_status == 500 and bad["error"]["type"] == "internal_server_error"
    assert good_status == 200


def test_a_burst_submits_every_stream_before_writing_any_headers(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams whose prompts are encoded together resume together: each submits its request,
    and only after all have does any prepare its response, so the scheduler's next plan holds
    the whole burst. Their replies are whole."""
    from aiohttp import web

    from aserve.scheduler.scheduler import Scheduler

    events: list[str] = []
    submit, prepare = Scheduler.submit, web.StreamResponse.prepare

    def spied_submit(self: Scheduler, req: Any) -> None:
        events.append("submit")
        submit(self, req)

    async def spied_prepare(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if not self.prepared:  # aiohttp calls it again once the handler returns
            events.append("prepare")
        return await prepare(self, request)

    monkeypatch.setattr(Scheduler, "submit", spied_submit)
    monkeypatch.setattr(web.StreamResponse, "prepare", spied_prepare)
    burst = 6

    async def one(url: str, i: int) -> list[bytes]:
        text = f"Question {i}: " + "tell me about the sea and the sky. " * 20  # > 512 chars
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={**body, "stream": True}) as response:
                return [line async for line in response.content if line.strip()]

    async def scenario() -> list[list[bytes]]:
        async with in_process_server(smollm2_dir) as (_, base):
            url = base + "/v1/chat/completions"
            return await asyncio.gather(*(one(url, i) for i in range(burst)))

    replies = run(scenario())
    assert all(lines[-1] == b"data: [DONE]\n" for lines in replies)
    assert events == ["submit"] * burst + ["prepare"] * burst


def read_until(fd: int, marker: bytes, timeout_s: float = 120.0) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout_s
    while marker not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(data.decode(errors="replace"))
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    return data


def test_shell_mode_through_a_pty(smollm2_dir: Path) -> None:
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aserve",
            "--shell",
            "--model",
            str(smollm2_dir),
            "--num-pages",
            "4096",
            "--log-level",
            "warning",
        ],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)

    def ask(line: str) -> str:
        os.write(leader, line.encode() + b"\n")
        echoed_and_reply = read_until(leader, b"> ").decode().replace("\r\n", "\n")
        return echoed_and_reply.split("\n", 1)[1].rsplit("\n", 1)[0]

    try:
        banner = read_until(leader, b"> ")
        assert b"/reset" in banner and b"INFO" not in banner, "--log-level warning hides INFO"
        capital = ask("What is the capital of France?")
        assert "Paris" in capital
        follow_up = ask("Why is it famous?")
        assert ask("/reset") == "(history cleared)"
        assert ask("Why is it famous?") != follow_up, "the history must shape the reply"
        ask("/reset")
        assert ask("What is the capital of France?") == capital
        os.write(leader, b"/exit\n")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)


def test_one_process_without_tp(smollm2_dir: Path) -> None:
    process = ServerProcess(["--model", str(smollm2_dir), "--num-pages", "1024"])
    try:
        process.wait_ready()
        children = subprocess.run(
            ["pgrep", "-P", str(process.proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert children == []
        status, body = run(get(process.base_url + "/health"))
        assert status == 200 and orjson.loads(body)["status"] == "ok"
    finally:
        assert process.stop() == 0
