"""Blocking work for a request, off the event loop: a task of one of the gateway's TaskPools, refused at once
when the pool cannot take it (429 when its queue is full or the client holds its share of the pool, 503 once it
is shut down), awaited while the connection is watched, so a client that leaves stops the wait, and while the
server's Drain is watched, so a shutdown past its graceful timeout ends it with 503."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from ninfer.core.task_pool import OwnerAtLimit, PoolClosed, Task, TaskPool
from ninfer_serve.drain import Drain, ended_by_shutdown
from ninfer_serve.errors import APIError
from ninfer_serve.listener import client_identity


class ClientGone(Exception):
    """The client closed the connection before the answer started."""


def client_of(request: Request) -> str:
    """The client a request counts against in per-client caps: its peer address (as the listener counts it)."""
    return client_identity(request.client.host) if request.client is not None else "unknown"


_GONE = "ninfer.client_gone"  # scope key: the connection's one http.disconnect message was consumed here


def client_gone(request: Request) -> bool:
    """Whether a watcher already saw the client leave. The server delivers ``http.disconnect`` once: a watch whose
    work finished in the same turn returns that work's result, and later stages (the stream's own listener
    among them) would never learn of it, so it is remembered on the connection's scope."""
    return bool(request.scope.get(_GONE))


async def _wait_disconnect(request: Request) -> None:
    if client_gone(request):
        return
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            request.scope[_GONE] = True
            return


T = TypeVar("T")


async def _first(work: Awaitable[T], watchers: dict[asyncio.Future, BaseException]) -> T:
    """``work``'s result, unless a watcher finishes first: then its exception is raised and ``work`` cancelled."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise next(exc for w, exc in watchers.items() if w in done)
    finally:
        pending = {t for t in (task, *watchers) if not t.done()}
        for task in pending:
            task.cancel()
        if pending:  # let them unwind; asyncio.wait neither raises their errors nor hides our own cancellation
            await asyncio.wait(pending)
            for task in pending:  # retrieved, so a cancelled gather's error is not reported as lost
                if not task.cancelled():
                    task.exception()


async def unless_disconnected(request: Request, coro: Awaitable[T], *, drain: Drain | None = None,
                              retry_after_s: int = 1) -> T:
    """Run ``coro`` but raise ClientGone as soon as the client disconnects (the body is already read), and
    the 503 of ``ended_by_shutdown`` when ``drain`` ends first."""
    watchers: dict[asyncio.Future, BaseException] = {asyncio.ensure_future(_wait_disconnect(request)): ClientGone()}
    if drain is not None:
        watchers[asyncio.ensure_future(drain.wait_ended())] = ended_by_shutdown(retry_after_s)
    return await _first(coro, watchers)


async def unless_ended(drain: Drain, coro: Awaitable[T], *, retry_after_s: int = 1) -> T:
    """Run ``coro`` but answer 503 (``ended_by_shutdown``) when ``drain`` ends first."""
    return await _first(coro, {asyncio.ensure_future(drain.wait_ended()): ended_by_shutdown(retry_after_s)})


def submit_or_refuse(pool: TaskPool, task: Task, *, retry_after_s: int, waiting_for: str,
                     owner: str | None = None) -> None:
    """Queue ``task`` on ``pool`` for ``owner`` or answer at once: 429 ``overload`` when its queue is full or
    ``owner`` holds the pool's per-owner cap (``waiting_for`` says what the waiting requests wait for), 503
    ``closed`` when the server is shutting down."""
    retry = {"Retry-After": str(retry_after_s)}
    try:
        accepted = pool.try_submit(task, owner=owner)
    except PoolClosed:
        raise APIError(503, "the server is shutting down", type="service_unavailable", code="closed",
                       headers=retry) from None
    except OwnerAtLimit:
        raise APIError(429, f"this client already has {pool.max_per_owner} requests waiting {waiting_for} or "
                            "being served there, the most one client address may; retry later",
                       type="rate_limit_error", code="overload", headers=retry) from None
    if not accepted:
        raise APIError(429, f"too many requests are waiting {waiting_for} (at most {pool.max_queued}); retry later",
                       type="rate_limit_error", code="overload", headers=retry)
