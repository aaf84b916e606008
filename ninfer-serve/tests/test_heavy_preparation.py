"""Heavy preparation (a constraint to compile, media to decode) runs on its own TaskPool, apart from plain
requests: a plain request is served while every heavy thread is busy; one client address holds at most its
share of the heavy pool and of the media pool (429 ``overload`` with Retry-After past it) while another
address is still taken; and a server stopping while a preparation is stuck ends within its bounds. The
scripted engine's ``submit`` holds constrained requests on a gate the test controls (the slow compile);
waits are on events, timeouts are hang guards."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import httpx
import pytest

import ninfer_serve.media
from ninfer.contract.prompt import ChatInput, MediaItem
from ninfer_serve.app import create_app
from ninfer_serve.drain import Drain
from ninfer_serve.testing import ThreadServer

GUARD_S = 30.0
PLAIN = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
CONSTRAINED = {**PLAIN, "response_format": {"type": "json_object"}}
IMAGE = {"model": "tiny-test", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}


class HeavyGate:
    """``engine.submit`` of a constrained request holds its thread until released (a slow compile) and says
    which thread ran each request; plain requests pass at once."""

    def __init__(self, engine, script) -> None:
        self.cond = threading.Condition()
        self.entered = 0
        self.release = threading.Event()
        self.threads: dict[str, list[str]] = {"plain": [], "heavy": []}
        self.script = script
        engine.next = self.submit

    def submit(self, req, cancel=None):
        media = isinstance(req.input, ChatInput) and req.input.media
        kind = "heavy" if req.constraint is not None or media else "plain"
        self.threads[kind].append(threading.current_thread().name)
        if kind == "heavy":
            with self.cond:
                self.entered += 1
                self.cond.notify_all()
            assert self.release.wait(GUARD_S)
        return self.script.Handle("r", self.script.text("r", 1, ["{}"]))

    def wait_entered(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.entered >= n, GUARD_S), f"{self.entered} of {n} entered"


def clients(app, *addresses: str) -> list[httpx.AsyncClient]:
    """One client per peer address, all over the same app."""
    return [httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(a, 40000)), base_url="http://localhost",
                              timeout=GUARD_S) for a in addresses]


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def shut(app) -> None:
    gw = app.state.gateway
    for pool in (gw.pool, gw.heavy_pool, gw.media.pool):
        pool.shutdown(timeout=GUARD_S)


def test_a_plain_request_is_served_while_every_heavy_thread_is_busy(engine, script):
    """Three clients' constrained requests hold every heavy thread in their compile; a plain request still runs
    at once, on the plain pool (two threads here, fewer than the heavy requests)."""
    gate = HeavyGate(engine, script)
    app = create_app(engine, http_threads=2, heavy_threads=3)

    async def main():
        cs = clients(app, "127.0.0.1", "127.0.0.2", "127.0.0.3")
        async with cs[0], cs[1], cs[2]:
            heavy = [asyncio.ensure_future(c.post("/v1/chat/completions", json=CONSTRAINED)) for c in cs]
            await in_thread(gate.wait_entered, 3)
            plain = await cs[0].post("/v1/chat/completions", json=PLAIN)
            gate.release.set()
            return plain, await asyncio.gather(*heavy)

    try:
        plain, heavy = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    finally:
        gate.release.set()
        shut(app)
    assert plain.status_code == 200 and [r.status_code for r in heavy] == [200] * 3
    assert all(name.startswith("ninfer-heavy-") for name in gate.threads["heavy"]), gate.threads
    assert all(name.startswith("ninfer-http-") for name in gate.threads["plain"]), gate.threads


def test_one_address_holds_at_most_its_share_of_the_heavy_pool(engine, script):
    gate = HeavyGate(engine, script)
    app = create_app(engine, heavy_threads=1, heavy_queue=8, heavy_per_client=2, retry_after_s=3)
    heavy = app.state.gateway.heavy_pool

    async def main():
        a, b = clients(app, "127.0.0.2", "127.0.0.3")
        async with a, b:
            held = [asyncio.ensure_future(a.post("/v1/chat/completions", json=CONSTRAINED)) for _ in range(2)]
            await in_thread(gate.wait_entered, 1)
            while heavy.held("127.0.0.2") < 2:  # one running, one queued (hang guard: wait_for)
                await asyncio.sleep(0.001)
            refused = await a.post("/v1/chat/completions", json=CONSTRAINED)
            other = asyncio.ensure_future(b.post("/v1/chat/completions", json=CONSTRAINED))
            while heavy.held("127.0.0.3") < 1:
                await asyncio.sleep(0.001)
            plain = await a.post("/v1/chat/completions", json=PLAIN)  # the plain pool has no per-client cap
            gate.release.set()
            return refused, plain, await asyncio.gather(*held, other)

    try:
        refused, plain, served = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    finally:
        gate.release.set()
        shut(app)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "3", refused.text
    err = refused.json()["error"]
    assert err["code"] == "overload" and err["type"] == "rate_limit_error" and "one client address" in err["message"]
    assert plain.status_code == 200 and [r.status_code for r in served] == [200] * 3
    assert len(engine.submitted) == 4  # the refused request never reached the engine


def test_one_address_runs_one_heavy_preparation_and_a_thread_stays_for_another(engine, script):
    """Two heavy threads: client a's two constrained requests are accepted, but only one is prepared at once
    (``heavy_running_per_client``), so client b's request, sent after them, takes the second thread at once."""
    gate = HeavyGate(engine, script)
    app = create_app(engine, heavy_threads=2, heavy_queue=8)
    heavy = app.state.gateway.heavy_pool

    async def main():
        a, b = clients(app, "127.0.0.2", "127.0.0.3")
        async with a, b:
            held = [asyncio.ensure_future(a.post("/v1/chat/completions", json=CONSTRAINED)) for _ in range(2)]
            await in_thread(gate.wait_entered, 1)
            while heavy.held("127.0.0.2") < 2:  # one running, one queued while a thread is free
                await asyncio.sleep(0.001)
            other = asyncio.ensure_future(b.post("/v1/chat/completions", json=CONSTRAINED))
            await in_thread(gate.wait_entered, 2)  # b's request runs beside a's first
            running = heavy.running
            gate.release.set()
            return running, await asyncio.gather(*held, other)

    try:
        running, served = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    finally:
        gate.release.set()
        shut(app)
    assert running == 2 and [r.status_code for r in served] == [200] * 3
    assert [r.input.messages for r in engine.submitted] and len(engine.submitted) == 3


