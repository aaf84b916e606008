"""Media acquisition: the bytes of every image and video frame a chat request names, as ``MediaItem``s.

Where media may come from is the server's ``MediaPolicy``:

- ``data:`` URLs (base64 or percent-encoded), always; the type, when given, must be an image type;
- local files only under ``root`` (``--media-root``), named by a ``file://`` URL or a plain path (relative
  paths are taken from the root); a path that leads out of the root, through ``..`` or a symbolic link, is
  refused, and only regular files are read;
- ``http(s)`` only with ``allow_remote`` (``--allow-remote-media``), by ``media_fetch``: public addresses only
  (or hosts the operator allows), checked after resolving and connected to as checked, each item within
  ``timeout_s`` in all, redirects to http(s) only and checked again.

Every item (an image, or a video's frames together) is at most ``max_bytes``. Acquisition runs on the
gateway's media TaskPool (``MediaAcquirer``), one task per request, never on the event loop; a client that
leaves stops it at its next read or wait. Refusals are 400s naming the parameter: ``invalid_media`` (malformed,
unreadable or unreachable), ``media_too_large``, ``media_not_allowed``.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
import os
import stat
import threading
import urllib.parse

import attrs
from starlette.requests import Request

from ninfer.contract import GenerationRequest
from ninfer.contract.prompt import MediaItem
from ninfer.core.task_pool import Task, TaskPool
from ninfer_serve.errors import APIError, bad_request
from ninfer_serve.media_fetch import (
    FetchCancelled,
    Fetched,
    MediaRefused,
    fetch_remote,
    image_like,
    too_large,
)
from ninfer_serve.media_fetch import shown as _shown
from ninfer_serve.media_parts import MediaSource, first_media_part, media_sources
from ninfer_serve.media_policy import MediaPolicy
from ninfer_serve.offload import client_of, submit_or_refuse, unless_disconnected
from ninfer_serve.schemas import ChatCompletionRequest

__all__ = ["FetchCancelled", "Fetched", "MediaAcquirer", "MediaPolicy", "MediaRefused", "acquire", "fetch"]

_CHUNK = 1 << 16


def fetch(url: str, policy: MediaPolicy, *, limit: int, cancel: threading.Event) -> Fetched:
    """The bytes behind ``url`` (at most ``limit``) as ``policy`` allows; MediaRefused says why not."""
    shown = _shown(url)
    if url[:5].lower() == "data:":
        return _data_url(url, limit, shown)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise MediaRefused("invalid_media", f"{shown} is not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return fetch_remote(url, policy, limit=limit, cancel=cancel)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise MediaRefused("invalid_media", f"{shown}: a file URL names no other host")
        return _local(urllib.parse.unquote(parts.path), policy, limit, shown)
    if scheme == "":
        return _local(url, policy, limit, shown)
    raise MediaRefused("invalid_media", f"{shown}: URLs of scheme '{scheme}' are not supported (data:, file:// "
                                        "or a path under the media root, or http(s))")


def _data_url(url: str, limit: int, shown: str) -> Fetched:
    head, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaRefused("invalid_media", f"{shown}: a data URL needs a comma before its data")
    params = [p.strip().lower() for p in head.split(";")]
    mime = params[0] or None
    if mime is not None and not image_like(mime):
        raise MediaRefused("invalid_media", f"{shown}: a data URL of type {mime} is not an image")
    if params[-1] == "base64" and len(params) > 1:
        compact = "".join(payload.split())
        if len(compact) // 4 * 3 > limit + 2:  # decoded size, known before decoding
            raise too_large(shown, limit)
        try:
            data = base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise MediaRefused("invalid_media", f"{shown}: the data is not valid base64") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > limit:
        raise too_large(shown, limit)
    return Fetched(data, mime)


def _local(path: str, policy: MediaPolicy, limit: int, shown: str) -> Fetched:
    root = policy.root
    if root is None:
        raise MediaRefused("media_not_allowed", f"{shown}: local files are off on this server (its operator "
                                                "allows them under a directory with --media-root DIR)")
    try:
        resolved = os.path.realpath(os.path.join(root, path))  # symbolic links resolved: the real place
    except ValueError as exc:  # an embedded NUL
        raise MediaRefused("invalid_media", f"{shown} is not a valid path: {exc}") from None
    if os.path.commonpath((resolved, root)) != root:
        raise MediaRefused("media_not_allowed", f"{shown} is outside the media root")
    try:  # no following a link swapped in since, no blocking on a FIFO
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MediaRefused("invalid_media", f"{shown}: no such file under the media root") from None
    except OSError as exc:
        raise MediaRefused("invalid_media", f"{shown} cannot be read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaRefused("invalid_media", f"{shown} is not a regular file")
        if info.st_size > limit:
            raise too_large(shown, limit)
        data = bytearray()
        while len(data) <= limit and (chunk := os.read(fd, min(_CHUNK, limit + 1 - len(data)))):
            data += chunk
    except OSError as exc:
        raise MediaRefused("invalid_media", f"{shown} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise too_large(shown, limit)
    guess = mimetypes.guess_type(resolved)[0]
    return Fetched(bytes(data), guess if guess is not None and guess.startswith("image/") else None)


def _fetch_at(url: str, param: str, policy: MediaPolicy, limit: int, cancel: threading.Event) -> Fetched:
    try:
        got = fetch(url, policy, limit=limit, cancel=cancel)
    except MediaRefused as exc:
        raise bad_request(f"{param}: {exc.message}", param=param, code=exc.code) from None
    if not got.data:
        raise bad_request(f"{param}: {_shown(url)} is empty", param=param, code="invalid_media")
    return got


def acquire(sources: tuple[MediaSource, ...], policy: MediaPolicy, cancel: threading.Event) -> tuple[MediaItem, ...]:
    """Every source's bytes, in order (runs in a media pool thread); a refusal is a 400 APIError."""
    items = []
    for source in sources:
        if source.kind == "image":
            got = _fetch_at(source.urls[0], source.param, policy, policy.max_bytes, cancel)
            items.append(MediaItem(kind="image", data=got.data, mime_type=got.mime_type))
            continue
        frames: list[bytes] = []
        left = policy.max_bytes
        for k, url in enumerate(source.urls):
            try:
                frames.append(_fetch_at(url, f"{source.param}[{k}]", policy, left, cancel).data)
            except APIError as exc:
                if exc.code == "media_too_large":
                    exc.message = (f"{source.param}: the video's frames together hold more than {policy.max_bytes} "
                                   "bytes (--media-max-bytes)")
                raise
            left -= len(frames[-1])
        items.append(MediaItem(kind="video", frames=frames, fps=source.fps))
    return tuple(items)


