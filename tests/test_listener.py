"""The server's own accept loop: a burst of connections is taken in one turn of a busy event
loop, where uvloop's listener takes one a turn (the reason it exists)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from aserve.server.listener import Listener, bind

CLIENTS = 64


class Counting(asyncio.Protocol):
    """Answers each connection's first bytes with the loop turn they arrived in."""

    turn = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.WriteTransport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.transport.write(f"{Counting.turn}\n".encode())
        self.transport.close()


async def busy_turns(stop: asyncio.Event) -> None:
    """A scheduler that keeps the loop busy: work, then a single yield, every turn."""
    while not stop.is_set():
        Counting.turn += 1
        sum(range(20_000))
        await asyncio.sleep(0)


async def one_client(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hello")
    turn = int(await reader.readline())
    writer.close()
    return turn


async def burst(use_listener: bool) -> list[int]:
    """The turns at which CLIENTS connections opened at once were first served."""
    loop = asyncio.get_running_loop()
    Counting.turn = 0
    if use_listener:
        sockets = bind("127.0.0.1", 0, 1024)
        port = sockets[0].getsockname()[1]
        listener = Listener(sockets, Counting)
        listener.start()
    else:
        server = await loop.create_server(Counting, "127.0.0.1", 0, backlog=1024)
        port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    busy = asyncio.create_task(busy_turns(stop))
    try:
        clients = asyncio.gather(*(one_client(port) for _ in range(CLIENTS)))
        return await asyncio.wait_for(clients, 60)  # a broken listener fails, never hangs
    finally:
        stop.set()
        await busy
        if use_listener:
            listener.close()
        else:
            server.close()


def test_a_burst_is_accepted_in_a_few_turns_of_a_busy_loop() -> None:
    turns = uvloop.run(burst(use_listener=True))
    assert max(turns) - min(turns) <= 3, turns


def test_uvloops_own_listener_takes_one_connection_a_turn() -> None:
    """Pins why the listener exists: if uvloop changes, it may go."""
    turns = uvloop.run(burst(use_listener=False))
    assert max(turns) - min(turns) >= CLIENTS // 2, turns


def test_bind_refuses_a_port_in_use() -> None:
    taken = bind("127.0.0.1", 0, 8)
    port = taken[0].getsockname()[1]
    try:
        with pytest.raises(OSError):
            bind("127.0.0.1", port, 8)
    finally:
        for sock in taken:
            sock.close()


def test_bind_listens_on_every_address_of_the_host() -> None:
    sockets = bind("localhost", 0, 8)
    try:
        families = {s.family for s in sockets}
        assert socket.AF_INET in families
        assert all(s.getblocking() is False for s in sockets)
    finally:
        for sock in sockets:
            sock.close()
