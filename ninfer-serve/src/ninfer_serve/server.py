"""Hypercorn served programmatically on a socket bound beforehand; SIGTERM / SIGINT stop accepting and let
in-flight requests finish within the graceful timeout.

Shutdown order: the signal sets the app's Drain stopping (new generation requests answer 503) and hypercorn
closes the listening socket and idle connections; in-flight requests get ``graceful_timeout``; then the Drain
ends, and the gateway answers what is left itself (503 ``closed`` to waiting requests, an error event and
``[DONE]`` to streams), so nothing is cut mid-write; hypercorn's own deadline, a few seconds later, is only a
backstop. Then the app's lifespan shuts its pools down, and the caller closes the engine.

Slow clients are bounded in three places: a connection must send complete request headers within
``keep_alive_timeout`` (hypercorn's idle timer runs from accept until the headers are parsed, and
between requests), the app answers 408 to a body not received within its body timeout, and the
listener caps open connections. Hypercorn's ``read_timeout`` stays off: it bounds every read of the
connection, so it would also cut a long stream to a client that has nothing more to send.

Status lines carry their reason phrase (ninfer_serve.status_line).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import attrs
from hypercorn.asyncio.run import worker_serve
from hypercorn.config import Config, Sockets
from hypercorn.utils import wrap_app
from starlette.types import ASGIApp

from ninfer_serve import status_line
from ninfer_serve.drain import Drain
from ninfer_serve.listener import LimitedListener

# After the Drain has ended the requests still running, how long they have to write those answers before
# hypercorn cancels what is left.
ENDING_MARGIN_S = 5.0


@attrs.frozen(kw_only=True)
class ServerOptions:
    graceful_timeout_s: float = 30.0  # in-flight requests get this long after SIGTERM
    keep_alive_timeout_s: float = 5.0  # complete headers within this long; idle time between requests
    max_header_bytes: int = 16 * 1024  # an incomplete request head larger than this is refused
    backlog: int = 128
    access_log: bool = False


def access_logger() -> logging.Logger:
    """Access lines go to stderr, with the server's other messages (hypercorn's "-" would be stdout)."""
    logger = logging.getLogger("ninfer_serve.access")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "[%Y-%m-%d %H:%M:%S %z]"))
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def gateway_logger() -> logging.Logger:
    """The gateway's own lines (a client leaving a stream, unhandled errors under their request id) go to
    stderr at INFO, formatted as hypercorn's error log; debug lines (ignored message fields) only when asked."""
    logger = logging.getLogger("ninfer_serve")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(process)d] [%(levelname)s] %(message)s",
                                           "[%Y-%m-%d %H:%M:%S %z]"))
    logger.handlers = [handler]
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def hypercorn_config(options: ServerOptions, *, margin_s: float = 0.0) -> Config:
    cfg = Config()
    cfg.graceful_timeout = options.graceful_timeout_s + margin_s
    cfg.keep_alive_timeout = options.keep_alive_timeout_s
    cfg.h11_max_incomplete_size = options.max_header_bytes
    cfg.backlog = options.backlog
    cfg.startup_timeout = 600  # lifespan startup does no model loading, but stay generous
    cfg.accesslog = access_logger() if options.access_log else None
    cfg.errorlog = "-"  # stderr
    return cfg


async def serve_async(app: ASGIApp, listener: LimitedListener, options: ServerOptions, *,
                      stop: asyncio.Event | None = None, drain: Drain | None = None) -> None:
    """Serve on ``listener`` until SIGTERM/SIGINT (or ``stop`` is set); hypercorn then closes the listening
    socket and waits for open requests; ``graceful_timeout`` after the signal ``drain`` (the app's) is ended,
    which ends those still running; then the lifespan shutdown runs. Without ``drain`` hypercorn cancels what
    runs past ``graceful_timeout``."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / not supported
            pass
    cfg = hypercorn_config(options, margin_s=ENDING_MARGIN_S if drain is not None else 0.0)
    ending: list[asyncio.TimerHandle] = []

    async def stopped() -> None:  # hypercorn stops accepting once this returns
        await stop.wait()
        if drain is not None:
            drain.stop()
            ending.append(loop.call_later(options.graceful_timeout_s, drain.end))

    listener.setblocking(False)
    status_line.install()
    try:
        await worker_serve(wrap_app(app, cfg.wsgi_max_body_size, "asgi"), cfg,
                           sockets=Sockets(secure_sockets=[], insecure_sockets=[listener], quic_sockets=[]),
                           shutdown_trigger=stopped)
    finally:
        for handle in ending:
            handle.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
        listener.close()


def serve(app: ASGIApp, listener: LimitedListener, options: ServerOptions, *, drain: Drain | None = None) -> None:
    asyncio.run(serve_async(app, listener, options, drain=drain))
