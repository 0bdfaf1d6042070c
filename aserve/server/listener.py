"""The listening sockets, accepted by the server itself rather than by the event loop.

uvloop's own listener accepts one connection per turn of the loop. Under load the loop turns
about once a scheduler step (the step's handlers run, the GPU's result is ready, the next
step launches), so a burst of clients was accepted one a step: on an H200, 256 chats reached
the scheduler over a second or more, a time to first token of seconds on a fresh server, and
decode batches that filled slowly. Here every pending connection is accepted whenever the
listening socket is readable, and each is handed to aiohttp's protocol as uvloop would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

logger = logging.getLogger(__name__)

RETRY_ACCEPT_S = 1.0  # out of file descriptors: stop accepting this long, as asyncio does


def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address of `host` (an IPv4 and an IPv6 one for
    "localhost"), as `loop.create_server` binds them; OSError if any cannot be bound."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Listener:
    """Accepts on `sockets` and connects each new socket to a `protocol_factory()`."""

    def __init__(
        self, sockets: list[socket.socket], protocol_factory: Callable[[], asyncio.Protocol]
    ) -> None:
        self.sockets = sockets
        self.protocol_factory = protocol_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: set[asyncio.Task[object]] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept_all, sock)

    def close(self) -> None:
        """Stop accepting; connections already accepted are aiohttp's to finish."""
        if self._loop is not None:
            for sock in self.sockets:
                self._loop.remove_reader(sock.fileno())
        for sock in self.sockets:
            sock.close()

    def _accept_all(self, listening: socket.socket) -> None:
        assert self._loop is not None
        while True:
            try:
                conn, _ = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as error:  # EMFILE, ENFILE, ENOBUFS: let some connections end
                logger.warning("cannot accept connections for %.0f s: %s", RETRY_ACCEPT_S, error)
                self._loop.remove_reader(listening.fileno())
                self._loop.call_later(RETRY_ACCEPT_S, self._resume, listening)
                return
            conn.setblocking(False)
            task = self._loop.create_task(
                self._loop.connect_accepted_socket(self.protocol_factory, conn)
            )
            self._connecting.add(task)
            task.add_done_callback(lambda done, conn=conn: self._connected(done, conn))

    def _connected(self, task: asyncio.Task[object], conn: socket.socket) -> None:
        self._connecting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("an accepted connection could not start: %s", task.exception())
            conn.close()

    def _resume(self, listening: socket.socket) -> None:
        assert self._loop is not None
        if listening.fileno() >= 0:
            with contextlib.suppress(OSError):
                self._loop.add_reader(listening.fileno(), self._accept_all, listening)
