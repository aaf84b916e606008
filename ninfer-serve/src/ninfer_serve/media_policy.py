"""The gateway's media policy, as a typed value: light at import (attrs and os only), so ``ninfer serve``'s
command line builds and checks it without loading the gateway."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable

import attrs

MIB = 1 << 20
MAX_MEDIA_THREADS = 16


def _resolved_dir(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(path)


def _is_dir(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not os.path.isdir(value):
        raise ValueError(f"{attribute.name}: {value} is not a directory")


def _whole(lo: int, hi: int | None = None):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"{attribute.name} must be an integer {bound}, got {value!r}")
    return check


def _flag(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


_NAME = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")


def _host_key(host: str) -> str:
    """A host as the allowed names are compared: lower-case, no brackets or final dot, an IP address in its
    standard spelling (``[0:0::1]`` is ``::1``; a number such as 2130706433 stays a name)."""
    host = host.strip().lower().strip("[]").rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def allowed_host_names(value: Iterable[str]) -> tuple[str, ...]:
    """``value`` (a sequence of names) as ``MediaPolicy.allowed_hosts`` keeps them; ValueError names a bad one."""
    if isinstance(value, str):
        raise ValueError(f"allowed_hosts must be a sequence of names, got the string {value!r}")
    names = tuple(_host_key(str(v)) for v in value)
    for name in names:
        try:
            ipaddress.ip_address(name)
            continue
        except ValueError:
            pass
        if not _NAME.match(name):
            raise ValueError(f"{name!r} is not a host name, an IP address or a '*.example.com' pattern")
    return names


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``host`` is one of ``allowed``: an exact name or address, or under a ``*.suffix`` pattern."""
    host = _host_key(host)
    return any(host == name or (name.startswith("*.") and host.endswith(name[1:])) for name in allowed)


@attrs.frozen(kw_only=True)
class MediaPolicy:
    """Where the gateway may take media from and how much (the ``--media-*`` options of ``ninfer serve``).

    ``root``: the directory local files are read under (None: no local files; kept resolved). ``allow_remote``:
    fetch http(s) URLs. ``allowed_hosts``: names (exact, or ``*.example.com`` for any name under it) and IP
    addresses fetched from without the public-address check (``media_fetch``). ``max_bytes``: per item (an
    image, or a video's frames together). ``timeout_s``: per remote item, all of it (redirects included).
    ``max_items``: images and videos per request. ``max_frames``: frames per video. ``threads`` and ``queue``:
    the media TaskPool's threads (1..16) and waiting requests.
    """

    root: str | None = attrs.field(default=None, converter=_resolved_dir, validator=_is_dir)
    allow_remote: bool = attrs.field(default=False, validator=_flag)
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=allowed_host_names)
    max_bytes: int = attrs.field(default=20 * MIB, validator=_whole(1))
    timeout_s: float = attrs.field(default=10.0, validator=_positive)
    max_items: int = attrs.field(default=16, validator=_whole(1))
    max_frames: int = attrs.field(default=256, validator=_whole(1))
    threads: int = attrs.field(default=4, validator=_whole(1, MAX_MEDIA_THREADS))
    queue: int = attrs.field(default=64, validator=_whole(0))
