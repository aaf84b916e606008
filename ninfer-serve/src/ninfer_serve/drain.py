"""Graceful shutdown as requests see it: the server stops (SIGTERM), then, once the graceful timeout has
passed, ends what is still running.

``stop()``: new generation requests are answered 503 ``closed``; requests already in flight carry on.
``end()``: every request still waiting (for its body, a pool thread, media or an engine slot, or its whole
answer) is answered 503 ``closed`` with ``Retry-After``, and every stream still running gets one error event
and ``data: [DONE]``. The gateway writes these answers itself, so the connections close cleanly instead of
hypercorn cancelling the request tasks mid-write. The state is shared across threads and event loops (tests
run an app on several), so waiters are futures bound to their own loops, not one asyncio.Event.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from ninfer_serve.errors import APIError


class Drain:
    """The server's stopping state, set by the server and watched by the gateway's requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopping = False
        self._ended = False
        self._subscribers: dict[int, tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}
        self._next = 0

    @property
    def stopping(self) -> bool:
        """SIGTERM (or SIGINT) was received: no new work is taken."""
        with self._lock:
            return self._stopping

    @property
    def ended(self) -> bool:
        """The graceful timeout has passed: requests still running are being ended."""
        with self._lock:
            return self._ended

    def stop(self) -> None:
        with self._lock:
            self._stopping = True

    def end(self) -> None:
        with self._lock:
            self._stopping = self._ended = True
            subscribers, self._subscribers = list(self._subscribers.values()), {}
        for loop, callback in subscribers:
            try:
                loop.call_soon_threadsafe(callback)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` in the running event loop when ``end()`` comes (soon, if it came already);
        returns the function that cancels the subscription."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._ended:
                key, self._next = self._next, self._next + 1
                self._subscribers[key] = (loop, callback)
                return lambda: self._unsubscribe(key)
        loop.call_soon(callback)
        return lambda: None

    def _unsubscribe(self, key: int) -> None:
        with self._lock:
            self._subscribers.pop(key, None)

    async def wait_ended(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        unsubscribe = self.subscribe(lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            unsubscribe()


def refused_while_stopping(retry_after_s: int) -> APIError:
    """A generation request that arrived after SIGTERM."""
    return APIError(503, "the server is shutting down; retry later", type="service_unavailable", code="closed",
                    headers={"Retry-After": str(retry_after_s)})


def ended_by_shutdown(retry_after_s: int) -> APIError:
    """A request still running when the graceful timeout passed."""
    return APIError(503, "the server is shutting down and ended this request at its graceful timeout; retry "
                         "later", type="service_unavailable", code="closed",
                    headers={"Retry-After": str(retry_after_s)})
