"""Who may call the gateway: the Host-header check (DNS rebinding), the API key on ``/v1`` and CORS.

Pure ASGI middlewares, so they answer before any route runs and cost nothing on a streaming body.
JSON-only request bodies (415 otherwise) are checked by the POST routes themselves (app.py).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Collection, Sequence

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from ninfer_serve.errors import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Bound to loopback, only loopback names are accepted in ``Host``: a page that rebinds its own DNS
    name to 127.0.0.1 still sends that name, so it is refused. Bound elsewhere, clients reach the server
    by names this process cannot know, so any Host is accepted (protect it with --api-key and, for a
    public name, --allowed-hosts)."""
    return LOOPBACK_NAMES if is_loopback(bind_host) else ("*",)


def host_name(header: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header[1:]
    name, sep, port = header.rpartition(":")
    return name if sep and port.isdigit() else header


def _host_allowed(name: str, allowed: Collection[str]) -> bool:
    for pattern in allowed:
        if pattern == "*" or pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


class HostCheck:
    """Refuse requests whose Host header is not one of ``allowed`` (exact names, ``*.suffix`` or ``*``)."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = tuple(a.lower().strip("[]") if not a.startswith("*") else a.lower() for a in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            header = Headers(scope=scope).get("host", "")
            if not _host_allowed(host_name(header), self.allowed):
                error = APIError(400, f"the Host header {header!r} is not one this server answers to "
                                 "(see --allowed-hosts)", param=None, code="host_not_allowed")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyCheck:
    """Require ``Authorization: Bearer <key>`` on every ``/v1`` route (compared in constant time);
    /health, /metrics and /openapi.json stay open, as in vLLM."""

    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1") -> None:
        self.app = app
        self.key = api_key.encode("utf-8")
        self.prefix = prefix

    def _guarded(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            # header values are latin-1 on the wire; compare the raw bytes whatever they hold
            given = token.strip().encode("latin-1", "replace")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.key):
                error = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                 param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def access_middleware(*, allowed_hosts: Sequence[str] | None, api_key: str | None,
                      allowed_origins: Sequence[str] | None) -> list[Middleware]:
    """The middlewares, outermost first: Host check, CORS (only when origins are given; preflights need
    no key), API key."""
    stack = []
    if allowed_hosts is not None:
        stack.append(Middleware(HostCheck, allowed=allowed_hosts))
    if allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                                allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-Id"]))
    if api_key:
        stack.append(Middleware(ApiKeyCheck, api_key=api_key))
    return stack
