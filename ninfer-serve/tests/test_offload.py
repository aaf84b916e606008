"""The client watch of ninfer_serve.offload: a disconnect seen once is remembered for every later stage."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from ninfer_serve.offload import ClientGone, client_gone, unless_disconnected


def gone_request() -> Request:
    """A connection whose client has left: the server hands the app one ``http.disconnect``, then nothing."""
    sent = []

    async def receive():
        if sent:
            await asyncio.Event().wait()  # as a server does after the one disconnect message: nothing more comes
        sent.append(1)
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_a_disconnect_seen_with_finished_work_is_remembered():
    async def scenario():
        request = gone_request()
        done = asyncio.get_running_loop().create_future()
        done.set_result("result")
        try:  # the work and the disconnect finish in the same turn: either may win this watch...
            await unless_disconnected(request, done)
        except ClientGone:
            pass
        assert client_gone(request)  # ...but the connection remembers the client left
        with pytest.raises(ClientGone):  # so the next stage ends at once instead of waiting forever
            await asyncio.wait_for(unless_disconnected(request, asyncio.sleep(30)), 5)

    asyncio.run(scenario())


def test_a_present_client_lets_the_work_finish():
    async def scenario():
        async def receive():
            await asyncio.Event().wait()

        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
        assert await unless_disconnected(request, asyncio.sleep(0, result=7)) == 7
        assert not client_gone(request)

    asyncio.run(scenario())
