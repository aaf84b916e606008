"""One client address cannot lock the others out (real hypercorn on loopback, real sockets, the scripted
engine): past its per-client cap its connections are answered 503 ``too_many_connections``, and when the
server is full the address holding the most places gives up its oldest connection to a newcomer holding
fewer, so ``/health``, ``/metrics`` and a chat from another address are served. Addresses are told apart by
binding client sockets to 127.0.0.x (all of 127/8 is loopback on Linux). Socket timeouts are hang guards."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from ninfer_serve.app import create_app
from ninfer_serve.listener import client_identity
from ninfer_serve.testing import ThreadServer

GUARD_S = 30.0
HALF_BODY = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
             b"content-length: 100\r\n\r\n{")
CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}


def connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GUARD_S, source_address=(source, 0))


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def until(check, what: str) -> None:
    end = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.005)


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=GUARD_S) as r:
        return r.status


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=GUARD_S) as r:
        return r.status, json.loads(r.read())


@pytest.fixture
def app(engine, script):
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    return create_app(engine, body_timeout_s=GUARD_S)


def hold(srv: ThreadServer, source: str, n: int) -> list[socket.socket]:
    """``n`` connections from ``source``, each holding a request whose body never comes, all accepted."""
    before = srv.listener.limit.held(source)
    held = [connect(srv.port, source) for _ in range(n)]
    for s in held:
        s.sendall(HALF_BODY)
    until(lambda: srv.listener.limit.held(source) == before + n, "the connections were not all accepted")
    return held


def test_a_full_server_sheds_the_heaviest_address_for_a_newcomer(app):
    """One address fills every place with half-sent bodies (the issue's lockout); another address's /health,
    /metrics and chat are still served, and the offender's oldest connection is answered 503 and closed."""
    with ThreadServer(app, max_connections=4, keep_alive_timeout_s=GUARD_S) as srv:
        held = hold(srv, "127.0.0.2", 4)
        try:
            assert srv.listener.limit.open == 4
            assert get(srv.url + "/health") == 200
            reply = read_all(held[0])  # the oldest gave its place up
            assert reply.startswith(b"HTTP/1.1 503 "), reply
            assert b"too_many_connections" in reply and b"retry-after: 1" in reply
            assert get(srv.url + "/metrics") == 200
            status, answer = post(srv.url + "/v1/chat/completions", CHAT)
            assert status == 200 and answer["choices"][0]["message"]["content"] == "ok"
        finally:
            for s in held:
                s.close()


def test_past_its_cap_an_address_gets_503_and_others_are_served(app, engine):
    with ThreadServer(app, max_connections=16, max_per_client=3, keep_alive_timeout_s=GUARD_S) as srv:
        held = hold(srv, "127.0.0.2", 3)
        try:
            with connect(srv.port, "127.0.0.2") as extra:
                reply = read_all(extra)
            assert reply.startswith(b"HTTP/1.1 503 "), reply
            body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "too_many_connections" and body["error"]["type"] == "service_unavailable"
            assert "one client address" in body["error"]["message"]
            assert srv.listener.limit.held("127.0.0.2") == 3  # nothing of its own was shed for it
            assert get(srv.url + "/health") == 200
            assert post(srv.url + "/v1/chat/completions", CHAT)[0] == 200
        finally:
            for s in held:
                s.close()
        until(lambda: srv.listener.limit.open == 0, "the closed connections' places were not given back")
    assert len(engine.submitted) == 1


def test_even_shares_are_not_taken_from_each_other(app):
    """Two addresses hold two places each of four: a third connection of either is refused, not given
    another's place (only an address holding more than the newcomer would gives one up)."""
    with ThreadServer(app, max_connections=4, keep_alive_timeout_s=GUARD_S) as srv:
        held = hold(srv, "127.0.0.2", 2) + hold(srv, "127.0.0.3", 2)
        try:
            with connect(srv.port, "127.0.0.2") as extra:
                reply = read_all(extra)
            assert reply.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in reply, reply
            assert srv.listener.limit.held("127.0.0.2") == srv.listener.limit.held("127.0.0.3") == 2
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize("peer,client", [
    (("127.0.0.1", 5000), "127.0.0.1"),
    (("::1", 5000, 0, 0), "::1"),
    (("::ffff:10.1.2.3", 5000, 0, 0), "10.1.2.3"),  # a dual-stack socket's IPv4 client is the IPv4 address
    (("2001:DB8::1", 5000, 0, 0), "2001:db8::1"),
    ("testclient", "testclient"),
])
def test_client_identity_is_the_peer_ip_address(peer, client):
    assert client_identity(peer) == client
