"""The listening socket: bound before any model work (a busy port fails at once, and nothing can take the
port between the check and serving), and a cap on open connections, which hypercorn itself lacks.

The cap lives in the socket: ``accept`` hands out connections that count themselves until closed; one
over the cap is answered 503 and closed at once, before it can hold any server resource.
"""

from __future__ import annotations

import json
import socket
import threading

_REFUSED_BODY = json.dumps({"error": {"message": "too many open connections; retry later", "type":
                                      "service_unavailable", "param": None, "code": "too_many_connections"}})
REFUSED = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
           f"content-length: {len(_REFUSED_BODY)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
           f"{_REFUSED_BODY}").encode("ascii")


class ConnectionLimit:
    """How many accepted connections are open, against a maximum."""

    def __init__(self, max_connections: int) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        with self._lock:
            return self._open

    def acquire(self) -> bool:
        with self._lock:
            if self._open >= self.max_connections:
                return False
            self._open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._open -= 1


class _CountedConnection(socket.socket):
    """An accepted connection that gives its place back when it is closed (or detached)."""

    def __init__(self, *args, limit: ConnectionLimit, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._limit: ConnectionLimit | None = limit

    def _give_back(self) -> None:
        limit, self._limit = self._limit, None
        if limit is not None:
            limit.release()

    def close(self) -> None:
        self._give_back()
        super().close()

    def detach(self) -> int:
        self._give_back()
        return super().detach()


class LimitedListener(socket.socket):
    """A listening TCP socket whose ``accept`` enforces a ConnectionLimit (the event loop calls it)."""

    limit: ConnectionLimit

    def accept(self) -> tuple[socket.socket, object]:
        fd, address = self._accept()  # type: ignore[attr-defined]
        conn = _CountedConnection(self.family, self.type, self.proto, fileno=fd, limit=self.limit)
        if not self.limit.acquire():
            conn._limit = None  # it never held a place
            try:
                conn.setblocking(False)
                conn.send(REFUSED)  # best effort: a tiny write into an empty send buffer
            except OSError:
                pass
            conn.close()
            # the event loop treats this as "nothing more to accept now" and keeps serving
            raise ConnectionAbortedError("connection limit reached")
        if socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)  # as socket.accept does
        return conn, address


def bind_listener(host: str, port: int, *, max_connections: int, backlog: int) -> LimitedListener:
    """Bind and listen on ``host:port``; raises OSError (address in use, permission, unknown host)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = infos[0]
    sock = LimitedListener(family, type_, proto)
    sock.limit = ConnectionLimit(max_connections)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse a TIME_WAIT port
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
