"""Shutdown under load, with real hypercorn on loopback (in a thread) over scripted handles: after the stop,
in-flight requests get the graceful timeout; then the gateway itself answers what is left: a request waiting
for an engine slot or a pool thread gets 503 ``closed`` in the OpenAI shape with Retry-After, a running stream
gets one error event and ``[DONE]``, and every handle is closed. A request that arrives after the stop is
refused the same way. Waits are on states the test observes; timeouts are hang guards."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx

from ninfer.contract.events import GenerationStart, OutputDelta
from ninfer_serve.app import create_app
from ninfer_serve.drain import Drain
from ninfer_serve.testing import ThreadServer

GUARD_S = 30.0
CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}


class EndlessHandle:
    """A running stream: started, then a token every few milliseconds until closed."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.closed = False

    def __aiter__(self):
        return self._events()

    async def _events(self):
        yield GenerationStart(request_id=self.request_id, prompt_tokens=1)
        while not self.closed:
            await asyncio.sleep(0.002)
            yield OutputDelta(content="x", token_ids=(10,))

    def exception(self):
        return None

    def close(self) -> None:
        self.closed = True


class QueuedHandle(EndlessHandle):
    """A request waiting for an engine slot: nothing comes until it is closed."""

    async def _events(self):
        await asyncio.Event().wait()  # cancelled when the gateway stops waiting
        yield GenerationStart(request_id=self.request_id, prompt_tokens=1)


def until(check, what: str) -> None:
    end = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.005)


def closed_error(response: httpx.Response) -> dict:
    assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "service_unavailable" and err["code"] == "closed" and "shutting down" in err["message"]
    return err


def test_what_outlives_the_graceful_timeout_is_ended_with_answers(engine):
    """One stream runs, two requests wait for an engine slot and one for the only preparation thread (held by
    a slow submit). After the stop and the graceful timeout each gets its answer from the gateway."""
    handles: list[EndlessHandle] = []
    slow_submit, stuck = threading.Event(), threading.Event()

    def submit(req, cancel=None):
        if req.request_id and len(handles) == 3 and not stuck.is_set():
            stuck.set()
            assert slow_submit.wait(GUARD_S)  # holds the only thread: the next request waits for it
        handle = (EndlessHandle if not handles else QueuedHandle)(req.request_id or "r")
        handles.append(handle)
        return handle
    engine.next = submit
    drain = Drain()
    app = create_app(engine, drain=drain, http_threads=1, http_queue=4)
    pool = app.state.gateway.pool

    async def main(srv: ThreadServer):
        async with httpx.AsyncClient(base_url=srv.url, timeout=GUARD_S) as c:
            lines: list[str] = []
            started = asyncio.Event()

            async def stream() -> httpx.Response:
                async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                            started.set()
                return r

            streaming = asyncio.ensure_future(stream())
            await started.wait()
            queued = [asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT)) for _ in range(2)]
            await asyncio.to_thread(until, lambda: len(handles) == 3, "the queued requests were not submitted")
            in_submit = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            await asyncio.to_thread(stuck.wait, GUARD_S)
            waiting = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            await asyncio.to_thread(until, lambda: pool.queued == 1, "no request waits for the pool")
            srv.stop()
            answers = await asyncio.gather(*queued, in_submit, waiting)
            return await streaming, lines, answers

    try:
        with ThreadServer(app, drain=drain, graceful_timeout_s=0.3) as srv:
            response, lines, answers = asyncio.run(asyncio.wait_for(main(srv), GUARD_S))
            assert srv.join(GUARD_S)
    finally:
        slow_submit.set()
    for answer in answers:
        closed_error(answer)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]", lines[-3:]
    tail = json.loads(lines[-2].removeprefix("data: "))
    assert tail["error"]["code"] == "closed" and tail["error"]["type"] == "service_unavailable", tail
    assert all(json.loads(line[6:]).get("choices") is not None for line in lines[:-2])  # chunks until then
    assert all(h.closed for h in handles)


def test_a_request_after_the_stop_is_refused(client, engine, script):
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    drain = Drain()
    c = client(engine, drain=drain)
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    drain.stop()
    closed_error(c.post("/v1/chat/completions", json=CHAT))
    assert c.get("/health").status_code == 200 and len(engine.submitted) == 1
