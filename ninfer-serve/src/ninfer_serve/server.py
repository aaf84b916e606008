"""Hypercorn served programmatically; SIGTERM / SIGINT stop accepting and let in-flight streams finish."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config


def hypercorn_config(host: str, port: int, *, graceful_timeout_s: float = 30.0, access_log: bool = False) -> Config:
    cfg = Config()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.graceful_timeout = graceful_timeout_s  # in-flight requests get this long after SIGTERM
    cfg.startup_timeout = 600  # lifespan startup does no model loading, but stay generous
    cfg.accesslog = "-" if access_log else None
    cfg.errorlog = "-"
    return cfg


async def serve_async(app: Any, cfg: Config, *, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set); hypercorn then closes the listening socket,
    waits up to ``graceful_timeout`` for open requests and runs the lifespan shutdown."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / not supported
            pass
    try:
        await hypercorn_serve(app, cfg, shutdown_trigger=stop.wait)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def serve(app: Any, host: str, port: int, *, graceful_timeout_s: float = 30.0, access_log: bool = False) -> None:
    asyncio.run(serve_async(app, hypercorn_config(host, port, graceful_timeout_s=graceful_timeout_s,
                                                  access_log=access_log)))
