"""HTTP/1.1 status lines carry their reason phrase: ``HTTP/1.1 400 Bad Request``, not ``HTTP/1.1 400 ``.

h11 writes whatever reason it is given and hypercorn gives none. An empty reason is valid HTTP, but clients,
proxies and logs that show only the status line then show nothing readable, and a few parsers reject it.
Hypercorn has no setting for it, so ``install`` wraps the one method of its HTTP/1.1 protocol that hands
response events to h11 and fills in the standard phrase; a hypercorn without that method fails at startup,
not silently.
"""

from __future__ import annotations

import http

import h11
from hypercorn.protocol.h11 import H11Protocol

# Statuses outside the IANA registry that the gateway uses (as nginx names it).
_EXTRA_PHRASES = {499: "Client Closed Request"}


def reason_phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return _EXTRA_PHRASES.get(status, "")


def with_reason(event: h11.Event) -> h11.Event:
    """``event`` with the standard reason phrase when it is a response without one; anything else unchanged."""
    if not isinstance(event, h11.Response | h11.InformationalResponse) or event.reason:
        return event
    phrase = reason_phrase(event.status_code)
    if not phrase:
        return event
    return type(event)(status_code=event.status_code, headers=event.headers, http_version=event.http_version,
                       reason=phrase.encode("ascii"))


_installed = False


def install() -> None:
    """Make hypercorn's HTTP/1.1 responses carry reason phrases (idempotent; the event loop's thread)."""
    global _installed
    if _installed:
        return
    send = H11Protocol._send_h11_event

    async def send_with_reason(self: H11Protocol, event: h11.Event) -> None:
        await send(self, with_reason(event))

    H11Protocol._send_h11_event = send_with_reason  # type: ignore[method-assign]
    _installed = True
