"""Connection lifecycle against a real ``ninfer serve`` process with a real tiny model: a bounded load test
with disconnecting clients (every gauge back to zero), overload (429) and queue timeout (503), and SIGTERM
letting a stream finish. Each step waits for the state it needs (polling /metrics, hang-guarded); nothing
depends on how long anything takes."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest

from ninfer import env
from ninfer_serve.testing import ServerProcess, scrape, tiny_model, wait_idle

DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")  # "cuda" to run these on the GPU machine


def _tiny_model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.getbasetemp())


def _body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False}, **kw}


async def _stream(client: httpx.AsyncClient, body: dict, *, leave_after: int | None = None,
                  started: asyncio.Event | None = None) -> str | None:
    """Run one streaming chat; returns the text, or None when it left after ``leave_after`` chunks.
    ``started`` is set at the first chunk (the request is admitted and generating)."""
    text, n = [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                return "".join(text)
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if started is not None:
                started.set()
            for c in chunk["choices"]:
                text.append(c["delta"].get("content") or "")
            n += 1
            if leave_after is not None and n >= leave_after:
                return None  # leaving the context manager closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


async def _until(url: str, name: str, value: float, timeout_s: float = 120.0) -> None:
    """Poll ``/metrics`` until the sample ``name`` equals ``value`` (the timeout is only a hang guard)."""
    end = time.monotonic() + timeout_s
    while scrape(url).get(name, 0.0) != value:
        assert time.monotonic() < end, f"{name} never reached {value}"
        await asyncio.sleep(0.02)


def test_load_with_disconnects_returns_every_gauge_to_zero(tmp_path_factory):
    """64 concurrent streams; a third of the clients leave after 1 to 4 chunks of a generation far longer
    than that (so they leave mid-stream). The others get exactly what they get alone, every leaver's request
    is cancelled, and every engine and gateway gauge returns to zero."""
    prompts = [f"Tell me about {w}." for w in ("ships", "bread", "rain", "kings", "cats", "stars", "iron", "wine")]
    rng = random.Random(7)
    leaving = set(rng.sample(range(64), 64 // 3))
    with ServerProcess(_tiny_model(tmp_path_factory), "--model-id", "tiny", "--max-concurrency", "4",
                       "--device", DEVICE, "--max-queue", "64", "--queue-timeout", "300") as srv:

        async def main():
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as client:
                alone = [await _stream(client, _body(p, 16)) for p in prompts]
                # A leaving client asks for far more tokens than it reads, so it is always still generating
                # when it leaves, however the two processes are scheduled.
                tasks = [_stream(client, _body(prompts[i % len(prompts)], 2000),
                                 leave_after=rng.randint(1, 4)) if i in leaving
                         else _stream(client, _body(prompts[i % len(prompts)], 16)) for i in range(64)]
                return alone, await asyncio.gather(*tasks)

        alone, results = asyncio.run(main())
        for i, out in enumerate(results):
            if i in leaving:
                assert out is None  # it left mid-stream
                continue
            assert out == alone[i % len(prompts)], f"client {i} differs from running alone"
        m = wait_idle(lambda: scrape(srv.url))
        # the leaving clients really left mid-stream, and the engine cancelled their requests
        assert m["ninfer:client_disconnects_total"] == len(leaving)
        text = httpx.get(srv.url + "/metrics").text
        cancelled = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("ninfer:request_success_total{") and 'finished_reason="cancelled"' in line]
        assert cancelled == [len(leaving)]
        assert m["ninfer:kv_cache_pages_total"] > 0
        assert m["ninfer:engine_failed"] == 0
        assert m["ninfer:request_success_total"] == 64 + len(prompts) + 4  # and the 4 warmup requests


# A request that holds the only lane: 4000 tokens take seconds on a CPU (and longer than the queue timeouts
# below on a GPU), and the tests cancel it once they are done.
HOLD_TOKENS = 4000


async def _hold_the_lane(client: httpx.AsyncClient) -> asyncio.Future:
    """Start a stream that takes the only lane, and return once it is generating."""
    started = asyncio.Event()
    long_run = asyncio.ensure_future(_stream(client, _body("Keep talking.", HOLD_TOKENS), started=started))
    await started.wait()
    return long_run


async def _leave(stream: asyncio.Future) -> None:
    stream.cancel()  # closes the connection: the server cancels the request
    try:
        await stream
    except asyncio.CancelledError:
        pass


def _one_lane_server(tmp_path_factory, queue_timeout: str) -> ServerProcess:
    """A server with one lane and one queue place."""
    return ServerProcess(_tiny_model(tmp_path_factory), "--model-id", "tiny", "--max-concurrency", "1",
                         "--device", DEVICE, "--max-queue", "1", "--queue-timeout", queue_timeout,
                         "--max-model-len", "4096")


def test_queue_timeout_503(tmp_path_factory):
    with _one_lane_server(tmp_path_factory, "0.1") as srv:

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                long_run = await _hold_the_lane(client)
                timed_out = await client.post("/v1/chat/completions", json=_body("Wait.", 4, stream=False))
                await _leave(long_run)
                return timed_out

        timed_out = asyncio.run(main())
        assert timed_out.status_code == 503, timed_out.text
        assert timed_out.headers["retry-after"] and timed_out.json()["error"]["code"] == "queue_timeout"
        m = wait_idle(lambda: scrape(srv.url))
        assert m["ninfer:client_disconnects_total"] == 1  # the long stream
        assert 'ninfer:http_requests_total{endpoint="chat",status="503"} 1.0' in httpx.get(srv.url + "/metrics").text


def test_overload_429_and_a_client_leaving_the_queue(tmp_path_factory):
    """A full queue answers 429 at once; a non-streaming client that leaves while its request waits in the
    queue cancels it (the queue timeout is long, so only the client's leaving can end it)."""
    with _one_lane_server(tmp_path_factory, "300") as srv:

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                long_run = await _hold_the_lane(client)
                leaver = asyncio.ensure_future(client.post("/v1/chat/completions", json=_body("Bye.", 4, stream=False)))
                await _until(srv.url, "ninfer:num_requests_waiting", 1)
                over = await client.post("/v1/chat/completions", json=_body("No room.", 4, stream=False))
                leaver.cancel()  # closes its connection while the request waits for the lane
                await _until(srv.url, "ninfer:client_disconnects_total", 1)
                await _until(srv.url, "ninfer:num_requests_waiting", 0)  # cancelled, never admitted
                await _leave(long_run)
                return over

        over = asyncio.run(main())
        assert over.status_code == 429, over.text
        assert over.headers["retry-after"] and over.json()["error"]["code"] == "overload"
        m = wait_idle(lambda: scrape(srv.url))
        assert m["ninfer:client_disconnects_total"] == 2  # the queued leaver and the long stream
        text = httpx.get(srv.url + "/metrics").text
        assert 'ninfer:http_requests_total{endpoint="chat",status="429"} 1.0' in text
        cancelled = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("ninfer:request_success_total{") and 'finished_reason="cancelled"' in line]
        assert cancelled == [2.0]


def test_sigterm_lets_the_in_flight_stream_finish(tmp_path_factory):
    srv = ServerProcess(_tiny_model(tmp_path_factory), "--model-id", "tiny", "--device", DEVICE,
                        "--max-model-len", "4096").start()
    try:
        chunks, done = [], False
        body = _body("Go on.", 400, stream_options={"include_usage": True})
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:  # wait until generation is under way
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) >= 3:
                        break
            srv.proc.send_signal(signal.SIGTERM)
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        assert done, "the stream did not finish after SIGTERM"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 400
        assert srv.proc.wait(60) == 0, srv.log()
        with pytest.raises(httpx.TransportError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.kill()
