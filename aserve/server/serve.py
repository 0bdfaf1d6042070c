"""Run the server: bind the port, load the model, serve until a signal, drain, exit.

A busy port or a model that cannot load ends the process with one line on stderr, never a
traceback. SIGINT / SIGTERM stop new work (503), give running requests up to
`drain_timeout_s` to finish, abort the rest and return 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from aserve.config import ConfigError, ServerConfig
from aserve.engine.followers import WorkerFailure
from aserve.server.app import Server

logger = logging.getLogger("aserve.server")

# Connections the kernel queues until the loop accepts them. aiohttp's default of 128 is
# less than a burst of streaming clients: the connections over it have their SYN dropped
# and retried a second or more later, which shows up as a time to first token of seconds.
LISTEN_BACKLOG = 2048


async def serve(config: ServerConfig, drain_timeout_s: float = 30.0) -> int:
    server = Server(config)
    runner = web.AppRunner(server.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=LISTEN_BACKLOG)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        print(
            f"aserve: error: cannot listen on {config.host}:{config.port}: {error.strerror}",
            file=sys.stderr,
        )
        return 1
    logger.info("listening on http://%s:%d (loading the model)", config.host, config.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done() and load.exception() is not None:
        error = load.exception()
        message = (
            str(error)
            if isinstance(error, (ConfigError, MemoryError, WorkerFailure))
            else repr(error)
        )
        print(f"aserve: error: {message}", file=sys.stderr)
        code = 2 if isinstance(error, ConfigError) else 1
    else:
        if load.done():
            logger.info(
                "ready: serving %s on http://%s:%d", server.model_name, config.host, config.port
            )
            code = await _until_stopped(stopping, server)
        logger.info("shutting down: draining running requests (up to %.0f s)", drain_timeout_s)
    load.cancel()
    stopping.cancel()
    await server.drain(drain_timeout_s)
    await runner.cleanup()
    logger.info("stopped")
    return code


async def _until_stopped(stopping: asyncio.Task[bool], server: Server) -> int:
    """0 on a signal; 1, with the error on stderr, if the scheduler loop ended by itself
    (a tensor-parallel rank died: the engine cannot go on, so neither can the server)."""
    ended = server.scheduler_task
    assert ended is not None
    await asyncio.wait({stopping, ended}, return_when=asyncio.FIRST_COMPLETED)
    if not ended.done() or ended.cancelled() or ended.exception() is None:
        return 0
    print(f"aserve: error: {ended.exception()}", file=sys.stderr)
    return 1


def run(config: ServerConfig, drain_timeout_s: float = 30.0) -> int:
    try:
        import uvloop

        return uvloop.run(serve(config, drain_timeout_s))
    except ImportError:
        return asyncio.run(serve(config, drain_timeout_s))
