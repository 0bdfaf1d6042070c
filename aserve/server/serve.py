"""Run the server: bind the port, load the model, serve until a signal, drain, exit.

A busy port or a model that cannot load ends the process with one line on stderr, never a
traceback. SIGINT / SIGTERM turn /health to 503 at once; new requests are still taken for
`drain_delay_s` (the time a router or load balancer needs to see that and stop sending: the
replicas of `aserve --dp` get their router's), then refused (503); running requests get up
to `drain_timeout_s` to finish, the rest are aborted, and the process returns 0. A second
signal during the delay cuts it short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from aserve.config import ConfigError, ServerConfig
from aserve.engine.followers import WorkerFailure
from aserve.server.app import Server
from aserve.server.listener import Listener, bind

logger = logging.getLogger("aserve.server")

# Connections the kernel queues until the loop accepts them. aiohttp's default of 128 is
# less than a burst of streaming clients: the connections over it have their SYN dropped
# and retried a second or more later, which shows up as a time to first token of seconds.
LISTEN_BACKLOG = 2048


def _quiet_malformed_http(record: logging.LogRecord) -> bool:
    """aiohttp logs a traceback for every request it cannot parse. Routers probe each worker
    for gRPC (an HTTP/2 preface) when they add it; such bytes get a 400 and one debug line."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, HttpProcessingError):
        logger.debug("malformed HTTP request answered 400: %s", str(error).splitlines()[0])
        return False
    return True


async def serve(
    config: ServerConfig, drain_timeout_s: float = 30.0, drain_delay_s: float = 0.0
) -> int:
    logging.getLogger("aiohttp.server").addFilter(_quiet_malformed_http)
    server = Server(config)
    try:
        sockets = bind(config.host, config.port, LISTEN_BACKLOG)
    except OSError as error:
        reason = error.strerror or str(error)
        where = f"{config.host}:{config.port}"
        print(f"aserve: error: cannot listen on {where}: {reason}", file=sys.stderr)
        return 1
    runner = web.AppRunner(server.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    assert runner.server is not None
    listener = Listener(sockets, runner.server)
    listener.start()
    logger.info("listening on http://%s:%d (loading the model)", config.host, config.port)

    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    load = asyncio.create_task(server.load())
    stopping = asyncio.create_task(signals.get())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done() and load.exception() is not None:
        error = load.exception()
        expected = isinstance(error, (ConfigError, MemoryError, WorkerFailure))
        if not expected:  # a defect, not a setting: its traceback goes to the log
            logger.error("start-up failed", exc_info=error)
        message = str(error) if expected else repr(error)
        print(f"aserve: error: {message}", file=sys.stderr)
        code = 2 if isinstance(error, ConfigError) else 1
    else:
        if load.done():
            logger.info(
                "ready: serving %s on http://%s:%d", server.model_name, config.host, config.port
            )
            code = await _until_stopped(stopping, server)
            if code == 0 and drain_delay_s > 0:
                await _announce_leaving(server, signals, drain_delay_s)
        logger.info("shutting down: draining running requests (up to %.0f s)", drain_timeout_s)
    load.cancel()
    stopping.cancel()
    await server.drain(drain_timeout_s)
    listener.close()
    await runner.cleanup()
    logger.info("stopped")
    return code


async def _until_stopped(stopping: asyncio.Task[int], server: Server) -> int:
    """0 on a signal; 1, with the error on stderr, if the scheduler loop ended by itself
    (a tensor-parallel rank died: the engine cannot go on, so neither can the server)."""
    ended = server.scheduler_task
    assert ended is not None
    await asyncio.wait({stopping, ended}, return_when=asyncio.FIRST_COMPLETED)
    if not ended.done() or ended.cancelled() or ended.exception() is None:
        return 0
    print(f"aserve: error: {ended.exception()}", file=sys.stderr)
    return 1


async def _announce_leaving(server: Server, signals: asyncio.Queue[int], delay_s: float) -> None:
    """/health says 503 while requests are still taken, so balancers stop sending first."""
    server.state.leaving = True
    logger.info("stopping: /health answers 503; new requests taken for %.1f s more", delay_s)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(signals.get(), delay_s)


def run(config: ServerConfig, drain_timeout_s: float = 30.0, drain_delay_s: float = 0.0) -> int:
    try:
        import uvloop

        return uvloop.run(serve(config, drain_timeout_s, drain_delay_s))
    except ImportError:
        return asyncio.run(serve(config, drain_timeout_s, drain_delay_s))
