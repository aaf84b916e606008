"""Remote media under the server's rules (``ninfer_serve.media_fetch``), all on loopback (no test touches the
network): non-public addresses are refused after resolving, in every spelling and behind a redirect, without
connecting; an allowed host is fetched at the address that was checked, under its own name (Host header, TLS);
the deadline is for the whole item, however slowly the origin answers; every failure to fetch reads the same;
the ``*_proxy`` environment is not used."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest
from starlette.testclient import TestClient

import ninfer_serve.media_fetch as media_fetch
from ninfer_serve.app import create_app
from ninfer_serve.media import MediaPolicy, MediaRefused, fetch
from ninfer_serve.testing import MediaOrigin

PNG = b"\x89PNG\r\n\x1a\n" + bytes(200)
GUARD_S = 30.0  # hang guard; a trickle lasts this long unless the client stops it
DRIP_S = 0.2  # one byte per this long


def make_origin(tls: ssl.SSLContext | None = None) -> MediaOrigin:
    """An origin recording each request's path and Host header: a PNG, a 500 with a secret, and trickles."""
    o = MediaOrigin(tls=tls, guard_s=GUARD_S, trickle_s=DRIP_S)
    o.routes["/cat.png"] = (200, {"Content-Type": "image/png", "Content-Length": str(len(PNG))}, PNG)
    o.routes["/secret"] = (500, {"Content-Type": "text/plain"}, b"db password is hunter2")
    return o


@pytest.fixture
def origin():
    o = make_origin()
    yield o
    o.close()


@pytest.fixture
def connects(monkeypatch):
    """Every address a client socket connects to, in order (the connection is made as usual)."""
    seen: list[str] = []
    real = socket.socket.connect

    def connect(self, address):
        seen.append(address[0])
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return seen


def policy(*allowed: str, timeout_s: float = GUARD_S) -> MediaPolicy:
    return MediaPolicy(allow_remote=True, allowed_hosts=allowed, timeout_s=timeout_s)


def get(url: str, pol: MediaPolicy):
    return fetch(url, pol, limit=1 << 20, cancel=threading.Event())


def refused(url: str, pol: MediaPolicy) -> MediaRefused:
    with pytest.raises(MediaRefused) as info:
        get(url, pol)
    assert "refused" in info.value.message
    return info.value


# ---------------------------------------------------------------- addresses


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "2130706433", "0x7f000001", "0177.0.0.1",
                                  "127.1", "169.254.169.254", "10.0.0.1", "192.168.1.1", "100.64.0.1", "0.0.0.0",
                                  "224.0.0.1", "[::ffff:127.0.0.1]", "[::ffff:a9fe:a9fe]", "[64:ff9b::7f00:1]",
                                  "[fe80::1]", "[fd00::1]"])
def test_non_public_addresses_are_refused_without_connecting(origin, connects, host):
    e = refused(f"http://{host}:{origin.port}/cat.png", policy())
    assert e.code in ("media_not_allowed", "invalid_media")
    assert connects == [] and origin.hits == []


def test_a_name_with_one_non_public_address_is_refused(monkeypatch, connects):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("8.8.8.8", 80)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 80))])
    refused("http://mixed.test/cat.png", policy())
    assert connects == []


def test_the_connection_goes_to_the_address_that_was_checked(monkeypatch, connects):
    """DNS rebinding: the name answers a public address, then loopback. One lookup per hop, and the
    connection goes to the address checked (here nothing answers there: refused, loopback never reached)."""
    answers = iter(["8.8.8.8"] + ["127.0.0.1"] * 5)
    lookups = []

    def getaddrinfo(host, port, *args, **kwargs):
        lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    def connect(self, address):  # nothing listens at the public address: no network in tests
        connects.append(address[0])
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(media_fetch._DeadlineSocket, "connect", connect)
    e = refused("http://rebind.test/cat.png", policy())
    assert e.code == "invalid_media" and lookups == ["rebind.test"] and connects == ["8.8.8.8"]


def test_an_allowed_host_is_fetched_under_its_name(origin, connects):
    got = get(f"http://localhost:{origin.port}/cat.png", policy("localhost"))
    assert got.data == PNG and got.mime_type == "image/png"
    assert origin.hits == [("/cat.png", f"localhost:{origin.port}")]
    assert set(connects) <= {"127.0.0.1", "::1"}