def test_a_client_that_leaves_cancels_its_preparation(engine, script):
    """The client of a constrained request closes its connection while its grammar compiles: the ``cancel``
    event ``engine.submit`` was given is set (a compile only it waits for is then killed)."""
    entered, release = threading.Event(), threading.Event()

    def submit(req):
        entered.set()
        assert release.wait(GUARD_S)
        return script.Handle("r", script.text("r", 1, ["{}"]))
    engine.next = submit
    app = create_app(engine)
    body = json.dumps(CONSTRAINED).encode()
    try:
        with ThreadServer(app) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=GUARD_S) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert entered.wait(GUARD_S)
            sock.close()  # the client goes away while its request is prepared
            end = time.monotonic() + GUARD_S
            while not engine.cancels[0].is_set():  # hang guard
                assert time.monotonic() < end, "the preparation was not cancelled"
                time.sleep(0.005)
    finally:
        release.set()
    assert len(engine.cancels) == 1


def test_one_address_holds_at_most_its_share_of_the_media_pool(engine, script, monkeypatch):
    engine.vision_enabled = True
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    entered, release = threading.Event(), threading.Event()

    def slow_acquire(sources, policy, cancel):
        entered.set()
        assert release.wait(GUARD_S)
        return (MediaItem(kind="image", data=b"png", mime_type="image/png"),)
    monkeypatch.setattr(ninfer_serve.media, "acquire", slow_acquire)
    app = create_app(engine, media_per_client=1, media=ninfer_serve.media.MediaPolicy(threads=1, queue=4))
    media = app.state.gateway.media.pool

    async def main():
        a, b = clients(app, "127.0.0.2", "127.0.0.3")
        async with a, b:
            first = asyncio.ensure_future(a.post("/v1/chat/completions", json=IMAGE))
            await in_thread(entered.wait, GUARD_S)
            refused = await a.post("/v1/chat/completions", json=IMAGE)
            other = asyncio.ensure_future(b.post("/v1/chat/completions", json=IMAGE))
            while media.held("127.0.0.3") < 1:  # queued behind the first (hang guard: wait_for)
                await asyncio.sleep(0.001)
            release.set()
            return refused, await asyncio.gather(first, other)

    try:
        refused, served = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    finally:
        release.set()
        shut(app)
    assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
    assert refused.json()["error"]["code"] == "overload" and "their media" in refused.json()["error"]["message"]
    assert [r.status_code for r in served] == [200, 200]
    assert all(g.input.media for g in engine.submitted) and len(engine.submitted) == 2


def post_answer(url: str, body: dict, answers: list) -> None:
    """POST ``body`` (in a thread) and record (status, body, Retry-After)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=GUARD_S) as r:
            answers.append((r.status, r.read(), r.headers.get("Retry-After")))
    except urllib.error.HTTPError as exc:
        answers.append((exc.code, exc.read(), exc.headers.get("Retry-After")))


def test_stopping_does_not_wait_for_a_stuck_preparation(engine, script):
    """A constrained request's compile never ends. SIGTERM: at the graceful timeout its client is answered 503
    ``closed``, and the server ends although the preparation thread is still stuck (closing the engine, the
    caller's next step, is what ends such a compile)."""
    gate = HeavyGate(engine, script)
    drain = Drain()
    app = create_app(engine, drain=drain)
    answers: list[tuple[int, bytes, str | None]] = []
    try:
        with ThreadServer(app, drain=drain, graceful_timeout_s=0.2) as srv:
            caller = threading.Thread(target=post_answer, args=(srv.url, CONSTRAINED, answers))
            caller.start()
            gate.wait_entered(1)
            srv.stop()
            assert srv.join(GUARD_S), "the server waited for the stuck preparation"
            caller.join(GUARD_S)
        assert not gate.release.is_set() and app.state.gateway.heavy_pool.running == 1  # still stuck
    finally:
        gate.release.set()
    [(status, body, retry)] = answers
    assert status == 503 and retry == "1", body
    assert json.loads(body)["error"] == {"message": json.loads(body)["error"]["message"], "type": "service_unavailable",
                                         "param": None, "code": "closed"}


@pytest.mark.parametrize("threads", [0])
def test_bad_pool_sizes_are_refused(engine, threads):
    with pytest.raises(ValueError):
        create_app(engine, heavy_threads=threads)
