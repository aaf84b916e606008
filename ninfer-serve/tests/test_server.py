"""The served socket, with real hypercorn on loopback (in a thread, over the scripted engine): a stalled body
gets 408 and its connection closes, incomplete headers are dropped, open connections are capped, and the
access log goes to stderr as ``--access-log``'s help says. Socket timeouts are hang guards only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import urllib.request

import pytest

from ninfer_serve.app import create_app
from ninfer_serve.listener import bind_listener
from ninfer_serve.server import ServerOptions, serve_async

GUARD_S = 30.0


@contextlib.contextmanager
def running(app, *, max_connections: int = 64, **options):
    listener = bind_listener("127.0.0.1", 0, max_connections=max_connections, backlog=16)
    port = listener.getsockname()[1]
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    opts = ServerOptions(**{"graceful_timeout_s": 2.0, **options})
    thread = threading.Thread(target=loop.run_until_complete, args=(serve_async(app, listener, opts, stop=stop),))
    thread.start()
    try:
        yield port, listener
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(GUARD_S)
        loop.close()
        assert not thread.is_alive()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)
    return s


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


def get(port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=GUARD_S) as r:
        return r.status


@pytest.fixture
def app(engine, script):
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    return create_app(engine, body_timeout_s=0.5)


def test_a_stalled_body_gets_408_and_the_connection_closes(app, engine):
    with running(app) as (port, _):
        with connect(port) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                      b"content-length: 100\r\n\r\n{\"model\": ")
            reply = read_all(s)  # returns only once the server has closed the connection
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert b'"code":"body_timeout"' in reply
        assert get(port, "/health") == 200
    assert engine.submitted == []


def test_incomplete_headers_are_dropped_after_the_keep_alive_timeout(app):
    with running(app, keep_alive_timeout_s=0.5) as (port, _):
        with connect(port) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            assert read_all(s) == b""  # closed by the server


def test_open_connections_are_capped(engine):
    """Three connections hold requests whose bodies never come; a fourth is answered 503 and closed at once;
    when one of the three leaves, its place is given back."""
    app = create_app(engine, body_timeout_s=GUARD_S)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{")
    with running(app, max_connections=3, keep_alive_timeout_s=GUARD_S) as (port, listener):
        held = [connect(port) for _ in range(3)]
        try:
            for s in held:
                s.sendall(head)
            with connect(port) as extra:
                reply = read_all(extra)
            assert reply.startswith(b"HTTP/1.1 503 "), reply
            assert b"too_many_connections" in reply and b"retry-after: 1" in reply
            held.pop().close()
            end = time.monotonic() + GUARD_S
            while listener.limit.open >= 3:  # the server sees the close and frees the place
                assert time.monotonic() < end, "the closed connection's place was never given back"
                time.sleep(0.01)
            assert get(port, "/health") == 200
        finally:
            for s in held:
                s.close()
    assert engine.submitted == []


def exchange(port: int, request: bytes) -> bytes:
    """The first bytes of the answer to one raw request (its status line and headers at least)."""
    with connect(port) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_status_lines_carry_their_reason_phrase(app):
    body = b'{"messages": 3}'
    with running(app) as (port, _):
        assert exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").startswith(b"HTTP/1.1 200 OK\r\n")
        bad = exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: "
                       b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert bad.startswith(b"HTTP/1.1 400 Bad Request\r\n"), bad
        untyped = exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 2"
                           b"\r\n\r\n{}")
        assert untyped.startswith(b"HTTP/1.1 415 Unsupported Media Type\r\n"), untyped


def test_reason_phrases_for_every_status_the_gateway_uses():
    import h11

    from ninfer_serve.status_line import reason_phrase, with_reason

    assert [reason_phrase(s) for s in (200, 408, 429, 499, 503)] == \
        ["OK", "Request Timeout", "Too Many Requests", "Client Closed Request", "Service Unavailable"]
    assert with_reason(h11.Response(status_code=299, headers=[])).reason == b""  # no standard phrase: none
    kept = h11.Response(status_code=200, headers=[("a", "b")], reason=b"Fine")
    assert with_reason(kept) is kept
    filled = with_reason(h11.Response(status_code=404, headers=[("a", "b")]))
    assert filled.reason == b"Not Found" and list(filled.headers) == [(b"a", b"b")]


def test_a_client_leaving_a_stream_is_one_log_line(engine, script, caplog, capfd, monkeypatch):
    engine.next = lambda req: script.Handle(req.request_id, script.text(req.request_id, 1, ["tok"] * 1000),
                                            delay_s=0.01)
    monkeypatch.setattr(logging.getLogger("ninfer_serve"), "propagate", True)  # to caplog, whatever ran before
    body = b'{"messages": [{"role": "user", "content": "x"}], "stream": true}'
    with caplog.at_level(logging.INFO, logger="ninfer_serve"), running(create_app(engine)) as (port, _):
        with connect(port) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json"
                      b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            seen = b""
            while seen.count(b"data:") < 3:
                seen += s.recv(65536)
        end = time.monotonic() + GUARD_S
        while not engine.handles[0].closed:  # the server notices, closes the request and logs
            assert time.monotonic() < end, "the request was not closed after its client left"
            time.sleep(0.01)
        assert get(port, "/health") == 200
    rid = next(line.split(b":", 1)[1].strip().decode() for line in seen.split(b"\r\n")
               if line.lower().startswith(b"x-request-id:"))
    # this request's log calls (pytest may hold a record twice when its handler sits on two loggers)
    lines = list({id(r): r for r in caplog.records if r.getMessage().startswith(f"request {rid}:")}.values())
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].exc_info is None
    assert "left the chat stream" in lines[0].getMessage()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "CancelledError" not in err


def test_access_log_goes_to_stderr(app, capfd):
    with running(app, access_log=True) as (port, _):
        assert get(port, "/health") == 200
    out, err = capfd.readouterr()
    assert "GET /health" in err
    assert "GET /health" not in out
