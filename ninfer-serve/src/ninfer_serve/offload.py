"""Blocking work for a request, off the event loop: a task of one of the gateway's TaskPools, refused at once
when the pool cannot take it (429 when its queue is full, 503 once it is shut down), awaited while the
connection is watched, so a client that leaves stops the wait."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from ninfer.core.task_pool import PoolClosed, Task, TaskPool
from ninfer_serve.errors import APIError


class ClientGone(Exception):
    """The client closed the connection before the answer started."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro: Any) -> Any:
    """Run ``coro`` but raise ClientGone as soon as the client disconnects (the body is already read)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone
    finally:
        pending = {t for t in (work, gone) if not t.done()}
        for task in pending:
            task.cancel()
        if pending:  # let them unwind; asyncio.wait neither raises their errors nor hides our own cancellation
            await asyncio.wait(pending)


def submit_or_refuse(pool: TaskPool, task: Task, *, retry_after_s: int, waiting_for: str) -> None:
    """Queue ``task`` on ``pool`` or answer at once: 429 ``overload`` when its queue is full (``waiting_for``
    says what the waiting requests wait for), 503 ``closed`` when the server is shutting down."""
    retry = {"Retry-After": str(retry_after_s)}
    try:
        accepted = pool.try_submit(task)
    except PoolClosed:
        raise APIError(503, "the server is shutting down", type="service_unavailable", code="closed",
                       headers=retry) from None
    if not accepted:
        raise APIError(429, f"too many requests are waiting {waiting_for} (at most {pool.max_queued}); retry later",
                       type="rate_limit_error", code="overload", headers=retry)
