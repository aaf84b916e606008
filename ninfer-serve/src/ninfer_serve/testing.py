"""Run a real ``ninfer serve`` process on loopback for integration tests (``ServerProcess``), or an app under
hypercorn in a thread of the test process (``ThreadServer``); a local origin of remote media (``MediaOrigin``).

The server process is started through the CLI, exactly as a user starts it; it is stopped with SIGTERM
(graceful) and killed only if it does not exit in time.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence


class ThreadServer:
    """An app under hypercorn on a loopback port, in a thread of this process (for tests that need real
    sockets but not a model): ``with ThreadServer(app) as srv: srv.port``. ``stop()`` is what SIGTERM does;
    ``drain`` is the app's (as ``ninfer serve`` passes it); ``options`` are ``ServerOptions`` fields."""

    def __init__(self, app: object, *, drain: object = None, max_connections: int = 64,
                 max_per_client: int | None = None, **options: float) -> None:
        import asyncio

        from ninfer_serve.listener import bind_listener
        from ninfer_serve.server import ServerOptions

        self.app = app
        self.drain = drain
        self.listener = bind_listener("127.0.0.1", 0, max_connections=max_connections, backlog=64,
                                      max_per_client=max_per_client)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.options = ServerOptions(**{"graceful_timeout_s": 2.0, **options})
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ThreadServer:
        from ninfer_serve.server import serve_async

        run = serve_async(self.app, self.listener, self.options, stop=self._stop, drain=self.drain)
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(run,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)

    def join(self, timeout_s: float) -> bool:
        """Wait for the server to end; True when it has."""
        assert self._thread is not None
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        ended = self.join(60.0)
        if ended:
            self._loop.close()
        assert ended, "the in-process server did not stop"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(model, "--max-concurrency", "4") as srv: srv.url``."""

    def __init__(self, model: str | os.PathLike | None, *args: str, host: str = "127.0.0.1",
                 startup_timeout_s: float = 180.0, env: dict[str, str] | None = None) -> None:
        self.host = host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.args: Sequence[str] = [sys.executable, "-m", "ninfer", "serve",
                                    *([os.fspath(model)] if model is not None else []),
                                    "--host", host, "--port", str(self.port), *args]
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(mode="w+")

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        end = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ninfer serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"ninfer serve did not become healthy in {self.startup_timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code (killing only after ``timeout_s``)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            self.terminate()
        finally:
            self._log.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name with labels stripped: value} (summed over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` of the server at ``url``, parsed by ``parse_metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10.0) as r:
        return parse_metrics(r.read().decode())


# Every gauge that must read zero once no request is in flight: the engine's queue, slots, pages and host
# bytes, and the gateway's own in-flight requests and its preparation and media pools.
IDLE_GAUGES = ("ninfer:num_requests_running", "ninfer:num_requests_waiting", "ninfer:num_requests_paused",
               "ninfer:num_requests_outstanding", "ninfer:kv_cache_pages_used", "ninfer:kv_cache_pages_reserved",
               "ninfer:state_slots_used", "ninfer:host_bytes_used", "ninfer:http_requests_in_flight",
               "ninfer:http_prepare_queued", "ninfer:http_prepare_running", "ninfer:http_heavy_prepare_queued",
               "ninfer:http_heavy_prepare_running", "ninfer:http_media_queued", "ninfer:http_media_running")


def wait_idle(read: Callable[[], dict[str, float]], *, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll ``read()`` (parsed metrics) until every IDLE_GAUGES entry is present and zero; ``timeout_s`` is a
    hang guard, not an expectation. Returns the last reading."""
    end = time.monotonic() + timeout_s
    while True:
        m = read()
        missing = [k for k in IDLE_GAUGES if k not in m]
        assert not missing, f"gauges missing from /metrics: {missing}"
        busy = {k: m[k] for k in IDLE_GAUGES if m[k] != 0}
        if not busy:
            return m
        if time.monotonic() > end:
            raise AssertionError(f"not idle after {timeout_s} s: {busy}")
        time.sleep(0.05)


def tiny_model(directory: str | os.PathLike) -> str:
    """A real tiny Qwen3.5 ``.ninfer`` (random weights, real converter) in ``directory``, built once."""
    from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint

    path = os.path.join(directory, "serve_tiny.ninfer")
    if not os.path.exists(path):
        src = make_tiny_checkpoint(os.path.join(directory, "serve_tiny_hf"), mtp=False)
        convert_tiny(src, path + ".part")
        os.replace(path + ".part", path)
    return path


class MediaOrigin:
    """A local HTTP(S) server for remote media: ``routes[path] = (status, headers, body)`` (404 elsewhere);
    ``/to/<location>`` redirects there; ``/slow`` answers its route only once ``release`` is set and ``/drip`` sends
    ten bytes of ``drip`` then holds the rest until then (``entered`` says one arrived); ``/trickle-body`` and
    ``/trickle-headers`` send a byte each ``trickle_s`` (``trickled`` counts them) until ``guard_s`` or ``close``.
    ``hits`` records each request's path and Host header."""

    def __init__(self, *, tls: ssl.SSLContext | None = None, drip: bytes = b"", guard_s: float = 30.0,
                 trickle_s: float = 0.2) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.hits: list[tuple[str, str]] = []
        self.release, self.entered, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.trickled = 0
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                origin.hits.append((self.path, self.headers.get("Host", "")))
                if self.path in ("/slow", "/drip"):
                    origin.entered.set()
                    if self.path == "/drip":
                        self._head(200, {"Content-Type": "image/png"})
                        self.wfile.write(drip[:10])
                        self.wfile.flush()
                    origin.release.wait(guard_s)
                    if self.path == "/drip":
                        self.wfile.write(drip[10:])
                        return
                if self.path == "/trickle-body":
                    self._head(200, {"Content-Type": "image/png"})
                    return self._trickle()
                if self.path == "/trickle-headers":
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    return self._trickle()
                if self.path.startswith("/to/"):
                    status, headers, body = 302, {"Location": self.path[len("/to/"):]}, b""
                else:
                    status, headers, body = origin.routes.get(self.path, (404, {}, b"not here"))
                self._head(status, headers)
                self.wfile.write(body)

            def _head(self, status: int, headers: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()

            def _trickle(self) -> None:
                end = time.monotonic() + guard_s
                while time.monotonic() < end and not origin.stop.is_set():
                    try:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    except OSError:  # the client hung up
                        return
                    origin.trickled += 1
                    origin.stop.wait(trickle_s)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"{'https' if tls is not None else 'http'}://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
