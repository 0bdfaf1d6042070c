"""A streamed response's events, written where the scheduler hands out tokens (the channel's
listener) or, once the client falls behind, by the handler: the same events either way."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aserve.sampling_params import SamplingParams
from aserve.scheduler.request import FinishReason, Req, ReqOutput, StreamPace
from aserve.server import openai
from aserve.server.generation import Choice, Delta
from aserve.server.http import sse
from aserve.server.openai import ResponseHead
from aserve.server.responses import ResponseShaper
from aserve.server.streaming import ChoiceStream
from aserve.tokenizer import Tokenizer

REPLIES = [[504, 2210, 314, 3444, 30], [1073, 1425, 28, 253, 3058]]


class StandInScheduler:
    """What a Choice asks of the scheduler; the test hands out the outputs itself."""

    def __init__(self) -> None:
        self.aborted: list[Req] = []
        self.requests = 0

    def make_request(
        self, prompt_ids: list[int], params: SamplingParams, images: object = None, adapter: int = 0
    ) -> Req:
        assert not images and not adapter
        self.requests += 1
        return Req(self.requests, prompt_ids, params, seed=0)

    def check_request(self, req: Req) -> None:
        return None

    def submit(self, req: Req) -> None:
        pass

    def abort(self, req: Req) -> None:
        self.aborted.append(req)


class RecordingWriter:
    """EventWriter's interface over a list; `congested` until the handler drains it."""

    def __init__(self, congest_after: int | None = None, closed: bool = False) -> None:
        self.events: list[bytes] = []
        self.congest_after = congest_after
        self.closed = closed
        self.drains = 0

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        self.events.append(data)

    @property
    def congested(self) -> bool:
        return self.congest_after is not None and len(self.events) >= self.congest_after

    async def drain(self) -> None:
        self.drains += 1


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def make_stream(tokenizer: Tokenizer, writer: RecordingWriter, gather: int = 1) -> ChoiceStream:
    parsed = openai.parse_chat(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
        ).encode(),
        {},
    )
    scheduler = StandInScheduler()
    choices = []
    for _ in range(2):
        choice = Choice(scheduler, tokenizer, [1, 2, 3], parsed.params, [])  # type: ignore[arg-type]
        assert choice.prepare() is None
        choice.start()
        choices.append(choice)
    runtime = SimpleNamespace(tokenizer=tokenizer)
    shaper = ResponseShaper(parsed, ResponseHead("chatcmpl-x", "m"), runtime, choices)  # type: ignore[arg-type]
    pace = StreamPace(gather)
    return ChoiceStream(shaper, choices, lambda choice, delta: None, writer, pace)  # type: ignore[arg-type]


def hand_out(stream: ChoiceStream, step: int, finish: FinishReason = FinishReason.LENGTH) -> None:
    """Step `step` of the scheduler: one token to each choice, the last one ends them."""
    last = step == len(REPLIES[0]) - 1
    for choice, reply in zip(stream.choices, REPLIES):
        assert choice.req is not None
        choice.req.channel.put_nowait(ReqOutput((reply[step],), (), finish if last else None))


def texts(events: list[bytes]) -> dict[int, str]:
    """Each choice's streamed content, joined, from the SSE events written."""
    joined: dict[int, str] = {0: "", 1: ""}
    for data in b"".join(events).split(b"\n\n"):
        if data.startswith(b"data: "):
            for choice in json.loads(data[6:])["choices"]:
                joined[choice["index"]] += choice["delta"].get("content") or ""
    return joined


def run(stream: ChoiceStream, steps: int, finish: FinishReason = FinishReason.LENGTH) -> Any:
    async def scenario() -> Any:
        handler = asyncio.create_task(stream.run())
        await asyncio.sleep(0)
        for step in range(steps):
            hand_out(stream, step, finish)
            await asyncio.sleep(0)
        return await asyncio.wait_for(handler, timeout=5)

    return asyncio.run(scenario())


def test_the_listener_writes_each_step_as_it_is_handed_out(tokenizer: Tokenizer) -> None:
    writer = RecordingWriter()
    stream = make_stream(tokenizer, writer)

    async def scenario() -> None:
        handler = asyncio.create_task(stream.run())
        await asyncio.sleep(0)
        for step in range(len(REPLIES[0])):
            before = len(writer.events)
            hand_out(stream, step)
            assert len(writer.events) == before + 2  # written inside the hand-out call
        assert await asyncio.wait_for(handler, timeout=5) is None

    asyncio.run(scenario())
    assert texts(writer.events) == {i: tokenizer.decode(r) for i, r in enumerate(REPLIES)}
    assert all(c.req is not None and c.req.channel.listener is None for c in stream.choices)
    assert writer.drains == 0