class MediaAcquirer:
    """The gateway's media TaskPool (its own instance, ``policy.threads`` threads; one client address holds at
    most ``per_client`` places, queued and running) and the policy it fetches by."""

    def __init__(self, policy: MediaPolicy, *, retry_after_s: int, per_client: int | None = None) -> None:
        self.policy = policy
        self.retry_after_s = retry_after_s
        self.pool = TaskPool("ninfer-media", threads=policy.threads, max_queued=policy.queue,
                             max_per_owner=per_client)

    async def attach(self, request: Request, req: ChatCompletionRequest, gen: GenerationRequest,
                     vision_enabled: bool) -> GenerationRequest:
        """``gen`` with its ChatInput's media acquired (unchanged when the request has none). A model without
        vision answers 400 ``vision_not_enabled`` before anything is fetched; a full media pool 429; a client
        that leaves raises ClientGone and stops the fetching."""
        where = first_media_part(req)
        if where is None:
            return gen
        if not vision_enabled:
            raise APIError(400, f"{where}: image and video input needs a model started with the vision feature; "
                                "this one was started without it", param=where, code="vision_not_enabled")
        sources = media_sources(req, max_items=self.policy.max_items, max_frames=self.policy.max_frames)
        cancel = threading.Event()
        task: Task[tuple[MediaItem, ...]] = Task(lambda: acquire(sources, self.policy, cancel))
        submit_or_refuse(self.pool, task, retry_after_s=self.retry_after_s, waiting_for="for their media",
                         owner=client_of(request))
        try:
            items = await unless_disconnected(request, task.wait())
        finally:
            cancel.set()  # a fetch still running (its client left) stops at its next read
        return attrs.evolve(gen, input=attrs.evolve(gen.input, media=items))
