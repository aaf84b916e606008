"""Interpreter exit ends every live engine's worker cleanly.

The worker is a daemon thread. Left running at exit, it is frozen mid-unit inside torch while the
interpreter tears down, which aborts the process ("terminate called without an active exception", exit
134) when a script leaves a generation loop early and never calls ``Engine.close()``. Each EngineCore
registers here weakly (a dropped, finished engine is not kept alive); one ``atexit`` hook closes those
still alive, which ends their in-flight requests with a ``closed`` error and joins their workers.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)

# A closing worker finishes its current unit and stops; the bound only matters if the device hangs.
EXIT_JOIN_TIMEOUT_S = 60.0


class _Closable(Protocol):
    thread: threading.Thread

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None: ...


_live: weakref.WeakSet[_Closable] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(core: _Closable) -> None:
    """Close ``core`` at interpreter exit unless it is gone (or closed) by then."""
    global _registered
    with _lock:
        _live.add(core)
        if not _registered:  # registered after torch's own hooks, so it runs before them (LIFO)
            atexit.register(close_live_engines)
            _registered = True


def close_live_engines(timeout: float = EXIT_JOIN_TIMEOUT_S) -> None:
    """Close every tracked engine core that is still alive and wait for its worker."""
    with _lock:
        cores = list(_live)
    for core in cores:
        try:
            core.close(timeout=timeout)
        except Exception:  # one engine's trouble must not keep the others running at exit
            log.exception("closing an engine at interpreter exit failed")
        if core.thread.is_alive():
            log.warning("engine worker %s did not stop within %.0f s of interpreter exit", core.thread.name,
                        timeout)
