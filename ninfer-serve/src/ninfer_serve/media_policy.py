"""The gateway's media policy, as a typed value: light at import (attrs and os only), so ``ninfer serve``'s
command line builds and checks it without loading the gateway."""

from __future__ import annotations

import os
from typing import Any

import attrs

MIB = 1 << 20
MAX_MEDIA_THREADS = 16


def _resolved_dir(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(path)


def _is_dir(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not os.path.isdir(value):
        raise ValueError(f"{attribute.name}: {value} is not a directory")


def _whole(lo: int, hi: int | None = None):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"{attribute.name} must be an integer {bound}, got {value!r}")
    return check


def _flag(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class MediaPolicy:
    """Where the gateway may take media from and how much (the ``--media-*`` options of ``ninfer serve``).

    ``root``: the directory local files are read under (None: no local files; kept resolved). ``allow_remote``:
    fetch http(s) URLs. ``max_bytes``: per item (an image, or a video's frames together). ``timeout_s``: per
    remote item. ``max_items``: images and videos per request. ``max_frames``: frames per video. ``threads`` and
    ``queue``: the media TaskPool's threads (1..16) and waiting requests.
    """

    root: str | None = attrs.field(default=None, converter=_resolved_dir, validator=_is_dir)
    allow_remote: bool = attrs.field(default=False, validator=_flag)
    max_bytes: int = attrs.field(default=20 * MIB, validator=_whole(1))
    timeout_s: float = attrs.field(default=10.0, validator=_positive)
    max_items: int = attrs.field(default=16, validator=_whole(1))
    max_frames: int = attrs.field(default=256, validator=_whole(1))
    threads: int = attrs.field(default=4, validator=_whole(1, MAX_MEDIA_THREADS))
    queue: int = attrs.field(default=64, validator=_whole(0))