def test_a_redirect_from_an_allowed_host_into_loopback_is_refused(origin, connects):
    for target in (f"http://127.0.0.1:{origin.port}/cat.png", f"http://2130706433:{origin.port}/cat.png"):
        origin.hits.clear()
        refused(f"http://localhost:{origin.port}/to/{target}", policy("localhost"))
        assert [path for path, _ in origin.hits] == [f"/to/{target}"]  # the target was never asked
    origin.hits.clear()
    ok = get(f"http://localhost:{origin.port}/to//cat.png", policy("localhost"))  # a relative redirect
    assert ok.data == PNG and len(origin.hits) == 2


def test_patterns_allow_names_under_them():
    allowed = MediaPolicy(allowed_hosts=["*.cdn.example", "Pics.Example", "[0::1]"]).allowed_hosts
    assert allowed == ("*.cdn.example", "pics.example", "::1")
    for host, verdict in [("a.cdn.example", True), ("a.b.cdn.example", True), ("cdn.example", False),
                          ("evilcdn.example", False), ("pics.example", True), ("PICS.EXAMPLE.", True),
                          ("::1", True), ("0:0:0:0:0:0:0:1", True), ("127.0.0.1", False)]:
        assert media_fetch.host_allowed(host, allowed) is verdict, host


def test_remote_media_over_http_refuses_the_metadata_address(engine, script):
    engine.vision_enabled = True
    engine.next = lambda req: script.Handle("r", script.text("r", 3, ["ok"]))
    with TestClient(create_app(engine, media=policy())) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny-test", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}]}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("media_not_allowed", "messages[0].content[0].image_url.url")
    assert "refused" in err["message"] and engine.submitted == []


# ---------------------------------------------------------------- the deadline


@pytest.mark.parametrize("path", ["/trickle-body", "/trickle-headers"])
def test_the_deadline_is_for_the_whole_item(origin, caplog, path):
    """One byte every 0.2 s keeps each read short; the item still ends at its 1 s deadline, not when the
    origin stops (GUARD_S)."""
    start = time.monotonic()
    e = refused(f"http://127.0.0.1:{origin.port}{path}", policy("127.0.0.1", timeout_s=1.0))
    assert time.monotonic() - start < GUARD_S / 3
    assert e.code == "invalid_media" and "not complete within 1 s" in caplog.text
    assert origin.trickled < GUARD_S / DRIP_S / 3


# ---------------------------------------------------------------- one answer for every failure


def test_a_closed_port_and_an_open_one_read_the_same(origin, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    mute = socket.socket()  # open: accepts, then says nothing and hangs up
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    threading.Thread(target=lambda: [mute.accept()[0].close() for _ in range(1)], daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{closed}/x.png", f"http://127.0.0.1:{mute.getsockname()[1]}/x.png",
                f"http://127.0.0.1:{origin.port}/secret", f"http://127.0.0.1:{origin.port}/missing"]
        messages = {refused(url, policy("127.0.0.1", timeout_s=5)).message.replace(repr(url), "U") for url in urls}
    finally:
        mute.close()
    assert len(messages) == 1, messages
    (message,) = messages
    assert "hunter2" not in message and "500" not in message and "Connection" not in message
    assert "hunter2" not in caplog.text and "answered HTTP 500" in caplog.text  # the detail is in the log


def test_the_proxy_environment_is_not_used(origin, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, nowhere)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert get(f"http://127.0.0.1:{origin.port}/cat.png", policy("127.0.0.1")).data == PNG


# ---------------------------------------------------------------- TLS keeps the name


@pytest.fixture
def tls_origin(tmp_path, monkeypatch):
    """An HTTPS origin whose certificate names localhost only, trusted by the fetcher for this test."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True, timeout=60,
                   env={**os.environ, "OPENSSL_CONF": "/dev/null"})
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    client_side = ssl.create_default_context(cafile=str(cert))
    client_side.sslsocket_class = media_fetch._DeadlineSSLSocket
    monkeypatch.setattr(media_fetch, "_tls", lambda: client_side)
    o = make_origin(tls=server_side)
    yield o
    o.close()


def test_tls_is_verified_against_the_url_s_name(tls_origin, caplog):
    got = get(f"https://localhost:{tls_origin.port}/cat.png", policy("localhost"))
    assert got.data == PNG and tls_origin.hits == [("/cat.png", f"localhost:{tls_origin.port}")]
    refused(f"https://127.0.0.1:{tls_origin.port}/cat.png", policy("127.0.0.1"))  # the certificate names localhost
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text or "certificate" in caplog.text.lower()
    start = time.monotonic()
    refused(f"https://localhost:{tls_origin.port}/trickle-body", policy("localhost", timeout_s=1.0))
    assert time.monotonic() - start < GUARD_S / 3
