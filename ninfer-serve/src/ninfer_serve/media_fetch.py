"""Remote media: one http(s) item fetched as the server's ``MediaPolicy`` allows (``--allow-remote-media``).

- Addresses. The URL's host is resolved, and the fetch is refused unless every address it resolves to is a
  public unicast address: loopback, private, link-local, shared (100.64/10), multicast, reserved and unspecified
  addresses are refused, and so are their IPv4-mapped (``::ffff:a.b.c.d``) and NAT64 (``64:ff9b::/96``)
  spellings. IPv4 written as one number (``2130706433``), in hex (``0x7f000001``) or octal (``0177.0.0.1``) is
  resolved to the address it means, then checked. The connection goes to an address that was checked: there
  is no second lookup, so a name that answers differently a moment later (DNS rebinding) cannot lead
  elsewhere; the Host header, TLS SNI and certificate check keep the URL's name. A host the operator allows
  (``allowed_hosts``, ``--media-allowed-hosts``: exact names, or ``*.example.com`` for any name under it) skips
  the address check.
- Redirects: at most ``MAX_REDIRECTS``, to http(s) URLs only, each checked like the first URL.
- Deadline: ``timeout_s`` is for the whole item (name lookups, connects, TLS handshakes, headers, body, every
  redirect). Each socket operation waits at most the time left, so an origin that trickles its answer a byte
  at a time ends at the deadline. A name lookup is the system resolver's; the deadline is checked after it.
- No proxy: the ``*_proxy`` environment is ignored, since a proxy would resolve the name itself, after the
  check, from where it sits.
- Errors say only that the fetch was refused: no status, no text of the origin's, no connection error that
  would tell a closed port from an open one. The log (``ninfer_serve.media``, warning) keeps the reason.
  Only what the client wrote itself is named: a URL that is not http(s) or a non-public IP literal.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from functools import cache
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

from ninfer_serve.media_policy import MediaPolicy, host_allowed

log = logging.getLogger("ninfer_serve.media")

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16
_SHOWN_CHARS = 80  # of a URL echoed in an error message
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class MediaRefused(Exception):
    """One URL cannot be acquired; ``code`` is the error code the client gets."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class FetchCancelled(Exception):
    """The request was abandoned (its client left): nobody wants the bytes any more."""


@attrs.frozen
class Fetched:
    data: bytes
    mime_type: str | None


def shown(url: str) -> str:
    """The URL as an error message names it (a data URL by its type only, a long one cut)."""
    if url[:5].lower() == "data:":
        return f"a {url.split(',', 1)[0][:40]} URL"
    return repr(url if len(url) <= _SHOWN_CHARS else url[:_SHOWN_CHARS] + "...")


def image_like(mime: str) -> bool:
    """Loosely: an image type, or bytes of no declared type (the Frontend decodes by content)."""
    return mime.startswith("image/") or mime in ("application/octet-stream", "binary/octet-stream")


def too_large(what: str, limit: int) -> MediaRefused:
    return MediaRefused("media_too_large", f"{what} holds more than {limit} bytes (--media-max-bytes)")


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A public unicast address (an IPv4 address inside IPv6, mapped or NAT64, is judged as itself)."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped
        if inner is None and address in _NAT64:
            inner = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
        if inner is not None:
            return is_public(inner)
        if address.is_site_local:
            return False
    return address.is_global and not (address.is_private or address.is_loopback or address.is_link_local
                                      or address.is_multicast or address.is_reserved or address.is_unspecified)


class _Refusal(Exception):
    """A failure to fetch: the client hears one generic sentence, the log gets ``detail``."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class _Deadline:
    """The item's time budget and its cancellation, consulted before every blocking socket operation."""

    def __init__(self, seconds: float, cancel: threading.Event) -> None:
        self.end = time.monotonic() + seconds
        self.cancel = cancel

    def left(self) -> float:
        if self.cancel.is_set():
            raise FetchCancelled
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the item's deadline passed")
        return left


