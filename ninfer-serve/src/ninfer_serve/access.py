"""Who may call the gateway: the Host-header check (DNS rebinding), the API keys on ``/v1`` and CORS.

Pure ASGI middlewares, so they answer before any route runs and cost nothing on a streaming body.
JSON-only request bodies (415 otherwise) are checked by the POST routes themselves (app.py).

With several API keys, each key is a tenant: the key that authenticated a request names its context-cache
scope (``key_scope``), so one key's requests never restore, nor time, another's cache entries. The scope is
an HMAC of the key under a secret drawn at startup, so neither the cache nor a log ever holds the key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Collection, Sequence

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from ninfer_serve.errors import APIError
from ninfer_serve.tokenizer_routes import TOKENIZER_PATHS

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
KEY_SCOPE = "ninfer.key_scope"  # ASGI scope entry: the authenticating key's cache scope (several keys only)


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


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The accepted keys, once each, in order: one key, several, or none (None, or an empty string alone:
    the API is open). An empty key among several is a mistake, refused."""
    if api_key is None or isinstance(api_key, str):
        return (api_key,) if api_key else ()
    keys = tuple(dict.fromkeys(api_key))
    if "" in keys:
        raise ValueError("an API key must not be empty")
    return keys


def read_api_key_file(path: str) -> tuple[str, ...]:
    """The keys of a keys file: one per line, surrounding whitespace stripped; blank lines and lines starting
    with '#' are skipped; a key listed twice counts once. ValueError (naming the file, never a key) when it
    cannot be read or holds no key."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:  # its message would quote the file's bytes
        raise ValueError(f"cannot read --api-key-file {path}: it is not UTF-8 text") from None
    keys = tuple(dict.fromkeys(line for line in lines if line and not line.startswith("#")))
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key (one per line; '#' starts a comment line)")
    return keys


def key_scope(scope: Scope) -> str | None:
    """The context-cache scope of the key that authenticated this request; None with one key or none."""
    return scope.get(KEY_SCOPE)


class ApiKeyCheck:
    """Require ``Authorization: Bearer <key>`` on every ``/v1`` route and the tokenizer routes, where the key is
    one of ``api_keys`` (each compared in constant time, all of them on every request); /health, /metrics and
    /openapi.json stay open, as in vLLM. With several keys the request's scope gets the key's ``KEY_SCOPE``."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], prefix: str = "/v1",
                 paths: Sequence[str] = TOKENIZER_PATHS) -> None:
        if not api_keys or not all(api_keys):
            raise ValueError("ApiKeyCheck needs non-empty API keys")
        self.app = app
        secret = secrets.token_bytes(32)  # per process: a scope reveals nothing about its key, even offline
        self.keys = [(key.encode("utf-8"), _scope_of(secret, key) if len(api_keys) > 1 else None)
                     for key in api_keys]
        self.prefix = prefix
        self.paths = frozenset(paths)

    def _guarded(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/") or path in self.paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            # header values are latin-1 on the wire; compare the raw bytes whatever they hold
            given = token.strip().encode("latin-1", "replace")
            matched, named = False, None
            for key, scope_name in self.keys:  # every key, whichever matches: the time tells nothing
                if hmac.compare_digest(given, key):
                    matched, named = True, scope_name
            if scheme.lower() != "bearer" or not matched:
                error = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                 param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
            if named is not None:
                scope[KEY_SCOPE] = named
        await self.app(scope, receive, send)


def _scope_of(secret: bytes, key: str) -> str:
    """A key's cache scope: an HMAC of it (no ':', so a client's salt appended after one stays apart)."""
    return "key-" + hmac.new(secret, key.encode("utf-8"), hashlib.sha256).hexdigest()[:32]


def access_middleware(*, allowed_hosts: Sequence[str] | None, api_key: str | Sequence[str] | None,
                      allowed_origins: Sequence[str] | None) -> list[Middleware]:
    """The middlewares, outermost first: Host check, CORS (only when origins are given; preflights need
    no key), API key (``api_key``: one key or several, see ``api_keys``)."""
    stack = []
    if allowed_hosts is not None:
        stack.append(Middleware(HostCheck, allowed=allowed_hosts))
    if allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                                allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-Id"]))
    keys = api_keys(api_key)
    if keys:
        stack.append(Middleware(ApiKeyCheck, api_keys=keys))
    return stack
