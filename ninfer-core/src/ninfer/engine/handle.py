"""GenerationHandle: the consumer's side of one request's response stream.

The worker writes into a ResponseChannel; the handle reads it. The worker never holds the handle
itself, so dropping the last reference to a handle is seen (``__del__``) and cancels the request; so does
leaving an iteration before the final result (``break``, closing the iterator, asyncio task cancellation).
Errors never raise out of iteration: the last event is a ``GenerationResult`` with
``finish_reason=ERROR``, ``error`` (message) and ``extra["error_kind"]`` (the error's ``kind``);
``handle.exception()`` returns the error object itself.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from ninfer.contract.events import Event, GenerationResult
from ninfer.engine.errors import InvariantBroken


class ResponseChannel:
    """Events for one request plus the two release conditions (response_done, consumer_released)."""

    def __init__(self, request_id: str, on_cancel: Callable[[], None], on_release: Callable[[], None]) -> None:
        self.request_id = request_id
        self.cond = threading.Condition()
        self.events: collections.deque[Event] = collections.deque()
        self.final: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancel_requested = False  # set by any thread; read by the worker at its boundaries
        self.response_done = False
        self.consumer_released = False
        self._released = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._on_cancel = on_cancel
        self._on_release = on_release

    # -- worker side ---------------------------------------------------------------------------------
    def publish(self, event: Event) -> None:
        with self.cond:
            if self.response_done:
                raise InvariantBroken(f"request {self.request_id}: event after the final result")
            self.events.append(event)
            if isinstance(event, GenerationResult):
                self.final = event
                self.response_done = True
            self.cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # the consumer's event loop is closed: nobody waits any more
                pass
        if self.response_done:
            self._maybe_release()

    # -- consumer side -------------------------------------------------------------------------------
    def cancel(self) -> None:
        with self.cond:
            if self.response_done or self.cancel_requested:
                return
            self.cancel_requested = True
        self._on_cancel()

    def release_consumer(self) -> None:
        with self.cond:
            if self.consumer_released:
                return
            self.consumer_released = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        with self.cond:
            if not (self.response_done and self.consumer_released) or self._released:
                return
            self._released = True
        self._on_release()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Blocking pop; None once the final result was taken (or on timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self.events:
                if self.response_done:
                    return None
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id}: no event within {timeout} s")
                self.cond.wait(left)
            return self.events.popleft()

    async def next_event_async(self) -> Event | None:
        loop = asyncio.get_running_loop()
        while True:
            with self.cond:
                if self.events:
                    return self.events.popleft()
                if self.response_done:
                    return None
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _leave(ch: ResponseChannel, finished: bool) -> None:
    """End of one iteration over a handle. Reaching the final result releases the consumer side; leaving
    before it (``break``, ``close()``/``aclose()`` of the iterator, an exception, asyncio task cancellation)
    abandons the response: the request is cancelled at once, so its slots and pages come back even while
    the handle object itself stays referenced."""
    if not finished:
        ch.cancel()
    ch.release_consumer()


class GenerationHandle:
    """Iterate (sync or async) over GenerationStart, OutputDelta*, then one GenerationResult."""

    def __init__(self, channel: ResponseChannel) -> None:
        self._channel = channel
        self.request_id = channel.request_id

    def __iter__(self) -> Iterator[Event]:
        ch = self._channel
        finished = False
        try:
            while (ev := ch.next_event()) is not None:
                yield ev
            finished = True
        finally:
            _leave(ch, finished)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Event]:
        ch = self._channel
        finished = False
        try:
            while (ev := await ch.next_event_async()) is not None:
                yield ev
            finished = True
        finally:  # also on task cancellation (CancelledError at the await) and on aclose()
            _leave(ch, finished)

    def next_event(self, timeout: float | None = None) -> Event | None:
        """One event (blocking up to ``timeout`` seconds); None after the final result."""
        return self._channel.next_event(timeout)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the final result (discarding unread deltas) and release the consumer side."""
        ch = self._channel
        end = None if timeout is None else time.monotonic() + timeout
        with ch.cond:
            while not ch.response_done:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id}: no result within {timeout} s")
                ch.cond.wait(left)
            ch.events.clear()
            final = ch.final
        ch.release_consumer()
        assert final is not None
        return final

    async def result_async(self) -> GenerationResult:
        final = None
        async for ev in self:
            if isinstance(ev, GenerationResult):
                final = ev
        assert final is not None
        return final

    def cancel(self) -> None:
        """Ask the worker to stop this request at its next stable boundary; output so far stays published."""
        self._channel.cancel()

    def exception(self) -> BaseException | None:
        """The error that ended the request (QueueTimeout, EngineFailed, ...), once it ended; else None."""
        return self._channel.error

    @property
    def done(self) -> bool:
        return self._channel.response_done

    def close(self) -> None:
        """Abandon the handle: cancel if still running and release the consumer side."""
        self._channel.cancel()
        self._channel.release_consumer()

    def __enter__(self) -> GenerationHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        ch = getattr(self, "_channel", None)
        if ch is not None:
            ch.cancel()
            ch.release_consumer()