class _DeadlineSocket(socket.socket):
    """A TCP socket whose every receive and send waits at most the time left to its item."""

    deadline: _Deadline

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(self.deadline.left())
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self.settimeout(self.deadline.left())
        return super().recv(bufsize, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(self.deadline.left())
        super().sendall(data, flags)


class _DeadlineSSLSocket(ssl.SSLSocket):
    """The same for a TLS connection (``SSLContext.sslsocket_class``)."""

    deadline: _Deadline | None = None

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None, flags: int = 0) -> int:
        if self.deadline is not None:
            self.settimeout(self.deadline.left())
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        if self.deadline is not None:
            self.settimeout(self.deadline.left())
        return super().recv(buflen, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        if self.deadline is not None:
            self.settimeout(self.deadline.left())
        super().sendall(data, flags)


@cache
def _tls() -> ssl.SSLContext:
    context = ssl.create_default_context()  # certificates verified against the URL's name
    context.sslsocket_class = _DeadlineSSLSocket
    return context


class _Connection(http.client.HTTPConnection):
    """http.client over a socket opened here, to a checked address; ``host`` stays the URL's (Host header)."""

    def __init__(self, host: str, port: int, sock: socket.socket, default_port: int) -> None:
        super().__init__(host, port)
        self.default_port = default_port  # the Host header leaves the scheme's own port out
        self.sock = sock

    def connect(self) -> None:  # never reached: the socket is given
        raise http.client.NotConnected("media_fetch opens its connections itself")


@attrs.frozen
class _Target:
    scheme: str
    host: str  # ASCII (IDNA), no brackets
    port: int
    path: str


def _target(url: str) -> _Target:
    """The parts of an http(s) URL a fetch needs; ValueError says what is wrong with it."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"the scheme '{scheme}' is not http(s)")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise ValueError("it names no host")
    if not host.isascii():
        host = host.encode("idna").decode("ascii")
    port = parts.port or _DEFAULT_PORTS[scheme]
    return _Target(scheme, host, port, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _addresses(target: _Target, policy: MediaPolicy, deadline: _Deadline) -> list[tuple]:
    """Where ``target`` may be reached: every address its host resolves to, each public unless the host is
    allowed by name."""
    try:
        found = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise _Refusal(f"{target.host} does not resolve: {exc}") from None
    deadline.left()
    found = [a for a in found if a[0] in (socket.AF_INET, socket.AF_INET6)]
    if not found:
        raise _Refusal(f"{target.host} has no IPv4 or IPv6 address")
    if not host_allowed(target.host, policy.allowed_hosts):
        for *_, sockaddr in found:
            address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
            if not is_public(address):
                raise _Refusal(f"{target.host} resolves to {address}, not a public address (not connected)")
    return found


def _connect(target: _Target, addresses: list[tuple], deadline: _Deadline) -> socket.socket:
    """A connection to the first of ``addresses`` that answers (TLS over it for https)."""
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in addresses:
        sock = _DeadlineSocket(family, kind, proto)
        sock.deadline = deadline
        try:
            sock.settimeout(deadline.left())
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        if target.scheme == "http":
            return sock
        try:
            sock.settimeout(deadline.left())
            secure = _tls().wrap_socket(sock, server_hostname=target.host)
        except BaseException:
            sock.close()
            raise
        secure.deadline = deadline
        return secure
    assert error is not None
    raise error


def _get(url: str, target: _Target, policy: MediaPolicy, limit: int, deadline: _Deadline) -> Fetched | str:
    """One hop: the item, or the URL it redirects to."""
    sock = _connect(target, _addresses(target, policy, deadline), deadline)
    conn = _Connection(target.host, target.port, sock, _DEFAULT_PORTS[target.scheme])
    try:
        conn.request("GET", target.path, headers={"User-Agent": "ninfer-serve", "Accept": "image/*",
                                                  "Connection": "close"})
        response = conn.getresponse()
        if response.status in _REDIRECTS:
            return urllib.parse.urljoin(url, response.getheader("Location") or "")
        if not 200 <= response.status < 300:
            raise _Refusal(f"answered HTTP {response.status}")
        mime = response.headers.get_content_type() if response.headers.get("Content-Type") else None
        if mime is not None and not image_like(mime):
            raise _Refusal(f"is of type {mime}, not an image")
        declared = response.getheader("Content-Length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(shown(url), limit)
        data = bytearray()
        while chunk := response.read(min(_CHUNK, limit + 1 - len(data))):
            data += chunk
            if len(data) > limit:
                raise too_large(shown(url), limit)
        return Fetched(bytes(data), mime)
    finally:
        conn.close()


def fetch_remote(url: str, policy: MediaPolicy, *, limit: int, cancel: threading.Event) -> Fetched:
    """The bytes behind the http(s) ``url`` (at most ``limit``) under ``policy``'s rules (module docstring);
    MediaRefused says why not, FetchCancelled when ``cancel`` is set."""
    name = shown(url)
    if not policy.allow_remote:
        raise MediaRefused("media_not_allowed", f"{name}: http(s) media is off on this server (its operator "
                                                "turns it on with --allow-remote-media)")
    try:
        target = _target(url)
    except (ValueError, UnicodeError) as exc:
        raise MediaRefused("invalid_media", f"{name} is not a valid http(s) URL: {exc}") from None
    literal = _literal(target.host)
    if literal is not None and not is_public(literal) and not host_allowed(target.host, policy.allowed_hosts):
        raise MediaRefused("media_not_allowed", f"{name}: refused, {literal} is not a public address (media is "
                                                "fetched from public addresses only; an operator allows named "
                                                "hosts with --media-allowed-hosts)")
    deadline = _Deadline(policy.timeout_s, cancel)
    current = url
    try:
        for _ in range(MAX_REDIRECTS + 1):
            got = _get(current, target, policy, limit, deadline)
            if isinstance(got, Fetched):
                return got
            try:
                target = _target(got)
            except (ValueError, UnicodeError) as exc:
                raise _Refusal(f"redirects to {shown(got)}, which is refused: {exc}") from None
            current = got
        raise _Refusal(f"redirects more than {MAX_REDIRECTS} times")
    except (MediaRefused, FetchCancelled):
        raise
    except _Refusal as exc:
        detail = exc.detail
    except TimeoutError:
        detail = f"not complete within {policy.timeout_s:g} s"
    except Exception as exc:  # connection, TLS and protocol errors, whatever their type
        detail = f"{type(exc).__name__}: {exc}"
    log.warning("media fetch of %s (at %s) refused: %s", name, shown(current), detail)
    raise MediaRefused("invalid_media", f"{name}: the fetch was refused (media is fetched from public "
                                        f"addresses, as an image, within {policy.timeout_s:g} s; the server's "
                                        "log says why)")
