"""SIGTERM under load, against a real ``ninfer serve`` process with a real tiny model: one lane, a long stream
holding it and three requests queued for it. After ``--graceful-timeout`` the server ends what is left itself:
the queued requests get 503 ``closed`` in the OpenAI error shape with Retry-After, the stream gets one error
event and ``data: [DONE]``, and the process exits cleanly. Waits poll /metrics (hang-guarded); the stream is
far longer than the graceful timeout, so it is always still running when the deadline comes."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx

from ninfer import env
from ninfer_serve.testing import ServerProcess, scrape, tiny_model

DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")  # "cuda" to run these on the GPU machine
GRACEFUL_S = 1.0


def _body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}, **kw}


async def _until(url: str, name: str, value: float, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while scrape(url).get(name, 0.0) != value:
        assert time.monotonic() < end, f"{name} never reached {value}"
        await asyncio.sleep(0.02)


def test_sigterm_ends_queued_requests_and_streams_with_answers(tmp_path_factory):
    srv = ServerProcess(tiny_model(tmp_path_factory.getbasetemp()), "--model-id", "tiny", "--device", DEVICE,
                        "--max-concurrency", "1", "--max-queue", "8", "--queue-timeout", "300",
                        "--graceful-timeout", str(GRACEFUL_S), "--max-model-len", "4096").start()
    try:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                lines: list[str] = []
                started = asyncio.Event()

                async def stream() -> int:
                    async with client.stream("POST", "/v1/chat/completions",
                                             json=_body("Keep talking.", 4000, stream=True)) as r:
                        async for line in r.aiter_lines():
                            if line:
                                lines.append(line)
                                started.set()
                        return r.status_code

                running = asyncio.ensure_future(stream())
                await started.wait()
                queued = [asyncio.ensure_future(client.post("/v1/chat/completions", json=_body(p, 8, stream=s)))
                          for p, s in (("One.", False), ("Two.", False), ("Three.", True))]
                await _until(srv.url, "ninfer:num_requests_waiting", 3)
                srv.proc.send_signal(signal.SIGTERM)
                return await running, lines, await asyncio.gather(*queued)

        status, lines, answers = asyncio.run(main())
        for r in answers:
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "closed" and err["type"] == "service_unavailable" and "shutting down" in err["message"]
        assert status == 200
        assert lines[-1] == "data: [DONE]", lines[-3:]
        tail = json.loads(lines[-2].removeprefix("data: "))
        assert tail["error"]["code"] == "closed" and tail["error"]["type"] == "service_unavailable", tail
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # cut short, not finished
        assert srv.proc.wait(60) == 0, srv.log()
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        srv.kill()
