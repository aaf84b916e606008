"""The listening socket: bound before any model work (a busy port fails at once, and nothing can take the
port between the check and serving), and caps on open connections, which hypercorn itself lacks.

The caps live in the socket: ``accept`` hands out connections that count themselves, by client address, until
closed. A client is its peer IP address (an IPv4-mapped IPv6 address counts as the IPv4 one). Policy:

- a client holding ``max_per_client`` connections has its next one answered 503 and closed at once;
- below that, a connection is admitted while fewer than ``max_connections`` are open;
- at ``max_connections``, the client holding the most connections gives up its oldest one, if it holds more
  than the newcomer would after admission (so shares even out and one address cannot keep others out);
  otherwise the newcomer is answered 503 and closed. The given-up connection is shut down, so the server
  reads end-of-file there; when it was waiting for an answer (the client sent bytes since the server last
  did), it is first answered the same 503.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading


def _refusal(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": "too_many_connections"}})
    return (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}").encode("ascii")


REFUSED = _refusal("too many open connections; retry later")


def client_identity(address: object) -> str:
    """The client an accepted peer address stands for: its IP address."""
    host = address[0] if isinstance(address, tuple) else str(address)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class ConnectionLimit:
    """Open accepted connections by client, against a total maximum and a maximum per client."""

    def __init__(self, max_connections: int, max_per_client: int | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if max_per_client is not None and max_per_client < 1:
            raise ValueError(f"max_per_client must be >= 1, got {max_per_client}")
        self.max_connections = max_connections
        self.max_per_client = min(max_per_client or max_connections, max_connections)
        self._open = 0
        self._by_client: dict[str, dict[int, _CountedConnection]] = {}  # oldest first
        self._lock = threading.Lock()
        self.per_client_refusal = _refusal(f"this client holds {self.max_per_client} open connections, the most "
                                           "one client address may; retry later")

    @property
    def open(self) -> int:
        with self._lock:
            return self._open

    def held(self, client: str) -> int:
        with self._lock:
            return len(self._by_client.get(client, ()))

    def admit(self, conn: _CountedConnection, client: str) -> tuple[bytes | None, _CountedConnection | None]:
        """Give ``conn`` a place, or say why not: (the refusal to answer or None, a connection to shed or
        None). A shed connection's place has passed to ``conn`` already."""
        with self._lock:
            held = len(self._by_client.get(client, ()))
            if held >= self.max_per_client:
                return self.per_client_refusal, None
            victim = None
            if self._open >= self.max_connections:
                heaviest = max(self._by_client.values(), key=len)
                if len(heaviest) <= held + 1:  # nobody holds more than the newcomer would: shares are even
                    return REFUSED, None
                victim = heaviest[next(iter(heaviest))]
                self._remove_locked(victim)
            self._by_client.setdefault(client, {})[id(conn)] = conn
            conn._place = (self, client)
            self._open += 1
            return None, victim

    def release(self, conn: _CountedConnection) -> None:
        with self._lock:
            self._remove_locked(conn)

    def _remove_locked(self, conn: _CountedConnection) -> None:
        place, conn._place = conn._place, None
        if place is None:
            return
        conns = self._by_client[place[1]]
        del conns[id(conn)]
        if not conns:
            del self._by_client[place[1]]
        self._open -= 1


class _CountedConnection(socket.socket):
    """An accepted connection that gives its place back when it is closed (or detached), and knows whether
    the client is waiting for an answer (it sent bytes since the server last sent any)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._place: tuple[ConnectionLimit, str] | None = None
        self._answered = False

    def _give_back(self) -> None:
        place = self._place
        if place is not None:
            place[0].release(self)

    def close(self) -> None:
        self._give_back()
        super().close()

    def detach(self) -> int:
        self._give_back()
        return super().detach()

    # the event loop's transport reads and writes through these
    def recv(self, *args) -> bytes:
        data = super().recv(*args)
        if data:
            self._answered = False
        return data

    def recv_into(self, *args) -> int:
        n = super().recv_into(*args)
        if n:
            self._answered = False
        return n

    def send(self, *args) -> int:
        n = super().send(*args)
        self._answered = self._answered or n > 0
        return n

    def sendmsg(self, *args) -> int:
        n = super().sendmsg(*args)
        self._answered = self._answered or n > 0
        return n

    def shed(self) -> None:
        """Give up this connection for another client's: answer 503 if the client waits for an answer, then
        shut it down, so the server reads end-of-file and closes it (the event loop still owns the socket)."""
        try:
            if not self._answered:
                super().send(REFUSED)  # best effort: a tiny write into an empty send buffer
            self.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class LimitedListener(socket.socket):
    """A listening TCP socket whose ``accept`` enforces a ConnectionLimit (the event loop calls it)."""

    limit: ConnectionLimit

    def accept(self) -> tuple[socket.socket, object]:
        fd, address = self._accept()  # type: ignore[attr-defined]
        conn = _CountedConnection(self.family, self.type, self.proto, fileno=fd)
        refusal, victim = self.limit.admit(conn, client_identity(address))
        if victim is not None:
            victim.shed()
        if refusal is not None:
            try:
                conn.setblocking(False)
                conn.send(refusal)  # best effort: a tiny write into an empty send buffer
            except OSError:
                pass
            conn.close()
            # the event loop treats this as "nothing more to accept now" and keeps serving
            raise ConnectionAbortedError("connection limit reached")
        if socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)  # as socket.accept does
        return conn, address


def bind_listener(host: str, port: int, *, max_connections: int, backlog: int,
                  max_per_client: int | None = None) -> LimitedListener:
    """Bind and listen on ``host:port``; raises OSError (address in use, permission, unknown host).
    ``max_per_client`` None: no cap below ``max_connections``."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = infos[0]
    sock = LimitedListener(family, type_, proto)
    sock.limit = ConnectionLimit(max_connections, max_per_client)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse a TIME_WAIT port
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
