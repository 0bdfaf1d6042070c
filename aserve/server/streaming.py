"""Streamed responses: each choice's deltas as SSE events, written where the scheduler hands
out a step's tokens.

Under hundreds of streams the event loop's time per token is what holds the GPU back (issue
21: at 256 streams the loop, not the GPU, set the pace on slower hosts). Reading each token in
the handler costs a task wake-up, a chain of async generators and aiohttp's write coroutines
per token. So a stream sets a listener on each choice's channel: the scheduler's hand-off calls
it with the output, and it detokenizes, shapes and writes the event to the connection in that
call; the handler sleeps until its stream ends. A client that stops reading (its connection's
write buffer past `WRITE_BUFFER_LIMIT`) takes the stream back to the handler, which waits for
the buffer to drain between events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from aiohttp import hdrs, web

from aserve.scheduler.request import EVERY_TOKEN, ReqOutput, StreamPace
from aserve.server.generation import Choice, Delta


class Shaper(Protocol):
    """What a route's replies are built by: OpenAI's (server/responses.py) or SGLang's
    (server/native.py)."""

    DONE: bytes  # what ends a stream after its closing events

    def opening_events(self) -> bytes: ...

    def delta_events(self, index: int, delta: Delta) -> bytes: ...

    def closing_events(self) -> bytes: ...

    def full_body(self, results: list[list[Delta]]) -> Any: ...


WRITE_BUFFER_LIMIT = 1 << 16
"""Bytes a connection may hold unsent before its stream waits for the client (aiohttp's own
write limit)."""


class EventWriter:
    """Bytes written straight to a prepared response's connection, framed as HTTP/1.1 chunks
    when the response is chunked (aiohttp's framing for a body of unknown length). The
    headers must be out already: aiohttp sends them with the first body write."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self.request = request
        self.transport = request.transport
        self.chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    @property
    def congested(self) -> bool:
        return self.transport is not None and (
            self.transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT
        )

    async def drain(self) -> None:
        """Wait until the client has read enough of what was written."""
        await self.request.writer.drain()


class ChoiceStream:
    """The SSE events of one response's choices, from the first token to the last."""

    def __init__(
        self,
        shaper: Shaper,
        choices: list[Choice],
        observe: Callable[[Choice, Delta], None],
        writer: EventWriter,
        pace: StreamPace = EVERY_TOKEN,
    ) -> None:
        self.shaper = shaper
        self.choices = choices
        self.observe = observe
        self.writer = writer
        self.pace = pace  # tokens an event gathers (--stream-interval)
        self.failure: tuple[int, Exception] | None = None
        self._gone: ConnectionResetError | None = None
        self._paused: asyncio.Future[None] | None = None

    async def run(self) -> tuple[int, Exception] | None:
        """Stream to the end; the index of the choice that failed and its error, if one did
        (the stream ends there). A closed connection raises ConnectionResetError. Behind a
        slow client the handler reads the choices one after the other (their outputs wait,
        merged, in their channels)."""
        self._paused = asyncio.get_running_loop().create_future()
        try:
            for index, choice in enumerate(self.choices):
                self._listen(index, choice)
            if not self._ended():
                await self._paused
        finally:
            self._stop_listening()
        if self._gone is not None:
            raise self._gone
        for index, choice in enumerate(self.choices):  # a slow client: the handler reads
            if self.failure is not None:
                break
            try:
                async for delta in choice.run():
                    await self.writer.drain()
                    self._emit(index, delta)
            except ConnectionResetError:
                raise
            except Exception as error:
                self.failure = (index, error)
        return self.failure

    def _listen(self, index: int, choice: Choice) -> None:
        """Take what the choice's channel holds now, then every output as it is put."""
        assert choice.req is not None
        pending = choice.req.channel.get_nowait()
        if pending is not None:
            self._on_output(index, pending)
        if not self._ended() and not self._paused_yet():
            choice.req.channel.listen(partial(self._on_output, index), self.pace, choice.req.rid)

    def _on_output(self, index: int, out: ReqOutput) -> None:
        """The listener: called in the scheduler's hand-off, so it never raises."""
        try:
            delta = self.choices[index].take(out)
            if delta is not None:
                self._emit(index, delta)
        except ConnectionResetError as error:
            self._gone = error
        except Exception as error:
            self.failure = (index, error)
        if self._ended() or self.writer.congested:
            self._pause()

    def _emit(self, index: int, delta: Delta) -> None:
        self.observe(self.choices[index], delta)
        events = self.shaper.delta_events(index, delta)
        if events:
            self.writer.write(events)

    def _ended(self) -> bool:
        return (
            self._gone is not None
            or self.failure is not None
            or all(choice.done for choice in self.choices)
        )

    def _paused_yet(self) -> bool:
        return self._paused is not None and self._paused.done()

    def _pause(self) -> None:
        self._stop_listening()
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    def _stop_listening(self) -> None:
        for choice in self.choices:
            if choice.req is not None:
                choice.req.channel.unlisten()