def test_a_client_that_falls_behind_gets_the_same_events_from_the_handler(
    tokenizer: Tokenizer,
) -> None:
    fast = RecordingWriter()
    assert run(make_stream(tokenizer, fast), len(REPLIES[0])) is None
    slow = RecordingWriter(congest_after=1)
    stream = make_stream(tokenizer, slow)
    assert run(stream, len(REPLIES[0])) is None
    assert slow.drains > 0
    assert texts(slow.events) == texts(fast.events)
    finishes = [e for e in b"".join(slow.events).split(b"\n\n") if b'"finish_reason":"length"' in e]
    assert len(finishes) == 2


def test_a_stream_interval_sends_fewer_events_with_the_same_text(tokenizer: Tokenizer) -> None:
    every = RecordingWriter()
    assert run(make_stream(tokenizer, every), len(REPLIES[0])) is None
    gathered = RecordingWriter()
    assert run(make_stream(tokenizer, gathered, gather=2), len(REPLIES[0])) is None
    assert texts(gathered.events) == texts(every.events)
    # Five tokens a choice, the first at once. Request 1 (odd phase): then two and two, the
    # last with the finish. Request 2 sends in the other steps: one, two, then the last.
    assert (len(every.events), len(gathered.events)) == (10, 7)


def test_an_error_finish_ends_the_stream_with_its_choice(tokenizer: Tokenizer) -> None:
    stream = make_stream(tokenizer, RecordingWriter())
    failure = run(stream, len(REPLIES[0]), FinishReason.ERROR)
    assert failure is not None and failure[0] == 0
    assert isinstance(failure[1], RuntimeError)


def test_a_closed_connection_raises_and_stops_listening(tokenizer: Tokenizer) -> None:
    stream = make_stream(tokenizer, RecordingWriter(closed=True))
    with pytest.raises(ConnectionResetError):
        run(stream, 2)
    assert all(c.req is not None and c.req.channel.listener is None for c in stream.choices)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_text_delta_filled_into_its_template_is_the_chunk_serialized(
    tokenizer: Tokenizer, kind: str
) -> None:
    body: dict[str, Any] = {"stream": True, "n": 2}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        parsed = openai.parse_chat(json.dumps(body).encode(), {})
    else:
        body["prompt"] = "hi"
        parsed = openai.parse_completion(json.dumps(body).encode(), {})
    runtime = SimpleNamespace(tokenizer=tokenizer)
    choices = [Choice(StandInScheduler(), tokenizer, [1], parsed.params, []) for _ in range(2)]  # type: ignore[arg-type]
    shaper = ResponseShaper(parsed, ResponseHead('id-"1"', "m\\x\x00"), runtime, choices)  # type: ignore[arg-type]
    texts = ["Hello", "", ' "quoted"\n\ttab \\ back', "caf\u00e9 \u2603 \U0001f600", "\x00\x1f"]
    for index in range(2):
        for text in texts:
            delta = Delta(text, [5], [])
            expected = b"".join(sse(c) for c in shaper.delta_chunks(index, delta))
            assert shaper.delta_events(index, delta) == expected
        last = Delta("end", [6], [], "length")
        expected = b"".join(sse(c) for c in shaper.delta_chunks(index, last))
        assert shaper.delta_events(index, last) == expected


def test_events_go_out_in_http_chunks_and_a_client_that_stops_reading_congests_them() -> None:
    """EventWriter on a real aiohttp connection: the bytes arrive framed as aiohttp frames a
    body, a client that reads nothing makes the connection congested, and drain() returns
    once it reads again."""
    from aiohttp import ClientSession, web

    from aserve.replicas import free_port
    from aserve.server.streaming import WRITE_BUFFER_LIMIT, EventWriter

    event = b"data: " + b"x" * 1000 + b"\n\n"
    report: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"")
        writer = EventWriter(request, response)
        assert writer.chunked
        written = 0
        while not writer.congested and written < 64 * 1024 * 1024:
            writer.write(event)
            written += 1
        report["congested"] = writer.congested
        report["congested_after"] = written
        await asyncio.wait_for(writer.drain(), timeout=30)
        report["drained"] = not writer.congested or writer.transport is None
        writer.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def scenario() -> bytes:
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/") as reply:
                    while "congested_after" not in report:  # read nothing until it congests
                        await asyncio.sleep(0.01)
                    return await reply.read()
        finally:
            await runner.cleanup()

    body = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    count = report["congested_after"]
    assert report["congested"] and count * len(event) > WRITE_BUFFER_LIMIT
    assert report["drained"]
    assert body == event * count + b"data: [DONE]\n\n"
