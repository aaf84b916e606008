"""``engine.submit`` (template rendering, tokenization) runs in the gateway's own TaskPool, not in the
event loop's shared thread pool: a full pool queue answers 429 in the OpenAI shape with Retry-After,
a request cancelled while it waits for the pool never reaches the engine, and the pool ends with the app."""

from __future__ import annotations

import asyncio
import threading

import httpx
from starlette.testclient import TestClient

from ninfer_serve.app import create_app

CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
GUARD_S = 30.0  # hang guard only


class Gate:
    """Makes ``engine.submit`` hold its thread until released, and reports who entered it."""

    def __init__(self, engine, script) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []
        self.script = script
        engine.next = self.submit

    def submit(self, req, cancel=None):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(GUARD_S)
        return self.script.Handle("r", self.script.text("r", 1, ["ok"]))


def test_submit_runs_in_the_gateway_pool(engine, script):
    gate = Gate(engine, script)
    gate.release.set()
    with TestClient(create_app(engine, http_threads=2)) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        pool = c.app.state.gateway.pool
    assert gate.threads and all(name.startswith("ninfer-http-") for name in gate.threads), gate.threads
    assert pool.closed and not any(w.is_alive() for w in pool._workers)  # shut down with the app


def test_a_full_pool_queue_answers_429_with_retry_after(engine, script):
    gate = Gate(engine, script)
    app = create_app(engine, http_threads=1, http_queue=0, retry_after_s=3)
    pool = app.state.gateway.pool

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, GUARD_S)
            refused = await c.post("/v1/chat/completions", json=CHAT)
            gate.release.set()
            return refused, await first

    try:
        refused, first = asyncio.run(main())
    finally:
        gate.release.set()
        pool.shutdown(timeout=GUARD_S)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "rate_limit_error" and err["code"] == "overload" and "waiting to be prepared" in err["message"]
    assert first.status_code == 200
    assert len(engine.submitted) == 1  # the refused request never reached the engine


def test_cancelled_while_waiting_for_the_pool_never_reaches_the_engine(engine, script):
    """The second request waits in the pool queue and is cancelled (as when its connection is torn down):
    its task gives its queue place back and never runs."""
    gate = Gate(engine, script)
    app = create_app(engine, http_threads=1, http_queue=4)
    gw = app.state.gateway

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, GUARD_S)
            second = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            while gw.pool.queued == 0:  # queued behind the first (hang guard: the test timeout)
                await asyncio.sleep(0.001)
            second.cancel()
            try:
                await second
            except asyncio.CancelledError:
                pass
            while gw.pool.queued:  # the abandoned task gives its place back
                await asyncio.sleep(0.001)
            gate.release.set()
            return await first

    try:
        first = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    finally:
        gate.release.set()
        gw.pool.shutdown(timeout=GUARD_S)
    assert first.status_code == 200
    assert len(engine.submitted) == 1
